"""Out-of-memory errors inside FSDP2 steps, several runs in one pair of processes; used by tests/run/test_monitor.py.

The test starts this script twice, as torchrun would (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` set: Lightning then starts no process of its own), and each process runs every case in turn
through ``python -m lit_memory fit``'s own entry point (`lit_memory.__main__.main`), one process group for all:

    python tests/oom_worker.py OUT ONE_DEVICE_PORT

First, on rank 0 alone, the `ONE_DEVICE` cases: FSDP2 on one device (its own one-rank process group on
``ONE_DEVICE_PORT``, destroyed after), while rank 1 waits for the pair's rendezvous; then the `TWO_RANKS` cases on
both. Every case raises torch's out-of-memory error in its first step (`oom.RaiseOutOfMemory`). Each process writes
``OUT/<case>/rank<N>.json``: the exit code, the type of what ended the run, its console's error stream.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback
from pathlib import Path

if __name__ == "__main__":  # a script: import this checkout's lit_memory and the tests' callbacks
    sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FAST = [
    "--trainer.accelerator=cpu", "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
    "--trainer.num_sanity_val_steps=0", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
    "--trainer.enable_checkpointing=false", "--data.limit_train_samples=16", "--data.limit_eval_samples=8",
    "--data.batch_size=4", "--data.padding=max_length", "--data.max_length=32", "--model.save_pretrained=false",
    "--trust-recipe", "--trainer.callbacks+=oom.RaiseOutOfMemory",
]
# case -> (recipe, where the error is raised, more arguments)
TWO_RANKS = {
    "untracked-before-backward": ("baseline", "before_backward", ["--memory.track_steps=0"]),
    "untracked-in-backward": ("fused", "backward", ["--memory.track_steps=0"]),
    "tracked-in-backward": ("fused", "backward", ["--memory.track_steps=1"]),
}
ONE_DEVICE = {
    "one-device-untracked-in-backward": ("fused", "backward", ["--memory.track_steps=0"]),
    "one-device-tracked-before-backward": ("baseline", "before_backward", ["--memory.track_steps=1"]),
}


def run(out: Path, case: str, recipe: str, where: str, more: list[str], devices: int) -> None:
    from lit_memory.__main__ import main

    folder = out / case
    args = [
        "fit", "--config", str(REPO / "recipes" / f"{recipe}.yaml"), "--config", str(REPO / "configs" / "fsdp.yaml"),
        *FAST, f"--trainer.devices={devices}", f"--trainer.callbacks.where={where}",
        f"--trainer.default_root_dir={folder}", *more,
    ]
    err, code, ended = io.StringIO(), 0, None
    with contextlib.redirect_stderr(err):
        try:
            main(args)
        except SystemExit as exit_:
            code = exit_.code
        except BaseException as exception:  # noqa: BLE001  what the test must not see: recorded, not raised
            code, ended = -1, f"{type(exception).__name__}: {exception}"
            traceback.print_exc(file=err)
    folder.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    record = {"code": code, "uncaught": ended, "stderr": err.getvalue()}
    (folder / f"rank{rank}.json").write_text(json.dumps(record), encoding="utf-8")


def main() -> None:
    out, one_device_port = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    if os.environ["RANK"] == "0":
        pair = {k: os.environ[k] for k in ("MASTER_PORT", "WORLD_SIZE")}
        os.environ.update(MASTER_PORT=one_device_port, WORLD_SIZE="1")
        for case, (recipe, where, more) in ONE_DEVICE.items():
            run(out, case, recipe, where, more, devices=1)
        torch.distributed.destroy_process_group()  # Lightning leaves it for the process's next run
        os.environ.update(pair)
    for case, (recipe, where, more) in TWO_RANKS.items():
        run(out, case, recipe, where, more, devices=2)


if __name__ == "__main__":
    main()
