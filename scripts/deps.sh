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
# Baselines the tests' benchmark smoke runs against. libopenblas0-pthread:
# Debian's torch calls whichever libblas.so.3 the alternatives system names,
# netlib's reference BLAS unless OpenBLAS is installed; the multi-turn
# benchmark's recompute baseline must not run on a reference BLAS.
if [[ "${1:-}" == "--with-test-tools" ]]; then
  PACKAGES+=(redis-server redis-tools python3 fio rocksdb-tools prometheus python3-yaml chromium fonts-dejavu-core
    python3-numpy python3-torch python3-matplotlib ucx-utils libopenblas0-pthread)
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
# redis-server and prometheus are baselines the tests start themselves (on
# free ports); their packages would also start system services (redis on
# :6379, prometheus on :9090 on every address) and enable them at boot. So
# services are kept from starting during the install (policy-rc.d, unless
# the host has its own) and the ones installed here are disabled after.
services=()
for p in "${missing[@]}"; do
  case "$p" in redis-server|prometheus) services+=("$p") ;; esac
done
policy=""
if ((${#services[@]} > 0)) && [[ ! -e /usr/sbin/policy-rc.d ]]; then
  policy=/usr/sbin/policy-rc.d
  printf '#!/bin/sh\n# deps.sh: no services start while it installs\nexit 101\n' |
    $SUDO tee "$policy" >/dev/null
  $SUDO chmod 755 "$policy"
  trap '$SUDO rm -f "$policy"' EXIT
fi
$SUDO apt-get update -qq
# Through env: sudo's env_reset would drop a DEBIAN_FRONTEND set before it.
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  "${missing[@]}" >/dev/null
if ((${#services[@]} > 0)) && [[ -d /run/systemd/system ]]; then
  for svc in "${services[@]}"; do
    $SUDO systemctl disable --now "$svc" >/dev/null 2>&1 || true
  done
  echo "deps.sh: installed ${services[*]} for the tests, with their system services disabled" >&2
fi
