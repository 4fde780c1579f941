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
#      the summary's last line says how many measurements met their aim
#      (judged against one copy of the same bytes; a verdict, not a step
#      that fails);
#   4. tests/gpu/test_cuda_kvshim.py (where python3 has torch with CUDA):
#      the C ABI library that the Python package uses for CUDA caches
#      (libkvdepot_kv_cuda.so, through kvdepot/kvshim.py) against its CPU
#      build, every layout and dtype, byte for byte;
#   5. tests/gpu/bench_kvshim_vs_torch.py: that library's save and load of
#      64 Llama-3-8B-shaped blocks against the torch staging path the vLLM
#      connector falls back to (ratios reported, not asserted);
#   6. writes the report to tools/results/gpu_checks_<date>_<gpu>.{txt,json};
#      when $OUT is set (the device runner), straight into $OUT/ instead,
#      as each step runs, and copied to tools/results/ after each step.
#
#   tests/gpu/run_gpu_checks.sh [--skip-deps] [--time-limit S]
#   tests/gpu/run_gpu_checks.sh --bundle DIR [--report-dir DIR] [--time-limit S]
#
# The device runner gives the whole command a hard limit (about 10 minutes)
# and brings back only what is under $OUT by then. So every check (steps 2
# to 5) runs under `timeout` with its share of --time-limit (default 540 s
# for the four together: gather_cuda_test 150, gpu_cuda_benchmark 150,
# test_cuda_kvshim.py 150, bench_kvshim_vs_torch.py 90), a step that
# passes its limit is killed and reported TIMED OUT (the next step still
# runs), and each step's whole output streams into
# $OUT/gpu_checks_<date>_<gpu>.<step>.log while it runs. The report ends with
# one line per step: passed, FAILED (exit code), or TIMED OUT. Step 1's
# build (without --bundle) is not part of that budget.
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
# Once nvidia-smi has seen a GPU, every step must pass: a Python step that
# skips (exit 77: no numpy, no torch, or torch sees no CUDA device) is a
# failure, its reason printed, since those steps are the only check of
# every layout and dtype through the Python package on device memory.
#
# Exit: 0 when every step passed, 1 otherwise (a step failed, skipped or
# timed out), 77 when there is no GPU (nvidia-smi lists none; with $OUT
# set, a one-line report there says so), 2 for a bad argument.
set -euo pipefail
cd "$(dirname "$0")/../.."
SKIP_DEPS=0
BUNDLE=""
REPORT_DIR=tools/results
TIME_LIMIT=540
while [[ $# -gt 0 ]]; do
  case "$1" in
    --skip-deps) SKIP_DEPS=1; shift ;;
    --bundle) BUNDLE="${2:?--bundle needs a directory}"; shift 2 ;;
    --report-dir) REPORT_DIR="${2:?--report-dir needs a directory}"; shift 2 ;;
    --time-limit) TIME_LIMIT="${2:?--time-limit needs seconds}"; shift 2 ;;
    *) echo "run_gpu_checks: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
[[ $TIME_LIMIT =~ ^[0-9]+$ ]] && (( TIME_LIMIT >= 40 )) ||
  { echo "run_gpu_checks: --time-limit must be at least 40 (seconds)" >&2; exit 2; }
# Each step's time limit: its share of TIME_LIMIT (shares of 540).
step_limit() { echo $(( TIME_LIMIT * $1 / 540 )); }
LIMIT_GATHER_TEST="$(step_limit 150)"
LIMIT_BENCHMARK="$(step_limit 150)"
LIMIT_KVSHIM_TEST="$(step_limit 150)"
LIMIT_KVSHIM_BENCH="$(step_limit 90)"
export PATH="/usr/local/cuda/bin:$PATH"
if [[ -n ${OUT:-} ]]; then
  mkdir -p "$OUT"
  OUT="$(cd "$OUT" && pwd)"
fi
if [[ -n $BUNDLE ]]; then
  [[ -f $BUNDLE/MANIFEST ]] || { echo "run_gpu_checks: $BUNDLE is not a bundle (no MANIFEST)" >&2; exit 1; }
  BUNDLE="$(cd "$BUNDLE" && pwd)"
elif [[ $SKIP_DEPS == 0 ]]; then
  ./scripts/deps.sh
fi
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "run_gpu_checks: no NVIDIA GPU here (nvidia-smi lists none); skipping (exit 77)" >&2
  if [[ -n ${OUT:-} ]]; then
    echo "run_gpu_checks: no NVIDIA GPU here (nvidia-smi lists none); nothing was run (exit 77)" \
      >"$OUT/gpu_checks_no_gpu.txt"
  fi
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
REPORT_DIR="$(cd "$REPORT_DIR" && pwd)"
NAME="gpu_checks_${DATE}_${SLUG}"
# The report and the step logs are written where they must end up: $OUT
# when set (a run killed at the device runner's limit still leaves there
# everything up to the kill), else REPORT_DIR.
WORK_DIR="${OUT:-$REPORT_DIR}"
REPORT="$WORK_DIR/$NAME"
# Copies the report and its JSON files to REPORT_DIR when they are written
# to $OUT (after every step, so that tools/results/ has them too).
publish() {
  [[ $WORK_DIR != "$REPORT_DIR" ]] || return 0
  local f
  for f in "$REPORT.txt" "$REPORT.json" "$REPORT.kvshim_vs_torch.json"; do
    [[ ! -f $f ]] || cp "$f" "$REPORT_DIR/" 2>/dev/null || true
  done
}
{
  echo "GPU checks (tests/gpu/run_gpu_checks.sh), $DATE"
  echo "GPU: $GPU"
  nvidia-smi --query-gpu=driver_version,memory.total --format=csv,noheader | sed 's/^/driver, memory: /'
  echo "$BUILT"
  echo "needs driver: $NEEDS (CUDA ${CUDA_RELEASE:-?} runtime)"
  echo "time limits (s): gather_cuda_test $LIMIT_GATHER_TEST, gpu_cuda_benchmark $LIMIT_BENCHMARK, test_cuda_kvshim.py $LIMIT_KVSHIM_TEST, bench_kvshim_vs_torch.py $LIMIT_KVSHIM_BENCH"
  [[ -z $DRIVER_NOTE ]] || echo "$DRIVER_NOTE"
} >"$REPORT.txt"
publish

# Line-buffered stdout for the C++ programs, so that a step killed at its
# limit leaves its output up to there (where stdbuf exists; the benchmark
# flushes each line itself).
LINEBUF=()
if command -v stdbuf >/dev/null; then LINEBUF=(stdbuf -oL -eL); fi
rc=0
SUMMARY=()
CURRENT_STEP=""
STEP_PID=""
# The whole run killed (TERM or INT, e.g. the device runner's limit; a
# KILL leaves only what was written so far): the step running is stopped
# and the report says which it was.
on_kill() {
  trap - TERM INT
  [[ -z $STEP_PID ]] || kill -TERM "$STEP_PID" 2>/dev/null || true
  {
    [[ -z $CURRENT_STEP ]] || grep -v '^{' "$REPORT.$CURRENT_STEP.log" 2>/dev/null | tail -n 40
    echo "-- ${CURRENT_STEP:-?}: KILLED (the whole run was stopped during it)"
    echo
    echo "== summary: NOT every step passed (the run was killed during ${CURRENT_STEP:-?})"
    printf '%s\n' "${SUMMARY[@]}"
  } >>"$REPORT.txt"
  publish
  echo "run_gpu_checks: killed during ${CURRENT_STEP:-?}" >&2
  exit 1
}
trap on_kill TERM INT
# run_step STEP LIMIT TITLE COMMAND...: runs COMMAND under `timeout LIMIT`,
# its output (stdout and stderr) streaming into $REPORT.STEP.log; the
# report gets its last 40 lines (JSON lines left out) and the outcome:
# passed, FAILED (exit N; exit 77, a skip, is a failure here: nvidia-smi
# has seen a GPU), or TIMED OUT.
run_step() {
  local step="$1" limit="$2" title="$3" log="$REPORT.$1.log" step_rc outcome reason
  shift 3
  { echo; echo "== $title"; } >>"$REPORT.txt"
  publish
  local t0=$SECONDS
  CURRENT_STEP="$step"
  set +e
  # In the background, so that a TERM for the whole run reaches on_kill
  # while the step runs.
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1 &
  STEP_PID=$!
  wait "$STEP_PID"
  step_rc=$?
  STEP_PID=""
  CURRENT_STEP=""
  set -e
  local took=$((SECONDS - t0))
  grep -v '^{' "$log" | tail -n 40 >>"$REPORT.txt" || true
  if [[ $step_rc == 124 || ( $step_rc == 137 && $took -ge $limit ) ]]; then
    outcome="TIMED OUT (killed at its limit of $limit s)"
    echo "run_gpu_checks: $step TIMED OUT after $limit s" >&2
  elif [[ $step_rc == 0 ]]; then
    outcome="passed"
  elif [[ $step_rc == 77 ]]; then
    reason="$(grep -v '^{' "$log" | grep -v '^[[:space:]]*$' | tail -n1 || true)"
    outcome="FAILED (skipped, exit 77, though nvidia-smi sees a GPU: ${reason:-no reason printed})"
  else
    outcome="FAILED (exit $step_rc)"
  fi
  [[ $step_rc == 0 ]] || rc=1
  echo "-- $step: $outcome, ${took} s" >>"$REPORT.txt"
  SUMMARY+=("$(printf '%-24s %s, %s s' "$step" "$outcome" "$took")")
  publish
}
run_step gather_cuda_test "$LIMIT_GATHER_TEST" "gather_cuda_test" \
  "${LINEBUF[@]}" "$BIN/gather_cuda_test" --gtest_brief=1
run_step gpu_cuda_benchmark "$LIMIT_BENCHMARK" \
  "gpu_cuda_benchmark (best of 5 rounds; aims judged on ours / one cudaMemcpyAsync of the same bytes)" \
  "${LINEBUF[@]}" "$BIN/gpu_cuda_benchmark" --rounds 5 --json "$REPORT.json"
run_step test_cuda_kvshim "$LIMIT_KVSHIM_TEST" \
  "test_cuda_kvshim.py (the Python package's CUDA library vs its CPU build)" \
  python3 -u tests/gpu/test_cuda_kvshim.py --cuda-lib "$CAPI/libkvdepot_kv_cuda.so" \
  --cpu-lib "$CAPI/libkvdepot_kv_cpu.so"
run_step bench_kvshim_vs_torch "$LIMIT_KVSHIM_BENCH" \
  "bench_kvshim_vs_torch.py (CUDA caches: kvshim vs the torch staging path)" \
  python3 -u tests/gpu/bench_kvshim_vs_torch.py --cuda-lib "$CAPI/libkvdepot_kv_cuda.so" \
  --json "$REPORT.kvshim_vs_torch.json"
# A driver check that could not tell (no version from nvidia-smi or the
# MANIFEST), but the runtime could.
if [[ -z $DRIVER_NOTE ]] && cat "$REPORT.txt" "$REPORT".*.log 2>/dev/null |
    grep -q "driver version is insufficient"; then
  DRIVER_NOTE="run_gpu_checks: DRIVER TOO OLD: the CUDA runtime says this machine's NVIDIA driver (${DRIVER:-unknown}) is older than it needs ($NEEDS)."
  { echo; echo "$DRIVER_NOTE"; } >>"$REPORT.txt"
fi
# Issue 6's aims: a verdict reported beside the steps (timings fail no
# step), from the benchmark's own tally.
AIMS="$(grep -h '^aims: ' "$REPORT.gpu_cuda_benchmark.log" 2>/dev/null | tail -n1 || true)"
{
  echo
  echo "== summary: $( ((rc == 0)) && echo "every step passed" || echo "NOT every step passed")"
  printf '%s\n' "${SUMMARY[@]}"
  echo "${AIMS:-aims: not judged (the benchmark did not finish)}"
} >>"$REPORT.txt"
publish
cat "$REPORT.txt"
[[ -z $DRIVER_NOTE ]] || echo "$DRIVER_NOTE" >&2
exit $rc
