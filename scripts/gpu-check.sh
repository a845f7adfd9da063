#!/usr/bin/env bash
# GPU readiness: the first thing to run on a machine with CUDA and SGLang.
#
# For each KV layout (default: the GPU profile's [suites] layouts: mha-p64-bf16, gqa-p64-bf16,
# mla-p64-bf16, then the production-shaped probes like:llama-3.1-8b-p64-bf16 and
# like:deepseek-v3-p64-bf16: those models' KV geometry) it stands up the GPU profile's prefill/decode
# cluster with that layout's probe model, runs the smoke suite (PD token-identical to a single server;
# decode generated from the transferred KV) and the probe-model benchmark (own-canary echo,
# foreign-canary sensitivity, stale-KV sensitivity inside SGLang, determinism), and prints one line of
# echo rates per layout. Everything it ran is kept under reports/gpu-check-<time>/ (logs, JSON, JUnit).
#
#   bash scripts/gpu-check.sh                      # every layout of the GPU profile, then the like: ones
#   KVCHAOS_GPU_LAYOUTS=mla-p64-bf16 bash scripts/gpu-check.sh
#   KVCHAOS_GPU_LIKE_LAYOUTS= bash scripts/gpu-check.sh      # the profile's layouts only
#   KVCHAOS_GPU_BACKEND=mooncake bash scripts/gpu-check.sh   # RDMA (set ib_device / KVCHAOS_IB_DEVICE)
#
# Env: KVCHAOS_GPU_PYTHON (interpreter with torch+CUDA and sglang; default python3),
#      KVCHAOS_GPU_LAYOUTS (the layouts, comma-separated; default: the profile's, then the like: ones),
#      KVCHAOS_GPU_LIKE_LAYOUTS (the production-shaped probes added to the profile's layouts; default
#        like:llama-3.1-8b-p64-bf16,like:deepseek-v3-p64-bf16; set it empty for none),
#      KVCHAOS_GPU_BACKEND (default mooncake_tcp: works on one host without RDMA),
#      KVCHAOS_GPU_QUICK=0 for the full benchmark (default quick: 50/50/30 trials per layout).
# scripts/gpu_device.py runs this within a 10-minute plan on a lent GPU machine.
# Exit: 0 every layout passed, 1 something failed (named in the summary), 2 not a GPU machine.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${KVCHAOS_GPU_PYTHON:-python3}
BACKEND=${KVCHAOS_GPU_BACKEND:-mooncake_tcp}
OUT=reports/gpu-check-$(date +%Y%m%d-%H%M%S)

if ! GPUS=$(nvidia-smi -L 2>&1); then
  echo "gpu-check: no CUDA device (nvidia-smi -L failed: ${GPUS:0:300})" >&2
  exit 2
fi
mkdir -p "$OUT"
echo "$GPUS" >"$OUT/nvidia-smi.txt"
if ! "$PY" - >"$OUT/versions.json" 2>"$OUT/versions.err" <<'PY'
import json, torch
from importlib import metadata as m
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
out = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
for pkg in ("sglang", "sglang-router", "mooncake-transfer-engine", "flashinfer-python", "sgl-kernel"):
    try:
        out[pkg] = m.version(pkg)
    except m.PackageNotFoundError:
        out[pkg] = None
assert out["sglang"], "sglang is not installed in this interpreter"
print(json.dumps(out))
PY
then
  echo "gpu-check: $PY cannot run the GPU profile: $(tail -c 400 "$OUT/versions.err")" >&2
  exit 2
fi
echo "gpu-check: $(cat "$OUT/versions.json")"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/gpu-check: /'

# production-shaped probes (kvchaos.cluster.layouts like:<model>): unset -> both, set empty -> none
LIKE=${KVCHAOS_GPU_LIKE_LAYOUTS-like:llama-3.1-8b-p64-bf16,like:deepseek-v3-p64-bf16}
LAYOUTS=${KVCHAOS_GPU_LAYOUTS:-$("$PY" -c 'import tomllib; print(",".join(tomllib.load(open("kvchaos/profiles/gpu.toml","rb"))["suites"]["layouts"]))')${LIKE:+,$LIKE}}
QUICK=()
[ "${KVCHAOS_GPU_QUICK:-1}" = 1 ] && QUICK=(--quick)
declare -a SUMMARY
FAILED=0
IFS=, read -ra LIST <<<"$LAYOUTS"
for L in "${LIST[@]}"; do
  d="$OUT/$L"; mkdir -p "$d"
  t0=$(date +%s)
  "$PY" -m pytest suites/test_smoke.py -p no:cacheprovider -q --kvchaos-profile gpu --kvchaos-layouts "$L" \
      --kvchaos-backends "$BACKEND" --kvchaos-reports "$d/reports" --junitxml "$d/smoke.xml" >"$d/smoke.log" 2>&1
  smoke=$?
  "$PY" bench/probe_model.py --profile gpu --layout "$L" --backend "$BACKEND" "${QUICK[@]}" \
      --json "$d/probe.json" >"$d/probe.log" 2>&1
  bench=$?
  rates=$("$PY" -c 'import json,sys; r=json.load(open(sys.argv[1])); print(" ".join(f"{k}={v[\"rate\"]*100:.1f}%({v[\"hits\"]}/{v[\"trials\"]})" for k,v in r["rates"].items()))' "$d/probe.json" 2>/dev/null || echo "no rates (see $d/probe.log)")
  ok=PASS; { [ $smoke = 0 ] && [ $bench = 0 ]; } || { ok=FAIL; FAILED=1; }
  SUMMARY+=("$L  $ok  smoke=$([ $smoke = 0 ] && echo pass || echo "FAIL($smoke)")  bench=$([ $bench = 0 ] && echo pass || echo "FAIL($bench)")  $rates  ($(( $(date +%s) - t0 )) s)")
  echo "gpu-check: ${SUMMARY[-1]}"
done
{
  echo "gpu-check summary ($OUT, backend $BACKEND)"
  printf '  %s\n' "${SUMMARY[@]}"
} | tee "$OUT/summary.txt"
exit $FAILED
