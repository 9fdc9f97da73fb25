"""The margin every "fits" decision keeps (lit_memory.memory.margin): what fits, and what each decision says."""

from __future__ import annotations

import pytest

from lit_memory.errors import UserError
from lit_memory.memory.margin import DEFAULT_MARGIN, Fit, check_margin, usable

GiB = 2**30


def test_a_fit_keeps_the_margin_and_says_what_is_left():
    limit = int(3.81 * GiB)
    fit = Fit(int(0.91 * limit), limit, 0.08, "rtx3050-4gb (3.81 GiB)")
    assert fit.fits and fit.spare == pytest.approx(0.09, abs=1e-6)
    assert fit.line().startswith("fits rtx3050-4gb (3.81 GiB) with 9 % to spare (predicted 3.47 GiB; margin 8 %)")
    # inside the limit but not with the margin kept: does not fit, and says by how much
    close = Fit(int(0.95 * limit), limit, 0.08, "rtx3050-4gb (3.81 GiB)")
    assert not close.fits and "does not fit rtx3050-4gb (3.81 GiB) with the margin 8 %" in close.line()
    assert "5 % to spare (at most 3.51 GiB)" in close.line()
    over = Fit(limit + GiB, limit, 0.08)
    assert not over.fits and "over by 1.00 GiB" in over.line()
    # the spare is rounded down: a fit never shows less than its margin
    edge = Fit(usable(limit, 0.08), limit, 0.08)
    assert edge.fits and "with 8 % to spare" in edge.line()
    assert Fit(usable(limit, 0.08) + 1, limit, 0.08).fits is False
    assert Fit(limit, limit, 0.0).fits  # no margin: the limit itself
    assert fit.to_dict()["fits"] and fit.to_dict()["limit_bytes"] == limit


@pytest.mark.parametrize("value", [-0.1, 0.5, 2, float("nan"), "abc", None])
def test_a_margin_outside_0_to_half_is_one_error_line(value):
    with pytest.raises(UserError, match=r"^memory.margin must be a share of the limit in \[0, 0.5\)"):
        check_margin(value)
    assert check_margin("0.1") == 0.1 and check_margin(0) == 0.0 and 0.07 < DEFAULT_MARGIN < 0.1


def test_the_runs_margin_is_read_once_from_its_settings():
    from lit_memory.cli import resolve

    assert resolve(["fit", "--memory.margin=0.12"]).step().margin == 0.12
    assert resolve(["fit"]).step().margin == DEFAULT_MARGIN
    with pytest.raises(UserError, match="memory.margin must be"):
        resolve(["fit", "--memory.margin=0.7"]).step()
