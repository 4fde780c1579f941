#!/usr/bin/python3
"""Warm restart: how soon a restarted kvdepotd serves its NVMe blocks, side
by side with Redis reloading the same keys and values from its RDB file.

One run (issue 3; ../shared/BENCHMARKS.md):

1. kvdepotd starts on an empty data dir (--dram-capacity small, so most
   blocks are demoted to NVMe while they are stored) and gets --blocks blocks
   of --block-size bytes through the Python binding (untimed). SIGTERM: the
   blocks still only in DRAM are written to NVMe (--persist-on-shutdown), and
   the time from SIGTERM to exit is reported.
2. Redis gets the same keys and values (pipelined SETs), SAVEs its RDB and
   shuts down.
3. --rounds times, alternating: the page cache is dropped (full runs as
   root only; see below), then
   kvdepotd is started on the same data dir, and a probe loop (a new client
   per try, so no reconnect backoff hides anything) measures from the exec
   to: the first health SERVING, and the first block served with its bytes
   matching what was stored. Then Redis is started on its RDB and the loop
   measures the first GET answered with the value (Redis answers LOADING
   until the whole file is read).
4. After each kvdepotd restart every key is looked up (all must be found)
   and a random sample of blocks is read back and compared byte for byte.

Prints a header (date, command, machine, kvdepotd's version), a table and
each round's line, the same text to --txt, and writes JSON (--out). No time
is asserted; the exit code
is 1 only if a restart lost or changed a block, or a side failed to start.

Page cache: so that both sides read their files from the disk, a full run
drops the page cache before each start (``sync`` and ``echo 3 >
/proc/sys/vm/drop_caches``). That needs root and empties the page cache of
the WHOLE machine, slowing whatever else runs on it; without root, or with
--no-drop-caches, the files may be read from memory (the output says which).
--smoke (CI) never drops it.

    /usr/bin/python3 tools/warm_restart.py [--blocks 100000]
        [--block-size 16KiB] [--dram-capacity 256MiB] [--rounds 2]
        [--no-redis] [--no-drop-caches] [--build build] [--out FILE]
        [--txt FILE] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
NAMESPACE = "warm-restart"
UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+)\s*(|B|KiB|MiB|GiB)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 16KiB)")
    return int(match.group(1)) * UNITS[match.group(2)]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="A full run drops the page cache before every start (sync; echo 3 > "
               "/proc/sys/vm/drop_caches): that needs root and empties the page "
               "cache of the whole machine, not just this benchmark's files. "
               "--smoke and --no-drop-caches skip it; so does running without root.")
    p.add_argument("--blocks", type=int, default=100_000)
    p.add_argument("--block-size", type=parse_size, default=parse_size("16KiB"))
    p.add_argument("--dram-capacity", default="256MiB")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sample", type=int, default=256,
                   help="blocks read back and compared after each restart")
    p.add_argument("--no-redis", action="store_true")
    p.add_argument("--no-drop-caches", action="store_true",
                   help="do not drop the (whole machine's) page cache before each "
                        "start; implied by --smoke")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--build", type=Path, default=REPO / "build")
    p.add_argument("--kvdepotd", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None, help="JSON report")
    p.add_argument("--txt", type=Path, default=None,
                   help="the text printed on stdout, also as a file")
    p.add_argument("--smoke", action="store_true",
                   help="CI: 2000 blocks of 4 KiB, 1 round, page cache not dropped")
    args = p.parse_args(argv)
    if args.smoke:
        args.blocks, args.block_size, args.rounds, args.sample = 2000, 4096, 1, 64
        args.no_drop_caches = True
    if args.kvdepotd is None:
        args.kvdepotd = args.build / "server" / "kvdepotd"
    if args.blocks < 1 or args.rounds < 1 or args.block_size < 8:
        p.error("--blocks and --rounds must be >= 1, --block-size >= 8")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def key_of(i: int) -> bytes:
    return b"wr/%09d" % i


def value_of(base: bytes, i: int) -> bytes:
    """Block i: the shared random base with i in its first 8 bytes."""
    return i.to_bytes(8, "little") + base[8:]


def drop_caches(enabled: bool) -> bool:
    """Drops the whole machine's page cache (sync, then 3 into
    /proc/sys/vm/drop_caches) when ``enabled`` and root; returns whether it
    did."""
    if not enabled or os.geteuid() != 0:
        return False
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def poll_until(probe: Callable[[], bool], timeout_s: float) -> Optional[float]:
    """Seconds (monotonic) at which probe() first returned True, or None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if probe():
            return time.monotonic()
        time.sleep(0.002)
    return None


class Kvdepotd:
    def __init__(self, binary: Path, data_dir: Path, dram: str) -> None:
        self.binary, self.data_dir, self.dram = binary, data_dir, dram
        self.address = ""
        self.proc: Optional[subprocess.Popen] = None
        self.log = data_dir.parent / "kvdepotd.log"

    def start(self) -> float:
        """Starts the daemon on a fresh port; returns the exec time."""
        self.address = f"127.0.0.1:{free_port()}"
        log = open(self.log, "ab")
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [str(self.binary), "--listen", self.address, "--metrics-listen", "",
             "--data-dir", str(self.data_dir), "--hugepages", "off",
             "--dram-capacity", self.dram, "--nvme-capacity", "1TiB",
             "--persist-on-shutdown", "true"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return started

    def stop(self) -> float:
        """SIGTERM; returns seconds to exit (killed after 120 s)."""
        assert self.proc is not None
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError("kvdepotd did not exit within 120 s of SIGTERM")
        if code != 0:
            raise RuntimeError(f"kvdepotd exited with {code}; log: {self.log}")
        return time.monotonic() - t0


class Redis:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.port = 0
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> float:
        self.port = free_port()
        started = time.monotonic()
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.dir), "--dbfilename", "dump.rdb", "--save", "",
             "--appendonly", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return started

    def connect(self, timeout: float = 1.0) -> Optional[socket.socket]:
        try:
            return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        except OSError:
            return None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)


def resp(*parts: bytes) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(part), part))
    return b"".join(out)


class RespReader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, bytearray()

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("redis closed the connection")
        self.buf += chunk

    def reply(self) -> Any:
        while b"\r\n" not in self.buf:
            self._fill()
        line, _, rest = bytes(self.buf).partition(b"\r\n")
        kind, body = line[:1], line[1:]
        if kind in (b"+", b"-", b":"):
            self.buf = bytearray(rest)
            return RuntimeError(body.decode()) if kind == b"-" else body
        if kind == b"$":
            n = int(body)
            if n < 0:
                self.buf = bytearray(rest)
                return None
            while len(self.buf) < len(line) + 2 + n + 2:
                self._fill()
            start = len(line) + 2
            value = bytes(self.buf[start:start + n])
            del self.buf[:start + n + 2]
            return value
        raise RuntimeError(f"unexpected RESP reply {line[:40]!r}")


def fill_kvdepot(kvdepot: Any, daemon: Kvdepotd, args: argparse.Namespace,
                 base: bytes) -> None:
    client = kvdepot.Client(daemon.address, timeout_s=60.0)
    batch = max(1, min(256, (8 << 20) // args.block_size))
    for first in range(0, args.blocks, batch):
        idx = range(first, min(args.blocks, first + batch))
        keys = [key_of(i) for i in idx]
        values = [value_of(base, i) for i in idx]
        for attempt in range(300):
            try:
                client.put(NAMESPACE, keys, values)
                break
            except RuntimeError as e:  # DRAM full while demotion catches up
                if "RESOURCE_EXHAUSTED" not in str(e) or attempt == 299:
                    raise
                time.sleep(0.1)
    client.close()


def fill_redis(redis: Redis, args: argparse.Namespace, base: bytes) -> None:
    sock = redis.connect(timeout=900)  # SAVE of gigabytes takes a while
    if sock is None:
        raise RuntimeError("redis-server did not accept a connection")
    reader = RespReader(sock)
    batch = 256
    for first in range(0, args.blocks, batch):
        idx = range(first, min(args.blocks, first + batch))
        sock.sendall(b"".join(resp(b"SET", key_of(i), value_of(base, i)) for i in idx))
        for _ in idx:
            r = reader.reply()
            if isinstance(r, Exception):
                raise r
    sock.sendall(resp(b"SAVE"))
    r = reader.reply()
    if isinstance(r, Exception):
        raise r
    sock.close()


def measure_kvdepot(kvdepot: Any, daemon: Kvdepotd, args: argparse.Namespace,
                    base: bytes, rng: random.Random) -> Dict[str, Any]:
    probe_index = rng.randrange(args.blocks)
    probe_key, probe_value = key_of(probe_index), value_of(base, probe_index)
    buf = bytearray(args.block_size)
    times: Dict[str, float] = {}

    def probe() -> bool:
        try:
            client = kvdepot.Client(daemon.address, timeout_s=1.0)
        except RuntimeError:
            return False
        try:
            if "serving" not in times:
                client.health()
                times["serving"] = time.monotonic()
            if client.get_into(NAMESPACE, [probe_key], [buf]) == [True] and \
                    bytes(buf) == probe_value:
                times["first_block"] = time.monotonic()
                return True
        except RuntimeError:
            pass
        finally:
            client.close()
        return False

    start = daemon.start()
    if poll_until(probe, 120) is None:
        raise RuntimeError(f"restarted kvdepotd served nothing in 120 s; log: {daemon.log}")
    result = {"serving_s": times["serving"] - start,
              "first_block_s": times["first_block"] - start}
    # Everything still there, and bytes unchanged.
    client = kvdepot.Client(daemon.address, timeout_s=60.0)
    found = 0
    for first in range(0, args.blocks, 1000):
        keys = [key_of(i) for i in range(first, min(args.blocks, first + 1000))]
        reply = client.lookup(NAMESPACE, keys)
        found += sum(1 for e in reply.entries if e.found)
    sample = rng.sample(range(args.blocks), min(args.sample, args.blocks))
    bufs = [bytearray(args.block_size) for _ in sample]
    filled = client.get_into(NAMESPACE, [key_of(i) for i in sample], bufs)
    identical = sum(1 for i, ok, b in zip(sample, filled, bufs)
                    if ok and bytes(b) == value_of(base, i))
    stats = client.stats()
    client.close()
    result.update({
        "found": found, "sample": len(sample), "sample_identical": identical,
        "nvme_blocks": int(stats["nvme"]["blocks"]),
        "dram_blocks": int(stats["dram"]["blocks"]),
    })
    return result


def measure_redis(redis: Redis, args: argparse.Namespace, base: bytes,
                  rng: random.Random) -> Dict[str, Any]:
    probe_index = rng.randrange(args.blocks)
    probe_key, probe_value = key_of(probe_index), value_of(base, probe_index)

    def probe() -> bool:
        sock = redis.connect()
        if sock is None:
            return False
        try:
            sock.sendall(resp(b"GET", probe_key))
            return RespReader(sock).reply() == probe_value
        except (OSError, ConnectionError):
            return False
        finally:
            sock.close()

    start = redis.start()
    at = poll_until(probe, 300)
    if at is None:
        raise RuntimeError("restarted redis-server served nothing in 300 s")
    sock = redis.connect(timeout=60)
    assert sock is not None
    sock.sendall(resp(b"DBSIZE"))
    keys = int(RespReader(sock).reply())
    sock.close()
    redis.stop()
    return {"first_block_s": at - start, "found": keys}


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    command = " ".join([Path(sys.argv[0]).name, *argv])
    load_start = os.getloadavg()
    sys.path.insert(0, str(args.build / "python"))
    try:
        import kvdepot  # noqa: F401
    except ImportError as e:
        print(f"warm_restart.py: the kvdepot Python module is not built: {e}",
              file=sys.stderr)
        return 77
    if not args.kvdepotd.exists():
        print(f"warm_restart.py: no kvdepotd at {args.kvdepotd}", file=sys.stderr)
        return 77
    with_redis = not args.no_redis and shutil.which("redis-server") is not None
    work = Path(tempfile.mkdtemp(prefix="kvdepot-warm-restart-", dir=args.dir))
    rng = random.Random(20261203)
    base = rng.randbytes(args.block_size)
    daemon = Kvdepotd(args.kvdepotd, work / "kvdepot", args.dram_capacity)
    redis = Redis(work / "redis")
    (work / "redis").mkdir()
    rounds: List[Dict[str, Any]] = []
    ok = True
    version: Optional[re.Match] = None
    try:
        t0 = time.monotonic()
        daemon.start()
        if poll_until(lambda: _health(kvdepot, daemon.address), 60) is None:
            raise RuntimeError(f"kvdepotd did not start; log: {daemon.log}")
        version = re.search(r"kvdepotd (\S+) \((\w+)\)",
                            daemon.log.read_text(errors="replace"))
        fill_kvdepot(kvdepot, daemon, args, base)
        fill_s = time.monotonic() - t0
        shutdown_s = daemon.stop()
        if with_redis:
            redis.start()
            if poll_until(lambda: _redis_up(redis), 60) is None:
                raise RuntimeError("redis-server did not start")
            fill_redis(redis, args, base)
            redis.stop()
        for r in range(args.rounds):
            row: Dict[str, Any] = {"round": r + 1}
            row["dropped_page_cache"] = drop_caches(not args.no_drop_caches)
            row["kvdepot"] = measure_kvdepot(kvdepot, daemon, args, base, rng)
            row["kvdepot"]["shutdown_s"] = daemon.stop()
            if with_redis:
                drop_caches(not args.no_drop_caches)
                row["redis"] = measure_redis(redis, args, base, rng)
            k = row["kvdepot"]
            if k["found"] != args.blocks or k["sample_identical"] != k["sample"]:
                ok = False
            print(f"warm_restart.py: round {r + 1}: kvdepotd SERVING "
                  f"{k['serving_s']:.3f} s, first block {k['first_block_s']:.3f} s, "
                  f"{k['found']}/{args.blocks} found, "
                  f"{k['sample_identical']}/{k['sample']} sampled identical"
                  + (f"; redis first GET {row['redis']['first_block_s']:.3f} s"
                     if with_redis else ""), file=sys.stderr)
            rounds.append(row)
    finally:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.proc.kill()
        redis.stop()
        shutil.rmtree(work, ignore_errors=True)

    best = lambda side, field: min(  # noqa: E731
        row[side][field] for row in rounds)
    report: Dict[str, Any] = {
        "benchmark": "warm_restart",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command,
        "machine": {"nproc": os.cpu_count(),
                    "mem_gib": round(os.sysconf("SC_PAGE_SIZE")
                                     * os.sysconf("SC_PHYS_PAGES") / (1 << 30), 1),
                    "data_dir_fs": filesystem_of(args.dir),
                    "loadavg_start": list(load_start),
                    "niceness": os.nice(0)},  # both sides' processes inherit it
        "kvdepotd": f"{version.group(1)} (commit {version.group(2)})" if version else None,
        "blocks": args.blocks, "block_size": args.block_size,
        "dram_capacity": args.dram_capacity, "rounds": rounds,
        "page_cache": page_cache_note(args, rounds),
        "fill_s": fill_s, "first_shutdown_s": shutdown_s,
        "kvdepot_serving_s_best": best("kvdepot", "serving_s"),
        "kvdepot_first_block_s_best": best("kvdepot", "first_block_s"),
        "all_blocks_found_and_identical": ok,
    }
    if with_redis:
        report["redis_first_get_s_best"] = best("redis", "first_block_s")
        report["redis_over_kvdepot"] = (report["redis_first_get_s_best"] /
                                        report["kvdepot_first_block_s_best"])
    text = "\n".join(report_lines(report, args, with_redis))
    print(text)
    if args.txt is not None:
        args.txt.write_text(text + "\n")
        print(f"text: {args.txt}")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"JSON: {args.out}")
    return 0 if ok else 1


def report_lines(report: Dict[str, Any], args: argparse.Namespace,
                 with_redis: bool) -> List[str]:
    """The text on stdout (and --txt), from the JSON report."""
    rounds, m = report["rounds"], report["machine"]
    gib = args.blocks * args.block_size / (1 << 30)
    load = m["loadavg_start"]
    lines = [
        f"date: {report['date']}",
        f"command: {report['command']}",
        f"machine: {m['nproc']} cores, {m['mem_gib']} GiB RAM, load average at start "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, run at niceness {m['niceness']} "
        f"(both sides); data dirs under {args.dir} on "
        f"{m['data_dir_fs']}; kvdepotd {report['kvdepotd'] or '?'}",
        "",
        f"Warm restart: {args.blocks} blocks of {args.block_size} B "
        f"({gib:.2f} GiB), DRAM tier {args.dram_capacity}; best of {args.rounds} "
        f"round(s); {report['page_cache']}",
        f"{'side':10} {'to SERVING s':>13} {'to first block s':>17} "
        f"{'blocks after':>13}",
        f"{'kvdepot':10} {report['kvdepot_serving_s_best']:13.3f} "
        f"{report['kvdepot_first_block_s_best']:17.3f} "
        f"{rounds[-1]['kvdepot']['found']:13d}",
    ]
    if with_redis:
        lines += [
            f"{'redis':10} {'-':>13} {report['redis_first_get_s_best']:17.3f} "
            f"{rounds[-1]['redis']['found']:13d}",
            f"ratio redis / kvdepot (time to first block): "
            f"{report['redis_over_kvdepot']:.2f}",
        ]
    for row in rounds:
        k = row["kvdepot"]
        lines.append(
            f"round {row['round']}: kvdepotd SERVING {k['serving_s']:.3f} s, first block "
            f"{k['first_block_s']:.3f} s, {k['found']}/{args.blocks} found, "
            f"{k['sample_identical']}/{k['sample']} sampled identical, tiers after: "
            f"nvme {k['nvme_blocks']} dram {k['dram_blocks']} blocks, SIGTERM to exit "
            f"{k['shutdown_s']:.2f} s"
            + (f"; redis first GET {row['redis']['first_block_s']:.3f} s"
               if with_redis else ""))
    met = (report["kvdepot_first_block_s_best"] < 3
           and report["kvdepot_serving_s_best"] < 3)
    lines += [
        f"issue 3 aim: first block and SERVING under 3 s: {'met' if met else 'NOT met'}",
        f"fill {report['fill_s']:.1f} s; first SIGTERM (persisting DRAM) to exit "
        f"{report['first_shutdown_s']:.2f} s; all blocks found and sampled bytes "
        f"identical: {report['all_blocks_found_and_identical']}",
    ]
    return lines


def filesystem_of(path: Path) -> str:
    """The device and type of the filesystem holding ``path`` (its longest
    mount point in /proc/mounts), e.g. ``/dev/vda (ext4)``; ``unknown``."""
    target = str(path.resolve())
    best = ("", "unknown")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) < 3:
                continue
            device, mount, fstype = fields[:3]
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best[0]):
                best = (mount, f"{device} ({fstype})")
    except OSError:
        pass
    return best[1]


def page_cache_note(args: argparse.Namespace, rounds: Sequence[Dict[str, Any]]) -> str:
    """Whether the page cache was dropped before each start, and why not."""
    if all(r["dropped_page_cache"] for r in rounds):
        return "page cache dropped before each start (the whole machine's; root)"
    if args.smoke:
        why = "--smoke never empties the whole machine's page cache"
    elif args.no_drop_caches:
        why = "--no-drop-caches"
    elif os.geteuid() != 0:
        why = "not root"
    else:
        why = "writing /proc/sys/vm/drop_caches failed"
    return f"page cache NOT dropped ({why}): files may be read from memory"


def _health(kvdepot: Any, address: str) -> bool:
    try:
        client = kvdepot.Client(address, timeout_s=1.0)
        try:
            client.health()
            return True
        finally:
            client.close()
    except RuntimeError:
        return False


def _redis_up(redis: Redis) -> bool:
    sock = redis.connect()
    if sock is None:
        return False
    sock.close()
    return True


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
