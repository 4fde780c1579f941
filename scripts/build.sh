#!/usr/bin/env bash
# Configures and builds kvdepot in ./build (RelWithDebInfo). Extra arguments
# are ninja targets (default: everything).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${KVDEPOT_BUILD_DIR:-build}
if [[ ! -f "$BUILD_DIR/build.ninja" ]]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    ${KVDEPOT_CMAKE_ARGS:-} >/dev/null
fi
ninja -C "$BUILD_DIR" "$@"
