#!/usr/bin/env bash
# Issue 59's GPU round as two calls on a lent machine (docs/gpu.md, "Two calls that cannot be wasted"), the most
# important rows first (`lit_memory.tools.proof.CALLS`):
#   call 1: first the sandbox probe (issue 57: examples/gpu_sandbox_probe.py --fits, PROBE_S seconds at most: compile,
#           bitsandbytes' 8-bit step, a two-rank group and the profiler, each confined as an untrusted run; README's
#           main job, unconfined; a sent recipe's 2-step fit, confined; its record $OUT/sandbox-probe.json), then the
#           proof's rows in what is left: bf16 beside its HF Trainer peer, 4gb beside 4gb-peer, baseline, 8bit;
#   call 2: bf16-compile, 4gb-compile, fsdp, 4gb-fp16, 2gb-2560mib, 4gb-snapshot (added to call 1's record).
# Every row gets what is left of SECONDS less what the call has spent already (`bench --gpu-proof --deadline`); the
# record docs/gpu/<gpu>-speed.json, its tables and the rows' logs are copied into $OUT after every row, so a call cut
# short still brings back each row it finished. Run there from the repository root with .carry carried
# (examples/gpu_carry.sh, built beforehand on a machine with PyPI):
#   bash examples/gpu_speed.sh call1 [SECONDS]   # default 420: the device call's timeout_s 450
#   bash examples/gpu_speed.sh call2 [SECONDS]   # default 300: timeout_s 330, right after call 1 (same machine)
# On any machine, every proof process faked (the plumbing: rows in order, the record after each, the limits), the
# sandbox probe run for real on its CPU equivalents, confined (about 2.5 minutes on a 2-core CPU):
#   REHEARSE=1 OUT=/tmp/out bash examples/gpu_speed.sh call1 [SECONDS]
set -uo pipefail
START=$(date +%s)
CALL=${1:-}
case "$CALL" in
  call1) LIMIT=${2:-420} ;;
  call2) LIMIT=${2:-300} ;;
  *) echo "usage: bash examples/gpu_speed.sh call1|call2 [SECONDS]" >&2; exit 2 ;;
esac
export PYTHONPATH=$PWD:$PWD/.carry/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
TAIL=20  # kept after the proof: the archives of the runs
mkdir -p "$OUT"
{
  echo "== $CALL, $(date -u +%FT%TZ), $LIMIT s"
  timeout 10 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "nvidia-smi: none"
  # the stack, Triton and the C compiler it builds its launchers with (compiled rows), pyseccomp (the sandbox's filter)
  timeout 60 python3 - <<'EOF'
import importlib, os, shutil, subprocess
import torch, transformers, lightning
line = [torch.__version__, torch.version.cuda, transformers.__version__, lightning.__version__]
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    line += [p.name, p.total_memory, f"sm{p.major}{p.minor}"]
print("torch, CUDA, transformers, lightning, device:", *line)
try:
    import triton
    print("triton", triton.__version__)
except Exception as err:  # noqa: BLE001  what the compiled rows will meet
    print("triton: not importable:", repr(err))
found = {name: shutil.which(name) for name in ("cc", "gcc", "clang", "g++")}
print("CC:", os.environ.get("CC"), "; on PATH:", found)
compiler = os.environ.get("CC") or found["cc"] or found["gcc"] or found["clang"]
if compiler:
    print("C compiler:", subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.splitlines()[:1])
else:
    print("C compiler: none (Triton cannot build its launchers: the compiled rows will fail)")
for name in ("pyseccomp", "bitsandbytes", "torchao", "jsonargparse"):
    try:
        module = importlib.import_module(name)
        print(name, "imports", getattr(module, "__version__", ""))
    except Exception as err:  # noqa: BLE001
        print(name, "does not import:", repr(err))
EOF
} > "$OUT/machine.txt" 2>&1
ROWS=${ROWS:-$CALL}
if [ "$CALL" = call1 ]; then
  # The sandbox probe first (issue 57, item 7), after machine.txt's unconfined first CUDA use (a confined one cannot
  # run the setuid nvidia-modprobe that makes /dev/nvidia-uvm); its own record, bounded as a whole by PROBE_S.
  PROBE_S=${PROBE_S:-200}
  timeout $(( PROBE_S + 15 )) python3 examples/gpu_sandbox_probe.py --fits --deadline "$PROBE_S" --out "$OUT" \
    > "$OUT/sandbox-probe.log" 2>&1
  echo "sandbox probe exit status $?, $(( $(date +%s) - START )) s into the call" >> "$OUT/sandbox-probe.log"
  # the proof's rows of call 1 but its own probe row, which the probe above replaces (`proof.CALLS`; written out here,
  # not imported: that takes seconds of the call; tests/sandbox/test_gpu_probe.py holds the two equal)
  CALL1_ROWS=bf16,4gb,4gb-peer,baseline,8bit
  [ "$ROWS" = call1 ] && ROWS=$CALL1_ROWS
fi
SPENT=$(( $(date +%s) - START ))
APPEND=()
[ "$CALL" = call2 ] && APPEND=(--append)  # call 2's rows go into call 1's record of the same card
REHEARSAL=()
[ -n "${REHEARSE:-}" ] && REHEARSAL=(--rehearse)
# The shipped recipes run as they ship (trusted: no sandbox); the sandbox has its own probe, above, in call 1.
timeout $(( LIMIT - SPENT )) python3 -m lit_memory bench --gpu-proof --peer --record speed --recipes "$ROWS" \
  --deadline $(( LIMIT - SPENT - TAIL )) --mirror "$OUT" --out /tmp/proof "${APPEND[@]}" "${REHEARSAL[@]}" \
  > "$OUT/proof.log" 2>&1
echo "proof exit status $?, $(( $(date +%s) - START )) s into the call" >> "$OUT/proof.log"
# what is left of the call: the runs' folders (memory.json, step times, profiles), 4gb's memory snapshot
timeout 10 tar czf "$OUT/runs.tgz" --exclude='*.trace.json.gz' --exclude='synthetic.csv' --exclude='*.ckpt' \
  --exclude='*.pickle' -C /tmp proof 2>/dev/null
timeout 5 sh -c "find /tmp/proof -name 'profile.trace.json.gz' | tar czf '$OUT/traces.tgz' -T -" 2>/dev/null
timeout 5 sh -c "find /tmp/proof -name 'memory_snapshot.pickle' -size -60M -exec gzip -c {} \; > '$OUT/4gb-memory_snapshot.pickle.gz'" 2>/dev/null
echo "$CALL: $(( $(date +%s) - START )) s of $LIMIT" >> "$OUT/machine.txt"
ls -la "$OUT"
