#!/usr/bin/env python3
"""multiturn_bench.py --smoke must fail (exit 1) when kvdepot's blocks do not
really reach the cache, or reach it in the wrong slot or changed.

Each case runs the smoke in a child process with one kvdepot method replaced
by a faulty stub (the way a regression in the package or the connector would
behave), and expects exit status 1 and the failure that names the cause:

* ``noop``: ``KvCacheStore.load`` writes nothing and reports every block
  loaded. The target blocks must not still hold K/V from an earlier request
  (a freed block is reset to NaN), so the logits turn NaN.
* ``partial``: ``KvCacheStore.load`` loads the first block and reports the
  rest missing, so the engine recomputes them (same tokens, only slower):
  the run must see that fewer blocks were loaded than the lookup found.
* ``save_half``: ``KvCacheStore.save`` stores only the first half of the
  blocks it is given, so later turns find shorter prefixes than the earlier
  turns left: the run must see that the hits differ from the expected ones.
* ``rotate``: ``KvCacheStore.load`` loads every block, then moves each
  loaded block one slot on (key i ends in the slot of key i + 1, the last in
  the first's): an off-by-one slot mapping. Attention over a fully visible
  prefix does not depend on the order of its blocks, so tokens and logits
  agree; the digest check must see the blocks differ from what was saved
  under the keys meant for their slots.
* ``bitflip``: ``KvCacheStore.load`` loads every block, then flips the
  lowest mantissa bit of one K element of the middle loaded block: too small
  for the tokens or the logits tolerance; the digest check must see it.
* ``dram_unparsed``: kvdepotd's start line as the benchmark reads it lacks
  ``DRAM tier N bytes``: the run must fail at once instead of weakening the
  block-count check.

Usage: load_checks_test.py [--build DIR] [--kvdepotd PATH]; exits 0 when
every case fails as expected, 1 otherwise, 77 (ctest: skipped) when torch,
numpy, the kvdepot package or kvdepotd is missing. With ``--stub MODE`` it
is the child: it patches kvdepot and runs multiturn_bench.main with the rest
of the arguments. No timing is asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SKIPPED = 77

# mode -> text that the failing run must print (the cause, not just "FAILED")
CASES = {
    "noop": "first-token logits NaN",
    "partial": "loaded fewer blocks than the lookup found",
    "save_half": "lookup hits differ from the expected",
    "rotate": "loaded blocks not identical to what was saved under their key",
    "bitflip": "loaded blocks not identical to what was saved under their key",
    "dram_unparsed": "has no 'DRAM tier N bytes'",
}


def patch(mode: str) -> None:
    """Replaces one method of the kvdepot package (or, for
    ``dram_unparsed``, of the benchmark's Daemon) by a faulty stub."""
    import kvdepot

    store = kvdepot.KvCacheStore
    real_load = store.load
    if mode == "noop":
        def load(self, caches, block_ids, keys):  # type: ignore[no-untyped-def]
            return [True] * len(keys)
        store.load = load
    elif mode == "partial":
        def load(self, caches, block_ids, keys):  # type: ignore[no-untyped-def]
            first = real_load(self, caches, block_ids[:1], keys[:1])
            return list(first) + [False] * (len(keys) - 1)
        store.load = load
    elif mode == "save_half":
        real_save = store.save

        def save(self, caches, block_ids, keys, parents=None):  # type: ignore[no-untyped-def]
            n = (len(keys) + 1) // 2
            stored = real_save(self, caches, block_ids[:n], keys[:n],
                               None if parents is None else parents[:n])
            return list(stored) + [False] * (len(keys) - n)
        store.save = save
    elif mode == "rotate":
        def load(self, caches, block_ids, keys):  # type: ignore[no-untyped-def]
            filled = real_load(self, caches, block_ids, keys)
            ids = list(block_ids)
            for cache in caches:  # the block of slot ids[i] moves to ids[i + 1]
                cache[:, ids[1:] + ids[:1]] = cache[:, ids].clone()
            return filled
        store.load = load
    elif mode == "bitflip":
        import torch

        def load(self, caches, block_ids, keys):  # type: ignore[no-untyped-def]
            filled = real_load(self, caches, block_ids, keys)
            if block_ids:
                element = caches[0][0, block_ids[len(block_ids) // 2], 3, 0, 0:1]
                element.view(torch.int32).bitwise_xor_(1)  # float32: lowest mantissa bit
            return filled
        store.load = load
    elif mode == "dram_unparsed":
        import multiturn_bench

        real_enter = multiturn_bench.Daemon.__enter__

        def enter(self):  # type: ignore[no-untyped-def]
            daemon = real_enter(self)
            daemon.banner = re.sub(r"DRAM tier \d+ bytes", "DRAM tier ? bytes",
                                   daemon.banner)
            return daemon
        multiturn_bench.Daemon.__enter__ = enter
    else:
        raise SystemExit(f"unknown stub {mode!r}")


def child(mode: str, build: Path, argv: Sequence[str]) -> int:
    """Patches kvdepot, then runs the benchmark in this process."""
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(build / "python"))
    if any(importlib.util.find_spec(m) is None for m in ("numpy", "torch", "kvdepot")):
        print("load_checks_test: torch, numpy or kvdepot missing; skipping",
              file=sys.stderr)
        return SKIPPED
    patch(mode)
    import multiturn_bench

    return multiturn_bench.main(["--build", str(build), *argv])


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", type=Path, default=REPO / "build")
    p.add_argument("--kvdepotd", type=Path)
    p.add_argument("--stub", choices=sorted(CASES), help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    kvdepotd = args.kvdepotd or args.build / "server" / "kvdepotd"
    if args.stub:
        return child(args.stub, args.build, [*rest, "--kvdepotd", str(kvdepotd)])

    failures: List[str] = []
    with tempfile.TemporaryDirectory(prefix="multiturn-load-checks-") as tmp:
        for mode, cause in CASES.items():
            cmd = [sys.executable, str(Path(__file__).resolve()), "--stub", mode,
                   "--build", str(args.build), "--kvdepotd", str(kvdepotd),
                   "--smoke", "--no-plot", "--out", str(Path(tmp) / f"{mode}.json")]
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=150)
            if proc.returncode == SKIPPED:
                print(proc.stdout)
                return SKIPPED
            if proc.returncode != 1 or cause not in proc.stdout:
                failures.append(mode)
                print(f"--- {mode}: exit {proc.returncode}, want 1 with {cause!r}:")
                print(proc.stdout)
            else:
                print(f"{mode}: exit 1 as expected ({cause})")
    if failures:
        print(f"load_checks_test: FAILED: {', '.join(failures)} not detected",
              file=sys.stderr)
        return 1
    print("load_checks_test: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
