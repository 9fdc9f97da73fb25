"""Every file lit_memory writes (`lit_memory.files`): whole or not at all, never through a link."""

from __future__ import annotations

import ast
import os

import pytest
from conftest import REPO

from lit_memory import files
from lit_memory.errors import UserError


def test_a_file_is_replaced_whole(tmp_path):
    path = tmp_path / "memory.json"
    files.write_text(path, "first")
    files.write_text(path, "second")
    assert path.read_text() == "second"
    assert [p.name for p in tmp_path.iterdir()] == ["memory.json"]  # no temporary left behind
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())  # as open() would create it


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_failed_write_leaves_the_old_file_and_nothing_else(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with files.replacing(path) as f:
            f.write("half of the new")
            raise RuntimeError("killed while writing")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["recipe.yaml"]


def test_a_symbolic_link_at_the_destination_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "bashrc"
    victim.write_text("mine")
    for writer in (lambda p: files.write_text(p, "x"), lambda p: files.write_bytes(p, b"x"), files.open_log):
        link = tmp_path / "recipe.yaml"
        link.symlink_to(victim)
        with pytest.raises(UserError) as error:
            writer(link)
        assert str(error.value).startswith(f"refusing to write {link}: it is a symbolic link to {victim}")
        assert victim.read_text() == "mine" and link.is_symlink()
        link.unlink()
    dangling = tmp_path / "memory.json"
    dangling.symlink_to(tmp_path / "nowhere" / "new-file")
    with pytest.raises(UserError):
        files.write_text(dangling, "x")
    assert not (tmp_path / "nowhere").exists()


def test_a_hard_link_keeps_its_content(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("mine")
    os.link(victim, tmp_path / "hparams.yaml")
    files.write_text(tmp_path / "hparams.yaml", "ours")  # a new file takes the name; the other name keeps its own
    assert victim.read_text() == "mine" and (tmp_path / "hparams.yaml").read_text() == "ours"


def test_a_folder_written_by_another_writer_replaces_the_old_one_whole(tmp_path):
    path = tmp_path / "hf_model"
    with files.replacing_folder(path) as folder:
        (folder / "config.json").write_text("1")
    with files.replacing_folder(path) as folder:
        (folder / "model.safetensors").write_text("2")
    assert sorted(p.name for p in path.iterdir()) == ["model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["hf_model"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "link").symlink_to(elsewhere)
    with pytest.raises(UserError):
        with files.replacing_folder(tmp_path / "link") as folder:
            (folder / "config.json").write_text("1")
    assert list(elsewhere.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == [
        "elsewhere",
        "hf_model",
        "link",
    ]


def test_a_folder_is_written_where_no_folder_exists_yet(tmp_path):
    # A resumed run that saves no checkpoint and logs nothing has no run folder when it exports its model.
    path = tmp_path / "run" / "hf_model"
    with files.replacing_folder(path) as folder:
        (folder / "config.json").write_text("1")
    assert [p.name for p in path.iterdir()] == ["config.json"]
    assert [p.name for p in path.parent.iterdir()] == ["hf_model"]


def test_planted_links_are_found_without_following_them(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").symlink_to(tmp_path)
    (tmp_path / "plain").write_text("x")
    os.link(tmp_path / "plain", tmp_path / "hard")
    found = sorted(p.name for p in files.planted_links(tmp_path))
    assert found == ["hard", "last.ckpt", "plain"]
    assert files.planted_links(tmp_path / "missing") == []


def test_lit_memory_writes_files_only_through_lit_memory_files():
    """No call that writes a file by name anywhere else in the package: ``open(..., "w"/"a"/"x")``,
    ``Path.write_text/write_bytes``; a chart is saved into a file `lit_memory.files` opened."""
    found = []
    # the sandbox writes kernel interfaces (cgroupfs, /proc/self/uid_map, a mount point), not files of a run
    kernel = {REPO / "lit_memory" / "sandbox" / name for name in ("cgroup.py", "namespaces.py")}
    for path in (REPO / "lit_memory").rglob("*.py"):
        if path == REPO / "lit_memory" / "files.py" or path in kernel:
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "files":
                continue
            mode = (
                node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
            )
            writing = name == "open" and isinstance(mode, ast.Constant) and set(str(mode.value)) & set("wax")
            chart = name == "savefig" and "files.replacing(" not in lines[node.lineno - 2]
            if name in ("write_text", "write_bytes") or writing or chart:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
    assert found == []
