#!/usr/bin/env bash
# Configures and builds kvdepot in ./build (RelWithDebInfo). Extra arguments
# are ninja targets (default: everything).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${KVDEPOT_BUILD_DIR:-build}
if [[ ! -f "$BUILD_DIR/build.ninja" ]]; then
  # Its output is kept in $BUILD_DIR/cmake.log; its warnings are shown
  # (what it leaves out, e.g. the Python tests without pybind11, or the CUDA
  # kernels without nvcc).
  mkdir -p "$BUILD_DIR"
  if ! cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      ${KVDEPOT_CMAKE_ARGS:-} >"$BUILD_DIR/cmake.log" 2>&1; then
    cat "$BUILD_DIR/cmake.log" >&2
    exit 1
  fi
  grep -iE -A3 "warning" "$BUILD_DIR/cmake.log" >&2 || true
elif [[ -n ${KVDEPOT_CMAKE_ARGS:-} ]]; then
  # Configured already: the arguments apply to the existing build.
  cmake "$BUILD_DIR" ${KVDEPOT_CMAKE_ARGS} >"$BUILD_DIR/cmake.log" 2>&1 ||
    { cat "$BUILD_DIR/cmake.log" >&2; exit 1; }
fi
ninja -C "$BUILD_DIR" "$@"
