#!/usr/bin/env bash
# The GPU checks of issue 6, as one command for a machine with an NVIDIA GPU
# (an H200 is sometimes lent for a few minutes; everything here was built and
# run up to the point of needing a device on a machine without one):
#
#   1. builds the CUDA implementation (nvcc from /usr/local/cuda or PATH) in
#      build-gpu/ with all cores;
#   2. gather_cuda_test: the property and pipeline tests against the CUDA
#      kernels (every layout and dtype, random block lists, repeats, out-of-
#      range ids) plus device-only cases;
#   3. gpu_cuda_benchmark: gather/scatter vs device-to-device cudaMemcpy of
#      the same bytes (aim >= 0.70), the staging pipeline's save vs
#      device-to-pinned-host cudaMemcpyAsync (aim >= 0.80), every layout;
#   4. writes the report to tools/results/gpu_checks_<date>_<gpu>.{txt,json}
#      (and to $OUT/ when set, for the device runner to bring back).
#
#   tests/gpu/run_gpu_checks.sh [--skip-deps]
#
# Exit: 0 when the tests passed and the benchmark ran, 1 otherwise, 77 when
# there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
[[ ${1:-} == --skip-deps ]] || ./scripts/deps.sh
export PATH="/usr/local/cuda/bin:$PATH"
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "run_gpu_checks: no NVIDIA GPU here; skipping" >&2
  exit 77
fi
command -v nvcc >/dev/null || { echo "run_gpu_checks: nvcc not found" >&2; exit 1; }
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1)"
SLUG="$(echo "$GPU" | tr -c 'A-Za-z0-9\n' '_' | tr -s '_')"
DATE="$(date -u +%Y-%m-%d)"
REPORT="tools/results/gpu_checks_${DATE}_${SLUG}"
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
ninja -C build-gpu -j "$(nproc)" gather_cuda_test gpu_cuda_benchmark
{
  echo "GPU checks (tests/gpu/run_gpu_checks.sh), $DATE"
  echo "GPU: $GPU"
  nvidia-smi --query-gpu=driver_version,memory.total --format=csv,noheader | sed 's/^/driver, memory: /'
  echo "nvcc: $(nvcc --version | tail -n1)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo
  echo "== gather_cuda_test"
} >"$REPORT.txt"
rc=0
build-gpu/gpu/gather_cuda_test --gtest_brief=1 2>&1 | tail -n 5 >>"$REPORT.txt" || rc=1
{ echo; echo "== gpu_cuda_benchmark (best of 5 rounds; ratio = ours / cudaMemcpy)"; } >>"$REPORT.txt"
build-gpu/gpu/gpu_cuda_benchmark --rounds 5 --json "$REPORT.json" >>"$REPORT.txt" 2>&1 || rc=1
cat "$REPORT.txt"
if [[ -n ${OUT:-} ]]; then cp "$REPORT.txt" "$REPORT.json" "$OUT/" 2>/dev/null || true; fi
exit $rc
