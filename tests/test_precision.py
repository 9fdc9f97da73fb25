from __future__ import annotations

import pytest

from conftest import RECIPES
from lit_memory import precision
from lit_memory.cli import LitMemoryCLI


@pytest.fixture
def no_native_bf16(monkeypatch):
    monkeypatch.setattr(precision, "native_cpu_bf16", lambda: False)


def test_bf16_on_a_cpu_without_it_falls_back_to_fp32_with_one_warning(no_native_bf16, capsys):
    assert precision.cpu_fallback("bf16-mixed", "cpu") == "32-true"
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: this CPU has no native bf16")


@pytest.mark.parametrize("setting", [("bf16-mixed", "gpu"), ("bf16-mixed", "cuda"), ("32-true", "cpu"), ("16-mixed", "cpu")])
def test_gpu_runs_and_other_precisions_are_never_changed(no_native_bf16, setting, capsys):
    assert precision.cpu_fallback(*setting) == setting[0]
    assert capsys.readouterr().err == ""


def test_cpus_with_native_bf16_keep_it(monkeypatch):
    monkeypatch.setattr(precision, "native_cpu_bf16", lambda: True)
    assert precision.cpu_fallback("bf16-mixed", "cpu") == "bf16-mixed"


@pytest.mark.parametrize("fallback, expected", [("true", "32-true"), ("false", "bf16-mixed")])
def test_cli_applies_the_fallback_unless_told_not_to(no_native_bf16, fallback, expected, tmp_path):
    cli = LitMemoryCLI(
        args=[
            "--config", str(RECIPES / "4gb.yaml"), "--trainer.accelerator=cpu",
            f"--cpu_bf16_fallback={fallback}", f"--trainer.default_root_dir={tmp_path}",
        ],
        run=False,
    )
    assert cli.trainer.precision == expected
