#!/usr/bin/python3
"""compare_store_pipeline.py: KvCacheStore loads and saves pipelined in
batches (pipeline_batches=N, the default 4) against one batch
(pipeline_batches=1), side by side against one kvdepotd it starts
(memory only, port 0, a temporary data dir).

A torch paged cache (vLLM FlashAttention NHD, bf16; 32 layers x 16 tokens x
8 KV heads x 128 by default: 2 MiB objects) is saved once, then each side
loads (and saves under new keys) the same blocks in alternation, --rounds
times; each side's figure is its best round. ratio = one-batch time /
pipelined time (> 1: pipelining is faster). Every load is checked byte for
byte.

Loads go through load_async, so each also measures ``layer0``: the time
until wait_for_layer(0) returns, i.e. until an engine may run layer 0's
attention, against ``load``, the time until every layer is in (what the
synchronous load() made an engine wait before layer 0). "layer 0 usable Nx
sooner" is load / layer0 of the same pipelined load, computed per round:
the median over the rounds that loaded the right bytes, with its range
(never one round's load over another round's layer0).

    /usr/bin/python3 tools/compare_store_pipeline.py [--build DIR]
        [--kvdepotd PATH] [--blocks 64] [--batches 4] [--rounds 5]
        [--out FILE] [--smoke]

Needs the kvdepotd build (--kvdepotd, default <build>/server/kvdepotd) and
the Python package in <build>/python (run with /usr/bin/python3: Debian's
torch and numpy). Exit 0 when every run succeeded, 1 otherwise, 77 without
torch (ctest's compare_store_pipeline_smoke, in client/python, then
reports a skip: it checks nothing where torch is not installed). The daemon
is stopped on every exit, Ctrl-C and SIGTERM included (SIGTERM, then
SIGKILL after 20 s).
"""
import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def _commit():
    """The checkout's commit, for the report ("unknown" outside git)."""
    try:
        return subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)),
                               "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"

def _exit_on_signal(signum, _frame) -> None:
    """SIGTERM (and SIGHUP) end the run as Ctrl-C does: through main's
    ``finally``, which stops the daemon."""
    raise SystemExit(128 + signum)


def stop_daemon(daemon: subprocess.Popen) -> None:
    """SIGTERM, up to 20 s for the daemon to exit, then SIGKILL; never
    raises, never leaves it running. Signals are ignored meanwhile, so a
    second Ctrl-C cannot cut the cleanup short."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    if daemon.poll() is not None:
        return
    daemon.terminate()
    try:
        daemon.wait(timeout=20)
    except subprocess.TimeoutExpired:
        print("compare_store_pipeline: kvdepotd did not exit 20 s after SIGTERM: SIGKILL",
              file=sys.stderr)
        daemon.kill()
        daemon.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--kvdepotd", default=None,
                    help="the daemon to start (default <build>/server/kvdepotd)")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(REPO, "tools/results/compare_store_pipeline.json"))
    ap.add_argument("--smoke", action="store_true", help="tiny run for CI")
    a = ap.parse_args()
    if a.smoke:
        a.blocks, a.rounds, a.layers = 8, 1, 2
    if a.kvdepotd is None:
        a.kvdepotd = os.path.join(a.build, "server/kvdepotd")
    if not os.access(a.kvdepotd, os.X_OK):
        print(f"compare_store_pipeline: {a.kvdepotd} is not an executable", file=sys.stderr)
        return 1
    sys.path.insert(0, os.path.join(a.build, "python"))
    try:
        import torch  # noqa: E402
    except ImportError:
        print("compare_store_pipeline: torch is not installed: skipped", file=sys.stderr)
        return 77
    import kvdepot  # noqa: E402

    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGHUP, _exit_on_signal)
    work = tempfile.mkdtemp()
    log = open(os.path.join(work, "kvdepotd.log"), "w+")
    daemon = subprocess.Popen(
        [a.kvdepotd, "--listen", "127.0.0.1:0",
         "--metrics-listen", "", "--data-dir", os.path.join(work, "d"),
         "--dram-capacity", "2GiB", "--nvme-capacity", "0"],
        stdout=subprocess.DEVNULL, stderr=log)
    try:
        address = None
        for _ in range(150):
            log.seek(0)
            m = re.search(r"listening on (127\.0\.0\.1:\d+)", log.read())
            if m:
                address = m.group(1)
                break
            time.sleep(0.1)
        if address is None:
            log.seek(0)
            print(log.read(), file=sys.stderr)
            return 1
        T, H, D = 16, 8, 128
        layout = kvdepot.KvLayout.mha(kvdepot.KvCacheLayout.FLASH_ATTN_NHD, a.layers,
                                      T, H, D, kvdepot.KvDtype.BFLOAT16)
        client = kvdepot.Client(address, timeout_s=30)
        sides = {
            "pipelined": kvdepot.KvCacheStore(address, layout, "bench", client=client,
                                              pipeline_batches=a.batches),
            "one_batch": kvdepot.KvCacheStore(address, layout, "bench", client=client,
                                              pipeline_batches=1),
        }
        g = torch.Generator().manual_seed(1)
        n = a.blocks
        src = [torch.randn((2, n, T, H, D), generator=g).to(torch.bfloat16)
               for _ in range(a.layers)]
        ids = list(range(n))
        keys = [b"blk%d" % i for i in ids]
        if not all(sides["one_batch"].save(src, ids, keys)):
            print("the blocks to load could not be stored", file=sys.stderr)
            return 1
        # One untimed load per side first (each side's first load pays for
        # its staging buffers and the daemon's first touch of the blocks).
        for store in sides.values():
            store.load_async([torch.zeros_like(t) for t in src], ids, keys).wait()
        best = {name: {"load_s": float("inf"), "layer0_s": float("inf"),
                       "save_s": float("inf")} for name in sides}
        rounds = []
        failed = False
        for r in range(a.rounds):
            for name, store in sides.items():
                dst = [torch.zeros_like(t) for t in src]
                t0 = time.perf_counter()
                handle = store.load_async(dst, ids, keys)
                handle.wait_for_layer(0)
                layer0_s = time.perf_counter() - t0
                filled = handle.wait()
                load_s = time.perf_counter() - t0
                load_ok = all(filled) and all(torch.equal(s, d) for s, d in zip(src, dst))
                if not load_ok:
                    print(f"{name}: load round {r} returned wrong bytes", file=sys.stderr)
                    failed = True
                new_keys = [b"%s-r%d-%s" % (name.encode(), r, k) for k in keys]
                t0 = time.perf_counter()
                stored = store.save(src, ids, new_keys)
                save_s = time.perf_counter() - t0
                save_ok = all(stored)
                if not save_ok:
                    print(f"{name}: save round {r} stored {sum(map(bool, stored))} of "
                          f"{len(stored)} blocks", file=sys.stderr)
                    failed = True
                # A failed round is kept in the JSON but never counts as a
                # side's best (a fast failure would look like a fast run).
                if load_ok:
                    best[name]["load_s"] = min(best[name]["load_s"], load_s)
                    best[name]["layer0_s"] = min(best[name]["layer0_s"], layer0_s)
                if save_ok:
                    best[name]["save_s"] = min(best[name]["save_s"], save_s)
                rounds.append({"round": r + 1, "side": name, "load_s": load_s,
                               "layer0_s": layer0_s, "save_s": save_s,
                               "load_failed": not load_ok, "save_failed": not save_ok})
        total = n * layout.object_bytes
        rows = []
        print(f"{n} blocks of {layout.object_bytes / 2**20:.1f} MiB, pipeline_batches "
              f"{a.batches} vs 1, best of {a.rounds} alternating rounds")
        print(f"{'op':6} {'pipelined_ms':>12} {'one_batch_ms':>13} {'pipelined_GB/s':>15} "
              f"{'one_batch_GB/s':>15} {'ratio':>6}")
        for op in ("load", "layer0", "save"):
            p, o = best["pipelined"][f"{op}_s"], best["one_batch"][f"{op}_s"]
            if p == float("inf") or o == float("inf"):
                print(f"{op:6} no round of one side succeeded")
                rows.append({"op": op, "failed": True})
                continue
            ratio = o / p if p > 0 else 0
            # layer0 moves no bytes of its own: no GB/s.
            gbs = ((f"{total / p / 1e9:15.2f} {total / o / 1e9:15.2f}") if op != "layer0"
                   else f"{'-':>15} {'-':>15}")
            print(f"{op:6} {p * 1e3:12.1f} {o * 1e3:13.1f} {gbs} {ratio:6.2f}")
            row = {"op": op, "pipelined_s": p, "one_batch_s": o, "ratio": ratio}
            if op != "layer0":
                row.update(pipelined_gb_per_s=total / p / 1e9,
                           one_batch_gb_per_s=total / o / 1e9)
            rows.append(row)
        # load / layer0 of the same load, per round (the best load and the
        # best layer0 may come from different rounds: their quotient
        # describes no load that happened).
        per_round = [(r["load_s"] / r["layer0_s"], r) for r in rounds
                     if r["side"] == "pipelined" and not r["load_failed"] and r["layer0_s"] > 0]
        if not per_round:
            print("layer 0: no pipelined load succeeded")
            rows.append({"op": "layer0_vs_whole_load", "failed": True})
        else:
            ratios = sorted(q for q, _ in per_round)
            med = statistics.median(ratios)
            p0 = statistics.median(r["layer0_s"] for _, r in per_round)
            pl = statistics.median(r["load_s"] for _, r in per_round)
            print(f"layer 0 usable {med:.2f}x sooner than every layer (load_async, pipelined; "
                  f"per-round load / layer0, median of {len(ratios)} rounds, range "
                  f"{ratios[0]:.2f}-{ratios[-1]:.2f}; median layer0 {p0 * 1e3:.1f} ms, "
                  f"load {pl * 1e3:.1f} ms)")
            rows.append({"op": "layer0_vs_whole_load",
                         "ratio": med, "ratio_min": ratios[0], "ratio_max": ratios[-1],
                         "ratio_per_round": [q for q, _ in per_round],
                         "ratio_is": "median over rounds of load_s / layer0_s of the same pipelined load",
                         "pipelined_layer0_median_s": p0, "pipelined_load_median_s": pl})
        with open(a.out, "w") as f:
            json.dump({"benchmark": "compare_store_pipeline",
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "host": platform.node(), "command": " ".join(sys.argv),
                       "commit": _commit(),
                       "blocks": n, "object_bytes": layout.object_bytes,
                       "layout": repr(layout), "pipeline_batches": a.batches,
                       "failed": failed, "results": rows, "rounds": rounds}, f, indent=1)
        print(f"JSON: {a.out}")
        return 1 if failed else 0
    finally:
        stop_daemon(daemon)
        log.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
