#!/usr/bin/env bash
# The CUDA backend's check on a machine with a GPU and PyTorch (no internet needed).
#
#   bash bench/gpu_check.sh            # from the repository root (or anywhere)
#
# 1. env      : GPU, driver, python, torch, nvcc, and which of the needed packages import;
# 2. install  : wheels carried in .whl/ (e.g. islpy, absent from some GPU images) into
#               /tmp/site, then the project itself: pip install --no-deps
#               --no-build-isolation -e . (falls back to running from the source tree);
# 3. tests    : the CUDA tests for real (tests/test_cuda_gpu.py, the shared-memory tiles'
#               GPU test in tests/test_cuda_tiles.py; the emulation and nvcc
#               tests run in CI without a GPU); meanwhile, memory: bench/gpu_memory.py,
#               the peak GPU memory of the eleven networks under reduce-overhead and the
#               middleware (weights copied / shared), each (network, mode) in a process of
#               its own, six side by side (memory is per process; no time is taken;
#               MW_GPU_MEMORY_MODES and MW_GPU_MEMORY_JOBS override the modes and the six);
# 4. chain    : bench/gpu_chain.py: BN -> ReLU -> MaxPool 3x3/2 on 16x64x112x112 fp32,
#               eager (cudnn.benchmark, NCHW/channels_last), torch.compile, middleware,
#               and the device-to-device copy bandwidth; bench/gpu_overhead.py: the host
#               time per call of step-by-step plans against their GPU time;
#               (MW_GPU_VARIANTS=1) bench/gpu_diag.py: the chain's kernel variants;
# 5. zoo      : bench/zoo.py --device cuda if it has that option and a --budget-s, else
#               bench/gpu_zoo.py: eleven torchvision networks at batch 16 within a budget:
#               eager (NCHW, channels_last), torch.compile (reduce-overhead, then the
#               default as far as the budget reaches; MW_GPU_COMPILE_MODES overrides), the
#               middleware step by step, replayed as a CUDA graph, and replayed with the
#               model's own weights (cuda_weights="share"); in-process allocator peaks.
#
# Every step has its own timeout (total at most MW_GPU_CHECK_S seconds, 470 by default)
# and the script never stops at a failed step. Results go to $OUT if set, else
# bench/results/: summary.txt, tests.log, memory.json, chain.json, chain.log, zoo.json,
# zoo.md, zoo.log (8 files: the device tool brings back at most 8).
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
RES=${OUT:-$ROOT/bench/results}
mkdir -p "$RES"
PY=${PYTHON:-python3}
SUMMARY=$RES/summary.txt
: >"$SUMMARY"
export PYTHONUNBUFFERED=1
T0=$(date +%s)

note() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME LIMIT_SECONDS LOGFILE COMMAND...
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local t=$(date +%s)
  note "== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
  timeout -k 10 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && note "   TIMED OUT"
  note "== $name rc=$rc in $(($(date +%s) - t))s"
  tail -n 15 "$log" | sed 's/^/   | /' >>"$SUMMARY"
  return 0
}

# 1. env
{
  nvidia-smi -L 2>&1 || echo "no nvidia-smi"
  "$PY" --version 2>&1
  command -v nvcc >/dev/null && nvcc --version | tail -n 2 || echo "no nvcc on PATH"
  "$PY" - <<'EOF'
import importlib
for m in ("torch", "torchvision", "numpy", "networkx", "jinja2", "tqdm", "islpy",
          "cuda.bindings", "pycuda", "pytest"):
    try:
        mod = importlib.import_module(m)
        print(f"{m:14s} {getattr(mod, '__version__', 'ok')}")
    except Exception as exc:
        print(f"{m:14s} MISSING ({type(exc).__name__})")
import torch
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU {p.name}: sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
          f"{p.total_memory / 2**30:.0f} GiB, L2 {getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MiB")
else:
    print("torch sees no CUDA device")
EOF
} >>"$SUMMARY" 2>&1

# 2. install
if ls .whl/*.whl >/dev/null 2>&1; then
  step wheels 60 "$RES/tests.log" "$PY" -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
step install 120 "$RES/tests.log" "$PY" -m pip install -q --no-deps --no-build-isolation -e .
if ! "$PY" -c "import middleware.backends.cuda" >>"$RES/tests.log" 2>&1; then
  note "   editable install unusable: running from the source tree"
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -c "import islpy" 2>/dev/null || note "   islpy missing: carry its wheel in .whl/ (see the README)"

# 3. tests, and memory beside them (its log in tests.log too)
MEM_S=${MW_GPU_MEMORY_S:-110}
note "== memory (limit ${MEM_S}s, beside the tests) $(date -u +%H:%M:%S)"
timeout -k 10 "$((MEM_S + 10))" "$PY" bench/gpu_memory.py --budget-s "$MEM_S" \
  --jobs "${MW_GPU_MEMORY_JOBS:-6}" \
  --nets alexnet,vgg16,resnet18,resnet50,densenet121,squeezenet1_1,mobilenet_v2,mobilenet_v3_small,googlenet,inception_v3,shufflenet_v2_x1_0 \
  --modes "${MW_GPU_MEMORY_MODES:-compile_ro,mw_graph,mw_share}" --out "$RES/memory.json" \
  >>"$RES/tests.log" 2>&1 &
MEM_PID=$!
step tests 120 "$RES/tests.log" "$PY" -m pytest -q -rs -p no:cacheprovider -o addopts= \
  -m "not slow or gpu" tests/test_cuda_gpu.py tests/test_cuda_loader.py tests/test_cuda_tiles.py
wait "$MEM_PID"
note "== memory rc=$? (MiB: allocated peak / steady state; reserved peak / steady state)"
grep -A 12 "peak allocated / steady" "$RES/tests.log" | tail -n 13 | tee -a "$SUMMARY"

# 4. chain, and variants of its kernel (tiled / one thread per output, parts left out)
step chain 90 "$RES/chain.log" "$PY" bench/gpu_chain.py --out "$RES/chain.json"
if [ "${MW_GPU_VARIANTS:-0}" = 1 ]; then
  step variants 75 "$RES/chain.log" "$PY" bench/gpu_diag.py --nets ""
fi
# host time per call of step-by-step plans against their GPU time (bench/gpu_overhead.py)
step overhead 60 "$RES/chain.log" "$PY" bench/gpu_overhead.py

# 5. zoo: what is left of the budget (8 minutes unless MW_GPU_CHECK_S says otherwise)
LEFT=$((${MW_GPU_CHECK_S:-470} - ($(date +%s) - T0)))
if [ "$LEFT" -lt 40 ]; then
  note "== zoo skipped: ${LEFT}s left of the 8 minutes"
elif [ -f bench/zoo.py ] && grep -q -- '"--device"' bench/zoo.py && grep -q -- '"--budget-s"' bench/zoo.py; then
  step zoo "$LEFT" "$RES/zoo.log" "$PY" bench/zoo.py --device cuda --batch 16 \
    --budget-s $((LEFT - 20)) --out "$RES/zoo.md"
else
  step zoo "$LEFT" "$RES/zoo.log" "$PY" bench/gpu_zoo.py --batch 16 \
    --compile-modes "${MW_GPU_COMPILE_MODES:-compile_ro,compile}" \
    --budget-s $((LEFT - 20)) --out "$RES/zoo.json"
fi
[ -f "$RES/zoo.md" ] && tee -a "$SUMMARY" <"$RES/zoo.md"
note "== total $(($(date +%s) - T0))s"
