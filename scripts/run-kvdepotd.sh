#!/usr/bin/env bash
# One command for a new user: installs what is missing, builds kvdepotd and
# starts it in the foreground on its embedded defaults (gRPC on
# 127.0.0.1:50551, metrics on 127.0.0.1:9551, DRAM tier 1GiB, data in
# ./kvdepot-data). Any arguments are passed to kvdepotd (e.g. --dram-capacity
# 4GiB). Stop it with Ctrl-C or SIGTERM.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/deps.sh
./scripts/build.sh kvdepotd kvdepotctl
exec "${KVDEPOT_BUILD_DIR:-build}/server/kvdepotd" "$@"
