"""KvDepotConnector: kvdepot as vLLM's external prefix cache (KV connector V1).

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvDepotConnector",
        "kv_connector_module_path": "kvdepot.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"server": "127.0.0.1:50551"}}'

Interface followed: vLLM v1 ``KVConnectorBase_V1``
(``vllm/distributed/kv_transfer/kv_connector/v1/base.py``) as of vLLM 0.11:
``get_num_new_matched_tokens(request, num_computed_tokens) -> (int | None,
bool)``, ``update_state_after_alloc(request, blocks, num_external_tokens)``,
``build_connector_meta(scheduler_output)``, ``update_connector_output(
connector_output)``, ``request_finished(request, block_ids) -> (bool, dict |
None)``; ``register_kv_caches(kv_caches)``, ``start_load_kv(forward_context,
**kwargs)``, ``wait_for_layer_load(layer_name)``, ``save_kv_layer(layer_name,
kv_layer, attn_metadata, **kwargs)``, ``wait_for_save()``,
``get_finished(finished_req_ids)``, ``get_block_ids_with_load_errors()``.
The constructor takes ``(vllm_config, role, kv_cache_config=None)`` and passes
``kv_cache_config`` on only where the installed base class takes it (newer
vLLM), so it loads on both. Without vLLM installed, the class subclasses
:class:`_StandInConnectorBase`, a minimal local stand-in of the base class
(metadata binding only) that exists so tests can drive the connector; it is
not vLLM.

How it works (one forward pass at a time; loads stream layer by layer):

* Keys are chained SHA-256 block hashes over the token ids
  (:func:`kvdepot.integrations.block_hashes`; LoRA name and ``cache_salt``
  are extra keys), in the namespace ``KvLayout.namespace_for(model/tpRofN)``,
  so different models, layouts, dtypes and tensor-parallel ranks never mix.
  The default model part also names, where set, the model revision
  (``rev:...``), the quantization method (``quant:...``), the effective
  RoPE scaling (``rope:<digest>``) and ``hf_overrides`` (``hf:<digest>``),
  so deployments of one model path that compute other KV never mix either
  (``vllm/<model>/rev:v2/quant:fp8/tp0of1``; a plain deployment's label is
  ``vllm/<model>/tp0of1``). A ``model`` given in the extra config is used
  as it is.
* Scheduler: ``get_num_new_matched_tokens`` looks up the prompt's full
  blocks (never the last token: vLLM must compute at least one) with
  ``prefix`` and ``pin``; the hits beyond the locally computed tokens are
  offered. A request that reads no prefix cache
  (``request.skip_reading_prefix_cache``, which vLLM sets for prompt
  logprobs; older vLLM: ``sampling_params.prompt_logprobs`` set) is offered
  nothing and not looked up; its blocks are still saved. The pins are held
  until the output of the step that loads them is in
  (``update_connector_output`` for that step; with async scheduling not
  the one before it, nor that of a step without tokens), the request
  finishes, or a new lookup replaces it. Outputs come back in the order
  the steps were planned, but a step without tokens has one only where it
  reports something or the executor aggregates the workers' outputs
  (``mp``, ``ray``; not ``uni``): the scheduler side numbers every step it
  plans and matches each output to the oldest step whose output is due.
  ``build_connector_meta`` sends the workers the block ids and
  keys to load, and the blocks to save: full blocks whose tokens are all
  computed once this step's forward pass is done, not yet known to be stored.
* Worker: ``start_load_kv`` starts one :meth:`kvdepot.KvCacheStore.load_async`
  for all of the step's loads (up to ``max_staging_blocks`` blocks; a larger
  load goes in staging rounds of that many, one after the other) and
  returns; a native loader thread scatters the blocks into the paged caches
  layer by layer, and ``wait_for_layer_load(layer_name)`` waits only until
  that layer (and the ones before it) is in place, so layer 0's attention
  runs while the later layers are still being written (with several rounds,
  the first wait finishes the rounds before the last, which streams). The
  store keeps its staging memory, sized by its largest round or save chunk
  (saves also go in chunks of at most ``max_staging_blocks``), so that bounds
  it. The load is finished, and its misses and
  errors recorded, before anything that needs it: ``wait_for_save``, the
  next ``start_load_kv``, ``get_finished``,
  ``get_block_ids_with_load_errors`` and ``shutdown``. ``wait_for_save``
  stores the step's publishable blocks after the forward pass
  (``save_kv_layer`` only records the layer).
* Batches: the daemon takes at most ``max_batch_keys`` keys (1024 by
  default) in one lookup, put or read, and one block is one key, so a
  prompt of more blocks (over 16k tokens with vLLM's block size of 16) is
  looked up, loaded and saved in chunks of at most that many keys. The
  lookup goes chunk after chunk, pinning each, and stops at the first chunk
  not entirely stored; the request holds every chunk's pin until it is
  released as above. A load is one :meth:`kvdepot.KvCacheStore.load_async`
  per staging round whose batches are chunks (the torch staging path reads
  chunk after chunk and stops at the first not entirely loaded); a save
  puts chunk after chunk, each chunk's first block linked to the last of
  the one before, as one call would. Saves and the torch path's reads also
  keep chunks within ``max_staging_blocks``.
* Errors never escape: a failed lookup offers 0 tokens; a failed or partial
  load reports the blocks from the first one not loaded through
  ``get_block_ids_with_load_errors`` (vLLM then recomputes them: where vLLM
  has ``kv_transfer_config.kv_load_failure_policy``, whose default
  ``"fail"`` would end the request with an error instead, the connector sets
  it to ``"recompute"`` and logs a warning, unless extra config
  ``keep_load_failure_policy`` is true); a failed save is logged and
  counted. After a call finds kvdepotd unavailable (UNAVAILABLE or
  DEADLINE_EXCEEDED), each side stops calling it for a back-off window
  (:class:`kvdepot.integrations.CircuitBreaker`: ``backoff_s``, doubling
  after each failed retry up to ``max_backoff_s``, reset once it answers;
  one warning when it opens, one when it closes): lookups offer 0 tokens,
  loads fail (recompute), saves are skipped (counted as save errors), pins
  are kept and unpinned once it answers again (the client's keep-alives
  would hold them for good), each skipped call counted in
  ``stats["unavailable_skips"]``. Lookups have their own deadline,
  ``lookup_timeout_s``, shorter than the transfers' ``timeout_s``: they run
  in vLLM's scheduling loop. Requests with multimodal inputs or prompt
  embeddings are neither looked up nor saved (their placeholder token ids,
  zeros for embeddings, do not name the content).
* A failed load poisons what the step computes over it, for the loading
  request and for any request that shares its blocks through vLLM's
  prefix cache (which caches the blocks of a load once allocated, so a
  request scheduled in the same step gets them as local hits): in that
  step the worker saves nothing of the loading request and, of every
  other request, no block from the first failed one it holds or attended
  to (``SaveSpec.after``); the scheduler, told the failed blocks
  (``invalid_block_ids``), counts them and the blocks after them as not
  stored in every request that holds them, so they are saved once vLLM
  recomputed them (with tensor parallelism this also stores the blocks a
  rank lacked). Until then they count as spoiled: vLLM recomputes a shared
  failed block in one request only, maybe over several steps (its token
  budget), while the others go on over it as computed, and later requests
  may get it from vLLM's prefix cache. A block is sound again once a
  request computed it again, from its first token, over sound KV; what is
  computed over a spoiled block is spoiled too; no request saves a block
  from the first spoiled one it holds on. With tensor parallelism, and
  with async scheduling for the steps planned before the load's outcome is
  in, the new blocks of every request computing over a loading block are
  saved only after that outcome. A request that ends first keeps its blocks
  (``request_finished`` answers ``(True, None)``) until the first step
  planned after the outcome saves them, in ``get_finished`` (which runs in
  steps without tokens too), and reports it finished sending. (If the
  engine has nothing else to run, that step may come only with the next
  request; the blocks stay held until then.)
* CUDA graphs: FULL graph replay skips ``wait_for_layer_load``, so
  :meth:`KvDepotConnector.requires_piecewise_for_cudagraph` asks vLLM (after
  0.11) for PIECEWISE graphs; where the configured ``cudagraph_mode`` still
  has FULL graphs (vLLM 0.11), ``start_load_kv`` finishes each load before
  returning (logged once), no longer layer by layer.

Caches: one tensor per layer in vLLM's FlashAttention layout ``[2,
num_blocks, block_size, num_kv_heads, head_size]`` (or MLA ``[num_blocks,
block_size, head_size]``), dtype fp16/bf16/fp32. CPU tensors go through the
native gather/scatter. CUDA tensors go through :mod:`kvdepot.kvshim` (the
CUDA gather/scatter kernels, between the GPU caches and page-locked staging
buffers): saves gather on the current stream; loads enqueue each layer's
scatter on the current stream from ``wait_for_layer_load``, once the blocks
have arrived. That path has run here only with the kvshim library's CPU
build (``staging=kvshim`` on CPU caches); the CUDA library has not yet run
on a GPU. Where the CUDA library is missing (not built, no usable device)
the connector falls back, with a warning, to a torch staging copy with the
same object bytes, which loads synchronously in ``start_load_kv`` (all
layers at once).
Not supported: pipeline parallelism, decode or prefill context parallelism
(``decode_context_parallel_size`` / ``prefill_context_parallel_size`` above
1: a rank's block holds only its slice of the tokens; the connector is then
disabled with an error log), hybrid (several KV cache groups) models,
speculative decoding whose proposer has layers, and KV caches, of its own
(EAGLE, MTP, a draft model; n-gram, suffix, Medusa and MLP speculators
are served): both sides are then disabled with an error log,
fp8 KV caches, loads that span forward passes (``get_num_new_matched_tokens``
always answers ``load_kv_async=False``).

Extra config (``kv_connector_extra_config``): ``server`` (default
``$KVDEPOT_SERVER`` or ``127.0.0.1:50551``), ``model`` (default the served
model with its revision, quantization, RoPE scaling and hf_overrides, as
above; given, the namespace's model name as it is), ``timeout_s`` (5: the
worker's transfers), ``lookup_timeout_s`` (the scheduler's lookups and
unpins; 1, or ``timeout_s`` if lower), ``backoff_s`` (1; 0 turns the circuit
breaker off) and ``max_backoff_s`` (30), ``lease_s`` (0: the daemon's
default), ``max_staging_blocks`` (128, at least 2: the most blocks a load
round or save chunk stages at once; the store's staging memory then holds
fewer than twice that many blocks, or 8), ``keep_load_failure_policy``
(false: see "Errors"), ``staging`` (``auto`` | ``kvshim`` |
``torch``: ``kvshim`` uses the kvshim library for any device, its CPU build
for CPU caches, and fails without it; ``torch`` forces the torch staging
path), ``load`` / ``save`` (booleans; default from ``kv_role``:
``kv_producer`` saves, ``kv_consumer`` loads, ``kv_both`` does both),
``max_batch_keys`` (1024, at least 2: set it to the daemon's
``max_batch_keys`` where that is lower).
"""

from __future__ import annotations

import collections
import enum
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import (Any, Callable, Deque, Dict, Iterable, List, Optional, Sequence, Set,
                    Tuple)

from . import (DEFAULT_MAX_BATCH_KEYS, UNAVAILABLE_CODES, CircuitBreaker, batch_ranges,
               block_hashes, model_label, model_variant, parents_of, status_code)

logger = logging.getLogger(__name__)


try:  # pragma: no cover - depends on the environment
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )

    HAVE_VLLM = True
except Exception:  # vLLM missing (or an incompatible one): the stand-ins.
    HAVE_VLLM = False

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        """Stand-in of vLLM's KVConnectorRole (same members and values)."""

        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Stand-in of vLLM's KVConnectorMetadata (an empty base)."""

    class _StandInConnectorBase:
        """A minimal local stand-in of vLLM's ``KVConnectorBase_V1``, used only
        when vLLM cannot be imported: the constructor and the metadata binding
        that the model runner calls (``bind_connector_metadata``,
        ``clear_connector_metadata``), as vLLM implements them. Everything
        else is the connector's own."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
            self._connector_metadata: Optional[Any] = None
            self._vllm_config = vllm_config
            if getattr(vllm_config, "kv_transfer_config", None) is None:
                raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self) -> Any:
            return self._role

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self) -> Any:
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None

    KVConnectorBase_V1 = _StandInConnectorBase  # type: ignore[misc,assignment]


def _base_takes_kv_cache_config() -> bool:
    import inspect

    try:
        params = inspect.signature(KVConnectorBase_V1.__init__).parameters
    except (TypeError, ValueError):
        return False
    return "kv_cache_config" in params


@dataclass
class LoadSpec:
    """Blocks of one request to read: ``keys[i]`` into cache block
    ``block_ids[i]``. Block ids without as many keys: a load the scheduler
    could not plan, whose blocks the worker reports as failed."""

    req_id: str
    block_ids: List[int]
    keys: List[bytes]


@dataclass
class SaveSpec:
    """Blocks of one request to store after this step's forward pass.

    ``after``: the request's blocks before these that this step loads
    (its own load's, or another request's that it shares through vLLM's
    prefix cache): the saved blocks attended to them, so if one of them
    fails to load, none is saved; a failed block among ``block_ids``
    itself cuts the spec there (see ``KvDepotConnector._savable``)."""

    req_id: str
    block_ids: List[int]
    keys: List[bytes]
    parents: List[bytes]
    after: List[int] = field(default_factory=list)


@dataclass
class _PendingLoad:
    """Worker side: the step's load in flight, and the specs it serves (in
    the order their blocks were concatenated into ``block_ids`` and
    ``keys``). The load goes in staging rounds (``rounds``: [lo, hi) of at
    most max_staging_blocks blocks), one ``KvCacheStore.load_async`` each,
    one after the other: ``handle`` is round ``round``'s (None: that round
    did not start), ``errors`` the per-block outcomes of the rounds before
    it (see ``KvDepotConnector._next_round``)."""

    specs: List[LoadSpec]
    block_ids: List[int]
    keys: List[bytes]
    rounds: List[Tuple[int, int]]
    round: int = 0
    handle: Any = None  # kvdepot.LoadHandle
    errors: List[Any] = field(default_factory=list)


@dataclass
class KvDepotConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler side tells the workers for one step (plain data:
    vLLM serializes it to the worker processes)."""

    loads: List[LoadSpec] = field(default_factory=list)
    saves: List[SaveSpec] = field(default_factory=list)
    # Requests that finished with blocks whose save had to wait (see
    # KvDepotConnector.request_finished): saved in get_finished, which runs
    # in every step (wait_for_save does not run in steps without tokens),
    # then reported there as finished sending, so vLLM frees their blocks.
    finishing_saves: List[SaveSpec] = field(default_factory=list)
    finishing: List[str] = field(default_factory=list)


@dataclass
class _RequestState:
    """Scheduler-side bookkeeping of one request."""

    request: Any
    extra_keys: Tuple[Any, ...]
    enabled: bool
    keys: List[bytes] = field(default_factory=list)  # full-block keys so far
    block_ids: List[int] = field(default_factory=list)  # the request's blocks
    stored_blocks: int = 0  # blocks [0, stored_blocks) are known stored
    # The pins of the last lookup, one per chunk it pinned (see
    # KvDepotConnector._unpin, which releases them all).
    pin_ids: List[int] = field(default_factory=list)
    load_from: int = 0  # block range to load, when load_pending
    load_to: int = 0
    # The blocks [load_from, external_to) hold the tokens vLLM took from
    # kvdepot (update_state_after_alloc): it counts them as computed.
    external_to: int = 0
    load_pending: bool = False
    load_in_flight: bool = False  # its pins wait for the output of load_step
    load_step: int = 0  # the step (see KvDepotConnector._step) loading
    # Finished with its blocks held (request_finished answered True; the
    # request is in KvDepotConnector._finishing): the blocks [stored_blocks,
    # finished_blocks) are saved, and the blocks freed, in the first step
    # planned once no load is in flight.
    finished_blocks: int = 0


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


# vLLM's null block: what its block tables hold where a request has no block
# (positions a sliding window left behind). Never a request's own block, so
# never saved.
_NULL_BLOCK_ID = 0


# Speculative decoding methods whose proposer has no attention layers, so
# no KV cache, of its own (n-gram and suffix matching, Medusa and MLP
# speculator heads): the engine's KV caches are the model's alone.
_PROPOSERS_WITHOUT_KV = frozenset({"ngram", "ngram_gpu", "suffix", "medusa",
                                   "mlp_speculator"})


def _unsupported_kv_cache(vllm_config: Any, kv_cache_config: Any) -> Optional[str]:
    """Why the connector cannot serve this engine's KV cache, or None. Only
    full attention keeps a block for every token of a request (MLA, and
    sliding-window layers that vLLM treats as full attention, included): a
    sliding-window or chunked-local group holds vLLM's null block (id 0) for
    the positions it left behind, and frees them, so a prefix could be
    saved from, or loaded into, blocks that are not the request's. Read from
    ``kv_cache_config.kv_cache_groups`` where vLLM passes it; otherwise from
    the model's sliding window (a model with one is refused, although vLLM
    may treat its layers as full attention: the safe answer).

    Speculative decoding with a proposer that has layers of its own (EAGLE,
    MTP, a draft model: any method but those of _PROPOSERS_WITHOUT_KV) adds
    their caches to the model's, which kvdepot's blocks do not hold: the
    workers find more caches than the model has layers and turn themselves
    off (see register_kv_caches), so the scheduler side must offer nothing
    either (each offer would be a failed load and a wasted forward pass).
    Read from ``speculative_config``, and from the layers of
    ``kv_cache_config``'s groups where vLLM names them."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups:
        for group in groups:
            spec = getattr(group, "kv_cache_spec", None)
            if not any(c.__name__ == "FullAttentionSpec" for c in type(spec).__mro__):
                return (f"KV cache group of {type(spec).__name__}: only full "
                        f"attention keeps a block for every token of a prefix")
    else:
        mc = getattr(vllm_config, "model_config", None)
        window_of = getattr(mc, "get_sliding_window", None)
        if callable(window_of) and window_of():
            return (f"the model uses sliding-window attention (window {window_of()}): "
                    f"vLLM keeps no block for the tokens its window left behind")
    speculative = getattr(vllm_config, "speculative_config", None)
    if speculative is not None:
        method = getattr(speculative, "method", None)
        if method is None or str(method) not in _PROPOSERS_WITHOUT_KV:
            return (f"speculative decoding ({method or 'method unknown'}) with a "
                    f"proposer whose layers have KV caches of their own, which "
                    f"kvdepot's blocks do not hold")
    names = {n for g in groups or () for n in (getattr(g, "layer_names", None) or ())}
    mc = getattr(vllm_config, "model_config", None)
    if names and mc is not None:
        num_layers = int(mc.get_num_layers(getattr(vllm_config, "parallel_config", None)))
        if len(names) > num_layers:
            return (f"{len(names)} layers have KV caches, the model has {num_layers} "
                    f"(a speculative proposer's?): kvdepot's blocks hold the model's")
    return None


def _vllm_cpu_platform() -> bool:
    """Whether vLLM runs on its CPU platform, whose attention backend
    (CPU_ATTN) lays each layer's cache out as [2, N, heads, block_size,
    head_size] (HND), a shape that FlashAttention's [2, N, block_size, heads,
    head_size] (NHD) also has where heads == block_size: the shape alone
    cannot tell them apart there. False without vLLM."""
    try:
        from vllm.platforms import current_platform
    except Exception:  # noqa: BLE001 - no vLLM (tests), or it cannot load
        return False
    try:
        return bool(current_platform.is_cpu())
    except Exception:  # noqa: BLE001
        return False


def _has_full_cudagraphs(vllm_config: Any) -> bool:
    """Whether vLLM may replay FULL CUDA graphs (``compilation_config.
    cudagraph_mode`` FULL, FULL_DECODE_ONLY or FULL_AND_PIECEWISE, the
    default of vLLM 0.11). Read defensively: no compilation config or mode
    is False; a mode that cannot be read is True (the safe answer)."""
    cc = getattr(vllm_config, "compilation_config", None)
    mode = getattr(cc, "cudagraph_mode", None)
    if mode is None:
        return False
    try:
        check = getattr(mode, "has_full_cudagraphs", None)
        if callable(check):
            return bool(check())
        return "FULL" in str(getattr(mode, "name", mode)).upper()
    except Exception:  # noqa: BLE001
        return True


def _layer_index(name: str, position: int) -> Tuple[int, int]:
    m = re.search(r"layers\.(\d+)", name) or re.search(r"(\d+)", name)
    return (int(m.group(1)) if m else position, position)


def _model_variant(model_config: Any) -> List[str]:
    """Parts of the default namespace label, beside the model path, for what
    else makes two deployments of one path compute other KV: the model
    ``revision`` (``rev:<revision>``), the ``quantization`` method
    (``quant:<method>``, also the one vLLM takes from the checkpoint), the
    RoPE scaling of the effective HF config (``rope:<digest>``: its
    ``rope_scaling`` / ``rope_parameters``, and older vLLM's
    ``rope_scaling`` / ``rope_theta`` arguments) and ``hf_overrides``
    (``hf:<digest>``). Each only where set, so a plain deployment keeps the
    label ``vllm/<model>/tpRofN``. Read defensively: what is missing is left
    out."""
    if model_config is None:
        return []
    rope: Dict[str, Any] = {}
    hf = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    for owner, attrs in ((hf, ("rope_scaling", "rope_parameters")),
                         (model_config, ("rope_scaling", "rope_theta"))):
        for attr in attrs:
            try:
                value = getattr(owner, attr, None) if owner is not None else None
            except Exception:  # noqa: BLE001 - a config property that raises
                value = None
            if value:
                rope[f"{'hf' if owner is hf else 'vllm'}.{attr}"] = value
    return model_variant(revision=getattr(model_config, "revision", None),
                         quantization=getattr(model_config, "quantization", None),
                         rope=rope, overrides=getattr(model_config, "hf_overrides", None))


def _every_output_reported(vllm_config: Any, tp_size: int) -> bool:
    """Whether vLLM passes the output of every step, with or without tokens,
    to the scheduler side's ``update_connector_output``. A step with tokens
    always carries a ``KVConnectorOutput``. One without tokens
    (``kv_connector_no_forward``) carries one only if it reports something
    (``is_empty()`` false: for this connector, finished sending) -- unless
    the executor aggregates the workers' outputs (``KVOutputAggregator``,
    used by the multiprocessing and Ray executors whenever a connector is
    configured, whatever the world size), which builds one for every step.
    The uniprocess executors (``uni``, ``external_launcher``) do not; vLLM
    picks ``uni`` for one GPU and ``mp`` (or ``ray``) for more when
    ``distributed_executor_backend`` is unset. An executor this cannot place
    counts as aggregating: an output then expected but never sent only
    delays pin releases and saves, while one sent but not expected would be
    taken for a later step's."""
    pc = getattr(vllm_config, "parallel_config", None)
    backend = getattr(pc, "distributed_executor_backend", None)
    if backend is None:
        return tp_size > 1
    if isinstance(backend, str):
        return backend not in ("uni", "external_launcher")
    names = {c.__name__ for c in getattr(backend, "__mro__", ())}
    return "UniProcExecutor" not in names


class KvDepotConnector(KVConnectorBase_V1):  # type: ignore[misc,valid-type]
    """kvdepot as vLLM's external prefix cache (see the module docstring).

    One instance per role and process, as vLLM creates them: the scheduler
    side and the worker side share nothing but the metadata. Not
    thread-safe; vLLM calls each side from one thread."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        if kv_cache_config is not None and _base_takes_kv_cache_config():
            super().__init__(vllm_config, role, kv_cache_config)
        else:
            super().__init__(vllm_config, role)
        tc = vllm_config.kv_transfer_config
        extra = dict(getattr(tc, "kv_connector_extra_config", None) or {})
        kv_role = getattr(tc, "kv_role", None) or "kv_both"
        self._server: str = str(
            extra.get("server") or os.environ.get("KVDEPOT_SERVER") or "127.0.0.1:50551"
        )
        self._timeout_s = float(extra.get("timeout_s", 5.0))
        # The scheduler side's calls (lookups, unpins) run in vLLM's
        # scheduling loop: a shorter deadline than the transfers'.
        self._lookup_timeout_s = float(extra.get("lookup_timeout_s",
                                                 min(1.0, self._timeout_s)))
        self._lease_s = float(extra.get("lease_s", 0.0))
        # After kvdepotd was found unavailable, no call for a back-off window
        # (see CircuitBreaker): lookups answer 0, loads fail (recompute),
        # saves are skipped.
        self._breaker = CircuitBreaker(
            f"vLLM {getattr(role, 'name', role)}",
            min_s=float(extra.get("backoff_s", 1.0)),
            max_s=float(extra.get("max_backoff_s", 30.0)), log=logger)
        # Offers paused while every load fails (a worker that turned itself
        # off, a tensor-parallel rank without the blocks): after
        # _LOAD_FAILURE_STEPS steps in a row whose every load failed, no
        # hits are offered for load_failure_pause_s (doubling while it goes
        # on, up to 10 minutes); a load that succeeds ends it. Each failed
        # load costs the request a wasted forward pass (vLLM recomputes).
        self._clock: Callable[[], float] = time.monotonic
        self._failed_load_steps = 0
        self._offers_paused_until = 0.0
        self._load_pause_min_s = float(extra.get("load_failure_pause_s", 30.0))
        self._load_pause_s = self._load_pause_min_s
        # Pins still to release (the scheduler's): those whose unpin was not
        # made (the breaker's window) or found the daemon unavailable. The
        # session's keep-alives would hold them (and their blocks in DRAM)
        # for good; released by the next _unpin that may call.
        self._owed_unpins: Deque[int] = collections.deque()
        # The most blocks one load or save stages at once (the store keeps
        # its staging memory, sized by its largest use, for good).
        self._max_staging_blocks = int(extra.get("max_staging_blocks", 128))
        if self._max_staging_blocks < 2:
            logger.warning("kvdepot: max_staging_blocks=%d is below 2; using 2",
                           self._max_staging_blocks)
            self._max_staging_blocks = 2
        self._staging = str(extra.get("staging", "auto"))
        if self._staging not in ("auto", "kvshim", "torch"):
            logger.warning("kvdepot: staging=%r is not auto, kvshim or torch; using auto",
                           self._staging)
            self._staging = "auto"
        self._load_enabled = _truthy(
            extra.get("load", kv_role in ("kv_consumer", "kv_both"))
        )
        self._save_enabled = _truthy(
            extra.get("save", kv_role in ("kv_producer", "kv_both"))
        )
        # At least 2: a KvCacheStore batch may hold 2 blocks (see _load_async).
        self._max_batch_keys = int(extra.get("max_batch_keys", DEFAULT_MAX_BATCH_KEYS))
        if self._max_batch_keys < 2:
            logger.warning("kvdepot: max_batch_keys=%d is below 2; using 2",
                           self._max_batch_keys)
            self._max_batch_keys = 2
        self._block_size = int(vllm_config.cache_config.block_size)
        mc = getattr(vllm_config, "model_config", None)
        pc = getattr(vllm_config, "parallel_config", None)
        self._model_name = str(extra.get("model") or getattr(mc, "model", None) or "model")
        self._tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        self._use_mla = bool(getattr(mc, "use_mla", False))
        self._client: Any = None
        self._disabled_reason: Optional[str] = None
        # Whether vLLM recomputes the blocks reported by
        # get_block_ids_with_load_errors (see _recompute_load_failures).
        self._recompute_failures = self._recompute_load_failures(tc, extra, role)
        # What else makes the served model's KV differ under the same path
        # (see _model_variant); a model named in the extra config is the
        # namespace's name as given.
        self._model_variant: List[str] = []
        if not extra.get("model"):
            try:
                self._model_variant = _model_variant(mc)
            except Exception as e:  # noqa: BLE001 - never mix, never fail the engine
                self._disable(f"cannot name the model's variant for its namespace: {e}")
        # The layout every rank must have (from the config), so that the
        # scheduler looks in the namespace the workers write to.
        self._layout: Any = None
        try:
            self._layout = self._layout_from_config(vllm_config)
        except Exception as e:  # noqa: BLE001 - degrade, never fail the engine
            self._disable(f"cannot derive the KV layout from the config: {e}")
        try:
            unsupported = _unsupported_kv_cache(vllm_config, kv_cache_config)
        except Exception as e:  # noqa: BLE001 - degrade, never fail the engine
            unsupported = f"cannot tell the KV cache's kind: {e}"
        if unsupported:
            self._disable(unsupported)

        # Scheduler side.
        self._requests: Dict[str, _RequestState] = {}
        # Requests that finished with their blocks held (request_finished).
        self._finishing: Set[str] = set()
        self._scheduler_namespace: Optional[str] = None
        # Steps: build_connector_meta numbers every step it plans, with or
        # without tokens (_step: the last one's number). Outputs come back
        # to update_connector_output in the order the steps were planned,
        # but not every step's does (see _every_output_reported): _awaited
        # holds, oldest first, the numbers of the planned steps whose output
        # will come, so that each output is matched to its own step; every
        # step up to _steps_done has ended. With async scheduling the next
        # step is planned before the output of the one running comes back,
        # so a load's pins are released, and the blocks it loads count as in
        # flight (_loads_in_flight, by step), until its own step's output is
        # in.
        self._step = 0
        self._steps_done = 0
        self._awaited: Deque[int] = collections.deque()
        self._loads_in_flight: Dict[int, Set[int]] = {}
        # Blocks whose KV may have been computed over a block whose load
        # failed, and not computed again over sound KV since (see
        # _recompute_spoiled): block id -> how many of its tokens, from its
        # first, have been. No request saves its blocks from the first of
        # these it holds on.
        self._spoiled: Dict[int, int] = {}
        self._every_output_reported = _every_output_reported(vllm_config, self._tp_size)
        if self._layout is not None:
            # The scheduler looks up TP rank 0's blocks (MLA caches are the
            # same on every rank).
            self._scheduler_namespace = self._namespace(self._layout, 0)

        # Worker side.
        self._caches: List[Any] = []
        self._store_caches: List[Any] = []  # as laid out in memory
        self._layer_names: List[str] = []
        self._layer_index: Dict[str, int] = {}  # name -> index in _caches
        self._pending_load: Optional[_PendingLoad] = None
        self._store: Any = None
        self._store_pipeline_batches = 1  # the store's own (see _load_async)
        self._via_store = True
        self._load_errors: Set[int] = set()
        # FULL CUDA graph replay runs the attention layers without the
        # per-layer hooks (wait_for_layer_load), so a load must then be in
        # the caches before the forward pass starts: start_load_kv finishes
        # it. (vLLM versions with requires_piecewise_for_cudagraph switch to
        # PIECEWISE graphs for this connector instead.)
        self._load_before_forward = _has_full_cudagraphs(vllm_config)
        if self._load_before_forward and role == KVConnectorRole.WORKER:
            logger.warning(
                "kvdepot: FULL CUDA graphs are enabled (compilation_config."
                "cudagraph_mode), which skip wait_for_layer_load: loads finish "
                "in start_load_kv, before the forward pass, instead of layer "
                "by layer. Use cudagraph_mode=PIECEWISE to keep them layered.")
        # Requests whose load failed in this step (from start_load_kv on),
        # and the block ids that failed: what the step computed over them
        # (for these requests, or any other request sharing the blocks) used
        # stale KV, so is not saved.
        self._failed_load_reqs: Set[str] = set()
        self._failed_load_blocks: Set[int] = set()
        self.stats: Dict[str, int] = {
            "lookups": 0,
            "lookup_errors": 0,
            "matched_tokens": 0,
            "loaded_blocks": 0,
            "load_errors": 0,
            "saved_blocks": 0,
            "save_errors": 0,
            "saves_dropped": 0,  # blocks not saved: the request's load failed
            # Daemon calls not made while kvdepotd was unavailable (the
            # breaker's back-off window): lookups, step loads, saves.
            "unavailable_skips": 0,
            # Lookups of requests scheduled before (resumed after a
            # preemption), capped at vLLM's num_cached_tokens.
            "resumed_caps": 0,
            # Lookups not made while offers were paused (every load failing)
            # and the pauses.
            "paused_offers": 0,
            "offer_pauses": 0,
        }

    # ------------------------------------------------------------------
    # Shared helpers

    def _disable(self, reason: str) -> None:
        if self._disabled_reason is None:
            logger.error("kvdepot connector disabled: %s", reason)
        self._disabled_reason = reason

    @property
    def disabled_reason(self) -> Optional[str]:
        """Why the connector does nothing, or None while it works."""
        return self._disabled_reason

    def _recompute_load_failures(self, tc: Any, extra: Dict[str, Any], role: Any) -> bool:
        """Makes vLLM recompute the blocks this connector reports through
        ``get_block_ids_with_load_errors``, which it does routinely (a block
        evicted between lookup and load, a daemon restart, a TP rank lacking
        a block). vLLM versions with ``kv_transfer_config.
        kv_load_failure_policy`` default it to ``"fail"``, which ends such a
        request with an error; the scheduler reads it after creating its
        connector, so it is set to ``"recompute"`` here (a warning says so),
        unless extra config ``keep_load_failure_policy`` is true. Older vLLM
        (no such field) always recomputes. Where the field cannot be set,
        loading is turned off (saves go on). Returns whether a load error is
        recomputed."""
        if not hasattr(tc, "kv_load_failure_policy"):
            return True
        policy = getattr(tc, "kv_load_failure_policy", None)
        if policy != "fail":
            return True
        scheduler = role == KVConnectorRole.SCHEDULER
        if _truthy(extra.get("keep_load_failure_policy", False)):
            if scheduler:
                logger.warning(
                    "kvdepot: kv_load_failure_policy is \"fail\" and kept "
                    "(keep_load_failure_policy): a request with a block kvdepot "
                    "offered but cannot load (evicted since the lookup, a daemon "
                    "restart, a tensor-parallel rank lacking it) ends with an error")
            return False
        try:
            tc.kv_load_failure_policy = "recompute"
        except Exception as e:  # noqa: BLE001 - a frozen config: no loads then
            self._load_enabled = False
            logger.error("kvdepot: cannot set kv_load_failure_policy to \"recompute\" "
                         "(%s); loading is off (saves go on), since under \"fail\" "
                         "every block kvdepot cannot load would fail its request", e)
            return False
        if scheduler:
            logger.warning(
                "kvdepot: kv_load_failure_policy was \"fail\" (vLLM's default), which "
                "ends a request with an error for any block the connector offered "
                "but cannot load (evicted since the lookup, a daemon restart, a "
                "tensor-parallel rank lacking it); set to \"recompute\": vLLM "
                "recomputes those blocks. To keep \"fail\", set "
                "kv_connector_extra_config {\"keep_load_failure_policy\": true}.")
        return True

    def _layout_from_config(self, vllm_config: Any) -> Any:
        import kvdepot

        mc = vllm_config.model_config
        pc = vllm_config.parallel_config
        cc = vllm_config.cache_config
        if int(getattr(pc, "pipeline_parallel_size", 1) or 1) != 1:
            raise ValueError("pipeline parallelism is not supported")
        # Context parallelism splits each block's tokens over ranks (rank r
        # holds the tokens whose position % size == r): a rank's block is
        # not the object the keys name.
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            size = int(getattr(pc, name, 1) or 1)
            if size > 1:
                raise ValueError(f"context parallelism ({name}={size}) is not supported")
        # Dual batch overlap runs the attention of two micro-batches on two
        # threads, which would call the worker side (wait_for_layer_load)
        # at once: it keeps one load's state, for one thread.
        if getattr(pc, "enable_dbo", False) is True:
            raise ValueError("dual batch overlap (enable_dbo) is not supported")
        cache_dtype = str(getattr(cc, "cache_dtype", "auto") or "auto")
        if cache_dtype != "auto":
            raise ValueError(f"cache_dtype {cache_dtype} is not supported (only auto)")
        dtype = kvdepot.dtype_from_torch(mc.dtype)
        num_layers = int(mc.get_num_layers(pc))
        head_size = int(mc.get_head_size())
        if self._use_mla:
            return kvdepot.KvLayout.mla(
                kvdepot.KvCacheLayout.MLA, num_layers, self._block_size, head_size, dtype
            )
        return kvdepot.KvLayout.mha(
            kvdepot.KvCacheLayout.FLASH_ATTN_NHD,
            num_layers,
            self._block_size,
            int(mc.get_num_kv_heads(pc)),
            head_size,
            dtype,
        )

    def _model_label(self, tp_rank: int) -> str:
        """The model name of the namespace: the model, what else sets its KV
        apart (revision, quantization, RoPE scaling, hf_overrides; see
        _model_variant) and the rank: MLA caches are the same on every
        rank; MHA ranks hold different heads."""
        if self._use_mla:
            return model_label("vllm", self._model_name, *self._model_variant, "mla")
        return model_label("vllm", self._model_name, *self._model_variant,
                           f"tp{tp_rank}of{self._tp_size}")

    def _namespace(self, layout: Any, tp_rank: int) -> str:
        return layout.namespace_for(self._model_label(tp_rank))

    def _chunks(self, n: int) -> List[Tuple[int, int]]:
        """[lo, hi) ranges splitting ``n`` keys into daemon calls of at most
        max_batch_keys keys, in order."""
        return batch_ranges(n, self._max_batch_keys)

    def _staging_chunks(self, n: int) -> List[Tuple[int, int]]:
        """[lo, hi) ranges splitting ``n`` blocks to save or read through
        staging memory into pieces of at most max_batch_keys and
        max_staging_blocks blocks, in order."""
        return batch_ranges(n, min(self._max_batch_keys, self._max_staging_blocks))

    def _get_client(self) -> Any:
        """The connection (made on first use). The scheduler side's makes
        only lookups and unpins, within ``lookup_timeout_s``; the worker
        side's transfers within ``timeout_s``."""
        if self._client is None:
            import kvdepot

            scheduler = self.role == KVConnectorRole.SCHEDULER
            self._client = kvdepot.Client(
                self._server,
                timeout_s=self._lookup_timeout_s if scheduler else self._timeout_s,
                lease_s=self._lease_s,
                client_name=f"kvdepot-vllm-{self.role.name.lower()}",
            )
        return self._client

    def shutdown(self) -> None:
        """Finishes a load in flight, releases the pins still held and closes
        the connection."""
        self._finish_load()
        for st in self._requests.values():
            self._unpin(st)
        self._requests.clear()
        self._finishing.clear()
        client, self._client, self._store = self._client, None, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001
                pass

    # ------------------------------------------------------------------
    # Scheduler side

    @staticmethod
    def _extra_keys(request: Any) -> Tuple[Any, ...]:
        extra: List[Any] = []
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            # The name is an engine's local alias (--lora-modules name=path):
            # engines sharing kvdepot may serve other adapters under one
            # name, so the adapter's path is part of the key too.
            extra.append("lora:" + str(getattr(lora, "lora_name", lora)))
            path = getattr(lora, "lora_path", None) or getattr(lora, "path", None)
            if path:
                extra.append("lora_path:" + str(path))
        salt = getattr(request, "cache_salt", None)
        if salt:
            extra.append("salt:" + str(salt))
        return tuple(extra)

    @staticmethod
    def _has_multimodal(request: Any) -> bool:
        for attr in ("mm_features", "mm_positions", "mm_hashes", "mm_inputs"):
            if getattr(request, attr, None):
                return True
        return False

    @staticmethod
    def _has_prompt_embeds(request: Any) -> bool:
        """True for a prompt sent as embeddings: vLLM then has no prompt
        token ids (``prompt_token_ids`` is None) and fills ``all_token_ids``
        with zeros, which do not name the content."""
        if getattr(request, "prompt_embeds", None) is not None:
            return True
        return hasattr(request, "prompt_token_ids") and request.prompt_token_ids is None

    @staticmethod
    def _skips_prefix_cache(request: Any) -> bool:
        """True for a request that must compute its whole prompt, reading no
        cached KV: ``request.skip_reading_prefix_cache`` (vLLM sets it for
        prompt logprobs, which need every prompt position's logits, and for
        pooling that reads all tokens); vLLM versions without that
        attribute skip the prefix cache for prompt logprobs
        (``sampling_params.prompt_logprobs`` set)."""
        skip = getattr(request, "skip_reading_prefix_cache", None)
        if skip is not None:
            return bool(skip)
        params = getattr(request, "sampling_params", None)
        return getattr(params, "prompt_logprobs", None) is not None

    @staticmethod
    def _tokens(request: Any) -> Sequence[int]:
        tokens = getattr(request, "all_token_ids", None)
        if tokens is None:
            tokens = request.prompt_token_ids
        return tokens

    def _state(self, request: Any) -> _RequestState:
        st = self._requests.get(request.request_id)
        if st is None:
            enabled = (
                self._disabled_reason is None
                and self._scheduler_namespace is not None
                and not self._has_multimodal(request)
                and not self._has_prompt_embeds(request)
            )
            st = _RequestState(request, self._extra_keys(request), enabled)
            self._requests[request.request_id] = st
        else:
            st.request = request
        return st

    def _keys_upto(self, st: _RequestState, num_blocks: int) -> List[bytes]:
        """The keys of the request's first ``num_blocks`` full blocks."""
        if len(st.keys) < num_blocks:
            parent = st.keys[-1] if st.keys else None
            st.keys.extend(
                block_hashes(
                    self._tokens(st.request),
                    self._block_size,
                    st.extra_keys,
                    start_block=len(st.keys),
                    parent=parent,
                    num_blocks=num_blocks,
                )
            )
        return st.keys[:num_blocks]

    # Most pins kept for a later unpin; past it the oldest are forgotten
    # (they end with the session: a restart of the engine or the daemon).
    _MAX_OWED_UNPINS = 1 << 16

    def _unpin(self, st: _RequestState) -> None:
        """Releases every pin of the request's last lookup, once, and those
        owed from before. A pin whose unpin cannot be made now (the breaker's
        window, or the daemon unavailable) is kept and released by a later
        call, once the breaker has closed: the client's keep-alives renew
        its session, so the pin (and its blocks in DRAM) would otherwise
        last as long as the engine. An
        unpin the daemon refuses (an unknown pin: its session ended) is
        logged and forgotten."""
        pins, st.pin_ids = st.pin_ids, []
        if self._client is None:
            return
        self._owed_unpins.extend(pins)
        if len(self._owed_unpins) > self._MAX_OWED_UNPINS:
            dropped = len(self._owed_unpins) - self._MAX_OWED_UNPINS
            for _ in range(dropped):
                self._owed_unpins.popleft()
            logger.warning("kvdepot: %d pins not released (kvdepotd unavailable too long); "
                           "they end with the session", dropped)
        # While the breaker is open, even past its window, not here: the
        # next lookup is its probe.
        while self._owed_unpins and not self._breaker.is_open:
            pin = self._owed_unpins[0]
            try:
                self._client.unpin(pin)
                self._breaker.succeeded()
            except Exception as e:  # noqa: BLE001
                if self._breaker.failed(e):  # unavailable: kept for later
                    logger.warning("kvdepot: unpin %d failed, retried later: %s", pin, e)
                    return
                logger.warning("kvdepot: unpin %d failed: %s", pin, e)
            self._owed_unpins.popleft()

    def _lookup_prefix(self, st: _RequestState, keys: List[bytes], pin: bool = True) -> int:
        """The stored prefix of ``keys``, in blocks, pinned (unless not
        ``pin``): a prefix lookup per chunk, in order, up to the first chunk
        not entirely stored; each chunk's pin joins ``st.pin_ids`` as soon
        as it is taken (so that :meth:`_unpin` releases it should a later
        chunk fail)."""
        client = self._get_client()
        hits = 0
        for lo, hi in self._chunks(len(keys)):
            reply = client.lookup(self._scheduler_namespace, keys[lo:hi],
                                  prefix=True, pin=pin)
            pin_id = int(reply.pin_id)
            if pin_id:
                st.pin_ids.append(pin_id)
            got = int(reply.prefix_hits)
            hits += got
            if got < hi - lo:
                break
        return hits

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> Tuple[Optional[int], bool]:
        """Tokens beyond ``num_computed_tokens`` that kvdepot holds (whole
        blocks, never the prompt's last token), loaded within the step that
        schedules them: returns ``(n, False)``; ``(0, False)`` on any error,
        and for a request that reads no prefix cache (see
        :meth:`_skips_prefix_cache`; its blocks are still saved)."""
        st = self._state(request)
        self._unpin(st)  # a repeated call replaces the earlier lookup
        st.load_pending = False
        if not (st.enabled and self._load_enabled) or self._skips_prefix_cache(request):
            return 0, False
        try:
            tokens = self._tokens(request)
            num_blocks = (len(tokens) - 1) // self._block_size
            # vLLM recomputes the blocks of a failed load (invalid block
            # ids) only within request.num_cached_tokens, which it sets when
            # it first schedules the request and keeps after a preemption.
            # A request scheduled before (resumed) would keep a failed
            # load's blocks past that unrecomputed, and decode from them:
            # it is offered no more.
            cached = getattr(request, "num_cached_tokens", -1)
            if isinstance(cached, int) and cached >= 0:
                num_blocks = min(num_blocks, cached // self._block_size)
                self.stats["resumed_caps"] += 1
            if num_blocks * self._block_size <= num_computed_tokens:
                # Nothing to load: every block is a local (prefix cache)
                # hit. Learn (unpinned) how many kvdepot holds already, so
                # that the saves of this request's steps do not gather and
                # send them all again (a shared system prompt's blocks, for
                # every request that reuses it).
                local = num_computed_tokens // self._block_size
                if st.stored_blocks < local and self._breaker.allow():
                    hits = self._lookup_prefix(st, self._keys_upto(st, local), pin=False)
                    self._breaker.succeeded()
                    st.stored_blocks = max(st.stored_blocks, hits)
                return 0, False
            keys = self._keys_upto(st, num_blocks)
            if not self._breaker.allow():  # kvdepotd unavailable: a miss
                self.stats["unavailable_skips"] += 1
                return 0, False
            if self._clock() < self._offers_paused_until:  # loads failing
                self.stats["paused_offers"] += 1
                return 0, False
            self.stats["lookups"] += 1
            hits = self._lookup_prefix(st, keys)
            self._breaker.succeeded()
            st.stored_blocks = max(st.stored_blocks, hits)
            matched = hits * self._block_size - num_computed_tokens
            if matched <= 0:
                self._unpin(st)
                return 0, False
            st.load_from = num_computed_tokens // self._block_size
            st.load_to = hits
            st.load_pending = True
            self.stats["matched_tokens"] += matched
            return matched, False
        except Exception as e:  # noqa: BLE001 - degrade to recompute
            self.stats["lookup_errors"] += 1
            self._breaker.failed(e)
            logger.warning("kvdepot: lookup for %s failed, recomputing: %s",
                           request.request_id, e)
            self._unpin(st)
            st.load_pending = False
            return 0, False

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        """Keeps the load planned by the last lookup if vLLM accepted it
        (``num_external_tokens > 0``), else drops it and its pin."""
        st = self._requests.get(request.request_id)
        if st is None:
            return
        st.request = request
        if num_external_tokens <= 0 or not st.load_pending:
            st.load_pending = False
            self._unpin(st)
            return
        accepted = st.load_from + num_external_tokens // self._block_size
        st.load_to = min(st.load_to, accepted)
        st.external_to = st.load_from + -(-num_external_tokens // self._block_size)

    def build_connector_meta(self, scheduler_output: Any) -> KvDepotConnectorMetadata:
        """This step's loads (planned by the lookups) and saves (blocks that
        become full and computed in this step), planned in that order: a
        save must know every load of the step (see :meth:`_plan_save`)."""
        meta = KvDepotConnectorMetadata()
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
        self._step += 1
        planned: List[Tuple[_RequestState, str, int, int]] = []
        for new_req in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            st = self._requests.get(new_req.req_id)
            if st is None:
                continue
            st.block_ids = list(new_req.block_ids[0]) if new_req.block_ids else []
            planned.append((st, new_req.req_id, int(new_req.num_computed_tokens),
                            int(scheduled.get(new_req.req_id, 0))))
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed_ids = getattr(cached, "resumed_req_ids", None)
            resumed_flags = getattr(cached, "resumed_from_preemption", None)
            for i, req_id in enumerate(cached.req_ids):
                st = self._requests.get(req_id)
                if st is None:
                    continue
                if resumed_ids is not None:
                    resumed = req_id in resumed_ids
                else:
                    resumed = bool(resumed_flags[i]) if resumed_flags else False
                new_ids = cached.new_block_ids[i]
                if resumed:
                    st.block_ids = list(new_ids[0]) if new_ids else []
                elif new_ids:
                    st.block_ids.extend(new_ids[0])
                planned.append((st, req_id, int(cached.num_computed_tokens[i]),
                                int(scheduled.get(req_id, 0))))
        for st, req_id, _, _ in planned:
            self._plan_load(st, req_id, meta)
        if self._spoiled:
            self._recompute_spoiled(planned, meta)
        # Blocks loaded by earlier steps whose outcome is not in yet, and by
        # this one.
        current = self._loads_in_flight.get(self._step, set())
        earlier: Set[int] = set()
        for step, ids in self._loads_in_flight.items():
            if step != self._step:
                earlier |= ids
        for st, req_id, num_computed, num_scheduled in planned:
            self._plan_save(st, req_id, num_computed, num_scheduled, earlier, current, meta)
        self._plan_finished(meta)
        # The output of a step with tokens always reaches
        # update_connector_output; one without, where every output does or
        # where it reports finished requests (see _every_output_reported).
        if (any(int(n) > 0 for n in scheduled.values()) or self._every_output_reported
                or meta.finishing):
            self._awaited.append(self._step)
        return meta

    def _plan_load(self, st: _RequestState, req_id: str,
                   meta: KvDepotConnectorMetadata) -> None:
        """The request's load planned by its lookup, now that vLLM gave it
        blocks: its blocks count as in flight until this step's output.

        vLLM already counts the tokens it took from kvdepot as computed, so
        a load that cannot be planned still goes to the workers, as a spec
        with the blocks of those tokens and no keys, which the workers
        report as failed (``get_block_ids_with_load_errors``): vLLM then
        recomputes them instead of reading blocks nothing wrote."""
        if not st.load_pending:
            return
        st.load_pending = False
        lo, hi = st.load_from, min(st.load_to, len(st.block_ids))
        try:
            if hi <= lo:
                raise ValueError(f"no blocks to load: [{lo}, {st.load_to}) of a "
                                 f"request with {len(st.block_ids)}")
            keys = self._keys_upto(st, hi)
            ids = st.block_ids[lo:hi]
            spec = LoadSpec(req_id, ids, keys[lo:hi])
        except Exception as e:  # noqa: BLE001
            self._unpin(st)
            ids = st.block_ids[lo:st.external_to]
            if not ids:
                logger.error("kvdepot: planning the load of %s failed (%s), and its "
                             "blocks are not known: vLLM counts its tokens %d-%d as "
                             "loaded", req_id, e, lo * self._block_size,
                             st.external_to * self._block_size)
                return
            logger.warning("kvdepot: planning the load of %s failed: %s; its %d "
                           "blocks are reported as not loaded", req_id, e, len(ids))
            spec = LoadSpec(req_id, ids, [])
        meta.loads.append(spec)
        st.load_in_flight = True
        st.load_step = self._step
        self._loads_in_flight.setdefault(self._step, set()).update(ids)

    def _recompute_spoiled(self, planned: List[Tuple[_RequestState, str, int, int]],
                           meta: KvDepotConnectorMetadata) -> None:
        """Follows, in this step, the blocks that a failed load spoiled
        (``_spoiled``; see update_connector_output). vLLM recomputes a
        shared failed block in one request only, the first it finds holding
        it, and may cut that recompute short (the token budget), while the
        others keep counting the blocks after it as computed and go on over
        them, and a later request may get them from the prefix cache. So a
        block is sound again only once a request computes it again, from its
        first token, over sound blocks: a request whose tokens before this
        step's all lie in sound blocks, its own or ones that another
        request computes in this same forward pass (attention reads each
        layer's KV after every request's is written), or a load of this
        step (kvdepot's KV; a failed one spoils again when its outcome is
        in). What a request computes over a spoiled block is spoiled too,
        even in a block not known spoiled (one of its own, past the shared
        ones)."""
        spoiled = self._spoiled
        bs = self._block_size
        for spec in meta.loads:
            if len(spec.block_ids) == len(spec.keys):  # not one failed at planning
                for b in spec.block_ids:
                    spoiled.pop(b, None)
        writes = []
        for st, _, num_computed, num_scheduled in planned:
            done = min(num_computed + num_scheduled, len(self._tokens(st.request)))
            if done > num_computed:
                writes.append((st, num_computed, done))

        def sound_before(st: _RequestState, first: int) -> bool:
            whole, part = divmod(first, bs)
            if any(b in spoiled for b in st.block_ids[:whole]):
                return False
            if part == 0 or whole >= len(st.block_ids):
                return True
            return spoiled.get(st.block_ids[whole], part) >= part

        progress = True
        while progress and writes:
            progress = False
            for w in list(writes):
                st, first, done = w
                if not sound_before(st, first):
                    continue
                writes.remove(w)
                progress = True
                for i in range(first // bs, min(-(-done // bs), len(st.block_ids))):
                    b = st.block_ids[i]
                    if b in spoiled:
                        if done - i * bs >= bs:
                            del spoiled[b]
                        else:
                            spoiled[b] = done - i * bs
        for st, first, done in writes:  # computed over spoiled blocks
            for b in st.block_ids[first // bs:-(-done // bs)]:
                if b != _NULL_BLOCK_ID:
                    spoiled[b] = 0

    def _sound_blocks(self, st: _RequestState, upto: int) -> int:
        """``upto``, or fewer: the request's first blocks, up to the first
        one spoiled (see _recompute_spoiled), which is not saved, nor any
        after it."""
        if self._spoiled:
            upto = next((i for i, b in enumerate(st.block_ids[:upto]) if b in self._spoiled),
                        upto)
        return upto

    def _plan_save(self, st: _RequestState, req_id: str, num_computed: int,
                   num_scheduled: int, earlier: Set[int], current: Set[int],
                   meta: KvDepotConnectorMetadata) -> None:
        """The request's blocks that are full and computed once this step ran
        and not known stored. They wait (are saved in a later step, or lost
        if the request ends first) while any block they attend to, the
        request's own or one it shares with another request through vLLM's
        prefix cache, has a load whose outcome is not known: one of an
        earlier step (async scheduling: this step runs before that outcome
        is in) or, with tensor parallelism, of this step (another rank's
        load may fail where this one's did not, and its attention output,
        all-reduced, spoils every rank's later layers). Loads of this step
        with one rank are the worker's to check: the spec names them
        (``SaveSpec.after``) and the worker saves nothing that a failed one
        spoiled. The loads of steps whose outcome is in: no block from the
        first one of the request's that a failed load spoiled and that has
        not been computed again since (see _recompute_spoiled)."""
        if not (st.enabled and self._save_enabled):
            return
        try:
            # Tokens whose K/V are in the cache once this step ran: the
            # scheduled ones that are real tokens (not speculative drafts).
            done = min(num_computed + num_scheduled, len(self._tokens(st.request)))
            full = self._sound_blocks(st, min(done // self._block_size, len(st.block_ids)))
            if full <= st.stored_blocks:
                return
            attended = st.block_ids[:full] if earlier or current else []
            if earlier and not earlier.isdisjoint(attended):
                return
            if current and self._tp_size > 1 and not current.isdisjoint(attended):
                return
            spec = self._blocks_to_save(st, req_id, full)
            if current:
                spec.after = [b for b in st.block_ids[:st.stored_blocks] if b in current]
            if spec.block_ids:
                meta.saves.append(spec)
            st.stored_blocks = full
        except Exception as e:  # noqa: BLE001
            logger.warning("kvdepot: planning the saves of %s failed: %s", req_id, e)

    def update_connector_output(self, connector_output: Any) -> None:
        """After a step: its loads have ended (the worker finishes them
        within the step), so their pins go and their blocks no longer count
        as in flight; loads planned for a later step (async scheduling) keep
        theirs. The output is matched to its step through the steps whose
        output comes (see build_connector_meta); one that was not awaited
        changes nothing but the failed blocks.

        Blocks whose load failed (``invalid_block_ids``, which vLLM
        recomputes): every request holding one, the loading request and any
        request sharing it through vLLM's prefix cache, no longer counts its
        blocks from the first failed one on as stored, so they are saved
        again once recomputed: the workers did not save what that step
        computed over them, and with tensor parallelism a block that rank 0
        holds may be missing on another rank. Those blocks count as spoiled
        until computed again over sound KV (see _recompute_spoiled): vLLM
        recomputes a shared block in one request only, maybe over several
        steps, while the others go on as if it were sound."""
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        if self._awaited:
            self._steps_done = self._awaited.popleft()
            loaded: Set[int] = set()
            for step in [s for s in self._loads_in_flight if s <= self._steps_done]:
                loaded |= self._loads_in_flight.pop(step)
            for st in self._requests.values():
                if st.load_in_flight and st.load_step <= self._steps_done:
                    st.load_in_flight = False
                    self._unpin(st)
            self._note_loads(loaded, invalid)
        if not invalid:
            return
        for st in self._requests.values():
            failed = next((i for i, b in enumerate(st.block_ids) if b in invalid), None)
            if failed is not None:
                st.stored_blocks = min(st.stored_blocks, failed)
                # A finished request is not recomputed: what it computed
                # from the failed block on is not saved.
                st.finished_blocks = min(st.finished_blocks, st.stored_blocks)
                for b in st.block_ids[failed:]:
                    if b != _NULL_BLOCK_ID:
                        self._spoiled[b] = 0

    _LOAD_FAILURE_STEPS = 3

    def _note_loads(self, loaded: Set[int], invalid: Set[int]) -> None:
        """The outcome of the loads of a step that ended (``loaded``: their
        block ids): pauses offers after _LOAD_FAILURE_STEPS steps in a row
        whose every block failed (see __init__)."""
        if not loaded:
            return
        if loaded - invalid:
            self._failed_load_steps = 0
            self._load_pause_s = self._load_pause_min_s
            return
        self._failed_load_steps += 1
        if self._failed_load_steps < self._LOAD_FAILURE_STEPS or self._load_pause_min_s <= 0:
            return
        self._failed_load_steps = 0
        self._offers_paused_until = self._clock() + self._load_pause_s
        self.stats["offer_pauses"] += 1
        logger.warning(
            "kvdepot: every load of the last %d steps failed (a worker without "
            "the connector, a rank without the blocks?); offering no kvdepot "
            "hits for %g s", self._LOAD_FAILURE_STEPS, self._load_pause_s)
        self._load_pause_s = min(2 * self._load_pause_s, 600.0)

    def request_finished(
        self, request: Any, block_ids: List[int]
    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """Drops the request's pins. Its blocks are saved step by step, so vLLM
        may free them now, ``(False, None)``, unless some of them still wait
        for a load's outcome (tensor parallelism, async scheduling; see
        ``_plan_save``): then ``(True, None)``, and the blocks are saved in the
        first step planned once that outcome is in (in the workers'
        ``get_finished``, which then reports the request as finished
        sending, so vLLM frees its blocks)."""
        st = self._requests.get(request.request_id)
        if st is None:
            return False, None
        self._unpin(st)
        st.request = request
        held = 0
        if st.enabled and self._save_enabled and self._disabled_reason is None:
            try:
                # The tokens whose K/V is in the cache: the computed ones,
                # never the last (sampled, not fed back).
                tokens = len(self._tokens(request))
                done = min(int(getattr(request, "num_computed_tokens", 0)), tokens - 1)
                if block_ids:
                    st.block_ids = list(block_ids)
                held = self._sound_blocks(
                    st, min(max(done, 0) // self._block_size, len(st.block_ids)))
            except Exception as e:  # noqa: BLE001 - free the blocks, lose the saves
                logger.warning("kvdepot: finishing %s failed: %s", request.request_id, e)
                held = 0
        if held <= st.stored_blocks:
            del self._requests[request.request_id]
            return False, None
        st.finished_blocks = held
        self._finishing.add(request.request_id)
        return True, None

    def _blocks_to_save(self, st: _RequestState, req_id: str, upto: int) -> SaveSpec:
        """The request's blocks from the first not known stored up to
        ``upto``, with their keys and parents."""
        first = st.stored_blocks
        if _NULL_BLOCK_ID in st.block_ids[first:upto]:
            # Not the request's block: nothing from it on is saved.
            upto = st.block_ids.index(_NULL_BLOCK_ID, first, upto)
        keys = self._keys_upto(st, upto)
        parent = keys[first - 1] if first > 0 else b""
        return SaveSpec(req_id, st.block_ids[first:upto], keys[first:upto],
                        parents_of(keys[first:upto], parent))

    def _plan_finished(self, meta: KvDepotConnectorMetadata) -> None:
        """The saves of finished requests whose blocks vLLM holds for them
        (``request_finished`` answered True), once no load whose blocks they
        attended to (their own, or another request's they share) is in
        flight; their state goes."""
        in_flight: Set[int] = set()
        for ids in self._loads_in_flight.values():
            in_flight |= ids
        for req_id in sorted(self._finishing):
            st = self._requests[req_id]
            if st.load_in_flight or (in_flight and not in_flight.isdisjoint(
                    st.block_ids[:st.finished_blocks])):
                continue
            self._finishing.discard(req_id)
            del self._requests[req_id]
            meta.finishing.append(req_id)
            upto = self._sound_blocks(st, st.finished_blocks)
            if upto <= st.stored_blocks:
                continue  # its load failed: nothing computed is worth saving
            try:
                spec = self._blocks_to_save(st, req_id, upto)
                if spec.block_ids:
                    meta.finishing_saves.append(spec)
            except Exception as e:  # noqa: BLE001 - still report it finished
                logger.warning("kvdepot: planning the last saves of %s failed: %s",
                               req_id, e)

    def take_events(self) -> Iterable[Any]:
        return ()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: Dict[str, Any]) -> bool:
        """True: loads are waited for per layer (``wait_for_layer_load``),
        which FULL CUDA graph replay would skip, so vLLM versions that ask
        (after 0.11) use PIECEWISE graphs with this connector."""
        return True

    # ------------------------------------------------------------------
    # Worker side

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        """Takes the per-layer caches (ordered by layer index) and checks them
        against the layout derived from the config; a mismatch disables the
        connector (logged), it never fails the engine."""
        try:
            import kvdepot

            if self._layout is None:
                return
            items = sorted(
                enumerate(kv_caches.items()), key=lambda x: _layer_index(x[1][0], x[0])
            )
            self._layer_names = [name for _, (name, _) in items]
            self._layer_index = {name: i for i, name in enumerate(self._layer_names)}
            self._caches = [t for _, (_, t) in items]
            if len(self._caches) != self._layout.num_layers:
                raise ValueError(
                    f"{len(self._caches)} cache tensors, the config says "
                    f"{self._layout.num_layers} layers")
            first = self._caches[0]
            bs = self._block_size
            # What the store reads: each cache as laid out in memory, and
            # that layout (the namespace is the same either way: objects are
            # in one order whatever the cache's). self._caches stay the
            # logical [2, N, block_size, heads, head_size] views (the torch
            # staging path indexes those).
            layout = self._layout
            self._store_caches = list(self._caches)
            if self._use_mla:
                want = (first.shape[0], bs, self._layout.head_size)
                order = "NHD"
            else:
                heads, head = self._layout.num_kv_heads, self._layout.head_size
                n = first.shape[1]
                want = (2, n, bs, heads, head)
                if _vllm_cpu_platform():
                    # CPU_ATTN: [2, N, heads, block_size, head_size] as is.
                    want = (2, n, heads, bs, head)
                    order = "CPU_ATTN"
                elif first.is_contiguous():
                    order = "NHD"
                else:
                    # FlashAttention with the HND stride order: a transposed
                    # view of [2, N, heads, block_size, head_size] memory.
                    order = "HND"
            for name, t in zip(self._layer_names, self._caches):
                if tuple(t.shape) != want or t.dtype != first.dtype:
                    raise ValueError(f"cache {name} has shape {tuple(t.shape)} "
                                     f"{t.dtype}, expected {want} {first.dtype}"
                                     + (" (vLLM's CPU attention layout)"
                                        if order == "CPU_ATTN" else ""))
                physical = t.transpose(2, 3) if order == "HND" else t
                if not physical.is_contiguous():
                    raise ValueError(f"cache {name} is neither contiguous nor a "
                                     f"[2, N, block_size, heads, head_size] view of "
                                     f"contiguous HND memory (strides {t.stride()})")
            if order != "NHD":
                self._store_caches = [t.transpose(2, 3) if order == "HND" else t
                                      for t in self._caches]
                self._caches = [t.transpose(2, 3) if order == "CPU_ATTN" else t
                                for t in self._caches]
                layout = kvdepot.KvLayout.mha(
                    kvdepot.KvCacheLayout.FLASH_ATTN_HND, self._layout.num_layers,
                    bs, self._layout.num_kv_heads, self._layout.head_size,
                    self._layout.dtype)
            if kvdepot.dtype_from_torch(first.dtype) != self._layout.dtype:
                raise ValueError(f"cache dtype {first.dtype} is not the model's")
            rank = self._tp_rank()
            # Through the store: the native module's gather/scatter for CPU
            # caches, the kvshim library (CUDA kernels) for CUDA caches
            # (staging=kvshim: the kvshim library for any device, its CPU
            # build for CPU caches); torch staging where that library is
            # missing, or with staging=torch.
            shim = None
            if self._staging == "kvshim":
                from kvdepot.kvshim import KvShim

                shim = KvShim.for_device(first.device.type)
            self._store = kvdepot.KvCacheStore(
                self._server, layout, self._model_label(rank),
                client=self._get_client(), shim=shim)
            # No store batch above max_batch_keys blocks (see _load_async).
            self._store.min_batch_bytes = min(
                self._store.min_batch_bytes,
                self._max_batch_keys * self._layout.object_bytes)
            self._store_pipeline_batches = self._store.pipeline_batches
            self._via_store = self._staging != "torch"
            if self._staging == "auto" and first.device.type != "cpu":
                try:
                    self._store.shim_for(self._store_caches)
                except Exception as e:  # noqa: BLE001
                    logger.warning(
                        "kvdepot: no native gather/scatter for %s caches (%s); "
                        "using the torch staging path", first.device, e)
                    self._via_store = False
        except Exception as e:  # noqa: BLE001
            self._store = None
            self._disable(f"register_kv_caches: {e}")

    def _tp_rank(self) -> int:
        pc = getattr(self._vllm_config, "parallel_config", None)
        rank = getattr(pc, "rank", 0) or 0
        try:  # vLLM's own view of the TP rank, where it is initialized
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        except Exception:  # noqa: BLE001
            pass
        return int(rank) % self._tp_size

    # The torch staging path (devices other than CPU): the same canonical
    # object bytes as kvdepot.gather/scatter, [layers, K/V, tokens, heads,
    # head_size] per block.
    def _torch_gather(self, block_ids: List[int]) -> List[Any]:
        import torch

        idx = torch.tensor(block_ids, dtype=torch.long, device=self._caches[0].device)
        if self._use_mla:
            stacked = torch.stack([c.index_select(0, idx) for c in self._caches], dim=1)
        else:
            stacked = torch.stack([c.index_select(1, idx) for c in self._caches], dim=0)
            stacked = stacked.permute(2, 0, 1, 3, 4, 5)
        host = stacked.contiguous().to("cpu")
        return [host[i] for i in range(len(block_ids))]

    def _torch_scatter(self, block_ids: List[int], objects: List[Any]) -> None:
        import torch

        dev = self._caches[0].device
        idx = torch.tensor(block_ids, dtype=torch.long, device=dev)
        data = torch.stack(objects).to(dev)
        for layer, cache in enumerate(self._caches):
            if self._use_mla:
                cache.index_copy_(0, idx, data[:, layer])
            else:
                cache.index_copy_(1, idx, data[:, layer].transpose(0, 1))

    def _object_shape(self) -> Tuple[int, ...]:
        lay = self._layout
        if self._use_mla:
            return (lay.num_layers, lay.block_size, lay.head_size)
        return (lay.num_layers, 2, lay.block_size, lay.num_kv_heads, lay.head_size)

    def _torch_load(self, block_ids: List[int],
                    keys: List[bytes]) -> Tuple[List[bool], List[Any]]:
        """The torch staging path's load (synchronous, all layers): a read
        per chunk, in order, up to the first chunk not entirely loaded (only
        a loaded prefix is used). Returns a flag per block and an error per
        block (None, or the ``(name, message)`` of a chunk that raised, at
        its first block); the blocks from a failed chunk on are not loaded."""
        import torch

        filled = [False] * len(keys)
        errors: List[Any] = [None] * len(keys)
        for lo, hi in self._staging_chunks(len(keys)):
            if not self._breaker.allow():
                self.stats["unavailable_skips"] += 1
                errors[lo] = ("UNAVAILABLE", "kvdepotd unavailable: not called (back-off)")
                break
            bufs = [torch.empty(self._object_shape(), dtype=self._caches[0].dtype)
                    for _ in range(lo, hi)]
            try:
                got = self._store.client.get_into(self._store.namespace, keys[lo:hi], bufs)
                self._breaker.succeeded()
            except Exception as e:  # noqa: BLE001 - reported by the caller
                self._breaker.failed(e)
                errors[lo] = (status_code(e) or type(e).__name__, str(e))
                break
            hits = [i for i, ok in enumerate(got) if ok]
            if hits:
                self._torch_scatter([block_ids[lo + i] for i in hits],
                                    [bufs[i] for i in hits])
            filled[lo:hi] = [bool(ok) for ok in got]
            if len(hits) < hi - lo:
                break
        return filled, errors

    def _load_async(self, block_ids: List[int], keys: List[bytes]) -> Any:
        """``KvCacheStore.load_async`` (of one staging round, see
        :meth:`_next_round`) in batches (one daemon read each) of
        at most max_batch_keys blocks. The store splits a load into up to
        ``pipeline_batches`` batches of at least 2 blocks and
        ``min_batch_bytes`` (register_kv_caches caps that at max_batch_keys
        objects) when the load starts, so for this call it gets enough
        batches to keep each within the limit; its saves keep its own
        number (each save here is one chunk)."""
        needed = -(-len(keys) // self._max_batch_keys)
        self._store.pipeline_batches = max(self._store_pipeline_batches, needed)
        try:
            return self._store.load_async(self._store_caches, block_ids, keys)
        finally:
            self._store.pipeline_batches = self._store_pipeline_batches

    def _save(self, block_ids: List[int], keys: List[bytes], parents: List[bytes]) -> None:
        """Stores one chunk (at most max_staging_blocks blocks)."""
        if self._via_store:
            self._store.save(self._store_caches, block_ids, keys, parents)
            return
        objects = self._torch_gather(block_ids)
        self._store.client.put(self._store.namespace, keys, objects, parents)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Starts reading this step's blocks into the paged caches and
        returns: one :meth:`kvdepot.KvCacheStore.load_async` for all of the
        step's loads, scattered layer by layer in the background (see
        :meth:`wait_for_layer_load`). The torch staging path (non-CPU caches)
        loads synchronously here instead. Blocks not loaded are reported by
        :meth:`get_block_ids_with_load_errors`; nothing raises."""
        self._finish_load()  # an earlier step's, should one be left
        self._failed_load_reqs = set()
        self._failed_load_blocks = set()
        meta = self._connector_metadata
        if not isinstance(meta, KvDepotConnectorMetadata) or not meta.loads:
            return
        if self._store is None:
            for spec in meta.loads:
                self._load_failed(spec, spec.block_ids, "connector disabled")
            return
        if not self._via_store:
            for spec in meta.loads:
                try:
                    if len(spec.block_ids) != len(spec.keys):  # see _plan_load
                        self._load_failed(spec, spec.block_ids, f"{len(spec.block_ids)} "
                                          f"block ids but {len(spec.keys)} keys")
                        continue
                    if self._breaker.blocked():
                        self.stats["unavailable_skips"] += 1
                        self._load_failed(spec, spec.block_ids,
                                          "kvdepotd unavailable: not called (back-off)")
                        continue
                    filled, errors = self._torch_load(spec.block_ids, spec.keys)
                    self._account(spec, filled, errors)
                except Exception as e:  # noqa: BLE001
                    self._load_failed(spec, spec.block_ids, str(e))
            return
        # One load for the step, of the specs that can load: a spec with a
        # bad block id is reported alone instead of failing the others.
        specs = []
        seen: Set[int] = set()
        for spec in meta.loads:
            ids = [int(b) for b in spec.block_ids]
            why = None
            if len(ids) != len(spec.keys):
                why = f"{len(ids)} block ids but {len(spec.keys)} keys"
            elif len(set(ids)) != len(ids) or not seen.isdisjoint(ids):
                why = "a block id repeats within the step"
            else:
                try:
                    self._store.check_block_ids(self._store_caches, ids)
                except ValueError as e:
                    why = str(e)
            if why is not None:
                self._load_failed(spec, spec.block_ids, why)
                continue
            seen.update(ids)
            specs.append(spec)
        if not specs:
            return
        block_ids = [b for spec in specs for b in spec.block_ids]
        keys = [k for spec in specs for k in spec.keys]
        # Staging rounds of at most max_staging_blocks blocks, one after the
        # other: the store's staging memory never grows past that.
        rounds = batch_ranges(len(keys), self._max_staging_blocks)
        pending = _PendingLoad(specs, block_ids, keys, rounds)
        self._start_round(pending, probe=True)
        self._pending_load = pending
        if self._load_before_forward:
            self._finish_load()

    def _start_round(self, pending: _PendingLoad, probe: bool = False) -> None:
        """Starts staging round ``pending.round``. Skipped, its blocks
        failing as unavailable, while kvdepotd is (the breaker's window;
        ``probe``: the step's first round, which may be the probe that ends
        it); a round that cannot start fails its blocks with the error."""
        lo, hi = pending.rounds[pending.round]
        pending.handle = None
        if not (self._breaker.allow() if probe else not self._breaker.blocked()):
            self.stats["unavailable_skips"] += 1
            pending.errors.extend(
                [("UNAVAILABLE", "kvdepotd unavailable: not called (back-off)")] * (hi - lo))
            return
        try:
            pending.handle = self._load_async(pending.block_ids[lo:hi], pending.keys[lo:hi])
        except Exception as e:  # noqa: BLE001 - e.g. a bad block id: recompute
            self._breaker.failed(e)
            pending.errors.extend([(status_code(e) or type(e).__name__, str(e))] * (hi - lo))

    def _end_round(self, pending: _PendingLoad) -> None:
        """Waits for the current round and records its per-block outcomes
        (and, for the breaker, whether the daemon answered)."""
        handle, pending.handle = pending.handle, None
        if handle is None:
            return  # skipped or failed to start: recorded
        failure: Optional[str] = None
        try:
            handle.wait()
        except Exception as e:  # noqa: BLE001 - block errors: per block below
            failure = str(e)
        try:
            errors = list(handle.errors())
        except Exception:  # noqa: BLE001 - not done (cannot happen after wait)
            errors = [("UNKNOWN", failure or "load not finished")] * len(handle)
        down = next((e for e in errors if status_code(e) in UNAVAILABLE_CODES), None)
        if down is not None:
            self._breaker.failed(down)
        else:
            self._breaker.succeeded()
        pending.errors.extend(errors)

    def _next_round(self, pending: _PendingLoad) -> bool:
        """Ends the current round and starts the next; False if it was the
        last."""
        self._end_round(pending)
        pending.round += 1
        if pending.round >= len(pending.rounds):
            return False
        self._start_round(pending)
        return True

    def _finish_load(self) -> None:
        """Waits for the load in flight, if any (every round), and records
        what each of its specs loaded and which blocks failed. Never
        raises."""
        pending, self._pending_load = self._pending_load, None
        if pending is None:
            return
        while self._next_round(pending):
            pass
        errors = pending.errors
        pos = 0
        for spec in pending.specs:
            part = errors[pos:pos + len(spec.block_ids)]
            pos += len(spec.block_ids)
            self._account(spec, [e is None for e in part], part)

    def _account(self, spec: LoadSpec, filled: List[bool],
                 errors: Optional[List[Any]]) -> None:
        """Counts the loaded prefix of ``spec`` and reports the rest: a prefix
        is what vLLM can use, everything from the first block not loaded on
        is recomputed."""
        n = filled.index(False) if False in filled else len(filled)
        self.stats["loaded_blocks"] += n
        if n < len(filled):
            err = errors[n] if errors is not None else None
            why = f"miss at block {n} of {len(filled)}"
            if err is not None and err[0] != "NOT_FOUND":
                why = f"{err[0]}: {err[1]} at block {n} of {len(filled)}"
            self._load_failed(spec, spec.block_ids[n:], why)

    def _load_failed(self, spec: LoadSpec, block_ids: Sequence[int], why: str) -> None:
        logger.warning("kvdepot: %d blocks of %s not loaded (%s); %s",
                       len(block_ids), spec.req_id, why,
                       "vLLM recomputes them" if self._recompute_failures else
                       "vLLM fails the request (kv_load_failure_policy \"fail\")")
        self.stats["load_errors"] += len(block_ids)
        self._load_errors.update(int(b) for b in block_ids)
        self._failed_load_blocks.update(int(b) for b in block_ids)
        self._failed_load_reqs.add(spec.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Returns once layer ``layer_name`` (and every layer before it, in
        the order ``register_kv_caches`` sorted them) of the blocks loaded
        this step is in the paged caches. An unknown layer name waits for
        the whole load. Nothing raises: a failure is recorded as load errors
        (see :meth:`get_block_ids_with_load_errors`)."""
        pending = self._pending_load
        if pending is None:
            return
        index = self._layer_index.get(layer_name)
        try:
            if index is not None:
                # The rounds before the last are loaded whole (each stages
                # into the memory the next one reuses); the last streams.
                while pending.round < len(pending.rounds) - 1:
                    self._next_round(pending)
                if pending.handle is not None:
                    pending.handle.wait_for_layer(index)
                return
        except Exception as e:  # noqa: BLE001 - never fail the engine
            logger.warning("kvdepot: waiting for layer %s failed: %s", layer_name, e)
        self._finish_load()

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Nothing per layer: a kvdepot block holds all layers, so the blocks
        are stored in wait_for_save once every layer is written."""
        return None

    def wait_for_save(self) -> None:
        """Finishes the step's load, then stores this step's publishable
        blocks (all layers). Failures are logged and counted: a lost save is
        a future miss, never an error.

        Nothing computed over a block whose load failed in this step is
        saved (see :meth:`_savable`): it attended to the KV of a block that
        was not loaded, and its key names the right prefix. (The scheduler,
        told of the failed blocks, has them saved once vLLM recomputed
        them.)"""
        self._finish_load()
        meta = self._connector_metadata
        if not isinstance(meta, KvDepotConnectorMetadata) or not meta.saves:
            return
        if self._store is None:
            return
        for spec in meta.saves:
            spec = self._savable(spec)
            if spec.keys:
                self._save_spec(spec)

    def _savable(self, spec: SaveSpec) -> SaveSpec:
        """The part of ``spec`` that no failed load of this step spoiled:
        nothing if the request's own load failed or a block it attended to
        before the spec's (``spec.after``) failed, else the blocks before
        the first failed one among the spec's own (a block another request
        loaded into the cache it shares through vLLM's prefix cache). What
        is cut is counted and logged."""
        failed = self._failed_load_blocks
        if not failed and spec.req_id not in self._failed_load_reqs:
            return spec
        if spec.req_id in self._failed_load_reqs or not failed.isdisjoint(spec.after):
            keep = 0
        else:
            keep = next((i for i, b in enumerate(spec.block_ids) if int(b) in failed),
                        len(spec.block_ids))
        if keep == len(spec.keys):
            return spec
        self.stats["saves_dropped"] += len(spec.keys) - keep
        logger.warning("kvdepot: not saving %d blocks of %s: they attended to blocks "
                       "whose load failed in this step", len(spec.keys) - keep, spec.req_id)
        return SaveSpec(spec.req_id, spec.block_ids[:keep], spec.keys[:keep],
                        spec.parents[:keep], spec.after)

    def _save_spec(self, spec: SaveSpec) -> None:
        """Stores one spec's blocks, a chunk at a time, in order: each chunk's
        first block links to the last of the chunk before (``spec.parents``
        chains them), which is stored by then. A failure is logged and
        counted; the chunks from the failed one on are not stored. While
        kvdepotd is unavailable (the breaker's window) nothing is called: the
        blocks count as save errors (and the call in ``unavailable_skips``)."""
        saved = 0
        try:
            for lo, hi in self._staging_chunks(len(spec.keys)):
                if not self._breaker.allow():
                    # kvdepotd unavailable (the breaker logged it): not saved.
                    self.stats["unavailable_skips"] += 1
                    self.stats["save_errors"] += len(spec.keys) - saved
                    break
                self._save(spec.block_ids[lo:hi], spec.keys[lo:hi], spec.parents[lo:hi])
                self._breaker.succeeded()
                saved = hi
        except Exception as e:  # noqa: BLE001
            self._breaker.failed(e)
            self.stats["save_errors"] += len(spec.keys) - saved
            logger.warning("kvdepot: saving %d blocks of %s failed: %s",
                           len(spec.keys) - saved, spec.req_id, e)
        self.stats["saved_blocks"] += saved

    def get_finished(
        self, finished_req_ids: Set[str]
    ) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """Finishes the step's load, should it still run, then stores the
        last blocks of the requests that finished with their blocks held
        (see :meth:`request_finished`) and reports those requests as
        finished sending, saved or not (a failed save is logged and counted),
        so vLLM frees their blocks. This runs in every step, with or without
        tokens. Loads end within their step: nothing is finished
        receiving."""
        self._finish_load()
        meta = self._connector_metadata
        if not isinstance(meta, KvDepotConnectorMetadata) or not meta.finishing:
            return None, None
        if self._store is not None:
            for spec in meta.finishing_saves:
                spec = self._savable(spec)
                if spec.keys:
                    self._save_spec(spec)
        return set(meta.finishing), None

    def get_block_ids_with_load_errors(self) -> Set[int]:
        """Block ids whose load failed since the last call (then cleared);
        finishes the step's load first."""
        self._finish_load()
        errors, self._load_errors = self._load_errors, set()
        return errors


__all__ = [
    "HAVE_VLLM",
    "KVConnectorRole",
    "KvDepotConnector",
    "KvDepotConnectorMetadata",
    "LoadSpec",
    "SaveSpec",
]
