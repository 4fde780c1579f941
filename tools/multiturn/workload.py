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
  saved), for the benchmark to check.
* without one, every prompt is prefilled from the first token (recompute).

Timing: a request's TTFT runs from when its client sent it (the moment the
previous answer was complete, or the step the client joined at) to the end of
the step that
produced its first token; its TPOT is the mean time per output token after
that. Lookup, load and save run inside the loop, so their time counts against
the requests waiting on that step, as it would in an engine that does them
synchronously.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Deque, Dict, List, Optional, Sequence, Tuple

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


class KvdepotConnector:
    """Moves a request's full KV blocks between the engine's paged cache and
    kvdepotd. Not thread-safe (nor is the :class:`kvdepot.KvCacheStore` it
    drives).

    Keys are chained block hashes (:mod:`kvdepot.integrations`) of the token ids,
    without extra keys (no LoRA, multimodal input or cache salt here), in the
    store's namespace, which names the model and the cache layout.
    """

    def __init__(self, store: "kvdepot.KvCacheStore", block_size: int) -> None:
        self.store = store
        self.block_size = block_size
        self.block_bytes: int = store.layout.object_bytes

    def load_prefix(
        self, cache: PagedKvCache, prompt: Sequence[int], block_ids: Sequence[int]
    ) -> Tuple[int, int]:
        """Loads the longest stored prefix of ``prompt``'s blocks into
        ``block_ids`` (lookup with prefix match and pin, load, unpin).

        Never loads the block holding the prompt's last token, which must be
        computed. Returns ``(lookup_hits, loaded)``: the blocks the lookup
        found and the leading blocks the load reported loaded.
        """
        max_blocks = (len(prompt) - 1) // self.block_size
        keys = block_hashes(prompt[: max_blocks * self.block_size], self.block_size)
        if not keys:
            return 0, 0
        client = self.store.client
        reply = client.lookup(self.store.namespace, keys, prefix=True, pin=True)
        try:
            hits = reply.prefix_hits
            if not hits:
                return 0, 0
            filled = self.store.load(cache.tensors, block_ids[:hits], keys[:hits])
        finally:
            if reply.pin_id:
                client.unpin(reply.pin_id)
        # Pinned blocks are not evicted, so a miss here is a failure, which
        # the benchmark reports (loaded < lookup_hits) and fails on. The
        # engine still serves the request correctly: the prefix ends before
        # the first miss and the rest is recomputed.
        loaded = filled.index(False) if False in filled else len(filled)
        return hits, loaded

    def save(
        self,
        cache: PagedKvCache,
        tokens: Sequence[int],
        block_ids: Sequence[int],
        skip_blocks: int,
    ) -> int:
        """Saves the full blocks of ``tokens`` (whose K/V are in
        ``block_ids``) after the first ``skip_blocks``, which are stored
        already. Returns the number of blocks sent."""
        keys = block_hashes(tokens, self.block_size)
        if len(keys) <= skip_blocks:
            return 0
        self.store.save(
            cache.tensors,
            list(block_ids[skip_blocks : len(keys)]),
            keys[skip_blocks:],
            parents_of(keys)[skip_blocks:],
        )
        return len(keys) - skip_blocks


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


@dataclass
class RunResult:
    """One run of the whole workload."""

    mode: str  # "recompute" or "kvdepot"
    concurrency: int
    wall_s: float
    steps: int
    records: List[RequestRecord]


@dataclass
class _Request:
    """A request in flight (engine state)."""

    spec: TurnSpec
    prompt: List[int]
    arrival: float
    block_ids: List[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    lookup_hits: int = 0
    loaded_blocks: int = 0
    expected_blocks: int = 0
    load_s: float = 0.0
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
        new prefills), samples, and finishes the requests that are done."""
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
        now = time.perf_counter()
        self.steps += 1

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
                arrival = time.perf_counter()
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
                load_start = time.perf_counter()
                req.lookup_hits, req.loaded_blocks = self.connector.load_prefix(
                    self.cache, req.prompt, req.block_ids
                )
                req.num_computed = req.loaded_blocks * bs
                req.load_s = time.perf_counter() - load_start
            self.busy[client] = True
            admitted.append((client, req))
        return admitted

    def _finish(self, client: int, req: _Request, now: float) -> None:
        """The answer is complete at ``now``, when the client sends its next
        turn; saving the new blocks is engine work that delays the next step
        (and so that turn's TTFT)."""
        tokens = req.prompt + req.output
        self.history[req.spec.conversation] = tokens
        stored = 0
        save_start = time.perf_counter()
        if self.connector is not None:
            # The last sampled token has no K/V yet: num_computed excludes it.
            stored = self.connector.save(
                self.cache, tokens[: req.num_computed], req.block_ids, req.loaded_blocks
            )
        save_s = time.perf_counter() - save_start
        self.cache.free(req.block_ids)
        self.busy[client] = False
        self.sent_at[client] = now
        block_bytes = self.connector.block_bytes if self.connector is not None else 0
        self.records.append(
            RequestRecord(
                conversation=req.spec.conversation,
                turn=req.spec.turn,
                prompt_tokens=len(req.prompt),
                hit_tokens=req.loaded_blocks * self.cache.block_size,
                lookup_hits=req.lookup_hits,
                loaded_blocks=req.loaded_blocks,
                expected_blocks=req.expected_blocks,
                output=req.output,
                first_logits=req.first_logits,
                ttft_s=req.first_token_time - req.arrival,
                tpot_s=(now - req.first_token_time) / (len(req.output) - 1),
                bytes_loaded=req.loaded_blocks * block_bytes,
                bytes_stored=stored * block_bytes,
                load_s=req.load_s,
                save_s=save_s,
            )
        )


def run_workload(
    model: DecoderModel,
    cache: PagedKvCache,
    conversations: Sequence[Sequence[TurnSpec]],
    concurrency: int,
    connector: Optional[KvdepotConnector],
) -> RunResult:
    """Serves every turn of ``conversations`` with ``concurrency`` clients;
    with ``connector``, reuses prefixes through kvdepot, else recomputes.

    ``cache`` must be free and large enough for ``concurrency`` requests of
    the longest context (:func:`cache_blocks_needed`). Call under
    ``torch.inference_mode()``.
    """
    engine = _Engine(model, cache, conversations, concurrency, connector)
    _warm_up(model, cache)
    start = time.perf_counter()
    engine.run()
    return RunResult(
        mode="kvdepot" if connector is not None else "recompute",
        concurrency=concurrency,
        wall_s=time.perf_counter() - start,
        steps=engine.steps,
        records=engine.records,
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
