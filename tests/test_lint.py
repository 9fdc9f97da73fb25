"""The habits the project names, run: `ruff check` with pyproject.toml's settings (pycodestyle, pyflakes and import
order at 120 characters) over the repository (package, tests, examples) finds nothing."""

import shutil
import subprocess
import sys

import pytest
from conftest import REPO


def test_ruff_finds_nothing():
    if shutil.which("ruff") is None and subprocess.run([sys.executable, "-m", "ruff", "--version"],
                                                       capture_output=True).returncode != 0:
        pytest.fail("ruff is not installed: pip install -e '.[test]' installs it")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
