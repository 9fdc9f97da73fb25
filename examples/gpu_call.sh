#!/usr/bin/env bash
# One call on this project's lent GPU machine (docs/gpu.md): the GPU proof with its peers and profiles, its record
# and the runs' logs, memory.json, step times and profiles brought back in $OUT. Run there from the repository
# root, with .carry (examples/gpu_carry.sh) carried:
#   bash examples/gpu_call.sh RECIPES [SECONDS]
# RECIPES: as `bench --gpu-proof --recipes` takes them (recipes and variants, in the order given); SECONDS: the
# proof's own time limit (default 520: a call may take 600), after which what it measured is still brought back.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/.carry/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; p = torch.cuda.get_device_properties(0); print(torch.__version__, torch.version.cuda, p.name, p.total_memory, f'sm{p.major}{p.minor}')"
} > "$OUT/machine.txt" 2>&1
timeout "${2:-520}" python3 -m lit_memory bench --gpu-proof ${PEER---peer} --recipes "$1" --out /tmp/proof > "$OUT/proof.log" 2>&1
echo "proof exit status $?" >> "$OUT/proof.log"
cp docs/gpu/*.json "$OUT/" 2>/dev/null
tar czf "$OUT/runs.tgz" --exclude='*.trace.json.gz' --exclude='synthetic.csv' --exclude='*.ckpt' -C /tmp proof
find /tmp/proof -name 'profile.trace.json.gz' | tar czf "$OUT/traces.tgz" -T - 2>/dev/null
ls -la "$OUT"
