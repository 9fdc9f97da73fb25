"""`python -m lit_memory estimate`: the run's settings read from recipes, the bars the recipes promise, the outputs.
The memory model itself: tests/planning/prediction/test_analytic.py."""

from __future__ import annotations

import json

import pytest
from conftest import CONFIGS, RECIPES

from lit_memory.__main__ import main
from lit_memory.memory.measure.footprint import CATEGORIES

GiB = 2**30


BERT_LARGE = ["--config", str(CONFIGS / "bert-large.yaml")]
A100 = ["--gpu", "a100-80gb", "--cuda", "12.4"]  # the documented default target, whatever this machine has


def estimate(capsys, *args: str) -> dict:
    main(["estimate", "--json", *A100, *args])
    return json.loads(capsys.readouterr().out)


def test_2gb_fits_2_gib_of_device_memory_at_bert_large(capsys):
    """The issue's bar: BERT-large at batch 32 x 128 predicted within 2.0 GiB of device memory (tensors, the
    caching allocator's reserve, the CUDA context) with the 8 % margin to spare by the analytic model, as the
    recipe's header says (its embeddings frozen: what it gives up for that). The
    simulation agrees on the tensors and, within 5 %, on the device total: its allocator replay, over the
    step's op-level allocations, finds more fragmentation around torchao's 4-bit step buffers (a little over
    2 GiB; their size on CUDA is unmeasured and predicted at the CPU kernel's)."""
    # the recipe's tier typed: estimate --gpu plans for the card asked about (the A100 here) unless told otherwise
    data = estimate(capsys, "--config", str(RECIPES / "2gb.yaml"), *BERT_LARGE, "--memory.tier", "2GiB")
    assert data["setup"]["batch_size"] == 32 and data["setup"]["max_length"] == 128
    parameters = data["model"]["parameters"]
    embeddings = (30522 + 512 + 2) * 1024 + 2 * 1024  # word, position, token type matrices and their LayerNorm
    assert data["model"]["trainable"] == parameters - embeddings > 300e6  # the embeddings frozen, no LoRA
    assert data["predicted"]["analytic"]["device_bytes"] <= 0.92 * 2 * GiB
    assert data["verdict"]["fits"] and data["verdict"]["spare"] >= 0.08
    simulated = data["predicted"]["simulated"]
    assert simulated["device_bytes"] == pytest.approx(data["predicted"]["analytic"]["device_bytes"], rel=0.05)
    assert simulated["peak_bytes"] + simulated["context_bytes"] <= 2 * GiB
    for method in ("analytic", "simulated"):
        footprint = data["predicted"][method]
        assert footprint["device_bytes"] == footprint["reserved_bytes"] + footprint["context_bytes"]
        assert footprint["reserved_bytes"] >= footprint["peak_bytes"]
        categories = footprint["categories"]
        # bf16 weights (and the position/token-type id buffers): 2 B per parameter, no fp32 master copy
        assert categories["weights"] == pytest.approx(2 * data["model"]["parameters"], rel=0.001)
        # 4-bit moments: 2 x (0.5 B + a fp32 scale per 64) per trained value; none for the frozen embeddings
        expected = 2 * (0.5 + 4 / 64) * (parameters - embeddings)
        assert categories["optimizer"] == pytest.approx(expected, rel=0.02)
    assert any("compiled code cannot run on fake tensors" in note for note in data["notes"])


def test_4gb_fits_its_card_with_the_margin_at_bert_large(capsys):
    """4gb.yaml is planned for rtx3050-4gb: on that card (3.81 GiB as torch reports it) BERT-large at 32 x 128
    fits with at least 8 % to spare; the JSON states the card's capacity and the verdict."""
    main(
        [
            "estimate",
            "--json",
            "--gpu",
            "rtx3050-4gb",
            "--no-simulate",
            "--config",
            str(RECIPES / "4gb.yaml"),
            *BERT_LARGE,
        ]
    )
    data = json.loads(capsys.readouterr().out)
    footprint = data["predicted"]["analytic"]
    assert set(footprint["phases"]["backward"]) == {"peak_bytes", "reserved_bytes", "device_bytes", "categories"}
    assert data["device"]["gpu"] == "rtx3050-4gb" and data["device"]["capacity_bytes"] == int(3902 * 2**20)
    verdict = data["verdict"]
    assert verdict["fits"] and verdict["spare"] >= 0.08 and verdict["limit_bytes"] == data["device"]["capacity_bytes"]
    assert footprint["device_bytes"] <= 0.92 * data["device"]["capacity_bytes"]
    assert verdict["line"].startswith("fits rtx3050-4gb (3.81 GiB) with")


def test_the_context_and_the_gpu_come_from_the_options(capsys):
    """--cuda-context replaces the table's context byte for byte; the GPU's architecture picks the kernel."""
    args = ["--no-simulate", "--config", str(RECIPES / "bf16.yaml"), "--data.batch_size=2", "--data.max_length=32"]
    table = estimate(capsys, *args)
    given = estimate(capsys, *args, "--cuda-context", "1343MiB")
    assert given["predicted"]["analytic"]["context_bytes"] == 1343 * 2**20
    assert given["predicted"]["analytic"]["reserved_bytes"] == table["predicted"]["analytic"]["reserved_bytes"]
    assert "memory-efficient" in table["setup"]["attention"]  # padding assumed: flash takes no mask
    main(["estimate", "--json", "--no-simulate", "--gpu", "v100-16gb", "--cuda", "11.2", *args[1:]])
    v100 = json.loads(capsys.readouterr().out)
    assert "V100" in v100["device"]["target"] and "eager module loading" in v100["device"]["target"]
    assert v100["predicted"]["analytic"]["context_bytes"] == 1341 * 2**20


def test_estimate_json_baseline_bert_large_is_above_10_gib(capsys):
    data = estimate(capsys, "--config", str(RECIPES / "baseline.yaml"), *BERT_LARGE)
    assert set(data["predicted"]) == {"analytic", "simulated", "flops_per_step", "flops"}
    assert (
        data["predicted"]["flops_per_step"]
        == data["predicted"]["flops"]["forward"] + data["predicted"]["flops"]["backward"]
    )
    assert data["predicted"]["flops"]["recompute"] == 0  # the baseline recomputes nothing
    for method in ("analytic", "simulated"):
        footprint = data["predicted"][method]
        assert isinstance(footprint["peak_bytes"], int) and footprint["peak_bytes"] > 10 * GiB
        assert set(footprint["categories"]) == set(CATEGORIES)
        assert sum(footprint["categories"].values()) == footprint["peak_bytes"]
        assert footprint["peak_bytes"] <= footprint["reserved_bytes"] < footprint["device_bytes"]
    # the two methods agree at every level (CUDA's kernels stood in for in the simulation)
    analytic, simulated = data["predicted"]["analytic"], data["predicted"]["simulated"]
    for level in ("peak_bytes", "reserved_bytes", "device_bytes"):
        assert simulated[level] == pytest.approx(analytic[level], rel=0.05), level
    assert data["model"]["file_bytes"]["fp32"] == 4 * data["model"]["parameters"]
    assert data["device"]["analytic"] == data["device"]["simulated"] == "cuda"
    assert any("simulated on CPU" in note for note in data["notes"])


def test_estimate_without_simulation_prints_a_table(capsys):
    main(["estimate", "--no-simulate", "--device", "cpu", "--config", str(RECIPES / "accumulate.yaml")])
    out = capsys.readouterr().out
    for label in (
        "weights",
        "gradients",
        "optimizer state",
        "activations",
        "other/temporary",
        "peak (tensors)",
        "inference",
        "model file",
    ):
        assert label in out
    assert "simulated" not in out and "reserved" not in out  # the CPU has no allocator or context to add
    main(["estimate", "--no-simulate", *A100, "--config", str(RECIPES / "accumulate.yaml")])
    out = capsys.readouterr().out
    assert "reserved (allocator)" in out and "device (nvidia-smi)" in out and "A100 80GB (sm80, 79.26 GiB)" in out
    assert "verdict: fits a100-80gb (79.26 GiB) with" in out


def test_estimate_json_without_simulation_has_null_simulated_entries(capsys):
    main(["estimate", "--json", "--no-simulate", "--config", str(RECIPES / "accumulate.yaml")])
    data = json.loads(capsys.readouterr().out)
    assert data["predicted"]["simulated"] is None and data["inference_bytes"]["simulated"] is None
    assert data["setup"]["accumulate_grad_batches"] == 32 and data["setup"]["batch_size"] == 1


def test_estimate_reads_clipping_by_norm_from_the_trainer_settings(capsys):
    """fused.yaml with trainer.gradient_clip_val (norm by default): the measuring backward is predicted, its
    largest gradient (the word embeddings') at the peak; by value, nothing changes."""
    peaks = {}
    for clip in (
        [],
        ["--trainer.gradient_clip_val=1.0"],
        ["--trainer.gradient_clip_val=1.0", "--trainer.gradient_clip_algorithm=value"],
    ):
        main(["estimate", "--json", "--no-simulate", "--config", str(RECIPES / "fused.yaml"), *clip])
        peaks[len(clip)] = json.loads(capsys.readouterr().out)["predicted"]["analytic"]
    assert peaks[1]["categories"]["gradients"] == 4 * 30522 * 384  # MiniLM's word embeddings
    assert peaks[1]["peak_bytes"] == peaks[0]["peak_bytes"] + 4 * 30522 * 384
    assert peaks[2] == peaks[0]


def test_unmodelled_precision_is_one_error_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", "--no-simulate", "--trainer.precision=transformer-engine"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().startswith("error: precision 'transformer-engine' is not modelled")


def test_under_fsdp_each_of_8_ranks_is_predicted_at_most_0_6_of_one_device(capsys):
    def peak(*more: str) -> int:
        # one checkpointing plan for both (`auto` would leave more layers whole on the ranks' smaller totals)
        plan = ["--model.gradient_checkpointing=true", "--model.offload_activations=false"]
        args = ["--config", str(RECIPES / "4gb.yaml"), "--config", str(CONFIGS / "bert-large.yaml"), *plan, *more]
        main(["estimate", "--json", "--no-simulate", *args])
        return json.loads(capsys.readouterr().out)["predicted"]["analytic"]

    one = peak()
    sharded = peak("--config", str(CONFIGS / "fsdp.yaml"), "--trainer.devices=8")
    assert sharded["peak_bytes"] <= 0.6 * one["peak_bytes"]
    # weights and optimizer state are 1/8 each (plus the gathered units); activations are each rank's own
    assert sharded["categories"]["optimizer"] == pytest.approx(one["categories"]["optimizer"] / 8, rel=0.01)
    assert sharded["categories"]["activations"] == one["categories"]["activations"]


def test_a_gpu_without_bf16_is_predicted_in_fp16_with_its_attention_kernel(capsys):
    """--gpu t4 (sm75): bf16.yaml's bf16 becomes what fit would train with there, 16-mixed (one line says so),
    whose fp16 attention runs SDPA's memory-efficient kernel. bf16 typed stays bf16, and then attention runs the
    math kernel (memory-efficient takes bf16 only from sm80): about 2 GiB more at BERT-large 32 x 128."""
    args = ["estimate", "--json", "--no-simulate", "--gpu", "t4", "--config", str(RECIPES / "bf16.yaml"), *BERT_LARGE]
    main(args)
    out = capsys.readouterr()
    fp16 = json.loads(out.out)
    assert fp16["setup"]["precision"] == "16-mixed" and "memory-efficient" in fp16["setup"]["attention"]
    assert [line for line in out.err.splitlines() if "has no bf16" in line] == out.err.strip().splitlines()[:1]
    main([*args, "--trainer.precision=bf16-mixed"])
    bf16 = json.loads(capsys.readouterr().out)
    assert bf16["setup"]["precision"] == "bf16-mixed" and "math" in bf16["setup"]["attention"]
    extra = (
        bf16["predicted"]["analytic"]["categories"]["activations"]
        - fp16["predicted"]["analytic"]["categories"]["activations"]
    )
    assert 1.8 * GiB < extra < 2.6 * GiB


def test_4gb_on_a_gpu_without_bf16_fits_4_gib_in_fp16_with_its_checking_backward(capsys):
    """The 4gb tier on an sm75 card: 16-mixed under the fused step, whose first backward checks for overflow
    (kept graph and the largest gradient predicted at the measuring pass; its FLOPs counted as a second
    backward), planned to fit 4 GiB (its tier, typed: estimate --gpu plans for the T4's 14.75 GiB otherwise). The 2gb
    tier's bf16 weights stop there with one line naming 4gb."""
    data = estimate(capsys, "--no-simulate", "--config", str(RECIPES / "4gb.yaml"), *BERT_LARGE, "--gpu", "t4",
                    "--memory.tier", "rtx3050-4gb")
    assert data["setup"]["precision"] == "16-mixed" and data["setup"]["measuring_backward"]
    assert data["predicted"]["analytic"]["device_bytes"] <= 4 * GiB
    flops = data["predicted"]["flops"]
    assert flops["measuring"] == flops["backward"] and data["predicted"]["flops_per_step"] == sum(
        flops[k] for k in ("forward", "backward", "measuring")
    )
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", "--no-simulate", "--gpu", "t4", "--config", str(RECIPES / "2gb.yaml"), *BERT_LARGE])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: trainer.precision bf16-true keeps the weights in bf16") and "--recipe 4gb" in error


def test_the_verdict_names_the_card_asked_and_the_first_line_the_model_with_a_throughput_estimate(capsys):
    """estimate --recipe 4gb --gpu rtx4060: the verdict is about the RTX 4060 and ``auto`` is planned for it (not for
    the recipe's memory.tier, rtx3050-4gb, the card the recipe was made for), the first line names the model estimated
    (MiniLM, the recipes' own), and the samples per second for the card come from one FLOP figure (the counted FLOPs
    per sample) at the utilisation the project's GPU records measured where the card set the pace, said to be an
    estimate; a memory.budget below the card caps it, named with it, and the plan is made for the budget."""
    from lit_memory.memory.hardware.gpus import GPUS
    from lit_memory.tools.estimate import format_report, record_rows

    main(["estimate", "--json", "--no-simulate", "--recipe", "4gb", "--gpu", "rtx4060"])
    data = json.loads(capsys.readouterr().out)
    card = GPUS["rtx4060"]
    assert (
        data["verdict"]["line"].startswith("fits rtx4060 (7.75 GiB) with")
        and data["verdict"]["limit_bytes"] == card.memory
    )
    assert any(
        n.startswith("gradient_checkpointing auto: ")
        and ": fits rtx4060 (7.75 GiB, --gpu) with" in n
        and n.endswith("a run there plans for memory.tier rtx3050-4gb (3.81 GiB) unless given --memory.tier rtx4060)")
        for n in data["notes"]
    )
    text = format_report(data).splitlines()
    assert text[0].startswith("estimating bundled:minilm (all-MiniLM-L6-v2, the recipes' model unless a config names")
    row, name = max(record_rows(), key=lambda r: r[0]["hfu"])  # the busiest step the records measured
    assert (name, row["recipe"], row["peak_kind"]) == ("h200.json", "fused", "fp32") and row["hfu"] > 0.5
    speed = data["throughput"]
    assert speed["flops_per_sample"] == data["predicted"]["flops"]["per_sample"]  # one FLOP figure
    assert (speed["bound"], speed["utilisation"], speed["peak_tflops"]) == ("card", row["hfu"], card.tflops)
    assert speed["samples_per_s"] == pytest.approx(
        row["hfu"] * card.tflops * 1e12 / speed["flops_per_sample"], rel=1e-9
    )
    assert speed["host_from"] is None  # the records' rows are BERT-large's: no host bound for MiniLM
    line = next(line for line in text if line.startswith("throughput on rtx4060: "))
    assert line.startswith(f"throughput on rtx4060: about {speed['samples_per_s']:,.0f} samples/s, an estimate, not a "
                           f"measurement: {speed['flops_per_sample'] / 1e9:.1f} GFLOP per sample (counted above) at "
                           f"{100 * row['hfu']:.1f} % of its bf16/fp16 dense peak 15.1 TFLOP/s")
    assert "fused (fp32) on h200.json" in line
    main(["estimate", "--json", "--no-simulate", "--recipe", "4gb", "--gpu", "rtx4060", "--memory.budget", "2GiB"])
    capped = json.loads(capsys.readouterr().out)
    assert capped["verdict"]["limit_bytes"] == 2 * 2**30
    assert "rtx4060 (7.75 GiB) capped at memory.budget 2.00 GiB" in capped["verdict"]["line"]
    assert any(": fits memory.budget 2.00 GiB with" in n for n in capped["notes"])  # planned for the budget


def test_bert_large_on_4gb_is_planned_for_the_card_and_its_speed_checked_against_the_gpu_records(capsys):
    """BERT-large with the 4gb recipe: on an RTX 4060 (15.1 dense bf16 TFLOP/s) planned for its 7.75 GiB (about no
    recompute: the 236.8 GFLOP per sample of the model) and at least the issue's floor, 20 % of its peak (12.7
    samples/s; it said 2); on the H200 itself, the host-bound rate h200.json measured for this recipe."""
    from lit_memory.tools.estimate import record_rows

    main(["estimate", "--json", "--no-simulate", "--recipe", "4gb", *BERT_LARGE, "--gpu", "rtx4060"])
    small = json.loads(capsys.readouterr().out)
    flops, speed = small["predicted"]["flops"], small["throughput"]
    assert flops["recompute_share"] < 0.01 and 236e9 < flops["per_sample"] < 238e9
    assert speed["bound"] == "card" and speed["host_from"] == "4gb on h200.json"
    assert speed["samples_per_s"] >= 0.2 * 15.1e12 / flops["per_sample"]
    main(["estimate", "--json", "--no-simulate", "--recipe", "4gb", *BERT_LARGE, "--gpu", "h200"])
    speed = json.loads(capsys.readouterr().out)["throughput"]
    measured = next(r for r, name in record_rows() if name == "h200.json" and r["recipe"] == "4gb")
    assert speed["bound"] == "host" and speed["samples_per_s"] == pytest.approx(measured["samples_per_s"], rel=1e-6)
