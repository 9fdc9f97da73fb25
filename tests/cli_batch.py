"""Run several ``python -m lit_memory ARGV`` commands in one fresh process; used by tests/config/test_trust.py.

    python tests/cli_batch.py CASES.json RESULTS.json

CASES.json: ``{name: {"argv": [...], "env": {...}}}``. Each case is one call of the entry point
(`lit_memory.__main__.main`, what ``python -m lit_memory`` runs) with its own argv and environment
variables (restored after it), its stdout and stderr captured; RESULTS.json gets
``{name: {"code": exit status, "out": stdout, "err": stderr, "seconds": its wall time}}``. Each command's trust decision
holds for that command only (`lit_memory.config.trust.Decision.applied`); tests/config/test_trust.py runs a batch all
untrusted and one all
``--trust-recipe`` to compare them. The cases share only what every one of them would set up the same way in a
process of its own, and a process start (about 10 s here) is paid once.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # a script: import this checkout's lit_memory
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run_case(argv: list[str], env: dict[str, str]) -> dict:
    from lit_memory.__main__ import main

    saved = dict(os.environ)
    os.environ.update(env)
    out, err = io.StringIO(), io.StringIO()
    code, started = 0, time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(argv)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException as exc:  # noqa: BLE001  a traceback is a result too (and a failed test)
        code, err = 99, io.StringIO(err.getvalue() + f"\nTRACEBACK {type(exc).__name__}: {exc}")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {
        "code": code,
        "out": out.getvalue(),
        "err": err.getvalue(),
        "seconds": round(time.perf_counter() - started, 1),
    }


if __name__ == "__main__":
    cases = json.loads(Path(sys.argv[1]).read_text())
    results = {name: run_case(case["argv"], case.get("env", {})) for name, case in cases.items()}
    Path(sys.argv[2]).write_text(json.dumps(results, indent=1))
