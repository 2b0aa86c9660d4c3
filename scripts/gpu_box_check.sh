#!/usr/bin/env bash
# One prepared pass on a lent GPU box (the device tool): what the real driver
# reports, captured as test fixtures, plus the gpu-marked tests and a sidecar
# watching a real CUDA job. Everything lands in $OUT (default /tmp/gpu-check):
#   real_gpu/<gpu>-{idle,load}.json   captures for tests/onbox/data/real_gpu/
#   health.json                       rgt-onbox health --json, idle
#   pytest-gpu.txt                    the gpu-marked tests
#   cuda-run.txt                      events a sidecar journaled for a CUDA job
# Missing Python packages travel as wheels in .whl/ (see the device README).
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks_throttle_reasons.active \
    --format=csv > "$OUT/nvidia-smi.csv" 2>&1

echo "== capture, idle"
python3 scripts/capture_gpu_fixture.py --samples 5 --tag idle --out "$OUT/real_gpu"
python3 -m onbox.cli health --seconds 3 --json > "$OUT/health.json"; echo "health exit $?"

echo "== capture, under a bf16 matmul load"
python3 - <<'PY' &
import time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
end = time.time() + 25
while time.time() < end:
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
PY
LOAD=$!
sleep 5
python3 scripts/capture_gpu_fixture.py --samples 5 --tag load --out "$OUT/real_gpu"
wait $LOAD

echo "== gpu-marked tests"
timeout 300 python3 -m pytest -m gpu tests/onbox/test_real_gpu.py -p no:cacheprovider -q \
    > "$OUT/pytest-gpu.txt" 2>&1; echo "pytest exit $?"; tail -3 "$OUT/pytest-gpu.txt"

echo "== sidecar watching a CUDA job"
root=$(mktemp -d)
python3 -m onbox.cli launch --root "$root" --project gpu --run-id cuda1 --json --sidecar-linger 3s \
    -- python3 scripts/train_tiny.py --device cuda --steps 400 --step-seconds 0.02 --nan-at 350
run="$root/gpu/active/cuda1"
for _ in $(seq 120); do [ -f "$run/rgt/exit.json" ] && break; sleep 0.5; done
sleep 4
{ cat "$run/rgt/exit.json"; echo; cat "$run"/rgt/events*.jsonl; } > "$OUT/cuda-run.txt" 2>&1
grep -o '"kind": *"[a-z_.]*"' "$OUT/cuda-run.txt" | sort | uniq -c
