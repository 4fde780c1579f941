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
#   4. tests/gpu/test_cuda_kvshim.py (where python3 has torch with CUDA):
#      the C ABI library that the Python package uses for CUDA caches
#      (libkvdepot_kv_cuda.so, through kvdepot/kvshim.py) against its CPU
#      build, every layout and dtype, byte for byte;
#   5. tests/gpu/bench_kvshim_vs_torch.py: that library's save and load of
#      64 Llama-3-8B-shaped blocks against the torch staging path the vLLM
#      connector falls back to (ratios reported, not asserted);
#   6. writes the report to tools/results/gpu_checks_<date>_<gpu>.{txt,json}
#      (and to $OUT/ when set, for the device runner to bring back).
#
#   tests/gpu/run_gpu_checks.sh [--skip-deps]
#   tests/gpu/run_gpu_checks.sh --bundle DIR [--report-dir DIR]
#
# With --bundle, steps 1's dependencies and build are skipped: DIR holds the
# programs built elsewhere with the libraries they need
# (tests/gpu/make_gpu_bundle.sh). That is how it runs on the lent GPU
# machine, whose image has CUDA but none of kvdepot's Debian build
# dependencies and no network: make the bundle here, then run
#   tests/gpu/run_gpu_checks.sh --bundle gpu-bundle   (carry ["gpu-bundle"])
#
# The programs link the CUDA runtime statically and need an NVIDIA driver
# at least as new as it: R580 or later for CUDA 13.x (the bundle's MANIFEST
# says which). With an older driver every check still runs, but the CUDA
# ones cannot start; the report and the last line printed say so
# ("DRIVER TOO OLD").
#
# Exit: 0 when the tests passed and the benchmark ran, 1 otherwise, 77 when
# there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
SKIP_DEPS=0
BUNDLE=""
REPORT_DIR=tools/results
while [[ $# -gt 0 ]]; do
  case "$1" in
    --skip-deps) SKIP_DEPS=1; shift ;;
    --bundle) BUNDLE="${2:?--bundle needs a directory}"; shift 2 ;;
    --report-dir) REPORT_DIR="${2:?--report-dir needs a directory}"; shift 2 ;;
    *) echo "run_gpu_checks: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
export PATH="/usr/local/cuda/bin:$PATH"
if [[ -n $BUNDLE ]]; then
  [[ -f $BUNDLE/MANIFEST ]] || { echo "run_gpu_checks: $BUNDLE is not a bundle (no MANIFEST)" >&2; exit 1; }
  BUNDLE="$(cd "$BUNDLE" && pwd)"
elif [[ $SKIP_DEPS == 0 ]]; then
  ./scripts/deps.sh
fi
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "run_gpu_checks: no NVIDIA GPU here; skipping" >&2
  exit 77
fi
if [[ -n $BUNDLE ]]; then
  BIN="$BUNDLE/bin"
  CAPI="$BUNDLE/lib"
  export LD_LIBRARY_PATH="$BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  BUILT="bundle: $(sed -n 's/^commit: //p' "$BUNDLE/MANIFEST"), $(sed -n 's/^nvcc: //p' "$BUNDLE/MANIFEST")"
else
  command -v nvcc >/dev/null || { echo "run_gpu_checks: nvcc not found" >&2; exit 1; }
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
  ninja -C build-gpu -j "$(nproc)" gather_cuda_test gpu_cuda_benchmark kvdepot_kv_cuda kvdepot_kv_cpu
  BIN=build-gpu/gpu
  CAPI=build-gpu/python/kvdepot
  [[ -f $CAPI/libkvdepot_kv_cuda.so ]] || CAPI=build-gpu/gpu
  BUILT="commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown), nvcc: $(nvcc --version | tail -n1)"
fi
# The driver the programs' CUDA runtime needs (a branch number: 580 for
# R580), from the bundle's MANIFEST or the local nvcc as
# make_gpu_bundle.sh derives it, against the driver here.
if [[ -n $BUNDLE ]]; then
  NEED_DRIVER="$(sed -n 's/^driver: R\([0-9][0-9]*\) or later.*/\1/p' "$BUNDLE/MANIFEST")"
  CUDA_RELEASE="$(sed -n 's/^nvcc: .*cuda_\([0-9]*\.[0-9]*\).*/\1/p' "$BUNDLE/MANIFEST")"
else
  CUDA_RELEASE="$(nvcc --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')"
  case "$CUDA_RELEASE" in
    13.*) NEED_DRIVER=580 ;;
    12.*) NEED_DRIVER=525 ;;
    11.*) NEED_DRIVER=450 ;;
    *) NEED_DRIVER="" ;;
  esac
fi
DRIVER="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1 || true)"
DRIVER="${DRIVER%%,*}"
NEEDS="unknown"
[[ -z $NEED_DRIVER ]] || NEEDS="R$NEED_DRIVER or later"
DRIVER_NOTE=""
if [[ -n $NEED_DRIVER && ${DRIVER%%.*} =~ ^[0-9]+$ ]] && (( ${DRIVER%%.*} < NEED_DRIVER )); then
  DRIVER_NOTE="run_gpu_checks: DRIVER TOO OLD: this machine's NVIDIA driver is $DRIVER; the programs' CUDA ${CUDA_RELEASE:-?} runtime (linked statically) needs $NEEDS, so the CUDA checks cannot start (\"CUDA driver version is insufficient for CUDA runtime version\"). Use a machine with a newer driver, or build with an nvcc that this driver supports."
  echo "$DRIVER_NOTE" >&2
fi
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1)"
SLUG="$(echo "$GPU" | tr -c 'A-Za-z0-9\n' '_' | tr -s '_')"
DATE="$(date -u +%Y-%m-%d)"
mkdir -p "$REPORT_DIR"
REPORT="$REPORT_DIR/gpu_checks_${DATE}_${SLUG}"
{
  echo "GPU checks (tests/gpu/run_gpu_checks.sh), $DATE"
  echo "GPU: $GPU"
  nvidia-smi --query-gpu=driver_version,memory.total --format=csv,noheader | sed 's/^/driver, memory: /'
  echo "$BUILT"
  echo "needs driver: $NEEDS (CUDA ${CUDA_RELEASE:-?} runtime)"
  [[ -z $DRIVER_NOTE ]] || echo "$DRIVER_NOTE"
  echo
  echo "== gather_cuda_test"
} >"$REPORT.txt"
rc=0
"$BIN/gather_cuda_test" --gtest_brief=1 2>&1 | tail -n 40 >>"$REPORT.txt" || rc=1
{ echo; echo "== gpu_cuda_benchmark (best of 5 rounds; ratio = ours / cudaMemcpy)"; } >>"$REPORT.txt"
"$BIN/gpu_cuda_benchmark" --rounds 5 --json "$REPORT.json" >>"$REPORT.txt" 2>&1 || rc=1
# A Python step: its last 40 lines (without its JSON line) go into the
# report; exit 77 (no numpy, torch or CUDA device there) is a skip.
python_step() {
  local title="$1" log="$REPORT.step.log" py_rc
  shift
  { echo; echo "== $title"; } >>"$REPORT.txt"
  set +e
  python3 "$@" >"$log" 2>&1
  py_rc=$?
  set -e
  grep -v '^{' "$log" | tail -n 40 >>"$REPORT.txt"
  rm -f "$log"
  case $py_rc in
    0) ;;
    77) echo "(skipped: python3 has no numpy, torch or CUDA device)" >>"$REPORT.txt" ;;
    *) rc=1 ;;
  esac
}
python_step "test_cuda_kvshim.py (the Python package's CUDA library vs its CPU build)" \
  tests/gpu/test_cuda_kvshim.py --cuda-lib "$CAPI/libkvdepot_kv_cuda.so" \
  --cpu-lib "$CAPI/libkvdepot_kv_cpu.so"
python_step "bench_kvshim_vs_torch.py (CUDA caches: kvshim vs the torch staging path)" \
  tests/gpu/bench_kvshim_vs_torch.py --cuda-lib "$CAPI/libkvdepot_kv_cuda.so" \
  --json "$REPORT.kvshim_vs_torch.json"
# A driver check that could not tell (no version from nvidia-smi or the
# MANIFEST), but the runtime could.
if [[ -z $DRIVER_NOTE ]] && grep -q "driver version is insufficient" "$REPORT.txt"; then
  DRIVER_NOTE="run_gpu_checks: DRIVER TOO OLD: the CUDA runtime says this machine's NVIDIA driver (${DRIVER:-unknown}) is older than it needs ($NEEDS)."
  { echo; echo "$DRIVER_NOTE"; } >>"$REPORT.txt"
fi
cat "$REPORT.txt"
[[ -z $DRIVER_NOTE ]] || echo "$DRIVER_NOTE" >&2
if [[ -n ${OUT:-} ]]; then
  cp "$REPORT.txt" "$REPORT.json" "$REPORT.kvshim_vs_torch.json" "$OUT/" 2>/dev/null || true
fi
exit $rc
