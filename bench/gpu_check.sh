#!/usr/bin/env bash
# GPU verification of the CUDA kernels (issue 6): one prepared run, under 8 minutes on one H200.
#
# Runs on the device machine's own python3 (torch, CuPy, transformers, grpcio are in its image); it
# installs nothing. From a developer session, once:
#     mkdir -p build/gpu_carry && cp -r ../shared/models/stories260K build/gpu_carry/   # build/ is gitignored
# (../shared does not travel to the device machine; nothing here is committed) then call the device
# tool's run with
#     command: bash bench/gpu_check.sh      carry: ["protos/python/gen", "build/gpu_carry"]      timeout_s: 540
# Steps (each bounded by `timeout`, all output also in $OUT):
#   1. the kernel tests through CuPy against the torch reference (tests/kernels/test_ops_gpu.py) and a
#      CUDA graph capture/replay check;
#   2. paged decode attention bandwidth as a fraction of device-to-device copy bandwidth, prefill and
#      sampling timings (bench/gpu_kernels_bench.py);
#   3. the engine with --device cuda vs cpu: greedy parity on stories260K and a random ~1B Llama, and
#      decode tokens/s at batch 1 and 64 with and without CUDA graphs (bench/gpu_engine_check.py; pass
#      GPU_CHECK_8B=1 to add the 8B shape, minutes more);
#   4. one table of every figure against its goal (also $OUT/goals.md).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/services/engine/src:$PWD/services/gateway/src:$PWD/protos/python/gen:$PWD/tests/kernels:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1 CONDUIT_KERNELS_DIR="$PWD/kernels"
status=0

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || status=1
$PY -c "import torch, cupy; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| cupy', cupy.__version__)" || exit 1

echo "== 1. kernel tests through CuPy"
timeout 180 $PY -m pytest -p no:cacheprovider -o addopts="" -q tests/kernels/test_ops_gpu.py \
    2>&1 | tee "$OUT/kernel_tests.log" || status=1

echo "== 2. kernel bandwidth"
timeout 90 $PY bench/gpu_kernels_bench.py 2>&1 | tee "$OUT/kernel_bench.log" || status=1

echo "== 3. engine parity and decode speed"
ENGINE_TIMEOUT=$([ -n "${GPU_CHECK_8B:-}" ] && echo 420 || echo 210)
timeout $ENGINE_TIMEOUT $PY bench/gpu_engine_check.py --out "$OUT/engine.json" ${GPU_CHECK_8B:+--with-8b} 2>&1 | tee "$OUT/engine.log" || status=1

echo "== every figure against its goal"
echo "| figure | value | goal | met |"
echo "|---|---|---|---|"
grep -h '^| ' "$OUT/kernel_bench.log" "$OUT/engine.log" | grep -v '^| figure ' | tee "$OUT/goals.md"

echo "== done (status $status); logs in $OUT"
exit $status
