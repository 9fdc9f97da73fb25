"""Whether a confined run (`lit_memory.sandbox`: what every run without --trust-recipe is) can use this machine's GPU,
and if not, the whole traceback: a child confined as a run's is (`child.confine`, the spec `make_plan` builds: Python,
system roots, the GPU's device files) initialises CUDA, multiplies on the GPU, asks NVML, and imports transformers'
PreTrainedModel and lit_memory.model. Run first in a lent GPU's call (examples/gpu_speed.sh): a failure here costs
seconds, not the proof's minutes.

    python examples/gpu_sandbox_probe.py       # prints each step's result; exit status 1 where a step failed
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lit_memory.sandbox import landlock, rules  # noqa: E402

PROBE = """
import json, os, sys, traceback
sys.path[:] = json.loads(os.environ['LIT_MEMORY_SANDBOX'])['path']
from lit_memory.sandbox import child
held = child.confine()
print('confined; missing layers:', json.dumps(held.missing), flush=True)
failed = 0
def step(name, fn):
    global failed
    try:
        print(name, 'ok', fn(), flush=True)
    except BaseException:
        failed += 1
        print(name, 'FAILED', flush=True)
        traceback.print_exc(file=sys.stdout)
import torch
step('cuda', lambda: (torch.cuda.is_available(), torch.cuda.device_count()))
step('matmul', lambda: float((torch.ones(64, 64, device='cuda') @ torch.ones(64, 64, device='cuda')).sum()))
def nvml():
    import pynvml
    pynvml.nvmlInit()
    return pynvml.nvmlDeviceGetCount()
step('nvml', nvml)
step('transformers', lambda: __import__('transformers').PreTrainedModel.__name__)
step('lit_memory.model', lambda: __import__('lit_memory.model', fromlist=['x']).SequenceClassifier.__name__)
sys.exit(1 if failed else 0)
"""


def main() -> int:
    print("landlock abi", landlock.abi(), "gpu devices", rules.gpu_devices(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        run, view = Path(tmp, "run"), Path(tmp, "view")
        run.mkdir()
        view.mkdir()
        spec = rules.Spec(read=[*rules.python_roots(), *rules.system_roots()],
                          write=[str(run), *rules.device_write_roots()], devices=rules.gpu_devices(),
                          path=rules.child_path(), view=str(view), shm=64 * 2**20, parent=os.getpid())
        env = {**rules.scrubbed(dict(os.environ)), rules.ENV: spec.to_env(), "TMPDIR": str(run),
               "TRITON_CACHE_DIR": str(run), "TORCHINDUCTOR_CACHE_DIR": str(run), "XDG_CACHE_HOME": str(run),
               "MPLCONFIGDIR": str(run), "HF_HUB_OFFLINE": "1"}
        done = subprocess.run([sys.executable, "-I", "-B", "-c", PROBE], env=env, timeout=300)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
