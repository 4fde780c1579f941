#!/usr/bin/env bash
# compare_requests.sh's exit status, with stubs for kvdepotd and kvdepot-bench
# (nothing is measured): 1 when a measured round fails or moves no block over
# UCX, and when kvdepotd dies before it listens.
# Usage: compare_requests_failure_test.sh PATH/TO/compare_requests.sh
set -u
script=$1
stub="$(mktemp -d)"
trap 'rm -rf "$stub"' EXIT
mkdir -p "$stub/server" "$stub/tools"
# A daemon that says where it listens and, like kvdepotd, exits 0 on SIGTERM.
cat >"$stub/server/kvdepotd" <<'STUB'
#!/usr/bin/env bash
echo "kvdepotd listening on 127.0.0.1:1" >&2
trap 'kill $! 2>/dev/null; exit 0' TERM
sleep 120 &
wait
STUB
# A kvdepot-bench that succeeds in the warm-ups (--duration 0.2 under
# --smoke) and fails in the measured rounds the way $STUB_FAILURE says.
cat >"$stub/tools/kvdepot-bench" <<'STUB'
#!/usr/bin/env bash
case " $* " in
  *" --duration 0.2 "*) ;;
  *) case $STUB_FAILURE in
       exit) echo "stub: failed" >&2; exit 1 ;;
       fallback) echo "kvdepot-bench: warning: client 0 falls back to grpc: stub" >&2 ;;
     esac ;;
esac
echo '{"gb_per_sec":1.5,"p99_us":10}'
STUB
chmod +x "$stub/server/kvdepotd" "$stub/tools/kvdepot-bench"
fail=0
expect_exit_1() {  # WHAT MESSAGE: the last run exited 1 and said MESSAGE
  if [[ $rc -ne 1 ]] || ! grep -qF "$2" "$stub/err"; then
    echo "FAIL: $1: exit $rc (want 1 and '$2' on stderr):"
    sed 's/^/  /' "$stub/err"
    fail=1
  fi
}
for mode in exit fallback; do
  STUB_FAILURE=$mode "$script" --smoke --build "$stub" --out "$stub/out.json" 2>"$stub/err"
  rc=$?
  expect_exit_1 "measured round failing ($mode)" "a kvdepot-bench run failed"
done
# A daemon that dies before it listens: reported at once, not after 60 s.
cat >"$stub/server/kvdepotd" <<'STUB'
#!/usr/bin/env bash
echo "stub: cannot start" >&2
exit 3
STUB
"$script" --smoke --build "$stub" --out "$stub/out.json" 2>"$stub/err"
rc=$?
expect_exit_1 "kvdepotd dying at start" "kvdepotd exited (status 3) before listening"
exit $fail
