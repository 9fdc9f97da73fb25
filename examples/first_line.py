"""Seconds to each command's first line (issue 60): ``--help`` of every command, and the ``error:`` line for a bad
file, column or option, each in a fresh ``python -m lit_memory`` process, as a user waits for it.

    python examples/first_line.py --runs 3 --json after.json                    # every case, 3 runs each
    python examples/first_line.py --runs 3 --before before.json                 # a table with a "before" column
    python examples/first_line.py --cases fit-help,empty-file                   # some of them

The clock runs from starting the process to the first line it prints on stdout or stderr, and to the line the case
is about (the ``error:`` line; a library's notice can come first); the process then runs to its end (a full help is
read whole). Prints a markdown table (min and median of the runs) naming the machine; ``--json`` keeps the numbers,
``--before`` puts another run's medians beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import selectors
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

RECIPE = ["--recipe", "4gb"]
# (name, argv; FILES names the folder of the data files made below)
CASES = [
    ("help", ["--help"]),
    *((f"{c}-help", [c, "--help"]) for c in ("fit", "validate", "test", "predict", "estimate", "plan", "cards", "bench",
                                            "recipes")),
    ("fit-help-all", ["fit", "--help", "all"]),
    ("bad-option", ["fit", *RECIPE, "--data.sourcex", "FILES/good.csv"]),
    ("missing-file", ["fit", *RECIPE, "--data.source", "FILES/missing.csv"]),
    ("empty-file", ["fit", *RECIPE, "--data.source", "FILES/empty.csv"]),
    ("latin-1-file", ["fit", *RECIPE, "--data.source", "FILES/latin1.csv"]),
    ("bad-column", ["fit", *RECIPE, "--data.source", "FILES/good.csv", "--data.text_column", "txt"]),
    ("predict-missing-file", ["predict", "--data.predict_path", "FILES/missing.csv"]),
]


def make_files(folder: Path) -> None:
    (folder / "empty.csv").write_bytes(b"")
    (folder / "latin1.csv").write_bytes("text,label\nCaf\xe9 au lait,1\nthe tea,0\n".encode("latin-1"))
    (folder / "good.csv").write_text("text,label\nhello there,1\ngoodbye,0\n", encoding="utf-8")


def first_line(argv: list[str], cwd: Path, limit: float = 600) -> tuple[float, str, Optional[float]]:
    """(seconds to the first line on stdout or stderr, that line, seconds to the first ``error:`` line or None) of
    ``python -m lit_memory ARGV``."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "lit_memory", *argv], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    selector = selectors.DefaultSelector()
    for stream in (proc.stdout, proc.stderr):
        selector.register(stream, selectors.EVENT_READ)
    held = {proc.stdout: b"", proc.stderr: b""}
    seconds, line, error = None, "", None
    while error is None and selector.get_map() and time.perf_counter() - start < limit:
        for key, _ in selector.select(timeout=limit):
            chunk = os.read(key.fileobj.fileno(), 65536)
            if not chunk:
                selector.unregister(key.fileobj)
                continue
            held[key.fileobj] += chunk
            now = time.perf_counter() - start
            if seconds is None and b"\n" in held[key.fileobj]:
                seconds, line = now, held[key.fileobj].split(b"\n", 1)[0].decode(errors="replace")
            if key.fileobj is proc.stderr and re.search(rb"(^|\n)error:[^\n]*\n", held[proc.stderr]):
                error = now  # a whole error: line
    selector.close()
    proc.communicate(timeout=limit)  # the rest of its output: the process ends as it would for a user
    return (seconds if seconds is not None else time.perf_counter() - start), line, error


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or platform.machine())
    return f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}"


def table(results: dict, before: dict | None) -> str:
    head = "| case | command | first line | min s | median s | error: line, median s |"
    lines = [f"{len(results['cases'][next(iter(results['cases']))]['seconds'])} runs each on {results['machine']}, "
             f"`{results['command']}`" + (f"; before: {before['label']}" if before else "") + ":", "",
             head + (" before: first line, median s | before: error: line, median s |" if before else ""),
             "|---|---|---|---:|---:|---:|" + ("---:|---:|" if before else "")]
    for name, case in results["cases"].items():
        row = (f"| {name} | `{' '.join(case['argv'])}` | `{case['line'][:50]}` | {min(case['seconds']):.2f} | "
               f"{statistics.median(case['seconds']):.2f} | {_median(case.get('error'))} |")
        if before:
            old = before["cases"].get(name)
            row += f" {statistics.median(old['seconds']):.2f} | {_median(old.get('error'))} |" if old else " - | - |"
        lines.append(row)
    return "\n".join(lines)


def _median(values: Optional[list]) -> str:
    return f"{statistics.median(values):.2f}" if values and None not in values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cases", default="all", help="`all` or a,b,c: " + ", ".join(name for name, _ in CASES))
    parser.add_argument("--json", type=Path, help="write the numbers here")
    parser.add_argument("--before", type=Path, help="another run's --json, its medians beside these")
    parser.add_argument("--label", default="", help="what this run measured (a commit), kept in --json")
    args = parser.parse_args()
    chosen = [c for c in CASES if args.cases == "all" or c[0] in args.cases.split(",")]
    command = "python examples/first_line.py " + " ".join(sys.argv[1:])
    results = {"label": args.label, "machine": machine(), "command": command, "cases": {}}
    with tempfile.TemporaryDirectory() as folder:
        make_files(Path(folder))
        for name, argv in chosen:
            argv = [a.replace("FILES", folder) for a in argv]
            runs = [first_line(argv, Path(folder)) for _ in range(args.runs)]
            shown = [a.replace(folder, "/tmp") for a in argv]
            results["cases"][name] = {"argv": shown, "seconds": [round(s, 3) for s, _, _ in runs],
                                      "line": runs[-1][1].replace(folder, "/tmp"),
                                      "error": [None if e is None else round(e, 3) for _, _, e in runs]}
            times = ", ".join(f"{s:.2f}" for s, _, _ in runs)
            print(f"{name}: {times} s  {runs[-1][1][:100]}", file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    before = json.loads(args.before.read_text(encoding="utf-8")) if args.before else None
    print(table(results, before))


if __name__ == "__main__":
    main()
