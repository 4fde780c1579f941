#!/usr/bin/env bash
# compare_requests.sh's exit status, with stubs for kvdepotd and kvdepot-bench
# (nothing is measured): 1 when a measured round fails, moves no block over
# UCX, or sends its requests another way than its side's (the daemon's
# kvdepot_ucx_requests_total did not move as it should), and when kvdepotd
# dies before it listens.
# Usage: compare_requests_failure_test.sh PATH/TO/compare_requests.sh
set -u
script=$1
stub="$(mktemp -d)"
trap 'rm -rf "$stub"' EXIT
mkdir -p "$stub/server" "$stub/tools"
# A daemon that says where it listens, serves kvdepot_ucx_requests_total and
# kvdepot_requests_total from $STUB_COUNTERS ("PushBlocks PullBlocks
# PullBlocksWithData" over UCX, then all PushBlocks and all PullBlocks,
# which the stub bench moves) and, like kvdepotd, exits 0 on SIGTERM.
export STUB_COUNTERS="$stub/counters"
cat >"$stub/server/kvdepotd" <<'STUB'
#!/usr/bin/env python3
import http.server, os, signal, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        push, pull, data, all_push, all_pull = open(os.environ["STUB_COUNTERS"]).read().split()
        body = (f'kvdepot_ucx_requests_total{{op="PushBlocks"}} {push}\n'
                f'kvdepot_ucx_requests_total{{op="PullBlocks"}} {pull}\n'
                f'kvdepot_ucx_requests_total{{op="PullBlocksWithData"}} {data}\n'
                f'kvdepot_requests_total{{code="OK",op="PushBlocks"}} {all_push}\n'
                f'kvdepot_requests_total{{code="OK",op="PullBlocks"}} {all_pull}\n'
                f'kvdepot_requests_total{{code="OK",op="Lookup"}} 7\n').encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
srv = http.server.HTTPServer(("127.0.0.1", 0), H)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
print(f"kvdepotd listening on 127.0.0.1:1; metrics on 127.0.0.1:{srv.server_address[1]}; x",
      file=sys.stderr, flush=True)
srv.serve_forever()
STUB
# A kvdepot-bench that succeeds in the warm-ups (--duration 0.2 under
# --smoke) and fails in the measured rounds the way $STUB_FAILURE says;
# every run counts one request of its op (PullBlocks for put, PushBlocks for
# get), over UCX for a run with --requests ucx unless
# STUB_FAILURE=wrong_path; with STUB_FAILURE=partial its measured rounds
# count one more, as a gRPC call.
cat >"$stub/tools/kvdepot-bench" <<'STUB'
#!/usr/bin/env bash
case " $* " in
  *" --duration 0.2 "*) ;;
  *) case $STUB_FAILURE in
       exit) echo "stub: failed" >&2; exit 1 ;;
       fallback) echo "kvdepot-bench: warning: client 0 falls back to grpc: stub" >&2 ;;
     esac ;;
esac
read -r push pull data all_push all_pull <"$STUB_COUNTERS"
n=1
[[ $STUB_FAILURE == partial && " $* " != *" --duration 0.2 "* ]] && n=2
if [[ " $* " == *" --op get "* ]]; then all_push=$((all_push + n)); else all_pull=$((all_pull + n)); fi
if [[ " $* " == *" --requests ucx "* && $STUB_FAILURE != wrong_path ]]; then
  if [[ " $* " == *" --op get "* ]]; then push=$((push + 1)); else pull=$((pull + 1)); fi
fi
echo "$push $pull $data $all_push $all_pull" >"$STUB_COUNTERS"
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
for mode in exit fallback wrong_path partial; do
  echo "0 0 0 0 0" >"$STUB_COUNTERS"
  STUB_FAILURE=$mode "$script" --smoke --build "$stub" --out "$stub/out.json" 2>"$stub/err"
  rc=$?
  expect_exit_1 "measured round failing ($mode)" "a kvdepot-bench run failed"
  # A run that is not valid counts in no figure: no ratio from it.
  if grep -q '"ratio": "[0-9]' "$stub/out.json" ||
     ! grep -qF '"failed": true' "$stub/out.json"; then
    echo "FAIL: $mode: the JSON counts runs that are not valid:"
    sed 's/^/  /' "$stub/out.json"
    fail=1
  fi
  case $mode in
    wrong_path) want="not a ucx run: no request came over UCX" ;;
    partial) want="not a ucx run: 1 of its 2 requests went as gRPC calls" ;;
    *) want="" ;;
  esac
  [[ -z $want ]] || grep -qF "$want" "$stub/err" || {
    echo "FAIL: $mode: no '$want' on stderr:"; sed 's/^/  /' "$stub/err"; fail=1; }
done
# Every run on its side's path: exit 0, and the JSON has each run's paths.
echo "0 0 0 0 0" >"$STUB_COUNTERS"
STUB_FAILURE=none "$script" --smoke --build "$stub" --out "$stub/out.json" 2>"$stub/err"
rc=$?
if [[ $rc -ne 0 ]] || ! grep -qF '"paths": {"PushBlocks": 0, "PullBlocks": 1' "$stub/out.json" ||
   ! grep -qF '"ratio": "1.00"' "$stub/out.json"; then
  echo "FAIL: runs on their paths: exit $rc (want 0, and paths in the JSON):"
  sed 's/^/  /' "$stub/err" "$stub/out.json"
  fail=1
fi
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
