#!/usr/bin/env python3
"""Multi-turn chat with kvdepot prefix reuse against recompute.

One command: starts its own kvdepotd (loopback, port 0, temporary data
directory), builds the seeded model, runs one untimed warm-up pass of the
whole workload on each side, and for each concurrency runs the same
workload recomputing and with kvdepot (its namespace emptied first), the
order alternating by round (recompute first, then kvdepot first: A B B A),
and stops the daemon. Prints a header and a table, writes JSON
(``--out``), the same text as stdout (``--txt``) and a PNG of TTFT by turn
(``--plot``, when matplotlib is installed). The report includes kvdepot's
own time per request (lookup+pin, load, unpin; save) as a share of the
TTFT, against an in-process copy of the same bytes and against the prefill
time it saves, and the transport the loads used. Exits 1 when a loaded
block's bytes differ from those saved under the key meant for its slot
(digest), the two runs disagree (generated tokens, first-token logits
beyond ``--atol`` or NaN), a kvdepot load returns fewer blocks than its
lookup found, a lookup finds other than the blocks the conversation's
earlier turns saved, or kvdepotd's start line does not give the DRAM tier's
size; timings are reported, never asserted. See README.md.

Needs /usr/bin/python3 with torch and numpy, and the kvdepot package built in
``<build>/python``. Exits 77 (ctest: skipped) when any of them is missing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Type

if TYPE_CHECKING:
    # Imported at run time only after main() has checked that torch, numpy
    # and kvdepot are there (else it exits 77), so inside the functions.
    import kvdepot
    from model import DecoderModel
    from workload import RequestRecord, RunResult, TurnSpec

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SKIPPED = 77  # ctest SKIP_RETURN_CODE

BLOCK_SIZE = 16
# Per-turn TTFT target of the issue: turns >= 2 with prompts this long.
TARGET_MIN_TURN = 2
TARGET_MIN_CONTEXT = 2000
TARGET_TTFT_REDUCTION = 0.70

# Sizes: the default fits 2 CPU cores (with torch's reference BLAS) in a few
# minutes; --smoke is a correctness check that takes seconds.
PRESETS: Dict[str, Dict[str, Any]] = {
    "default": dict(
        vocab=4096, hidden=128, layers=2, heads=4, kv_heads=2, head_size=32,
        intermediate=384, conversations=8, turns=3, first_tokens=2048,
        user_tokens=192, output_tokens=24, concurrency=[4, 8], rounds=2,
    ),
    "smoke": dict(
        vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, head_size=16,
        intermediate=128, conversations=2, turns=2, first_tokens=80,
        user_tokens=40, output_tokens=6, concurrency=[2], rounds=2,
    ),
}
# First-token logits may differ by rounding only (the same math in a
# different order); tight bounds per dtype.
DEFAULT_ATOL = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 5e-3}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The options, with unset sizes taken from the default or smoke preset."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="tiny model, 2 conversations x 2 turns, 1 concurrency, "
                        "2 rounds (both orders): the correctness checks in "
                        "seconds (CI)")
    p.add_argument("--build", type=Path, default=REPO / "build",
                   help="CMake build tree: imports <build>/python/kvdepot and "
                        "runs <build>/server/kvdepotd (default <repo>/build)")
    p.add_argument("--kvdepotd", type=Path,
                   help="kvdepotd binary (default <build>/server/kvdepotd)")
    p.add_argument("--dram-capacity", default="1GiB",
                   help="kvdepotd DRAM tier (default 1GiB)")
    p.add_argument("--out", type=Path,
                   help="JSON report (default tools/multiturn/results/multiturn.json; "
                        "with --smoke, multiturn_smoke.json in the temporary "
                        "directory, so that a smoke run leaves the committed "
                        "results alone)")
    p.add_argument("--txt", type=Path,
                   help="the header and table printed on stdout, as a text file "
                        "(default: --out with .txt)")
    p.add_argument("--plot", type=Path,
                   help="PNG of TTFT by turn (default: --out with .png); "
                        "skipped without matplotlib")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")

    def preset(name: str, text: str) -> str:
        return (f"{text} (default {PRESETS['default'][name]}, "
                f"--smoke {PRESETS['smoke'][name]})")

    m = p.add_argument_group("model")
    m.add_argument("--vocab", type=int, help=preset("vocab", "vocabulary size"))
    m.add_argument("--hidden", type=int, help=preset("hidden", "hidden size"))
    m.add_argument("--layers", type=int, help=preset("layers", "decoder layers"))
    m.add_argument("--heads", type=int, help=preset("heads", "query heads"))
    m.add_argument("--kv-heads", type=int, help=preset("kv_heads", "K/V heads"))
    m.add_argument("--head-size", type=int, help=preset("head_size", "head size"))
    m.add_argument("--intermediate", type=int,
                   help=preset("intermediate", "SwiGLU width"))
    m.add_argument("--model-seed", type=int, default=0, help="weights seed (default 0)")
    m.add_argument("--dtype", choices=sorted(DEFAULT_ATOL), default="float32",
                   help="model and KV cache dtype (default float32)")
    m.add_argument("--threads", type=int,
                   help="torch intra-op threads (default: torch's choice)")
    m.add_argument("--atol", type=float,
                   help=f"max abs difference of first-token logits "
                        f"(default by dtype: {DEFAULT_ATOL})")

    w = p.add_argument_group("workload")
    w.add_argument("--conversations", type=int,
                   help=preset("conversations", "conversations"))
    w.add_argument("--turns", type=int, help=preset("turns", "turns per conversation"))
    w.add_argument("--first-tokens", type=int,
                   help=preset("first_tokens", "mean length of a conversation's "
                                               "first user message"))
    w.add_argument("--user-tokens", type=int,
                   help=preset("user_tokens", "mean length of each later user message"))
    w.add_argument("--output-tokens", type=int,
                   help=preset("output_tokens", "mean answer length"))
    w.add_argument("--length-jitter", type=float, default=0.2,
                   help="lengths drawn uniformly within +- this fraction (default 0.2)")
    w.add_argument("--concurrency", type=int, nargs="+",
                   help=preset("concurrency", "concurrent clients; one comparison each"))
    w.add_argument("--workload-seed", type=int, default=0,
                   help="token ids and lengths (default 0)")
    w.add_argument("--rounds", type=int,
                   help=preset("rounds", "runs of each side per concurrency; "
                                         "odd rounds recompute first, even "
                                         "rounds kvdepot first (A B B A), so "
                                         "an even count balances the order; "
                                         "requests pooled"))
    w.add_argument("--no-warmup", action="store_true",
                   help="skip the untimed full-size warm-up pass of each side "
                        "(the first measured run then pays one-time costs)")

    args = p.parse_args(argv)
    for name, value in PRESETS["smoke" if args.smoke else "default"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.atol is None:
        args.atol = DEFAULT_ATOL[args.dtype]
    if args.out is None:
        args.out = (Path(tempfile.gettempdir()) / "multiturn_smoke.json" if args.smoke
                    else HERE / "results" / "multiturn.json")
    if args.kvdepotd is None:
        args.kvdepotd = args.build / "server" / "kvdepotd"
    if args.plot is None:
        args.plot = args.out.with_suffix(".png")
    if args.txt is None:
        args.txt = args.out.with_suffix(".txt")
    return args


class Daemon:
    """A kvdepotd on a loopback port picked by the kernel, with a temporary
    data directory; stopped with SIGTERM (killed after 15 s) on exit."""

    def __init__(self, binary: Path, dram_capacity: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvdepot-multiturn-"))
        self.log_path = self.dir / "kvdepotd.log"
        self.address = ""
        self.banner = ""
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [str(binary), "--listen", "127.0.0.1:0", "--metrics-listen", "",
                 "--data-dir", str(self.dir / "data"), "--hugepages", "off",
                 "--dram-capacity", dram_capacity, "--nvme-capacity", "0"],
                stdout=log, stderr=subprocess.STDOUT)

    def __enter__(self) -> "Daemon":
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace")
            match = re.search(r"^.*listening on (\S+);.*$", text, re.MULTILINE)
            if match:
                self.address = match.group(1)
                self.banner = match.group(0)
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"kvdepotd did not start:\n{text}")

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.stop()

    def stop(self) -> None:
        """Stops the daemon and removes its data directory."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def ratio(a: float, b: float) -> Optional[float]:
    """a / b, None when b is 0."""
    return a / b if b else None


def summarize(
    records: Sequence[RequestRecord], wall_s: Optional[float] = None
) -> Dict[str, Any]:
    """TTFT p50/p90 and mean, mean TPOT, hit ratio, bytes moved, time spent
    in kvdepot calls of some requests (means over all of them) and how that
    time compares with their TTFT and with an in-process copy of the same
    bytes (ratios of sums over the requests that loaded, or saved); with
    ``wall_s``, also their throughput."""
    n = len(records)
    prompt = sum(r.prompt_tokens for r in records)
    loads = [r for r in records if r.bytes_loaded]
    saves = [r for r in records if r.bytes_stored]

    def mean_ms(values: Sequence[float]) -> float:
        return 1e3 * sum(values) / n

    out: Dict[str, Any] = {
        "requests": n,
        "prompt_tokens_mean": prompt / n,
        "ttft_p50_ms": 1e3 * percentile([r.ttft_s for r in records], 50),
        "ttft_p90_ms": 1e3 * percentile([r.ttft_s for r in records], 90),
        "ttft_mean_ms": mean_ms([r.ttft_s for r in records]),
        "tpot_mean_ms": mean_ms([r.tpot_s for r in records]),
        "hit_ratio": sum(r.hit_tokens for r in records) / prompt,
        "lookup_hit_blocks": sum(r.lookup_hits for r in records),
        "loaded_blocks": sum(r.loaded_blocks for r in records),
        "expected_blocks": sum(r.expected_blocks for r in records),
        "bytes_loaded": sum(r.bytes_loaded for r in records),
        "bytes_stored": sum(r.bytes_stored for r in records),
        # lookup + load + unpin, the kvdepot calls inside the TTFT
        "load_mean_ms": mean_ms([r.load_s for r in records]),
        "lookup_mean_ms": mean_ms([r.lookup_s for r in records]),
        "store_load_mean_ms": mean_ms([r.store_load_s for r in records]),
        "unpin_mean_ms": mean_ms([r.unpin_s for r in records]),
        "load_share_of_ttft": ratio(sum(r.load_s for r in records),
                                    sum(r.ttft_s for r in records)),
        "copy_load_mean_ms": mean_ms([r.copy_load_s for r in records]),
        "load_over_copy": ratio(sum(r.load_s for r in loads),
                                sum(r.copy_load_s for r in loads)),
        "store_load_over_copy": ratio(sum(r.store_load_s for r in loads),
                                      sum(r.copy_load_s for r in loads)),
        "save_mean_ms": mean_ms([r.save_s for r in records]),
        "copy_save_mean_ms": mean_ms([r.copy_save_s for r in records]),
        "save_over_copy": ratio(sum(r.save_s for r in saves),
                                sum(r.copy_save_s for r in saves)),
        "digest_checked_blocks": sum(r.digest_checked for r in records),
        "digest_mismatched_blocks": sum(len(r.digest_mismatches) for r in records),
    }
    if wall_s is not None:
        out["wall_s"] = wall_s
        out["requests_per_s"] = len(records) / wall_s
        out["output_tokens_per_s"] = sum(len(r.output) for r in records) / wall_s
    return out


def by_turn(records: Sequence[RequestRecord]) -> Dict[int, List[RequestRecord]]:
    """Records grouped by turn, in turn order."""
    turns: Dict[int, List[RequestRecord]] = {}
    for r in records:
        turns.setdefault(r.turn, []).append(r)
    return dict(sorted(turns.items()))


def describe_run(run: RunResult) -> Dict[str, Any]:
    """The JSON of one (merged) run: overall and per-turn summaries, and
    each request's numbers (in completion order, round after round)."""
    return {
        "mode": run.mode,
        "concurrency": run.concurrency,
        "steps": run.steps,
        "overall": summarize(run.records, run.wall_s),
        "per_turn": [
            {"turn": turn, **summarize(recs)} for turn, recs in by_turn(run.records).items()
        ],
        "requests": [
            {"conversation": r.conversation, "turn": r.turn,
             "prompt_tokens": r.prompt_tokens, "hit_tokens": r.hit_tokens,
             "lookup_hits": r.lookup_hits, "loaded_blocks": r.loaded_blocks,
             "expected_blocks": r.expected_blocks,
             "output_tokens": len(r.output), "ttft_ms": round(1e3 * r.ttft_s, 3),
             "tpot_ms": round(1e3 * r.tpot_s, 3), "load_ms": round(1e3 * r.load_s, 3),
             "lookup_ms": round(1e3 * r.lookup_s, 3),
             "store_load_ms": round(1e3 * r.store_load_s, 3),
             "unpin_ms": round(1e3 * r.unpin_s, 3),
             "copy_load_ms": round(1e3 * r.copy_load_s, 4),
             "save_ms": round(1e3 * r.save_s, 3),
             "copy_save_ms": round(1e3 * r.copy_save_s, 4),
             "bytes_loaded": r.bytes_loaded, "bytes_stored": r.bytes_stored,
             "digest_checked": r.digest_checked,
             "digest_mismatches": [list(m) for m in r.digest_mismatches]}
            for r in run.records
        ],
        "transport": run.transport,
    }


def merge_rounds(runs: Sequence[RunResult]) -> RunResult:
    """One run of the same mode and concurrency pooling every round's
    requests, steps and wall time."""
    from workload import RunResult

    return RunResult(
        mode=runs[0].mode,
        concurrency=runs[0].concurrency,
        wall_s=sum(r.wall_s for r in runs),
        steps=sum(r.steps for r in runs),
        records=[rec for r in runs for rec in r.records],
        transport=[t for r in runs for t in r.transport],
    )


def check_correctness(
    pairs: Sequence[Tuple[RunResult, RunResult]], atol: float, dram_bytes: int,
) -> Dict[str, Any]:
    """Compares each (recompute, kvdepot) pair of runs request by request
    and checks what the kvdepot runs loaded.

    Failures: a loaded block whose bytes are not those saved under the key
    meant for its slot (the engine's digest check: a block in the wrong
    slot, or changed by even one bit, which the tokens and logits can miss,
    since attention over a fully visible prefix does not depend on the
    order of its blocks); generated tokens that differ; first-token logits
    beyond ``atol`` or NaN (the cache starts as NaN and freed blocks are
    reset to NaN, so a block the load did not write poisons them); a
    request whose load returned fewer blocks than its lookup found (the
    engine would recompute the rest: right tokens, wrong timing); a request
    whose lookup found other than ``expected_blocks``, the full blocks its
    conversation's earlier turns saved (0 at turn 1: the namespace is
    emptied before each kvdepot run). The latter is exact only while nothing
    is evicted: when a run stored more than half of the DRAM tier
    (``dram_bytes``), it only fails on more hits than expected and on a
    turn >= 2 where no request hit at all.
    """
    import torch

    mismatched = []
    max_diff = 0.0
    nan_logits = False
    short_loads = []
    unexpected_hits = []
    digest_mismatches = []
    stored_per_run = [sum(r.bytes_stored for r in kv.records) for _, kv in pairs]
    exact = 2 * max(stored_per_run) <= dram_bytes
    for round_index, (recompute, cached) in enumerate(pairs):
        base = {(r.conversation, r.turn): r for r in recompute.records}
        for r in cached.records:
            ref = base[(r.conversation, r.turn)]
            where = {"round": round_index, "conversation": r.conversation, "turn": r.turn}
            if r.output != ref.output:
                mismatched.append(where)
            diff = (r.first_logits - ref.first_logits).abs()
            nan_logits = nan_logits or bool(torch.isnan(diff).any())
            max_diff = max(max_diff, float(diff.nan_to_num(0.0).max()))
            blocks = {"lookup_hits": r.lookup_hits, "loaded_blocks": r.loaded_blocks,
                      "expected_blocks": r.expected_blocks}
            if r.loaded_blocks < r.lookup_hits:
                short_loads.append({**where, **blocks})
            if (r.lookup_hits != r.expected_blocks if exact
                    else r.lookup_hits > r.expected_blocks):
                unexpected_hits.append({**where, **blocks})
            for block, why in r.digest_mismatches:
                digest_mismatches.append({**where, "block": block, "why": why})
    cached_records = [r for _, kv in pairs for r in kv.records]
    no_hit_turns = [] if exact else [
        turn for turn, recs in by_turn(cached_records).items()
        if turn >= TARGET_MIN_TURN and not any(r.lookup_hits for r in recs)]
    total = len(cached_records)
    digest_checked = sum(r.digest_checked for r in cached_records)
    failures = []
    if digest_mismatches:
        first = digest_mismatches[0]
        requests_hit = {(x["round"], x["conversation"], x["turn"]) for x in digest_mismatches}
        failures.append(
            f"loaded blocks not identical to what was saved under their key "
            f"(digest): {len(digest_mismatches)} of {digest_checked} blocks in "
            f"{len(requests_hit)} of {total} requests; first: round "
            f"{first['round'] + 1}, conversation {first['conversation']}, turn "
            f"{first['turn']}, block {first['block']}: {first['why']}")
    if mismatched:
        failures.append(f"tokens differ in {len(mismatched)} of {total} requests")
    if nan_logits:
        failures.append("first-token logits NaN (a cache slot read before it was "
                        "computed or loaded)")
    if max_diff > atol:
        failures.append(f"first-token logits max |diff| {max_diff:.3g} > atol {atol:g}")
    if short_loads:
        failures.append(
            f"{len(short_loads)} of {total} requests loaded fewer blocks than the "
            f"lookup found ({sum(x['loaded_blocks'] for x in short_loads)} of "
            f"{sum(x['lookup_hits'] for x in short_loads)})")
    if unexpected_hits:
        failures.append(
            f"{len(unexpected_hits)} of {total} requests: lookup hits differ from the "
            f"expected blocks (those earlier turns saved): "
            f"{sum(x['lookup_hits'] for x in unexpected_hits)} found, "
            f"{sum(x['expected_blocks'] for x in unexpected_hits)} expected")
    if no_hit_turns:
        failures.append(f"no lookup hit at turns {no_hit_turns}")
    return {
        "ok": not failures,
        "failures": failures,
        "requests_compared": total,
        "loaded_blocks_digest_checked": digest_checked,
        "loaded_blocks_identical": not digest_mismatches,
        "digest_mismatches": digest_mismatches,
        "tokens_identical": not mismatched,
        "mismatched_requests": mismatched,
        "first_logits_max_abs_diff": max_diff,
        # Bit for bit (atol aside): the two sides batch requests into steps
        # of other shapes, and an optimized BLAS may round by shape.
        "first_logits_bit_identical": max_diff == 0.0 and not nan_logits,
        "first_logits_nan": nan_logits,
        "atol": atol,
        "lookup_hit_blocks": sum(r.lookup_hits for r in cached_records),
        "loaded_blocks": sum(r.loaded_blocks for r in cached_records),
        "expected_blocks": sum(r.expected_blocks for r in cached_records),
        "short_loads": short_loads,
        "expected_hits_exact": exact,
        "unexpected_hits": unexpected_hits,
        "turns_without_hits": no_hit_turns,
    }


def kvdepot_time(
    recompute: Sequence[RequestRecord], cached: Sequence[RequestRecord]
) -> Dict[str, Any]:
    """kvdepot's own time in the same requests of both sides: the lookup
    (with pin), load and unpin of each kvdepot request, as a share of its
    TTFT, against an in-process copy of the bytes it loaded (timed next to
    it, CopyReference), and against the prefill time the load saves (mean
    TTFT recompute minus mean TTFT kvdepot; None when nothing is saved)."""
    a, b = summarize(recompute), summarize(cached)
    saved_ms = a["ttft_mean_ms"] - b["ttft_mean_ms"]
    return {
        "requests": b["requests"],
        "lookup_pin_mean_ms": b["lookup_mean_ms"],
        "store_load_mean_ms": b["store_load_mean_ms"],
        "unpin_mean_ms": b["unpin_mean_ms"],
        "load_mean_ms": b["load_mean_ms"],
        "ttft_mean_ms_kvdepot": b["ttft_mean_ms"],
        "load_share_of_ttft": b["load_share_of_ttft"],
        "bytes_loaded_mean": b["bytes_loaded"] / b["requests"],
        "copy_load_mean_ms": b["copy_load_mean_ms"],
        "load_over_copy": b["load_over_copy"],
        "store_load_over_copy": b["store_load_over_copy"],
        "ttft_mean_ms_recompute": a["ttft_mean_ms"],
        "prefill_saved_mean_ms": saved_ms,
        "load_over_prefill_saved": ratio(b["load_mean_ms"], saved_ms) if saved_ms > 0 else None,
    }


def compare(recompute: RunResult, cached: RunResult) -> Dict[str, Any]:
    """Ratios kvdepot/recompute of one concurrency, per turn and overall,
    kvdepot's own time (:func:`kvdepot_time`, per turn and over the turns
    >= 2; saves separately) and the issue's target."""
    rec_turns, kv_turns = by_turn(recompute.records), by_turn(cached.records)
    per_turn = []
    for turn in rec_turns:
        a, b = summarize(rec_turns[turn]), summarize(kv_turns[turn])
        per_turn.append({
            "turn": turn,
            "prompt_tokens_mean": a["prompt_tokens_mean"],
            "ttft_p50_ratio": ratio(b["ttft_p50_ms"], a["ttft_p50_ms"]),
            "ttft_p90_ratio": ratio(b["ttft_p90_ms"], a["ttft_p90_ms"]),
            "tpot_ratio": ratio(b["tpot_mean_ms"], a["tpot_mean_ms"]),
            "hit_ratio": b["hit_ratio"],
            "kvdepot_time": kvdepot_time(rec_turns[turn], kv_turns[turn]),
        })
    later = [r for r in cached.records if r.turn >= TARGET_MIN_TURN]
    later_rec = [r for r in recompute.records if r.turn >= TARGET_MIN_TURN]
    all_kv = summarize(cached.records, cached.wall_s)
    saving: Dict[str, Any] = {
        "requests": all_kv["requests"],
        "save_mean_ms": all_kv["save_mean_ms"],
        "bytes_stored_mean": all_kv["bytes_stored"] / all_kv["requests"],
        "copy_save_mean_ms": all_kv["copy_save_mean_ms"],
        "save_over_copy": all_kv["save_over_copy"],
        "save_share_of_wall": ratio(sum(r.save_s for r in cached.records), cached.wall_s),
    }
    own_time: Dict[str, Any] = {
        "what": "kvdepot calls timed in the kvdepot runs: lookup+pin, load (get and "
                "scatter), unpin per request, inside its TTFT; save after each "
                "answer, inside the engine loop. Compared with the TTFT, with one "
                "in-process copy of the same bytes (torch copy_, timed next to each "
                "call with the engine clock paused) and with the prefill time the "
                "load saves (mean TTFT recompute - kvdepot)",
        "selection": f"turn >= {TARGET_MIN_TURN}",
        "load": kvdepot_time(later_rec, later) if later else None,
        "save": saving,
    }
    overall_a = summarize(recompute.records, recompute.wall_s)
    overall_b = summarize(cached.records, cached.wall_s)

    def in_target(records: Sequence[RequestRecord]) -> List[RequestRecord]:
        return [r for r in records if is_target(r)]

    target: Dict[str, Any] = {
        "selection": f"turn >= {TARGET_MIN_TURN} and prompt >= {TARGET_MIN_CONTEXT} tokens",
        "requests": len(in_target(cached.records)),
        "tpot_ratio": ratio(overall_b["tpot_mean_ms"], overall_a["tpot_mean_ms"]),
    }
    target["tpot_no_worse"] = (target["tpot_ratio"] or 0.0) <= 1.0
    if target["requests"]:
        ta = summarize(in_target(recompute.records))
        tb = summarize(in_target(cached.records))
        reduction = 1.0 - tb["ttft_p50_ms"] / ta["ttft_p50_ms"]
        target.update({
            "ttft_p50_ms_recompute": ta["ttft_p50_ms"],
            "ttft_p50_ms_kvdepot": tb["ttft_p50_ms"],
            "ttft_p50_reduction": reduction,
            "ttft_reduction_met": reduction >= TARGET_TTFT_REDUCTION,
        })
    return {
        "concurrency": recompute.concurrency,
        "per_turn": per_turn,
        "overall": {
            "ttft_p50_ratio": ratio(overall_b["ttft_p50_ms"], overall_a["ttft_p50_ms"]),
            "ttft_p90_ratio": ratio(overall_b["ttft_p90_ms"], overall_a["ttft_p90_ms"]),
            "tpot_ratio": target["tpot_ratio"],
            "requests_per_s_ratio": ratio(overall_b["requests_per_s"],
                                          overall_a["requests_per_s"]),
        },
        "kvdepot_time": own_time,
        "target": target,
    }


def fmt_bytes(n: float) -> str:
    """Bytes in binary units, e.g. ``16.2 MiB``."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt_ratio(value: Optional[float], spec: str, suffix: str = "") -> str:
    """``value`` formatted by ``spec`` with ``suffix``; ``-`` for None."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


def transport_line(transport: Dict[str, Any]) -> str:
    """The header's line on how the loads travelled (report["transport"])."""
    status = transport["client_data_plane_status"] or "OK"
    line = (f"Transport:   loads over {transport['loads']} (probe after each of "
            f"{transport['kvdepot_runs']} kvdepot runs; client data plane: {status}; "
            f"daemon: {transport['daemon_data_plane'] or '?'})")
    if transport["loads"] != "ucx":
        line += "  <-- NOT the UCX data plane: the gRPC byte path is many times slower"
    return line


def kvdepot_time_lines(own: Dict[str, Any]) -> List[str]:
    """The lines on kvdepot's own time (compare()["kvdepot_time"])."""
    lines = []
    load = own["load"]
    if load is not None:
        lines.append(
            f"kvdepot's own time, {own['selection']} ({load['requests']} requests, "
            f"{fmt_bytes(load['bytes_loaded_mean'])} loaded each): lookup+pin "
            f"{load['lookup_pin_mean_ms']:.2f} + load {load['store_load_mean_ms']:.2f} + "
            f"unpin {load['unpin_mean_ms']:.2f} = {load['load_mean_ms']:.2f} ms per "
            f"request = {fmt_ratio(load['load_share_of_ttft'], '.1%')} of their TTFT "
            f"(mean {load['ttft_mean_ms_kvdepot']:.1f} ms); "
            f"{fmt_ratio(load['load_over_copy'], '.1f', 'x')} an in-process copy of "
            f"the same bytes ({load['copy_load_mean_ms']:.3f} ms); "
            f"{fmt_ratio(load['load_over_prefill_saved'], '.1%')} of the prefill time "
            f"it saves ({load['prefill_saved_mean_ms']:.1f} ms: mean TTFT recompute "
            f"- kvdepot)")
    save = own["save"]
    lines.append(
        f"kvdepot's save, all turns: {save['save_mean_ms']:.2f} ms per request "
        f"({fmt_bytes(save['bytes_stored_mean'])} each), "
        f"{fmt_ratio(save['save_over_copy'], '.1f', 'x')} an in-process copy "
        f"({save['copy_save_mean_ms']:.3f} ms); "
        f"{fmt_ratio(save['save_share_of_wall'], '.1%')} of the kvdepot runs' wall time")
    return lines


def report_header(report: Dict[str, Any]) -> List[str]:
    """The lines above the table, from the JSON report alone (so the text
    and the JSON cannot disagree on date, daemon or sizes)."""
    m, model, kv, w = (report["machine"], report["model"], report["kv_cache"],
                       report["workload"])
    load = report["machine"].get("loadavg_start")
    return [
        "Multi-turn chat, kvdepot prefix reuse vs recompute "
        "(tools/multiturn/multiturn_bench.py)",
        "",
        f"Date (UTC):  {report['date_utc']}",
        f"Command:     {report['command']}",
        f"Machine:     nproc {m['nproc']}"
        + (f", load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
           if load else "")
        + f"; torch {m['torch']}, {m['torch_threads']} intra-op thread(s), "
          f"BLAS_INFO={m['torch_blas']} ({m.get('blas_library', '?')}), {m['device']}",
        *(["WARNING:     torch runs on netlib's reference BLAS: the recompute "
           "side is several times slower than with an optimized BLAS (OpenBLAS: "
           "Debian's libopenblas0-pthread), kvdepot's share is not, so the TTFT "
           "reduction is overstated"] if m.get("reference_blas") else []),
        f"Daemon:      kvdepotd {report.get('daemon_version') or '?'} "
        f"(commit {report.get('daemon_commit') or '?'}), loopback, DRAM tier "
        f"{report.get('daemon_dram_bytes') or '?'} bytes, NVMe tier off",
        transport_line(report["transport"]),
        f"Model:       {model['model_id']} ({model['parameters']:,} parameters), "
        f"{model['dtype']}, {kv['block_size']}-token blocks of "
        f"{fmt_bytes(kv['block_bytes'])}",
        f"Workload:    {w['num_conversations']} conversations x {w['num_turns']} turns, "
        f"first message {w['first_tokens']} tokens, later {w['user_tokens']}, "
        f"answers {w['output_tokens']} (each +-{w['length_jitter']:.0%}), "
        f"concurrency {' and '.join(str(c) for c in w['concurrency'])}, "
        f"{w['rounds']} round(s) per side, order alternating by round (recompute "
        f"first, then kvdepot first: A B B A), requests pooled; "
        + ("warm-up: one discarded full pass of each side"
           if w.get("warmup") else "no warm-up pass"),
        f"Wall time:   {report['wall_s']:.0f} s",
        "",
    ]


def report_table(
    runs: Sequence[Dict[str, Any]], comparisons: Sequence[Dict[str, Any]]
) -> List[str]:
    """The table (per concurrency: each turn, then all requests; recompute
    then kvdepot) and the ratios, target and correctness lines."""
    lines: List[str] = []
    header = (f"{'C':>2} {'turn':>4} {'mode':<9} {'prompt':>6} {'TTFT p50':>10} "
              f"{'TTFT p90':>10} {'TPOT':>8} {'hit':>5} {'blk hit/ld/exp':>15} "
              f"{'loaded':>10} {'stored':>10} {'kv load':>9} {'/TTFT':>6} "
              f"{'/copy':>6} {'req/s':>6}")
    lines.append(header)
    lines.append("-" * len(header))

    def row(c: int, label: str, mode: str, s: Dict[str, Any]) -> None:
        rps = f"{s['requests_per_s']:6.2f}" if "requests_per_s" in s else ""
        blocks = (f"{s['lookup_hit_blocks']}/{s['loaded_blocks']}/{s['expected_blocks']}"
                  if mode == "kvdepot" else "-")
        if mode == "kvdepot":
            own = (f"{s['load_mean_ms']:7.2f}ms {fmt_ratio(s['load_share_of_ttft'], '.1%'):>6} "
                   f"{fmt_ratio(s['load_over_copy'], '.1f', 'x'):>6}")
        else:
            own = f"{'-':>9} {'-':>6} {'-':>6}"
        lines.append(
            f"{c:>2} {label:>4} {mode:<9} {s['prompt_tokens_mean']:6.0f} "
            f"{s['ttft_p50_ms']:8.1f}ms {s['ttft_p90_ms']:8.1f}ms "
            f"{s['tpot_mean_ms']:6.1f}ms {s['hit_ratio']:5.2f} {blocks:>15} "
            f"{fmt_bytes(s['bytes_loaded']):>10} {fmt_bytes(s['bytes_stored']):>10} "
            f"{own} {rps:>6}")

    for comp in comparisons:
        c = comp["concurrency"]
        pair = [r for r in runs if r["concurrency"] == c]
        for i in range(len(pair[0]["per_turn"])):
            for run in pair:
                turn = run["per_turn"][i]
                row(c, str(turn["turn"]), run["mode"], turn)
        for run in pair:
            row(c, "all", run["mode"], run["overall"])
        def ratios(comp: Dict[str, Any]) -> str:
            ttft = ", ".join(f"turn {t['turn']} {t['ttft_p50_ratio']:.3f}"
                             for t in comp["per_turn"])
            return (f"TTFT p50: {ttft}; TPOT {comp['overall']['tpot_ratio']:.3f}; "
                    f"req/s {comp['overall']['requests_per_s_ratio']:.3f}")

        balance = ("order balanced" if comp["order_balanced"]
                   else "order NOT balanced (odd --rounds)")
        lines.append(f"   C={c}: kvdepot/recompute, all rounds ({balance}): "
                     f"{ratios(comp)}")
        for order, sub in comp["by_order"].items():
            lines.append(f"   C={c}:   {order.replace('_', ' ')} "
                         f"({sub['rounds']} round(s)): {ratios(sub)}")
        lines.extend(f"   C={c}: {line}" for line in kvdepot_time_lines(comp["kvdepot_time"]))
        floor = comp["noise_floor"]
        if floor["ttft_p50_ratio_turn1"] is not None:
            lines.append(
                f"   C={c}: noise floor: turn-1 TTFT p50 ratio "
                f"{floor['ttft_p50_ratio_turn1']:.3f} (same work on both sides; "
                f"{floor['deviation']:.1%} from 1): differences of that size "
                f"are not evidence")
        tgt = comp["target"]
        if "ttft_p50_reduction" in tgt:
            lines.append(
                f"   C={c}: target ({tgt['selection']}, {tgt['requests']} requests): "
                f"TTFT p50 {tgt['ttft_p50_ms_recompute']:.0f} -> "
                f"{tgt['ttft_p50_ms_kvdepot']:.0f} ms, "
                f"{tgt['ttft_p50_reduction']:.1%} lower "
                f"({'met' if tgt['ttft_reduction_met'] else 'NOT met'}, want >= "
                f"{TARGET_TTFT_REDUCTION:.0%}); TPOT "
                f"{'no worse' if tgt['tpot_no_worse'] else 'WORSE'}")
            if "by_round" in tgt:
                rounds = " / ".join(f"{r['ttft_p50_reduction']:.1%}" for r in tgt["by_round"])
                lines.append(
                    f"   C={c}: target by round: {rounds} lower "
                    f"({'met in every round' if tgt['met_every_round'] else 'NOT met in every round'})"
                    + (f"; paired (median of {tgt['paired_requests']} per-request "
                       f"ratios): {tgt['paired_median_reduction']:.1%} lower"
                       if "paired_median_reduction" in tgt else ""))
        else:
            lines.append(f"   C={c}: target: no request with {tgt['selection']}")
        ok = comp["correctness"]
        if ok["ok"]:
            exact = ("= expected" if ok["expected_hits_exact"]
                     else "<= expected (DRAM tier too small to expect every block)")
            lines.append(
                f"   C={c}: correctness OK: bytes of all "
                f"{ok['loaded_blocks_digest_checked']} loaded blocks identical to "
                f"what was saved under their key (digest); tokens identical in "
                f"{ok['requests_compared']} requests, first-token logits max |diff| "
                f"{ok['first_logits_max_abs_diff']:.3g} (atol {ok['atol']:g}; "
                f"{'bit-identical' if ok['first_logits_bit_identical'] else 'not bit-identical'}); "
                f"blocks loaded = lookup hits ({ok['loaded_blocks']}) {exact}")
        else:
            lines.append(f"   C={c}: correctness FAILED: " + "; ".join(ok["failures"]))
        lines.append("")
    return lines


def plot_ttft(runs: Sequence[Dict[str, Any]], title: str, path: Path) -> bool:
    """TTFT p50 (solid) and p90 (dashed) by turn, one panel per concurrency.
    Returns False when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({r["concurrency"] for r in runs})
    fig, axes = plt.subplots(1, len(levels), figsize=(5 * len(levels), 4), squeeze=False)
    colors = {"recompute": "tab:red", "kvdepot": "tab:blue"}
    for ax, c in zip(axes[0], levels):
        for run in (r for r in runs if r["concurrency"] == c):
            turns = [t["turn"] for t in run["per_turn"]]
            color = colors[run["mode"]]
            ax.plot(turns, [t["ttft_p50_ms"] for t in run["per_turn"]], "o-",
                    color=color, label=f"{run['mode']} p50")
            ax.plot(turns, [t["ttft_p90_ms"] for t in run["per_turn"]], "o--",
                    color=color, alpha=0.5, label=f"{run['mode']} p90")
        ax.set_title(f"{c} concurrent clients")
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT (ms)")
        ax.set_xticks(turns)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# The order of a round's two runs: round 1 recompute first, round 2
# kvdepot first, and so on (A B B A A B ...), so that what the second run of
# a pair gains from the first (warm caches, allocator, CPU frequency) or
# loses (heat, a neighbour's load) falls on each side equally often.
RECOMPUTE_FIRST = "recompute_first"
KVDEPOT_FIRST = "kvdepot_first"


def round_order(round_index: int) -> str:
    """The order of round ``round_index`` (0-based)."""
    return RECOMPUTE_FIRST if round_index % 2 == 0 else KVDEPOT_FIRST


def run_side(
    model: DecoderModel,
    store: kvdepot.KvCacheStore,
    conversations: Sequence[Sequence[TurnSpec]],
    concurrency: int,
    use_kvdepot: bool,
) -> RunResult:
    """One run of the whole workload, on a fresh cache; with kvdepot, its
    namespace emptied first."""
    from model import PagedKvCache
    from workload import KvdepotConnector, cache_blocks_needed, run_workload

    num_blocks = cache_blocks_needed(conversations, concurrency, BLOCK_SIZE)
    # NaN everywhere: a slot read before it was computed or loaded would
    # poison the logits.
    cache = PagedKvCache(model.config, num_blocks, BLOCK_SIZE, model.embed.weight.dtype,
                         model.embed.weight.device, fill_value=float("nan"))
    connector = None
    if use_kvdepot:
        store.client.evict(store.namespace, all=True)
        connector = KvdepotConnector(store, BLOCK_SIZE)
    return run_workload(model, cache, conversations, concurrency, connector)


def warm_up(
    model: DecoderModel,
    store: kvdepot.KvCacheStore,
    conversations: Sequence[Sequence[TurnSpec]],
    concurrency: int,
) -> float:
    """One full-size pass of each side, discarded (recompute, then
    kvdepot): the first measured run no longer pays for torch's and the
    allocator's first use of each shape, the client's buffers and the
    daemon's first touch of its memory. Returns its wall time."""
    started = time.perf_counter()
    for use_kvdepot in (False, True):
        run = run_side(model, store, conversations, concurrency, use_kvdepot)
        print(f"[C={concurrency} warm-up, discarded] {run.mode}: {len(run.records)} "
              f"requests, {run.steps} steps, {run.wall_s:.1f} s", file=sys.stderr)
    return time.perf_counter() - started


def run_pairs(
    model: DecoderModel,
    store: kvdepot.KvCacheStore,
    conversations: Sequence[Sequence[TurnSpec]],
    concurrency: int,
    rounds: int,
) -> List[Tuple[RunResult, RunResult]]:
    """``rounds`` pairs of runs of the workload at one concurrency, each
    returned as (recompute, kvdepot) whatever order it ran in
    (:func:`round_order`)."""
    pairs = []
    for round_index in range(rounds):
        order = round_order(round_index)
        sides = (False, True) if order == RECOMPUTE_FIRST else (True, False)
        done: Dict[bool, RunResult] = {}
        for use_kvdepot in sides:
            run = run_side(model, store, conversations, concurrency, use_kvdepot)
            print(f"[C={concurrency} round {round_index + 1}/{rounds}, "
                  f"{order.replace('_', ' ')}] {run.mode}: "
                  f"{len(run.records)} requests, {run.steps} steps, {run.wall_s:.1f} s",
                  file=sys.stderr)
            done[use_kvdepot] = run
        pairs.append((done[False], done[True]))
    return pairs


def is_target(r: RequestRecord) -> bool:
    """Whether request ``r`` is one the TTFT target is about."""
    return r.turn >= TARGET_MIN_TURN and r.prompt_tokens >= TARGET_MIN_CONTEXT


def paired_ttft_ratios(pairs: Sequence[Tuple[RunResult, RunResult]]) -> List[float]:
    """kvdepot/recompute TTFT of each target request (the same conversation
    and turn in the same round), over all rounds."""
    out = []
    for rec, kv in pairs:
        base = {(r.conversation, r.turn): r for r in rec.records}
        for r in kv.records:
            ref = base.get((r.conversation, r.turn))
            if ref is not None and ref.ttft_s > 0 and is_target(r):
                out.append(r.ttft_s / ref.ttft_s)
    return out


def compare_balanced(pairs: Sequence[Tuple[RunResult, RunResult]]) -> Dict[str, Any]:
    """The comparison of all rounds pooled (the headline: balanced when the
    rounds are even), the same per order, and the noise floor: the turn-1
    TTFT p50 ratio, where both sides do the same work (every lookup misses)
    and a ratio away from 1 is the machine's noise and what order effects
    are left. (Turn-1 requests may share steps with other clients' later
    turns, which kvdepot makes shorter: a run with ``--turns 1`` gives the
    pure control.)"""
    pooled = compare(merge_rounds([p[0] for p in pairs]),
                     merge_rounds([p[1] for p in pairs]))
    orders = [round_order(i) for i in range(len(pairs))]
    by_order: Dict[str, Any] = {}
    for order in (RECOMPUTE_FIRST, KVDEPOT_FIRST):
        chosen = [p for p, o in zip(pairs, orders) if o == order]
        if not chosen:
            continue
        c = compare(merge_rounds([p[0] for p in chosen]),
                    merge_rounds([p[1] for p in chosen]))
        by_order[order] = {"rounds": len(chosen), "per_turn": c["per_turn"],
                           "overall": c["overall"], "target": c["target"]}

    def turn1(comp: Dict[str, Any]) -> Optional[float]:
        return next((t["ttft_p50_ratio"] for t in comp["per_turn"] if t["turn"] == 1), None)

    floor = turn1(pooled)
    # The target per round, and over paired requests: the pooled p50 may
    # take one side's median from a slower round than the other's (the
    # machine's speed drifts between rounds), so the headline is judged on
    # every round as well.
    by_round = []
    for i, (rec, kv) in enumerate(pairs):
        t = compare(rec, kv)["target"]
        if "ttft_p50_reduction" in t:
            by_round.append({"round": i + 1, "order": orders[i],
                             "ttft_p50_reduction": t["ttft_p50_reduction"],
                             "ttft_reduction_met": t["ttft_reduction_met"]})
    target = pooled["target"]
    if by_round:
        target["by_round"] = by_round
        target["worst_round_reduction"] = min(r["ttft_p50_reduction"] for r in by_round)
        target["met_every_round"] = all(r["ttft_reduction_met"] for r in by_round)
    paired = paired_ttft_ratios(pairs)
    if paired:
        target["paired_requests"] = len(paired)
        target["paired_median_reduction"] = 1.0 - percentile(paired, 50)
    return {
        **pooled,
        "order": orders,
        "order_balanced": orders.count(RECOMPUTE_FIRST) == orders.count(KVDEPOT_FIRST),
        "by_order": by_order,
        "noise_floor": {
            "what": "turn-1 TTFT p50 ratio kvdepot/recompute (same work on both "
                    "sides: every lookup misses)",
            "ttft_p50_ratio_turn1": floor,
            "deviation": None if floor is None else abs(1.0 - floor),
            "by_order": {o: turn1(c) for o, c in by_order.items()},
        },
    }


def machine_info(device: str) -> Dict[str, Any]:
    """What the timings depend on: CPUs, Python, torch and its BLAS."""
    import torch

    blas = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    # The library behind it: Debian's torch calls whichever libblas.so.3
    # the alternatives system points at (netlib's reference BLAS, or
    # OpenBLAS once installed), which BLAS_INFO does not tell.
    torch.ones(8, 8) @ torch.ones(8, 8)
    blas_library = "unknown"
    try:
        with open("/proc/self/maps") as maps:
            libs = {line.split()[-1] for line in maps
                    if re.search(r"/lib(open)?blas[^/]*\.so", line)}
        if libs:
            blas_library = ", ".join(sorted(os.path.realpath(p) for p in libs))
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_blas": blas.group(1) if blas else "unknown",
        "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "blas_library": blas_library,
        "reference_blas": "/blas/" in blas_library or "netlib" in blas_library,
        "device": device,
        "loadavg_start": list(os.getloadavg()),
    }


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    missing = [m for m in ("numpy", "torch") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"multiturn: {' and '.join(missing)} not installed; skipping",
              file=sys.stderr)
        return SKIPPED
    sys.path.insert(0, str(args.build / "python"))
    if importlib.util.find_spec("kvdepot") is None:
        print(f"multiturn: no kvdepot package in {args.build / 'python'}; skipping",
              file=sys.stderr)
        return SKIPPED
    if not args.kvdepotd.exists():
        print(f"multiturn: no kvdepotd at {args.kvdepotd}; skipping", file=sys.stderr)
        return SKIPPED
    # An optimized BLAS (OpenBLAS) starts a thread per core on its own,
    # whatever torch's intra-op threads: the engine gets as many threads as
    # --threads (1 unless given), leaving the other core to kvdepotd.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads or 1))
    import torch

    import kvdepot
    from model import DecoderModel, ModelConfig
    from workload import WorkloadConfig, longest_context, make_workload

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    device = torch.device("cpu")  # the kvdepot package works on host memory
    workload_config = WorkloadConfig(
        num_conversations=args.conversations, num_turns=args.turns,
        first_tokens=args.first_tokens, user_tokens=args.user_tokens,
        output_tokens=args.output_tokens, length_jitter=args.length_jitter,
        seed=args.workload_seed)
    conversations = make_workload(workload_config, args.vocab)
    model_config = ModelConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
        num_heads=args.heads, num_kv_heads=args.kv_heads, head_size=args.head_size,
        intermediate_size=args.intermediate, seed=args.model_seed,
        max_model_len=max(8192, longest_context(conversations)))
    model = DecoderModel.create(model_config, dtype, device)
    layout = kvdepot.KvLayout.mha(
        kvdepot.KvCacheLayout.FLASH_ATTN_NHD, num_layers=model_config.num_layers,
        block_size=BLOCK_SIZE, num_kv_heads=model_config.num_kv_heads,
        head_size=model_config.head_size, dtype=kvdepot.dtype_from_torch(dtype))
    # The namespace names the weights and sizes (model_id) and, through the
    # layout's fingerprint, the cache format.
    model_name = f"multiturn/{model_config.model_id()}/tp0of1"

    started = datetime.datetime.now(datetime.timezone.utc)
    started_s = time.perf_counter()
    machine = machine_info(str(device))  # load average before the runs
    runs: List[RunResult] = []
    comparisons: List[Dict[str, Any]] = []
    with Daemon(args.kvdepotd, args.dram_capacity) as daemon, torch.inference_mode():
        # The block-count check is exact only while nothing is evicted, which
        # it decides from the DRAM tier's size: without it, fail rather than
        # weaken the check.
        dram = re.search(r"DRAM tier (\d+) bytes", daemon.banner)
        if not dram:
            print(f"multiturn: FAILED: kvdepotd's start line has no 'DRAM tier N "
                  f"bytes' to read the DRAM tier's size from (needed to expect "
                  f"exact lookup hits): {daemon.banner!r}", file=sys.stderr)
            return 1
        dram_bytes = int(dram.group(1))
        store = kvdepot.KvCacheStore(daemon.address, layout, model_name)
        store.client.health()
        warmup_s = 0.0
        if not args.no_warmup:
            warmup_s = warm_up(model, store, conversations, args.concurrency[0])
        for concurrency in args.concurrency:
            pairs = run_pairs(model, store, conversations, concurrency, args.rounds)
            recompute = merge_rounds([p[0] for p in pairs])
            cached = merge_rounds([p[1] for p in pairs])
            runs.extend([recompute, cached])
            comparisons.append({**compare_balanced(pairs),
                                "correctness": check_correctness(pairs, args.atol,
                                                                 dram_bytes)})
        store.client.close()

    wall_s = time.perf_counter() - started_s
    described = [describe_run(r) for r in runs]
    ok = all(c["correctness"]["ok"] for c in comparisons)
    version = re.search(r"kvdepotd (\S+) \((\w+)\)", daemon.banner)
    data_plane = re.search(r"UCX data plane [^;]*", daemon.banner)
    probes = [t for r in runs for t in r.transport]
    seen = sorted({t["transport"] for t in probes})
    transport = {
        "what": "after each measured kvdepot run, one get of a stored block into "
                "Client.allocate_buffer memory, where KvCacheStore stages its loads: "
                "TransferOp.transport() (ucx or grpc); the client's "
                "data_plane_status() (empty: OK); the daemon's start line",
        "loads": seen[0] if len(seen) == 1 else "mixed: " + ", ".join(seen),
        "kvdepot_runs": len(probes),
        "client_data_plane_status": "; ".join(
            sorted({t["data_plane_status"] for t in probes if t["data_plane_status"]})),
        "daemon_data_plane": data_plane.group(0) if data_plane else None,
    }
    report = {
        "tool": "multiturn",
        "date_utc": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join([Path(sys.argv[0]).name, *argv]),
        "wall_s": wall_s,
        "ok": ok,
        "machine": machine,
        "daemon": daemon.banner,
        "daemon_version": version.group(1) if version else None,
        "daemon_commit": version.group(2) if version else None,
        "daemon_dram_bytes": dram_bytes,
        "transport": transport,
        "model": {**asdict(model_config), "model_id": model_config.model_id(),
                  "dtype": args.dtype,
                  "parameters": sum(p.numel() for p in model.parameters())},
        "kv_cache": {"layout": "FLASH_ATTN_NHD [2, num_blocks, 16, kv_heads, head_size]",
                     "block_size": BLOCK_SIZE, "block_bytes": layout.object_bytes,
                     "namespace": store.namespace},
        "workload": {**asdict(workload_config), "concurrency": args.concurrency,
                     "rounds": args.rounds,
                     "order": "round 1 recompute first, round 2 kvdepot first, ... "
                              "(A B B A); rounds pooled",
                     "warmup": None if args.no_warmup else {
                         "what": "one full pass of each side (recompute, then kvdepot) "
                                 "at the first concurrency, discarded",
                         "concurrency": args.concurrency[0], "wall_s": warmup_s},
                     "clients": "closed loop, no think time; one engine loop"},
        "runs": described,
        "comparisons": comparisons,
    }
    text = "\n".join(report_header(report) + report_table(described, comparisons))
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    args.txt.parent.mkdir(parents=True, exist_ok=True)
    args.txt.write_text(text + "\n")
    print(f"JSON: {args.out}\ntext: {args.txt}")
    if not args.no_plot:
        title = (f"{model_config.model_id()} {args.dtype}, {args.conversations} "
                 f"conversations x {args.turns} turns, {args.rounds} round(s), "
                 f"{os.cpu_count()} CPUs")
        if plot_ttft(described, title, args.plot):
            print(f"plot: {args.plot}")
        else:
            print("plot: skipped (matplotlib is not installed)")
    if not ok:
        for comp in comparisons:
            for failure in comp["correctness"]["failures"]:
                print(f"multiturn: FAILED: C={comp['concurrency']}: {failure}",
                      file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
