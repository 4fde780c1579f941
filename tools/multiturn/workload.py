"""The multi-turn chat workload and a one-loop engine that serves it.

Workload: N conversations of M turns. A turn's prompt is the conversation so
far (every earlier user message and answer) plus a new user message of
random token ids; the answer is ``max_tokens`` greedy tokens (no end of
sequence: the weights are random). All
lengths and ids come from one seeded generator, so both runs of a comparison
serve the same requests.

Clients: C closed-loop clients with no think time. Client ``c`` owns the
conversations ``c, c + C, c + 2C, ...`` and sends their turns turn-major
(turn 1 of each, then turn 2 of each, ...), the next request as soon as the
previous answer is complete, so up to C requests are in flight. Client ``c``
sends its first request at engine step ``c`` (a ramp-up: the run does not
open with C long prefills in one batch).

Engine: one scheduler loop, as in vLLM V1 without chunked prefill. Each step
admits every waiting request, builds one flattened batch of the running
requests' decode tokens and the admitted requests' prefills, runs the model
once and samples greedily. The schedule depends only on step counts, never
on time, so both runs of a comparison batch the same requests together. The
engine's paged cache holds only the requests in flight: a finished request's
blocks are freed at once, as if a busy engine had evicted them before the
conversation's next turn. Reuse across turns can therefore only come from
kvdepot:

* with a :class:`KvdepotConnector`, admission looks up the prompt's full
  blocks (prefix match, pinned), loads the hits into the request's cache
  blocks (``KvCacheStore.load``: get, then scatter), unpins, and prefills
  only the rest; the partial last block is always recomputed, and so is the
  last full block when the prompt ends on a block boundary (the last prompt
  token must run to give the first output's logits). A finished request
  saves its new full blocks (``KvCacheStore.save``, with parents). Each
  request records the lookup's hits, the blocks actually loaded and the
  blocks it should have found (what the conversation's earlier turns
  saved), for the benchmark to check. The connector keeps a digest of every
  block it saves (the block's bytes in the cache: every layer, K and V) per
  key, and after the step that used a load the engine digests each loaded
  block in the slot it was scattered into and compares it with the digest
  saved under the key meant for that slot; the request records the blocks
  that differ.
* without one, every prompt is prefilled from the first token (recompute).

Timing: a request's TTFT runs from when its client sent it (the moment the
previous answer was complete, or the step the client joined at) to the end of
the step that
produced its first token; its TPOT is the mean time per output token after
that. Lookup, load and save run inside the loop, so their time counts against
the requests waiting on that step, as it would in an engine that does them
synchronously. The benchmark's own checks (the digests) and the reference
copies (:class:`CopyReference`) run with the engine's clock paused
(:class:`EngineClock`), so they count in no timing.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Deque, Dict, Iterator, List, Optional, Sequence,
                    Tuple)

import numpy as np
import torch

from kvdepot.integrations import block_hashes, parents_of
from model import DecoderModel, PagedKvCache, SequenceChunk

if TYPE_CHECKING:
    import kvdepot


@dataclass(frozen=True)
class WorkloadConfig:
    """Shape of the workload. Lengths are means; each is drawn uniformly
    within ``± length_jitter`` of it."""

    num_conversations: int
    num_turns: int
    first_tokens: int  # first user message: system prompt + document
    user_tokens: int  # each later user message
    output_tokens: int  # answer length (max_tokens)
    length_jitter: float = 0.2
    seed: int = 0


@dataclass(frozen=True)
class TurnSpec:
    """One request of the workload: the user message it appends and the
    answer length it asks for."""

    conversation: int
    turn: int  # 1-based
    user_tokens: Tuple[int, ...]
    max_tokens: int


def make_workload(config: WorkloadConfig, vocab_size: int) -> List[List[TurnSpec]]:
    """The turns of every conversation, ``[conversation][turn - 1]``."""
    rng = np.random.default_rng(config.seed)

    def length(mean: int, minimum: int) -> int:
        scale = rng.uniform(1.0 - config.length_jitter, 1.0 + config.length_jitter)
        return max(minimum, round(mean * scale))

    conversations = []
    for conv in range(config.num_conversations):
        turns = []
        for turn in range(1, config.num_turns + 1):
            n = length(config.first_tokens if turn == 1 else config.user_tokens, 1)
            tokens = tuple(int(t) for t in rng.integers(0, vocab_size, n))
            # At least 2 output tokens, so that every request has a TPOT.
            turns.append(TurnSpec(conv, turn, tokens, length(config.output_tokens, 2)))
        conversations.append(turns)
    return conversations


class EngineClock:
    """The engine's clock: ``time.perf_counter()`` less the time spent inside
    :meth:`paused`, so that work the benchmark adds to check or calibrate
    (digests, reference copies) shifts no TTFT, TPOT or wall time."""

    def __init__(self) -> None:
        self._excluded = 0.0

    def now(self) -> float:
        """Seconds, comparable only with other readings of this clock."""
        return time.perf_counter() - self._excluded

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The time spent in the ``with`` body counts in no later reading."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._excluded += time.perf_counter() - start


class CopyReference:
    """Times a plain in-process copy of a number of bytes (``torch``
    ``copy_`` between two host buffers of this process, already touched):
    the floor for moving a request's blocks, with no store, no transport
    and no scatter. Not thread-safe."""

    def __init__(self) -> None:
        self._src = torch.empty(0, dtype=torch.uint8)
        self._dst = torch.empty(0, dtype=torch.uint8)

    def time_copy(self, nbytes: int) -> float:
        """Seconds one copy of ``nbytes`` bytes took (0 for 0 bytes)."""
        if nbytes <= 0:
            return 0.0
        if self._src.numel() < nbytes:
            # Grown (and every page touched) before the copy is timed.
            self._src = torch.full((nbytes,), 1, dtype=torch.uint8)
            self._dst = torch.zeros(nbytes, dtype=torch.uint8)
        start = time.perf_counter()
        self._dst[:nbytes].copy_(self._src[:nbytes])
        return time.perf_counter() - start


def block_digest(cache: PagedKvCache, block_id: int) -> bytes:
    """BLAKE2b-128 of one cache block's bytes as the cache holds them: every
    layer, K then V (``tensors[layer][0 or 1, block_id]``, each contiguous).
    Equal digests mean equal bits, whatever the dtype (NaN included)."""
    h = hashlib.blake2b(digest_size=16)
    for tensor in cache.tensors:
        raw = tensor.view(torch.uint8)  # the same memory, bytes in the last dim
        for kv in (0, 1):
            h.update(raw[kv, block_id].numpy())
    return h.digest()


@dataclass
class PrefixLoad:
    """What :meth:`KvdepotConnector.load_prefix` did. Times are seconds."""

    lookup_hits: int = 0  # blocks the prefix lookup found
    loaded: int = 0  # leading blocks the load reported loaded
    keys: List[bytes] = field(default_factory=list)  # the keys of those blocks
    lookup_s: float = 0.0  # lookup with prefix match and pin
    store_load_s: float = 0.0  # KvCacheStore.load (get, then scatter)
    unpin_s: float = 0.0


class KvdepotConnector:
    """Moves a request's full KV blocks between the engine's paged cache and
    kvdepotd. Not thread-safe (nor is the :class:`kvdepot.KvCacheStore` it
    drives).

    Keys are chained block hashes (:mod:`kvdepot.integrations`) of the token ids,
    without extra keys (no LoRA, multimodal input or cache salt here), in the
    store's namespace, which names the model and the cache layout.

    ``saved_digests`` maps each key this connector saved to the
    :func:`block_digest` of the bytes stored under it (filled by
    :meth:`record_digests`), for :meth:`check_digests` to compare loads with.
    One connector serves one run, whose namespace starts empty.
    """

    def __init__(self, store: "kvdepot.KvCacheStore", block_size: int) -> None:
        self.store = store
        self.block_size = block_size
        self.block_bytes: int = store.layout.object_bytes
        self.saved_digests: Dict[bytes, bytes] = {}

    def load_prefix(
        self, cache: PagedKvCache, prompt: Sequence[int], block_ids: Sequence[int]
    ) -> PrefixLoad:
        """Loads the longest stored prefix of ``prompt``'s blocks into
        ``block_ids`` (lookup with prefix match and pin, load, unpin).

        Never loads the block holding the prompt's last token, which must be
        computed. Returns the blocks the lookup found, the leading blocks the
        load reported loaded (and their keys: ``keys[i]`` went into
        ``block_ids[i]``) and the time of each call.
        """
        result = PrefixLoad()
        max_blocks = (len(prompt) - 1) // self.block_size
        keys = block_hashes(prompt[: max_blocks * self.block_size], self.block_size)
        if not keys:
            return result
        client = self.store.client
        start = time.perf_counter()
        reply = client.lookup(self.store.namespace, keys, prefix=True, pin=True)
        result.lookup_s = time.perf_counter() - start
        filled: List[bool] = []
        try:
            result.lookup_hits = reply.prefix_hits
            if result.lookup_hits:
                start = time.perf_counter()
                filled = self.store.load(cache.tensors, block_ids[: result.lookup_hits],
                                         keys[: result.lookup_hits])
                result.store_load_s = time.perf_counter() - start
        finally:
            if reply.pin_id:
                start = time.perf_counter()
                client.unpin(reply.pin_id)
                result.unpin_s = time.perf_counter() - start
        # Pinned blocks are not evicted, so a miss here is a failure, which
        # the benchmark reports (loaded < lookup_hits) and fails on. The
        # engine still serves the request correctly: the prefix ends before
        # the first miss and the rest is recomputed.
        result.loaded = filled.index(False) if False in filled else len(filled)
        result.keys = keys[: result.loaded]
        return result

    def save(
        self,
        cache: PagedKvCache,
        tokens: Sequence[int],
        block_ids: Sequence[int],
        skip_blocks: int,
    ) -> Tuple[List[bytes], List[int], List[bool]]:
        """Saves the full blocks of ``tokens`` (whose K/V are in
        ``block_ids``) after the first ``skip_blocks``, which are stored
        already. Returns the keys sent, the cache blocks they were saved from
        and the store's flags (True: stored now; False: stored before)."""
        keys = block_hashes(tokens, self.block_size)
        if len(keys) <= skip_blocks:
            return [], [], []
        ids = list(block_ids[skip_blocks : len(keys)])
        stored = self.store.save(cache.tensors, ids, keys[skip_blocks:],
                                 parents_of(keys)[skip_blocks:])
        return keys[skip_blocks:], ids, list(stored)

    def record_digests(
        self,
        cache: PagedKvCache,
        keys: Sequence[bytes],
        block_ids: Sequence[int],
        stored: Sequence[bool],
    ) -> None:
        """Keeps the digest of block ``block_ids[i]``, just saved, under
        ``keys[i]``. A key that was stored before (``stored[i]`` False)
        keeps the digest of its first save: put-if-absent kept those bytes."""
        for key, block_id, now in zip(keys, block_ids, stored):
            if now or key not in self.saved_digests:
                self.saved_digests[key] = block_digest(cache, block_id)

    def check_digests(
        self, cache: PagedKvCache, keys: Sequence[bytes], block_ids: Sequence[int]
    ) -> List[Tuple[int, str]]:
        """Compares each loaded block ``block_ids[i]`` with the digest saved
        under ``keys[i]``, the key meant for that slot. Returns ``(i,
        why)`` for each block that differs or whose key this run never
        saved."""
        bad = []
        for i, (key, block_id) in enumerate(zip(keys, block_ids)):
            want = self.saved_digests.get(key)
            if want is None:
                bad.append((i, "key never saved in this run"))
            elif block_digest(cache, block_id) != want:
                bad.append((i, "bytes differ from those saved under its key"))
        return bad


@dataclass
class RequestRecord:
    """What one request did and how long it took. Times are seconds."""

    conversation: int
    turn: int
    prompt_tokens: int
    hit_tokens: int  # prompt tokens loaded from kvdepot
    lookup_hits: int  # blocks the prefix lookup found (kvdepot runs)
    loaded_blocks: int  # leading blocks the load reported loaded
    expected_blocks: int  # blocks this conversation's earlier turns saved
    output: List[int]
    first_logits: torch.Tensor  # float32 [vocab], on the CPU
    ttft_s: float
    tpot_s: float  # mean time per output token after the first
    bytes_loaded: int
    bytes_stored: int
    load_s: float  # lookup + load + unpin, inside the TTFT
    save_s: float  # after the answer, inside the engine loop
    lookup_s: float = 0.0  # lookup with prefix match and pin (part of load_s)
    store_load_s: float = 0.0  # KvCacheStore.load: get and scatter (part of load_s)
    unpin_s: float = 0.0  # (part of load_s)
    copy_load_s: float = 0.0  # an in-process copy of bytes_loaded (CopyReference)
    copy_save_s: float = 0.0  # an in-process copy of bytes_stored
    digest_checked: int = 0  # loaded blocks compared with their saved digest
    # (block index in the prompt, why) of each loaded block that did not match.
    digest_mismatches: List[Tuple[int, str]] = field(default_factory=list)


@dataclass
class RunResult:
    """One run of the whole workload."""

    mode: str  # "recompute" or "kvdepot"
    concurrency: int
    wall_s: float
    steps: int
    records: List[RequestRecord]
    # kvdepot runs: how a get into the memory the loads stage in travelled
    # after the run (transport_probe); merged runs keep one entry per run.
    transport: List[Dict[str, str]] = field(default_factory=list)


@dataclass
class _Request:
    """A request in flight (engine state)."""

    spec: TurnSpec
    prompt: List[int]
    arrival: float
    block_ids: List[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    expected_blocks: int = 0
    load_s: float = 0.0
    load: PrefixLoad = field(default_factory=PrefixLoad)
    copy_load_s: float = 0.0
    digest_mismatches: List[Tuple[int, str]] = field(default_factory=list)
    output: List[int] = field(default_factory=list)
    first_token_time: float = 0.0
    first_logits: torch.Tensor = field(default_factory=lambda: torch.empty(0))


def _warm_up(model: DecoderModel, cache: PagedKvCache) -> None:
    """One untimed prefill and decode, so that the first timed step pays no
    one-time allocation costs."""
    blocks = cache.allocate(4)
    prompt = list(range(48))
    model([SequenceChunk(prompt, 0, blocks)], cache)
    model([SequenceChunk([1], len(prompt), blocks)], cache)
    cache.free(blocks)


class _Engine:
    """One run's state: the clients' queues, the requests in flight, the
    conversations' histories and the finished requests' records."""

    def __init__(
        self,
        model: DecoderModel,
        cache: PagedKvCache,
        conversations: Sequence[Sequence[TurnSpec]],
        concurrency: int,
        connector: Optional[KvdepotConnector],
    ) -> None:
        self.model = model
        self.cache = cache
        self.connector = connector
        self.clock = EngineClock()
        self.copy_reference = CopyReference()
        self.queues: List[Deque[TurnSpec]] = [deque() for _ in range(concurrency)]
        for turn in range(max(len(c) for c in conversations)):
            for conv, turns in enumerate(conversations):
                if turn < len(turns):
                    self.queues[conv % concurrency].append(turns[turn])
        self.history: Dict[int, List[int]] = {c: [] for c in range(len(conversations))}
        self.busy = [False] * concurrency
        # When each client got its last answer, and so sent its next request;
        # None before its first request.
        self.sent_at: List[Optional[float]] = [None] * concurrency
        self.running: List[Tuple[int, _Request]] = []  # (client, request)
        self.records: List[RequestRecord] = []
        self.steps = 0

    def run(self) -> None:
        """Steps until every turn of every conversation is answered."""
        while self.running or any(self.queues):
            self._step()

    def _step(self) -> None:
        """Admits, runs one batch (decodes of the running requests, then the
        new prefills), samples, checks what this step's admissions loaded,
        and finishes the requests that are done."""
        admitted = self._admit()
        bs = self.cache.block_size
        chunks = []
        for _, req in self.running:
            if req.num_computed == len(req.block_ids) * bs:
                req.block_ids += self.cache.allocate(1)
            chunks.append(SequenceChunk([req.output[-1]], req.num_computed, req.block_ids))
        for _, req in admitted:
            new_tokens = req.prompt[req.num_computed :]
            chunks.append(SequenceChunk(new_tokens, req.num_computed, req.block_ids))
        batch = self.running + admitted
        logits = self.model(chunks, self.cache)
        now = self.clock.now()
        self.steps += 1
        self._check_loads(admitted)

        self.running = []
        next_tokens = logits.argmax(dim=-1).tolist()
        for (client, req), chunk, row, token in zip(batch, chunks, logits, next_tokens):
            req.num_computed += len(chunk.token_ids)
            if not req.output:
                req.first_token_time = now
                req.first_logits = row.cpu()
            req.output.append(token)
            if len(req.output) < req.spec.max_tokens:
                self.running.append((client, req))
            else:
                self._finish(client, req, now)

    def _check_loads(self, admitted: Sequence[Tuple[int, _Request]]) -> None:
        """Untimed (the clock paused): digests each block this step's
        admissions loaded, in the slot it was scattered into (the step wrote
        only later positions), against the digest saved under its key, and
        times the reference copy of the bytes loaded."""
        if self.connector is None:
            return
        with self.clock.paused():
            for _, req in admitted:
                loaded = req.load.loaded
                if not loaded:
                    continue
                req.digest_mismatches = self.connector.check_digests(
                    self.cache, req.load.keys, req.block_ids[:loaded])
                req.copy_load_s = self.copy_reference.time_copy(
                    loaded * self.connector.block_bytes)

    def _admit(self) -> List[Tuple[int, _Request]]:
        """Every idle client's next turn (client c joins at step c), its
        blocks allocated and, with a connector, its stored prefix loaded."""
        bs = self.cache.block_size
        admitted = []
        for client, queue in enumerate(self.queues):
            if self.busy[client] or not queue or client > self.steps:
                continue
            spec = queue.popleft()
            arrival = self.sent_at[client]
            if arrival is None:
                arrival = self.clock.now()
            history = self.history[spec.conversation]
            req = _Request(spec, history + list(spec.user_tokens), arrival)
            req.block_ids = self.cache.allocate(-(-len(req.prompt) // bs))
            if self.connector is not None:
                # The previous turn saved the full blocks of its prompt and
                # answer but the last answer token (see _finish), the turns
                # before it the shorter prefixes of the same chain; the
                # lookup stops before the prompt's last token.
                if history:
                    req.expected_blocks = min((len(history) - 1) // bs,
                                              (len(req.prompt) - 1) // bs)
                load_start = self.clock.now()
                req.load = self.connector.load_prefix(self.cache, req.prompt, req.block_ids)
                req.num_computed = req.load.loaded * bs
                req.load_s = self.clock.now() - load_start
            self.busy[client] = True
            admitted.append((client, req))
        return admitted

    def _finish(self, client: int, req: _Request, now: float) -> None:
        """The answer is complete at ``now``, when the client sends its next
        turn; saving the new blocks is engine work that delays the next step
        (and so that turn's TTFT). The digests of the saved blocks and the
        reference copy are taken with the clock paused."""
        tokens = req.prompt + req.output
        self.history[req.spec.conversation] = tokens
        stored = 0
        copy_save_s = 0.0
        keys: List[bytes] = []
        saved_ids: List[int] = []
        flags: List[bool] = []
        save_start = self.clock.now()
        if self.connector is not None:
            # The last sampled token has no K/V yet: num_computed excludes it.
            keys, saved_ids, flags = self.connector.save(
                self.cache, tokens[: req.num_computed], req.block_ids, req.load.loaded
            )
            stored = len(keys)
        save_s = self.clock.now() - save_start
        if self.connector is not None:
            with self.clock.paused():
                self.connector.record_digests(self.cache, keys, saved_ids, flags)
                copy_save_s = self.copy_reference.time_copy(
                    stored * self.connector.block_bytes)
        self.cache.free(req.block_ids)
        self.busy[client] = False
        self.sent_at[client] = now
        block_bytes = self.connector.block_bytes if self.connector is not None else 0
        self.records.append(
            RequestRecord(
                conversation=req.spec.conversation,
                turn=req.spec.turn,
                prompt_tokens=len(req.prompt),
                hit_tokens=req.load.loaded * self.cache.block_size,
                lookup_hits=req.load.lookup_hits,
                loaded_blocks=req.load.loaded,
                expected_blocks=req.expected_blocks,
                output=req.output,
                first_logits=req.first_logits,
                ttft_s=req.first_token_time - req.arrival,
                tpot_s=(now - req.first_token_time) / (len(req.output) - 1),
                bytes_loaded=req.load.loaded * block_bytes,
                bytes_stored=stored * block_bytes,
                load_s=req.load_s,
                save_s=save_s,
                lookup_s=req.load.lookup_s,
                store_load_s=req.load.store_load_s,
                unpin_s=req.load.unpin_s,
                copy_load_s=req.copy_load_s,
                copy_save_s=copy_save_s,
                digest_checked=req.load.loaded,
                digest_mismatches=req.digest_mismatches,
            )
        )


def transport_probe(store: "kvdepot.KvCacheStore", key: Optional[bytes]) -> Dict[str, str]:
    """How the loads' blocks travel, asked after a run (untimed): one get of
    the stored block ``key`` into memory from ``Client.allocate_buffer``,
    the memory :class:`kvdepot.KvCacheStore` stages its loads in (the store
    falls back to plain host memory, and so to gRPC, only when that
    allocation fails; so does this probe). ``transport`` is the get's
    ``TransferOp.transport()`` (``ucx`` or ``grpc``), or ``grpc`` with the
    allocation's error; ``data_plane_status`` the client's (empty: the UCX
    data plane is up). ``key`` None (nothing stored): ``unknown``."""
    client = store.client
    out = {"transport": "unknown (no block stored)", "data_plane_status": ""}
    if key is not None:
        try:
            buffer = client.allocate_buffer(store.layout.object_bytes)
        except RuntimeError as e:
            out["transport"] = "grpc"
            out["allocate_buffer_error"] = str(e)
        else:
            op = client.get_into_async(store.namespace, [key], [buffer])
            op.wait()
            out["transport"] = op.transport() if all(op.ok()) else (
                f"{op.transport()} (probe get failed: {op.errors()[0]})")
    out["data_plane_status"] = client.data_plane_status()
    return out


def run_workload(
    model: DecoderModel,
    cache: PagedKvCache,
    conversations: Sequence[Sequence[TurnSpec]],
    concurrency: int,
    connector: Optional[KvdepotConnector],
) -> RunResult:
    """Serves every turn of ``conversations`` with ``concurrency`` clients;
    with ``connector``, reuses prefixes through kvdepot, else recomputes.
    A kvdepot run ends with a :func:`transport_probe` (untimed).

    ``cache`` must be free and large enough for ``concurrency`` requests of
    the longest context (:func:`cache_blocks_needed`). Call under
    ``torch.inference_mode()``.
    """
    engine = _Engine(model, cache, conversations, concurrency, connector)
    _warm_up(model, cache)
    start = engine.clock.now()
    engine.run()
    wall_s = engine.clock.now() - start
    transport = []
    if connector is not None:
        transport.append(transport_probe(
            connector.store, next(iter(connector.saved_digests), None)))
    return RunResult(
        mode="kvdepot" if connector is not None else "recompute",
        concurrency=concurrency,
        wall_s=wall_s,
        steps=engine.steps,
        records=engine.records,
        transport=transport,
    )


def longest_context(conversations: Sequence[Sequence[TurnSpec]]) -> int:
    """Tokens of the workload's longest context: the last turn of the longest
    conversation, answer included."""
    return max(
        sum(len(t.user_tokens) + t.max_tokens for t in turns) for turns in conversations
    )


def cache_blocks_needed(
    conversations: Sequence[Sequence[TurnSpec]], concurrency: int, block_size: int
) -> int:
    """Blocks for ``concurrency`` requests of the workload's longest context,
    plus the warm-up's 4."""
    return concurrency * -(-longest_context(conversations) // block_size) + 4
