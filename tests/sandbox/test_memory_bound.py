"""The confined run's memory bound (issue 57 item 5): per rank, and counting the pages its processes share once
(`lit_memory.sandbox.watchdog.rss`, PSS), so 8 ranks mapping the same CUDA libraries do not pass it 8 times over."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from lit_memory.confine import launch
from lit_memory.sandbox import watchdog

# A process that forks 3 children (sharing the interpreter's pages copy-on-write) and waits.
FORKS = """
import os, sys, time
import json  # some pages of its own
for _ in range(3):
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
print("ready", flush=True)
time.sleep(60)
"""


def test_shared_pages_count_once(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", FORKS], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        tree = watchdog._children(process.pid)
        assert len(tree) == 4
        resident = sum(int(Path(f"/proc/{p}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") for p in tree)
        assert abs(watchdog.rss(process.pid) - resident) < 0.05 * resident  # the cheap sum, asked every 0.2 s
        counted = watchdog.rss(process.pid, shared_once=True)  # asked where that sum is over the bound
        assert 0 < counted < 0.6 * resident, (counted, resident)  # four copies of the interpreter would be 4x one
    finally:
        for pid in watchdog._children(process.pid)[::-1]:
            os.kill(pid, 9)
        process.wait()


def test_the_bound_grows_with_the_ranks():
    assert launch._ranks({"trainer.devices": 4}) == 4
    assert launch._ranks({"trainer.devices": "0,1"}) == 2 and launch._ranks({"trainer.devices": [0, 1, 2]}) == 3
    assert launch._ranks({"trainer.devices": "auto"}) == 1 and launch._ranks({}) == 1
    assert launch._ranks({"trainer.devices": "2"}) == 2
