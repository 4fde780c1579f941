#!/usr/bin/env bash
# One command for a new user and for CI: installs what is missing, builds
# everything and runs the whole test suite (unit, end-to-end against a real
# kvdepotd on loopback, and a short smoke of each benchmark). Ends with
# ctest's summary line; exits non-zero if any test fails.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/deps.sh --with-test-tools
./scripts/build.sh
cd "${KVDEPOT_BUILD_DIR:-build}"
exec ctest --output-on-failure --timeout 900 -j "$(nproc)"
