"""`lit_memory.run.compiling` and the compile recipes: each layer compiled, still compiled after a step that ran under a
dispatch mode (the memory tracker, the planner's FLOP counter), the recipes training on this CPU. Dynamo and
AOTAutograd run as in a real fit; the ``aot_eager`` backend stands in for inductor's C++ code generation (minutes on
this CPU), so the tests stay cheap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch._dynamo.utils
from conftest import RECIPES, the_error
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lit_memory.__main__ import main
from lit_memory.cli import LitMemoryCLI
from lit_memory.run import compiling
from lit_memory.run.monitor import StepTimer

TINY_BERT = [
    "--model.model_name_or_path=bundled:bert-large", "--model.pretrained=false",
    "--model.config_overrides={num_hidden_layers: 2, hidden_size: 64, num_attention_heads: 4, intermediate_size: 128}",
    "--data.limit_train_samples=32", "--data.limit_eval_samples=8", "--data.batch_size=4", "--data.max_length=16",
]


class Block(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.sin() * 2).relu()


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.fixture
def cheap_compile(monkeypatch):
    """torch.compile on the aot_eager backend; the modes asked for, recorded."""
    modes, real = [], torch.compile

    def compile_(fn, mode=None, **kwargs):
        modes.append(mode)
        return real(fn, backend="aot_eager")

    monkeypatch.setattr(compiling.torch, "compile", compile_)
    torch._dynamo.reset()
    yield modes
    torch._dynamo.reset()


def test_a_step_under_a_dispatch_mode_leaves_the_layer_compiled_for_the_next(cheap_compile):
    """nn.Module.compile's layer, once called under a mode (here torch's FLOP counter, as the planner runs it), is
    declined by dynamo for good; a layer compiled here runs eagerly under the mode and compiles after it."""
    x = torch.randn(4, 8)
    plain = Block()
    plain.compile(backend="aot_eager")
    with FlopCounterMode(display=False):
        plain(x)
    before = graphs()
    plain(x)
    assert graphs() == before  # the code was declined for good: eager from here on
    torch._dynamo.reset()
    start = graphs()  # what earlier tests in this process compiled
    ours = Block()
    compiling.compile_layer(ours)
    with FlopCounterMode(display=False) as flops:
        ours(x)
    assert flops.get_total_flops() == 0 and graphs() == start  # eager, and dynamo never asked
    torch.testing.assert_close(ours(x), Block()(x))
    assert graphs() == start + 1 and not compiling.declined_by_dynamo()


@pytest.mark.parametrize("recipe, mode, extra", [
    ("bf16-compile", "reduce-overhead", []),
    # every layer recomputed, through the compiled layer
    ("4gb-compile", None, ["--model.gradient_checkpointing=full"]),
])
def test_the_compile_recipes_train_with_every_layer_compiled_and_compile_time_apart(
    recipe, mode, extra, cheap_compile, tmp_path
):
    timer = {"class_path": "lit_memory.run.monitor.StepTimer", "init_args": {"warmup": 3, "save": True}}
    cli = LitMemoryCLI(args=[
        "fit", "--config", str(RECIPES / f"{recipe}.yaml"), *TINY_BERT, *extra, "--trainer.max_steps=4",
        "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--trainer.enable_checkpointing=false", "--model.save_pretrained=false", "--memory.picture=false",
        f"--trainer.default_root_dir={tmp_path}", f"--trainer.callbacks+={json.dumps(timer)}",
    ])
    assert cli.trainer.global_step == 4
    # each of the 2 layers (of every copy the run builds: the memory predictions build one), CUDA graphs asked for
    # where shapes are static
    assert set(cheap_compile) == {mode} and len(cheap_compile) % 2 == 0
    assert graphs() >= 1  # compiled after the monitor's 2 tracked steps, which ran eagerly
    times = json.loads((Path(cli.trainer.log_dir) / StepTimer.FILE).read_text())
    assert times["compile_s"] > 0 and len(times["step_times_s"]) == 1  # compiled in the warm-up, apart from the timed


def test_cuda_graphs_need_one_batch_shape(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(RECIPES / "bf16-compile.yaml"), "--data.padding=longest",
              f"--trainer.default_root_dir={tmp_path}"])
    assert the_error(capsys.readouterr().err).startswith(
        "error: model.compile cudagraphs records each layer's CUDA graph for one batch shape"
    )
