"""Published GPU measurements against lit_memory's predictions (lit_memory/tools/published.py): every row the
table holds is within its stated bound, and docs/memory.md shows exactly what the command generates."""

from __future__ import annotations

import pytest

from lit_memory.tools import published

RESULTS = published.results()  # the predictions, once for the module (about a second per row)


@pytest.mark.parametrize("result", RESULTS, ids=[f"{r.row.source.name[:20]}: {r.row.label}" for r in RESULTS])
def test_each_published_row_is_predicted_within_its_bound(result):
    row = result.row
    assert result.predicted is not None and result.predicted > 0
    if row.unmatched is None:
        assert result.within, f"{row.label}: predicted {result.predicted} for {row.published} ({result.ratio:.2f})"
    else:  # a row no single run's prediction can reach: it must say why, and it reads more than predicted
        assert result.ratio < 1 and len(row.unmatched) > 40


def test_three_independent_sources_and_every_level_named():
    sources = {r.row.source for r in RESULTS}
    assert len(sources) >= 3
    assert {s.level for s in sources} >= {"device", "reserved"}
    held = [r for r in RESULTS if r.row.unmatched is None]
    assert len(held) >= 15 and all(r.within for r in held)


def test_the_docs_show_the_generated_table():
    text = published.DOCS.read_text(encoding="utf-8")
    start, end = published.MARKERS
    shown = text[text.index(start) + len(start) : text.index(end)].strip()
    assert shown == published.markdown(RESULTS).strip(), (
        "regenerate: python -m lit_memory estimate --published --update-docs"
    )


def test_the_default_margin_covers_the_worst_under_prediction_on_a_strict_row():
    """`memory.margin`'s default (lit_memory/memory/margin.py) is derived from this table: no smaller than the
    worst under-prediction on a strictly comparable row, whichever way it is counted (the share of the limit a
    plan must leave free, 1 - ratio; or how far the measurement ran above the prediction, 1 / ratio - 1)."""
    from lit_memory.memory.margin import DEFAULT_MARGIN

    worst = published.margin_row(RESULTS)
    assert worst.row.source.strict and worst.row.unmatched is None and worst.ratio < 1
    assert DEFAULT_MARGIN >= 1 / worst.ratio - 1 >= 1 - worst.ratio
    assert DEFAULT_MARGIN < 1 / worst.ratio - 1 + 0.01  # derived from it, not padded
    assert all(r.ratio >= worst.ratio for r in RESULTS if r.row.unmatched is None and r.row.source.strict)
    assert f"default {100 * DEFAULT_MARGIN:g} %" in published.markdown(RESULTS)
