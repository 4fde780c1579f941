#!/usr/bin/env bash
# ctest gpu_bundle_test: the GPU bundle can be made from this build and
# run_gpu_checks.sh --bundle drives it, on a machine without a GPU.
#
#   1. make_gpu_bundle.sh packs gather_cuda_test and gpu_cuda_benchmark with
#      their libraries and proves they stand alone (ldd with only the
#      bundle; as root, a chroot holding only the bundle and the C runtime);
#   2. run_gpu_checks.sh --bundle runs with an nvidia-smi stand-in that
#      reports a GPU (the only fake: there is no GPU here) and no
#      scripts/deps.sh, build or nvcc on PATH: it must write its report with
#      the bundle's commit, and run the bundled programs, which find no CUDA
#      device and exit 77, so the script must fail (exit 1), saying so; and
#      the Python check of the bundled C ABI libraries, which stops at
#      torch's "no CUDA device" (exit 77), which is a failure there (a GPU
#      was seen). The report goes straight into $OUT (and is copied to
#      --report-dir), with each step's whole log, the steps' time limits
#      and a summary line per step. The stand-in's driver (0.0) is older
#      than the MANIFEST says the programs need: the script must say DRIVER
#      TOO OLD.
#
#   tests/gpu/bundle_test.sh BUILD_DIR
set -euo pipefail
BUILD="$(cd "${1:?usage: bundle_test.sh BUILD_DIR}" && pwd)"
SRC="$(cd "$(dirname "$0")/../.." && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
fail() { echo "bundle_test: FAIL: $*" >&2; exit 1; }

"$SRC/tests/gpu/make_gpu_bundle.sh" --no-build --build "$BUILD" --out "$WORK/bundle" \
  >"$WORK/make.log" 2>&1 || { cat "$WORK/make.log" >&2; fail "make_gpu_bundle.sh failed"; }
cat "$WORK/make.log"
for f in bin/gather_cuda_test bin/gpu_cuda_benchmark lib/libkvdepot_kv_cuda.so \
         lib/libkvdepot_kv_cpu.so MANIFEST; do
  [[ -s $WORK/bundle/$f ]] || fail "the bundle has no $f"
done
ls "$WORK/bundle/lib/"libabsl_status.so* >/dev/null 2>&1 || fail "the bundle lacks Abseil's libraries"
if ls "$WORK/bundle/lib/" | grep -Eq '^(libc|libstdc\+\+|libcuda)\.so'; then
  fail "the bundle carries a library the GPU machine must provide itself"
fi
grep -Eq '^driver: (R[0-9]+ or later|unknown) ' "$WORK/bundle/MANIFEST" ||
  fail "the MANIFEST does not say which NVIDIA driver the programs need"
# Every file the manifest lists is there with its checksum.
(cd "$WORK/bundle" && sed -n 's/^  //p' MANIFEST | sha256sum --quiet -c -) ||
  fail "the MANIFEST's checksums do not match the bundle"

# The checks through the bundle: a PATH with an nvidia-smi stand-in and the
# basic tools, and no nvcc, cmake or ninja.
mkdir -p "$WORK/path" "$WORK/out"
cat >"$WORK/path/nvidia-smi" <<'EOF'
#!/bin/sh
case "$*" in
  -L) echo "GPU 0: Stand-in GPU (UUID: GPU-0)" ;;
  *name*) echo "Stand-in GPU" ;;
  *) echo "0.0, 0 MiB" ;;
esac
EOF
chmod +x "$WORK/path/nvidia-smi"
for t in bash sh env cat sed grep head tail tr date mkdir cp rm pwd dirname git timeout stdbuf; do
  p="$(command -v "$t" || true)"
  [[ -n $p ]] && ln -sf "$p" "$WORK/path/$t"
done
# Debian's python3 (numpy, CPU torch): the kvshim check runs up to torch's
# "no CUDA device".
[[ -x /usr/bin/python3 ]] && ln -sf /usr/bin/python3 "$WORK/path/python3"
set +e
env -i HOME="$WORK" PATH="$WORK/path" OUT="$WORK/out" \
  "$WORK/path/bash" "$SRC/tests/gpu/run_gpu_checks.sh" --bundle "$WORK/bundle" \
  --report-dir "$WORK/reports" >"$WORK/run.log" 2>&1
rc=$?
set -e
cat "$WORK/run.log"
[[ $rc == 1 ]] || fail "run_gpu_checks.sh --bundle exited $rc; expected 1 (no real GPU behind the stand-in)"
report="$(ls "$WORK/reports"/gpu_checks_*_Stand_in_GPU.txt 2>/dev/null | head -n1)"
[[ -n $report ]] || fail "no report was written"
grep -q "^bundle: $(sed -n 's/^commit: //p' "$WORK/bundle/MANIFEST" | sed 's/[][\.*^$]/\\&/g')" "$report" ||
  fail "the report does not name the bundle's commit"
grep -q "no usable CUDA device" "$report" ||
  fail "the bundled gather_cuda_test did not run to its device check"
grep -q "no CUDA device" "$report" && grep -q "== gpu_cuda_benchmark" "$report" ||
  fail "the bundled gpu_cuda_benchmark did not run"
if grep -q '^driver: R[0-9]' "$WORK/bundle/MANIFEST"; then
  grep -q "DRIVER TOO OLD: this machine's NVIDIA driver is 0.0; " "$report" ||
    fail "the report does not say that the stand-in's driver is too old"
  [[ $(tail -n1 "$WORK/run.log") == "run_gpu_checks: DRIVER TOO OLD: "* ]] ||
    fail "the last line printed is not the too-old-driver line"
fi
grep -q "== test_cuda_kvshim.py" "$report" || fail "the kvshim check did not run"
grep -q "== bench_kvshim_vs_torch.py" "$report" || fail "the kvshim benchmark did not run"
if [[ -x /usr/bin/python3 ]] && /usr/bin/python3 -c 'import numpy, torch' 2>/dev/null; then
  grep -q "test_cuda_kvshim: torch sees no CUDA device; skipping" "$report" ||
    fail "the kvshim check did not get as far as torch's device check"
  grep -q "bench_kvshim_vs_torch: torch sees no CUDA device; skipping" "$report" ||
    fail "the kvshim benchmark did not get as far as torch's device check"
fi
[[ -f $WORK/out/$(basename "$report") ]] || fail "the report was not written to \$OUT"
cmp -s "$report" "$WORK/out/$(basename "$report")" ||
  fail "the report in --report-dir differs from the one in \$OUT"
[[ -f $WORK/out/$(basename "$report" .txt).gather_cuda_test.log ]] ||
  fail "the step's whole output (gather_cuda_test.log) is not in \$OUT"
# Every step ran under its time limit and has a line in the summary; with
# a GPU seen by nvidia-smi, the Python steps' skip (exit 77) is a failure.
grep -q "^time limits (s): gather_cuda_test [0-9]" "$report" ||
  fail "the report does not give the steps' time limits"
grep -q "^== summary: NOT every step passed" "$report" || fail "the report has no summary"
for step in gather_cuda_test gpu_cuda_benchmark test_cuda_kvshim bench_kvshim_vs_torch; do
  grep -q "^$step  *FAILED" "$report" || fail "the summary does not say that $step failed"
done
if [[ -x /usr/bin/python3 ]] && /usr/bin/python3 -c 'import numpy, torch' 2>/dev/null; then
  grep -q "^test_cuda_kvshim  *FAILED (skipped, exit 77, though nvidia-smi sees a GPU: .*no CUDA device" \
    "$report" || fail "the kvshim check's skip is not reported as a failure with its reason"
fi
echo "bundle_test: OK"
