#!/usr/bin/env bash
# Installs kvdepot's build and test dependencies from Debian 12's archive.
# Only missing packages are installed; `apt-get update` runs only when
# something is missing. Needs root (or sudo).
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git curl ccache
  protobuf-compiler protobuf-compiler-grpc libprotobuf-dev libgrpc++-dev
  libabsl-dev librocksdb-dev libspdlog-dev libfmt-dev prometheus-cpp-dev libyaml-cpp-dev
  libcli11-dev libxxhash-dev libcivetweb-dev zlib1g-dev pybind11-dev python3-dev libucx-dev
  libgtest-dev libgmock-dev libbenchmark-dev
)
# Baselines the tests' benchmark smoke runs against.
if [[ "${1:-}" == "--with-test-tools" ]]; then
  PACKAGES+=(redis-server redis-tools python3 fio rocksdb-tools prometheus python3-yaml chromium fonts-dejavu-core
    python3-numpy python3-torch python3-matplotlib ucx-utils)
fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  exit 0
fi
SUDO=""
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "deps.sh: run as root or install sudo" >&2; exit 1; }
  SUDO=sudo
fi
echo "deps.sh: installing ${missing[*]}" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
  "${missing[@]}" >/dev/null
