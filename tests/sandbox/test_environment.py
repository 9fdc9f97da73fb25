"""Class D of issue 58: the confined child's environment is an allowlist (`lit_memory.sandbox.environment`), so a
secret not spelled like one (a database URL with its password, a proxy's credentials, a webhook) never reaches it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import RECIPES

from lit_memory.sandbox import environment, landlock, rules, watchdog

# Each got into a sent recipe's run folder in the fifth outside hunt, past the name-based denylist.
SECRETS = {
    "DATABASE_URL": "postgres://app:s3cret-db@db.internal/prod", "MYSQL_PWD": "s3cret-mysql",
    "HTTPS_PROXY": "http://me:s3cret-proxy@proxy.internal:3128", "PIP_INDEX_URL": "https://s3cret-pip@pypi.internal/simple",
    "SENTRY_DSN": "https://s3cret-sentry@o1.ingest.sentry.io/2", "SLACK_WEBHOOK_URL": "https://hooks.slack.com/s3cret-slack",
}
NEEDED = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "2", "TZ": "UTC",
          "CUDA_VISIBLE_DEVICES": "1", "NVIDIA_VISIBLE_DEVICES": "1", "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0",
          "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NCCL_DEBUG": "WARN", "LIT_MEMORY_CONFIG_DIR": "/x"}


def test_only_what_a_run_needs_is_kept():
    """The six secrets of the hunt are dropped with everything else unknown; what a run reads stays; a kept family's
    member named like a secret and the variables that import code (PYTHONSTARTUP, PYTHONWARNINGS) are dropped too."""
    code = {"PYTHONSTARTUP": "/tmp/x.py", "PYTHONWARNINGS": "ignore::evil.Warning", "LD_PRELOAD": "/tmp/x.so",
            "NCCL_IB_AUTH_TOKEN": "s3cret-nccl", "SOMETHING_ELSE": "x"}
    kept = environment.allowed({**SECRETS, **NEEDED, **code})
    assert kept == NEEDED
    assert rules.scrubbed(SECRETS) == SECRETS  # the denylist the allowlist replaced let every one through


@pytest.mark.skipif(landlock.abi() < 1, reason="a sent recipe runs confined only where Landlock is")
def test_a_confined_fit_gets_no_secret_of_the_users_environment(tmp_path, capsys, monkeypatch):
    """``fit`` of a sent recipe, with the hunt's secrets in the user's environment: the environment the child is
    started with (the watchdog's) holds none of their values, and what the run needs (PATH, offline, its private
    temporary folder, the user's thread count) is there."""
    from lit_memory.__main__ import main

    for name, value in {**SECRETS, "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(rules.ENV, raising=False)
    seen: dict = {}
    monkeypatch.setattr(watchdog, "watch", lambda command, env, spec, *a, **k: seen.update(env) or 0)
    (tmp_path / "sent.yaml").write_text("# sent by someone\n" + (RECIPES / "fused.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    try:
        main(["fit", "--config", "sent.yaml", "--model.model_name_or_path", "bundled:minilm",
              "--trainer.max_steps", "2", "--trainer.accelerator", "cpu"])
    except SystemExit as exit_:
        assert not exit_.code, capsys.readouterr().err[-2000:]
    assert seen, capsys.readouterr().err[-2000:]
    leaked = [name for name, value in seen.items() if any(s in value for s in SECRETS.values())]
    assert not leaked and not set(SECRETS) & set(seen), leaked
    assert seen["PATH"] == os.environ["PATH"] and seen["HF_HUB_OFFLINE"] == "1" and seen["OMP_NUM_THREADS"] == "1"
    assert Path(seen["TMPDIR"]).name == "tmp" and "lit_memory-run-" in seen["TMPDIR"]
