from __future__ import annotations

import pytest
from conftest import RECIPES

from lit_memory.__main__ import main
from lit_memory.cli import LitMemoryCLI, resolve
from lit_memory.errors import UserError
from lit_memory.memory.hardware.gpus import GPUS
from lit_memory.optim import precision


@pytest.fixture
def no_native_bf16(monkeypatch):
    monkeypatch.setattr(precision, "native_cpu_bf16", lambda: False)


def test_bf16_on_a_cpu_without_it_falls_back_to_fp32_with_one_warning(no_native_bf16, capsys):
    fallen, warning = precision.cpu_fallback("bf16-mixed", "cpu")
    assert fallen == "32-true" and warning.startswith("warning: this CPU has no native bf16") and "\n" not in warning
    assert capsys.readouterr().err == ""  # the caller says it, once (`LitMemoryCLI._prepare`)


@pytest.mark.parametrize(
    "setting", [("bf16-mixed", "gpu"), ("bf16-mixed", "cuda"), ("32-true", "cpu"), ("16-mixed", "cpu")]
)
def test_gpu_runs_and_other_precisions_are_never_changed(no_native_bf16, setting, capsys):
    assert precision.cpu_fallback(*setting) == (setting[0], None)
    assert capsys.readouterr().err == ""


def test_cpus_with_native_bf16_keep_it(monkeypatch):
    monkeypatch.setattr(precision, "native_cpu_bf16", lambda: True)
    assert precision.cpu_fallback("bf16-mixed", "cpu") == ("bf16-mixed", None)


@pytest.mark.parametrize("fallback, expected", [("true", "32-true"), ("false", "bf16-mixed")])
def test_cli_applies_the_fallback_unless_told_not_to_and_says_it_once(no_native_bf16, fallback, expected, tmp_path,
                                                                       capsys):
    args = ["--config", str(RECIPES / "4gb.yaml"), "--trainer.accelerator=cpu", f"--cpu_bf16_fallback={fallback}",
            f"--trainer.default_root_dir={tmp_path}"]
    judged = resolve(["fit", *args])  # a confined run is parsed in the parent first: it says nothing
    assert judged.settings.trainer.precision == expected and capsys.readouterr().err == ""
    cli = LitMemoryCLI(args=args, run=False)  # the run, built
    assert cli.trainer.precision == expected
    said = [line for line in capsys.readouterr().err.splitlines() if "no native bf16" in line]
    assert len(said) == (expected == "32-true")


# -- a GPU without bf16 (compute capability below 8.0) ----------------------------------------------


def test_gpus_without_bf16_train_bf16_autocast_in_fp16_with_one_line(capsys):
    t4, v100, a100 = GPUS["t4"], GPUS["v100-16gb"], GPUS["a100-80gb"]
    assert not t4.bf16 and not v100.bf16 and a100.bf16
    assert precision.on_gpu("bf16-mixed", t4) == "16-mixed"
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: Tesla T4 (sm75) has no bf16")
    assert (
        "training with trainer.precision=16-mixed" in lines[0] and "--trainer.precision bf16-mixed keeps it" in lines[0]
    )
    for unchanged in (("bf16-mixed", a100), ("bf16-mixed", None), ("32-true", t4), ("16-mixed", v100)):
        assert precision.on_gpu(*unchanged) == unchanged[0]
    assert capsys.readouterr().err == ""


def test_bf16_weights_on_a_gpu_without_bf16_are_one_error_naming_the_tier_that_trains_there():
    with pytest.raises(UserError) as error:
        precision.on_gpu("bf16-true", GPUS["v100-16gb"])
    message = str(error.value)
    assert "Tesla V100 16GB (sm70) has none" in message and "--recipe 4gb" in message and "\n" not in message
    assert precision.on_gpu("bf16-true", GPUS["a100-80gb"]) == "bf16-true"


def test_a_run_on_a_gpu_without_bf16_takes_fp16_unless_the_precision_was_typed(capsys):
    """The GPU is the seam (`LitMemoryCLI(gpu=...)`: a run's own by default, a catalogue card here): a recipe's
    bf16 becomes 16-mixed with one line; a --trainer.precision the user typed stays (unless a file after it
    sets it again); a GPU with bf16 changes nothing."""
    t4 = GPUS["t4"]
    assert resolve(["fit", "--recipe", "4gb"], gpu=t4).settings.trainer.precision == "16-mixed"
    assert capsys.readouterr().err.count("has no bf16") == 1
    # The run itself is on this CPU: where it has no bf16, its own fallback (bf16 trains in fp32) is another rule.
    own = ["--cpu_bf16_fallback=false"]
    typed = resolve(["fit", "--recipe", "4gb", "--trainer.precision", "bf16-mixed", *own], gpu=t4)
    assert typed.settings.trainer.precision == "bf16-mixed"
    later = resolve(["fit", "--trainer.precision=32-true", "--recipe", "4gb"], gpu=t4)
    assert later.settings.trainer.precision == "16-mixed"  # the recipe after it set bf16 again: the recipe's
    assert resolve(["fit", "--recipe", "4gb", *own], gpu=GPUS["a100-80gb"]).settings.trainer.precision == "bf16-mixed"
    assert (
        resolve(["fit", "--recipe", "4gb", "--trainer.accelerator=cpu", *own]).settings.trainer.precision
        == "bf16-mixed"
    )
    assert capsys.readouterr().err.count("has no bf16") == 1  # the later recipe's


def test_the_2gb_recipe_on_a_gpu_without_bf16_stops_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """A run (`main`) on a T4, the GPU given by the seam a run reads (`precision.training_gpu`)."""
    monkeypatch.setattr(precision, "training_gpu", lambda accelerator: GPUS["t4"])
    root = tmp_path / "runs"
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--recipe", "2gb", f"--trainer.default_root_dir={root}"])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"error: {precision.NO_BF16_WEIGHTS.format(precision='bf16-true', gpu='Tesla T4 (sm75)')}"]
    assert not root.exists()
