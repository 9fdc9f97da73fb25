#!/usr/bin/env bash
# Issue 46's GPU round in one call on this project's lent machine (docs/gpu.md, "Speed where people train"): the
# proof's speed rows first (bf16 beside its HF Trainer peer, 4gb beside the Trainer's best under the same cap, both
# compiled recipes), then issue 49's rows where time is left. Writes docs/gpu/<gpu>-speed.json, rewritten after each
# row, so what a timeout cuts keeps what was measured; brings back the record, its table, the logs, profiles and
# 4gb's CUDA memory snapshot in $OUT. Run there from the repository root with .carry carried
# (examples/gpu_carry.sh, built beforehand on a machine with PyPI):
#   bash examples/gpu_speed.sh [SECONDS]      # the proof's own limit, default 480 (the call: at least SECONDS + 60:
#                                             # the probe, the tables and the archives after the proof need that)
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/.carry/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
LIMIT=${1:-480}
# issue 46's rows, then issue 49's (fsdp: FSDP2 on one GPU within its card; 4gb-fp16: capped as a GTX 1650;
# 2gb-2560mib: 2gb.yaml at 2.5 GiB; 4gb-snapshot: torch's memory history of 4gb's first steps)
ROWS=${ROWS:-bf16,4gb,4gb-peer,bf16-compile,4gb-compile,fsdp,4gb-fp16,2gb-2560mib,4gb-snapshot}
mkdir -p "$OUT"
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, lightning; p = torch.cuda.get_device_properties(0); print(torch.__version__, torch.version.cuda, transformers.__version__, lightning.__version__, p.name, p.total_memory, f'sm{p.major}{p.minor}')"
  # a confined run's use of the GPU first (seconds): every run without --trust-recipe is one, and the proof's are
  echo "== examples/gpu_sandbox_probe.py"
  timeout 120 python3 examples/gpu_sandbox_probe.py
  echo "probe exit status $?" | tee /tmp/probe.status
} > "$OUT/machine.txt" 2>&1
# Where a confined run cannot use this GPU, the speed rows still come: every run trusted, as the record's command says
TRUST=()
grep -q "status 0" /tmp/probe.status || TRUST=(--trust-recipe)
timeout "$LIMIT" python3 -m lit_memory bench --gpu-proof --peer --record speed --recipes "$ROWS" --out /tmp/proof \
  "${TRUST[@]}" > "$OUT/proof.log" 2>&1
echo "proof exit status $?" >> "$OUT/proof.log"
cp docs/gpu/*-speed.json "$OUT/" 2>/dev/null
for record in docs/gpu/*-speed.json; do
  python3 -m lit_memory bench --gpu-proof --show "$record" > "$OUT/table.md" 2>&1
  python3 -m lit_memory bench --gpu-proof --speed-table "$record" > "$OUT/speed-table.md" 2>&1
done
tar czf "$OUT/runs.tgz" --exclude='*.trace.json.gz' --exclude='synthetic.csv' --exclude='*.ckpt' --exclude='*.pickle' -C /tmp proof
find /tmp/proof -name 'profile.trace.json.gz' | tar czf "$OUT/traces.tgz" -T - 2>/dev/null
find /tmp/proof -name 'memory_snapshot.pickle' -size -60M -exec gzip -c {} \; > "$OUT/4gb-memory_snapshot.pickle.gz" 2>/dev/null
ls -la "$OUT"
