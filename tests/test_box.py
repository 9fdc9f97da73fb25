"""The box (`lit_memory.box`): an untrusted run's process writes, reads, starts and reaches only what the box
allows, whatever code asks. In-process: each test holds a box over folders in tmp_path and tries what an
attacker's recipe would make some class do; the hook is process-wide, the box only while it is held.
End-to-end runs of hostile recipes through the CLI are in tests/test_trust.py ("the box")."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO
from lit_memory import box

VICTIM = "the victim's own content\n"


@pytest.fixture
def place(tmp_path):
    """A run folder (recipe-chosen: create-only) with a file it did not make, and a victim outside it."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    (outside / "victim.txt").write_text(VICTIM)
    (run / "theirs.txt").write_text(VICTIM)
    (run / "theirs").mkdir()
    (run / "theirs" / "keep.txt").write_text(VICTIM)
    held = box.Box(since=time.time() + 1e-3)
    held.allow(run, "trainer.default_root_dir")
    held.name_settings([("trainer.callbacks.0.init_args.exclude_batches_path", str(outside / "x.json"))])
    return held, run, outside


def refused(held, fn, *fragments):
    with pytest.raises(box.Refused) as err:
        with box.confine(held):
            fn()
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)
    return str(err.value)


def test_a_run_creates_and_rewrites_its_own_files_in_its_run_folder(place):
    held, run, _ = place
    with box.confine(held):
        (run / "a" / "b").mkdir(parents=True)
        (run / "a" / "b" / "x.txt").write_text("1")
        (run / "a" / "b" / "x.txt").write_text("2")  # made by the run: rewritten
        with open(run / "a" / "b" / "x.txt", "a") as f:
            f.write("3")
        os.replace(run / "a" / "b" / "x.txt", run / "a" / "y.txt")
        os.symlink("y.txt", run / "a" / "last.ckpt")  # Lightning's save_last link, beside its target
        os.remove(run / "a" / "last.ckpt")
        shutil.rmtree(run / "a")
    assert sorted(p.name for p in run.iterdir()) == ["theirs", "theirs.txt"] and held.refused == []


@pytest.mark.parametrize("in_temp", [False, True])
def test_the_missing_folders_above_a_run_folder_are_made_and_nothing_beside_them(tmp_path, in_temp):
    """A logger's save_dir below folders that do not exist yet (bench's --out DIR/runs/<recipe>): made like
    mkdir -p, also in the temporary folder under a folder made before the run (found on a GPU: the CSV
    logger's makedirs was refused); a folder beside the way stays refused, and outside the temporary folder a
    file on the way too."""
    (tmp_path / "new").mkdir()  # made before the run
    run = tmp_path / "new" / "runs" / "mine"
    held = box.Box(since=time.time() + 1e-3)
    if in_temp:
        held.allow(tmp_path, "the temporary folder", shallow=True)
    held.allow(run, "trainer.logger.init_args.save_dir")
    with box.confine(held):
        run.mkdir(parents=True)
        (run / "metrics.csv").write_text("1")
    refused(held, lambda: (tmp_path / "new" / "beside").mkdir(), "refusing to create")
    if not in_temp:
        refused(held, lambda: (tmp_path / "new" / "runs" / "x.txt").write_text("1"), "outside the run's folders")
    assert (run / "metrics.csv").read_text() == "1"


def test_a_write_outside_the_run_folder_names_the_path_and_the_setting(place):
    held, _, outside = place
    line = refused(held, lambda: (outside / "x.json").write_text("{}"), str(outside / "x.json"),
                   "(trainer.callbacks.0.init_args.exclude_batches_path)", "outside the run's folders")
    assert line.startswith("refusing to write ")
    assert not (outside / "x.json").exists() and len(held.refused) == 1


@pytest.mark.parametrize("what", ["write", "append", "truncate", "chmod", "replace", "remove", "rmtree", "rename_away"])
def test_nothing_the_run_did_not_make_is_changed_or_removed(place, what):
    held, run, _ = place
    theirs = run / "theirs.txt"
    scratch = run / "scratch"
    actions = {
        "write": lambda: theirs.write_text("x"),
        "append": lambda: open(theirs, "a").write("x"),
        "truncate": lambda: os.truncate(theirs, 0),
        "chmod": lambda: os.chmod(theirs, 0o777),
        "replace": lambda: (scratch.write_text("x"), os.replace(scratch, theirs)),  # save_pretrained's export
        "remove": lambda: os.remove(theirs),
        "rmtree": lambda: shutil.rmtree(run / "theirs"),  # ModelCheckpoint(save_last: link)'s rmtree of last.ckpt
        "rename_away": lambda: os.rename(run / "theirs", run / "old"),
    }
    refused(held, actions[what], "this run did not make it")
    assert theirs.read_text() == VICTIM and (run / "theirs" / "keep.txt").read_text() == VICTIM


def test_never_through_a_link_however_deep(place):
    held, run, outside = place
    (run / "a" / "b").mkdir(parents=True)
    (run / "a" / "b" / "c").symlink_to(outside)  # three folders down, as FSDP2's sharded save met it
    refused(held, lambda: (run / "a" / "b" / "c" / "victim.txt").write_text("x"), f"{run / 'a' / 'b' / 'c'} is a link")
    refused(held, lambda: (run / "a" / "b" / "c" / "d").mkdir(), "is a link")
    (run / "planted.json").symlink_to(outside / "victim.txt")
    refused(held, lambda: (run / "planted.json").write_text("x"), "is a link")
    refused(held, lambda: os.symlink(outside / "victim.txt", run / "mine"), "point outside the run's folder")
    refused(held, lambda: os.link(run / "theirs.txt", run / "hard"), "did not make it")
    assert (outside / "victim.txt").read_text() == VICTIM


def test_native_writers_are_judged_too(place):
    """torch.save's C++ zip writer, safetensors' Rust writer and torch's distributed checkpoint write without
    Python's `open` (or, for DCP, in threads of their own): each is refused through a link all the same."""
    import safetensors.torch
    import torch.distributed.checkpoint as dcp

    held, run, outside = place
    (run / "ckpt").symlink_to(outside)
    refused(held, lambda: torch.save({"w": torch.ones(1)}, run / "ckpt" / "meta.pt"), "is a link")
    refused(held, lambda: safetensors.torch.save_file({"w": torch.ones(1)}, str(run / "ckpt" / "model.safetensors")),
            "is a link")
    with pytest.raises(BaseException), box.confine(held):  # torch wraps it in a CheckpointException: the box keeps it
        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(run / "ckpt" / "sharded"), no_dist=True)
    assert "ckpt is a link" in str(held.refused[-1])
    assert sorted(p.name for p in outside.iterdir()) == ["victim.txt"]
    with box.confine(held):  # and in the run folder itself they work
        torch.save({"w": torch.ones(1)}, run / "meta.pt")
        safetensors.torch.save_file({"w": torch.ones(1)}, str(run / "model.safetensors"))
    assert torch.load(run / "meta.pt")["w"].item() == 1.0


def test_the_temporary_folder_holds_only_what_the_run_made_there(place, tmp_path):
    import tempfile

    held, _, _ = place
    held.allow(tempfile.gettempdir(), "the temporary folder", shallow=True)
    existing = tmp_path / "outside"  # a folder inside the temporary folder that the run did not make
    with box.confine(held):
        made = Path(tempfile.mkdtemp())
        (made / "sub").mkdir()
        (made / "sub" / "x").write_text("x")
        shutil.rmtree(made)
    refused(held, lambda: (existing / "new.json").write_text("x"), "only what the run made there")


def test_reads_of_fifos_and_devices_are_refused_unless_typed(place):
    held, run, _ = place
    fifo = run / "memory.json"
    os.mkfifo(fifo)
    (run / "metadata").symlink_to("/dev/zero")
    refused(held, lambda: open(fifo, "rb"), "it is a FIFO")
    refused(held, lambda: open(run / "metadata", "rb").read(1), "it is a device")
    with box.confine(held):
        assert open("/dev/null", "rb").read() == b""
        assert (run / "theirs.txt").read_text() == VICTIM  # regular files, whoever made them
    held.typed_files = {os.path.realpath(run / "metadata")}  # typed on the command line: the user's
    with box.confine(held):
        assert open(run / "metadata", "rb").read(4) == b"\0" * 4


def test_no_program_starts_but_lit_memory_itself(place):
    held, _, _ = place
    refused(held, lambda: subprocess.run(["true"]), "starts no programs")
    refused(held, lambda: os.system("true"), "starts no programs")
    refused(held, lambda: os.execv("/bin/true", ["true"]), "starts no programs")
    assert box._is_lit_memory(sys.executable, [sys.executable, "-m", "lit_memory", "fit", "--config", "x.yaml"])
    assert box._is_lit_memory(sys.executable, [sys.executable, "-P", "-m", "lit_memory.tools.peer", "--out", "x"])
    assert not box._is_lit_memory(sys.executable, [sys.executable, "-m", "lit_memory", "fit", "--trust-recipe"])
    assert not box._is_lit_memory(sys.executable, [sys.executable, "-c", "import os"])
    assert not box._is_lit_memory("/bin/sh", ["/bin/sh", "-m", "lit_memory"])


def test_forked_children_are_bounded(place):
    import multiprocessing

    held, _, _ = place
    held.max_children = 0
    context = multiprocessing.get_context("fork")
    refused(held, lambda: context.Process(target=print).start(), "the bound for this run is 0")


def test_no_connection_but_to_the_hub(place):
    held, _, _ = place
    held.hosts = {"huggingface.co", "hf.co"}
    refused(held, lambda: socket.create_connection(("127.0.0.1", 9), timeout=1), "refusing to connect to ('127.0.0.1', 9)")
    refused(held, lambda: socket.getaddrinfo("example.com", 443), "refusing to look up example.com")
    refused(held, lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", 9)), "refusing to connect")
    assert box._allowed_host("cdn-lfs.hf.co", held.hosts) and not box._allowed_host("evilhf.co", held.hosts)


def test_a_refusal_a_library_swallows_is_kept(place):
    held, _, outside = place
    with box.confine(held):
        try:
            (outside / "x.json").write_text("{}")
        except OSError:  # a library that treats "cannot write" as a soft failure
            pass
    assert len(held.refused) == 1 and str(outside / "x.json") in str(held.refused[0])


def test_the_box_holds_only_while_held(place):
    held, _, outside = place
    before = os.environ.get(box.ENV)
    with box.confine(held):
        assert box.active() is held and os.environ[box.ENV] and os.environ["PYTHONSAFEPATH"] == "1"
    assert box.active() is None and os.environ.get(box.ENV) == before
    (outside / "x.json").write_text("{}")  # the hook stays installed, inactive


def test_a_process_the_run_starts_is_boxed_the_same_way(place):
    """Lightning's DDP launcher, multiprocessing's spawn and the bench start Python processes: each one that
    imports lit_memory holds the box it inherits (its roots and when the run started)."""
    held, run, outside = place
    assert box.Box.from_env(held.to_env()).roots == held.roots
    code = "import lit_memory, pathlib, sys; pathlib.Path(sys.argv[1]).write_text('x')"
    env = {**os.environ, box.ENV: held.to_env(), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code, str(outside / "x.json")], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and "refusing to write" in done.stderr and not (outside / "x.json").exists()
    done = subprocess.run([sys.executable, "-c", code, str(run / "x.json")], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_before_a_run_the_box_says_what_it_would_refuse_without_recording_it(place):
    held, run, outside = place
    assert "outside the run's folders" in held.would_refuse(outside, "into")  # an existing folder of the user's
    assert str(outside) + " (" in held.would_refuse(outside, "into")
    assert held.would_refuse(run / "new" / "deeper", "into") is None
    assert "did not make it" in held.would_refuse(run / "theirs.txt", "remove", "replace")
    assert held.refused == [] and held.made == set()


def test_python_m_lit_memory_imports_nothing_from_the_folder_it_runs_in(tmp_path):
    """A shared folder holding ``logging.py`` or ``datasets/``: Python puts the working folder first on sys.path for
    ``-m``; lit_memory/__init__.py drops it before importing anything (the same for every ``-m lit_memory.*``, so
    the cheapest module stands for the CLI here), and a shared recipe's rerun line names the installed script."""
    marker = tmp_path / "IMPORTED"
    (tmp_path / "logging.py").write_text(f"open({str(marker)!r}, 'w').write('logging')\n")
    (tmp_path / "datasets").mkdir()
    (tmp_path / "datasets" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('datasets')\n")
    code = "import lit_memory, sys, importlib.util; print(importlib.util.find_spec('datasets').origin)"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "lit_memory.errors"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0 and not marker.exists(), done.stderr
    done = subprocess.run([sys.executable, "-c", f"import sys; sys.argv[0] = '-m'; {code}"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)  # as `-m` sees it while the package is imported
    assert done.returncode == 0 and str(tmp_path) not in done.stdout and not marker.exists(), done.stdout + done.stderr
    from lit_memory.recipes import SAFE_COMMAND, shared_recipe

    assert f"# rerun: {SAFE_COMMAND} fit --config recipe.yaml" in shared_recipe("{}\n", "cmd", "machine", tmp_path)
    assert SAFE_COMMAND == "lit-memory"


def test_what_a_library_caught_and_went_on_without_is_said_at_the_end(place, capsys):
    """`python -m lit_memory` ends with the refusals some library caught (a program that did not start, a file
    that was not written): warnings, once each; the command's own outcome stands."""
    from lit_memory.__main__ import _report

    held, _, outside = place
    with box.confine(held):
        for attempt in (lambda: subprocess.run(["true"]), lambda: (outside / "x.json").write_text("{}")) * 2:
            try:
                attempt()
            except OSError:
                pass
        assert box._is_lit_memory("/usr/bin/uname", ["uname", "-p"])  # platform.processor()'s question
    _report(held)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("warning: refusing to run true")
    assert err[1].startswith(f"warning: refusing to write {outside}") and not (outside / "x.json").exists()


def test_a_file_a_tool_is_told_to_write_is_the_only_one_in_its_folder(place):
    """``plan --output planned.yaml``: the user's file (replaced whole, through a temporary beside it), not the
    folder it is in."""
    from lit_memory import files

    held, _, outside = place
    held.allow(outside / "victim.txt", "--output", owned=True, file=True)
    with box.confine(held):
        files.write_text(outside / "victim.txt", "planned\n")
    assert (outside / "victim.txt").read_text() == "planned\n"
    refused(held, lambda: (outside / "other.yaml").write_text("x"), "outside the run's folders")
    assert sorted(p.name for p in outside.iterdir()) == ["victim.txt"]
