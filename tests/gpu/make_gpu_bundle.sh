#!/usr/bin/env bash
# Packs the GPU checks into a folder that runs on a GPU machine which has
# none of kvdepot's build dependencies.
#
# The GPU machine that is sometimes lent (an H200, 15 minutes) runs its own
# image: CUDA's driver and toolchain, PyTorch, CMake, but no Debian packages
# (Abseil, xxHash, gRPC...) and no network, so kvdepot cannot be built there.
# This script, run here (where nvcc builds the kernels but no GPU runs them),
# puts the two CUDA programs of tests/gpu/run_gpu_checks.sh and the shared
# libraries they need, except the C runtime, into one folder:
#
#   <out>/bin/gather_cuda_test, <out>/bin/gpu_cuda_benchmark  (debug info stripped)
#   <out>/lib/libkvdepot_kv_{cuda,cpu}.so  the C ABI libraries that
#                        tests/gpu/test_cuda_kvshim.py loads with ctypes
#   <out>/lib/*.so*      every library ldd resolves, except the ones any
#                        Linux has (glibc, libstdc++, libgcc_s) and the driver
#   <out>/MANIFEST       commit, date, nvcc, the NVIDIA driver it needs, glibc,
#                        CUDA architectures, sha256s
#
# then proves the folder stands alone: ldd with only <out>/lib finds every
# library, and (as root) each program runs in a chroot that holds nothing but
# the folder and the C runtime, where it must reach its "no GPU" exit (77).
# The CUDA runtime is linked statically; the programs need only the driver,
# one at least as new as that runtime needs: R580 or later for CUDA 13.x
# (the MANIFEST's "driver:" line; run_gpu_checks.sh checks it).
#
#   tests/gpu/make_gpu_bundle.sh [--build DIR] [--out DIR] [--no-build] [--no-chroot]
#
# Then, on the GPU machine: tests/gpu/run_gpu_checks.sh --bundle <out>
# (the device tool: run with carry ["gpu-bundle"]).
set -euo pipefail
cd "$(dirname "$0")/../.."

BUILD=build
OUT_DIR=gpu-bundle
DO_BUILD=1
DO_CHROOT=1
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) BUILD="${2:?--build needs a directory}"; shift 2 ;;
    --out) OUT_DIR="${2:?--out needs a directory}"; shift 2 ;;
    --no-build) DO_BUILD=0; shift ;;
    --no-chroot) DO_CHROOT=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "make_gpu_bundle: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done

PROGRAMS=(gather_cuda_test gpu_cuda_benchmark)
CAPI_LIBS=(kvdepot_kv_cuda kvdepot_kv_cpu)
# Libraries the GPU machine's own system provides (and must: they are the C
# runtime every program there uses), plus the driver's libcuda, which the
# static CUDA runtime opens at run time. Everything else travels.
SYSTEM_LIBS='^(linux-vdso\.so\.1|ld-linux-x86-64\.so\.2|libc\.so\.6|libm\.so\.6|libpthread\.so\.0|libdl\.so\.2|librt\.so\.1|libstdc\+\+\.so\.6|libgcc_s\.so\.1|libcuda\.so\.1)$'

die() { echo "make_gpu_bundle: $*" >&2; exit 1; }

[[ -f $BUILD/CMakeCache.txt ]] || die "$BUILD is not a configured build directory (cmake -S . -B $BUILD -G Ninja)"
grep -q '^CMAKE_CUDA_COMPILER:[A-Z]*=.\+' "$BUILD/CMakeCache.txt" ||
  die "$BUILD was configured without CUDA (no nvcc found): nothing to bundle"
grep -Eq '^KVDEPOT_(SANITIZE|TSAN):BOOL=ON' "$BUILD/CMakeCache.txt" &&
  die "$BUILD is a sanitizer build, whose programs need the sanitizer's runtime: bundle a plain build"
if [[ $DO_BUILD == 1 ]]; then
  cmake --build "$BUILD" --target "${PROGRAMS[@]}" "${CAPI_LIBS[@]}"
fi
for p in "${PROGRAMS[@]}"; do
  [[ -x $BUILD/gpu/$p ]] || die "$BUILD/gpu/$p is not built"
done
# Beside the Python module where that is built, else in gpu/.
capi_path() {
  local f
  for f in "$BUILD/python/kvdepot/lib$1.so" "$BUILD/gpu/lib$1.so"; do
    [[ -f $f ]] && { echo "$f"; return; }
  done
  die "lib$1.so is not built (ninja -C $BUILD $1)"
}

rm -rf "$OUT_DIR"
mkdir -p "$OUT_DIR/bin" "$OUT_DIR/lib"
for p in "${PROGRAMS[@]}"; do
  objcopy --strip-debug "$BUILD/gpu/$p" "$OUT_DIR/bin/$p"
done
for l in "${CAPI_LIBS[@]}"; do
  objcopy --strip-debug "$(capi_path "$l")" "$OUT_DIR/lib/lib$l.so"
done

# name path, for every library ldd resolves (ldd follows the whole closure).
resolved() { ldd "$@" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u; }
while read -r name path; do
  [[ $name =~ $SYSTEM_LIBS ]] && continue
  cp -L "$path" "$OUT_DIR/lib/$name"
done < <(resolved "$OUT_DIR"/bin/* "$OUT_DIR"/lib/libkvdepot_kv_*.so)

# Stands alone: with only the folder's lib/ on the path, ldd finds every
# library, and the ones found outside the folder are the system's.
for b in "$OUT_DIR"/bin/* "$OUT_DIR"/lib/libkvdepot_kv_*.so; do
  out="$(env -i LD_LIBRARY_PATH="$OUT_DIR/lib" ldd "$b" 2>&1)"
  if grep -q 'not found' <<<"$out"; then
    die "$b: a library is missing from the bundle:"$'\n'"$out"
  fi
  while read -r name path; do
    [[ $name =~ $SYSTEM_LIBS || $path == "$OUT_DIR/lib/"* ]] ||
      die "$b: $name resolves outside the bundle ($path)"
  done < <(env -i LD_LIBRARY_PATH="$OUT_DIR/lib" ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}')
done

# And runs there: a chroot with the folder and the C runtime alone. Without a
# GPU (here) each program must get as far as asking the CUDA runtime for a
# device and exit 77; a missing library or symbol exits 127 or crashes.
CHROOT="$(command -v chroot || true)"
if [[ $DO_CHROOT == 1 && $(id -u) == 0 && -n $CHROOT ]]; then
  root="$(mktemp -d)"
  trap 'rm -rf "$root"' EXIT
  mkdir -p "$root/bundle"
  cp -a "$OUT_DIR/bin" "$OUT_DIR/lib" "$root/bundle/"
  while read -r name path; do
    [[ $name =~ $SYSTEM_LIBS ]] || continue
    mkdir -p "$root$(dirname "$path")"
    cp -L "$path" "$root$path"
  done < <(resolved "$OUT_DIR"/bin/*)
  # The dynamic loader, by the path the programs name.
  interp="$(readelf -l "$OUT_DIR/bin/${PROGRAMS[0]}" | sed -n 's/.*interpreter: \(.*\)]/\1/p')"
  mkdir -p "$root$(dirname "$interp")"
  cp -L "$interp" "$root$interp"
  for p in "${PROGRAMS[@]}"; do
    set +e
    out="$(env -i LD_LIBRARY_PATH=/bundle/lib "$CHROOT" "$root" "/bundle/bin/$p" 2>&1)"
    rc=$?
    set -e
    [[ $rc == 77 || $rc == 0 ]] ||
      die "$p does not run in a chroot holding only the bundle and the C runtime (exit $rc):"$'\n'"$out"
    echo "make_gpu_bundle: $p runs alone (exit $rc: ${out%%$'\n'*})"
  done
  rm -rf "$root"
  trap - EXIT
else
  echo "make_gpu_bundle: chroot check skipped (needs root and chroot)"
fi

# The oldest driver branch that runs the statically linked CUDA runtime of
# this nvcc release (CUDA's minor version compatibility: any 13.x runtime
# on R580, 12.x on R525, 11.x on R450). Older drivers fail every CUDA call
# with cudaErrorInsufficientDriver.
NVCC="$(sed -n 's/^CMAKE_CUDA_COMPILER:[A-Z]*=//p' "$BUILD/CMakeCache.txt")"
cuda_release="$("$NVCC" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')"
case "$cuda_release" in
  13.*) min_driver="R580 or later" ;;
  12.*) min_driver="R525 or later" ;;
  11.*) min_driver="R450 or later" ;;
  *) min_driver=unknown ;;  # a newer CUDA: see its release notes
esac

commit="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
if [[ $commit != unknown && -n $(git status --porcelain --untracked-files=no 2>/dev/null) ]]; then
  commit="$commit (with uncommitted changes)"
fi
{
  echo "kvdepot GPU bundle (tests/gpu/make_gpu_bundle.sh)"
  echo "commit: $commit"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME")"
  echo "glibc: $(ldd --version | head -n1)"
  echo "nvcc: $("$NVCC" --version | tail -n1)"
  echo "driver: $min_driver (NVIDIA; the CUDA $cuda_release runtime is linked statically)"
  echo "cuda architectures: $(sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' "$BUILD/CMakeCache.txt")"
  echo "build type: $(sed -n 's/^CMAKE_BUILD_TYPE:[A-Z]*=//p' "$BUILD/CMakeCache.txt")"
  # What the GPU machine's C runtime must offer (its glibc and libstdc++ at
  # least these versions).
  echo "needs: $(objdump -T "$OUT_DIR"/bin/* "$OUT_DIR"/lib/* 2>/dev/null |
    grep -o 'GLIBC_[0-9.]*\|GLIBCXX_[0-9.]*\|CXXABI_[0-9.]*' | sort -u -V |
    awk -F_ '{last[$1] = $0} END {print last["GLIBC"], last["GLIBCXX"], last["CXXABI"]}')"
  echo "files:"
  (cd "$OUT_DIR" && find bin lib -type f | sort | xargs sha256sum | sed 's/^/  /')
} >"$OUT_DIR/MANIFEST"
echo "make_gpu_bundle: $OUT_DIR ($(du -sh "$OUT_DIR" | cut -f1)): $(ls "$OUT_DIR/bin" | tr '\n' ' ')+ $(ls "$OUT_DIR/lib" | wc -l) libraries"
