"""KvDepotHiCacheStorage: kvdepot as SGLang's HiCache L3 storage backend.

Load it with::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvdepot",
            "module_path": "kvdepot.integrations.sglang",
            "class_name": "KvDepotHiCacheStorage", "interface_v1": 1,
            "server": "127.0.0.1:50551"}'

``"interface_v1": 1`` makes SGLang's cache controller use the zero-copy page
functions (``batch_get_v1`` / ``batch_set_v1``) for a dynamic backend; without
it SGLang uses the generic ``batch_get`` / ``batch_set`` with staging
tensors, which this backend also implements.

Interface followed: SGLang ``HiCacheStorage``
(``python/sglang/srt/mem_cache/hicache_storage.py``) and the dynamic loading
of ``python/sglang/srt/mem_cache/storage/backend_factory.py``, which calls
``cls(storage_config, kwargs)``; the cache controller then calls
``register_mem_pool_host(host_pool)``. Methods: ``batch_exists(keys,
extra_info=None) -> int`` (length of the stored prefix, in pages),
``batch_get_v1(keys, host_indices, extra_info=None) -> list[bool]`` and
``batch_set_v1(...)`` (no staging tensor: kvdepot reads and writes the host
pool's memory at the page addresses the pool's ``get_page_buffer_meta``
gives), ``get``/``set``/``batch_get``/``batch_set``/``exists`` (generic path),
``clear``, ``get_stats`` (a ``StorageMetrics`` where SGLang has it). The
``*_v2`` pool-transfer methods (hybrid models: DSA indexer, Mamba/GDN, SWA
pools) are not served: they answer misses (``batch_exists_v2`` a
``PoolTransferResult`` of 0 pages, ``batch_get_v2``/``batch_set_v2`` False
for every page of every pool) and never raise, and a host pool other than
the KV pool and speculative decoding's draft KV pools registered through
``register_mem_host_pool_v2`` disables the backend (error log), since KV
pages alone are no use to such a model. Speculative decoding's draft KV
pages (EAGLE, MTP) are not stored: SGLang sends them, for a backend other
than mooncake, through the generic ``batch_set`` / ``batch_get`` under
``<page hash>.draft`` (or ``.draft-<drafter>``) with pages of the draft
pool's size, not the target pool's; those calls are answered False / None
without a daemon call, quietly (SGLang treats draft pages as best-effort:
a miss costs only acceptance), and counted in
``counters["draft_skipped"]``. Without
SGLang installed, the class subclasses :class:`_StandInHiCacheStorage`, a
local stand-in of the base class (its ``register_mem_pool_host`` and
prefix ``batch_exists``) that exists so tests can drive the backend; it is
not SGLang.

Data plane: ``register_mem_pool_host`` registers the host pool's tensors
(``kv_buffer``) with the kvdepot client (``Client.register_buffer``), so the
page buffers, which lie inside them, move over UCX, in place. Where that
fails (no UCX; ``Client.data_plane_status`` says why) a warning is logged and
the pages take the gRPC byte path: the same bytes, copied through the RPC
messages, many times slower.

Storage: each page is stored as the objects ``get_page_buffer_meta`` lists
for it (K and V for an MHA ``page_first`` pool, one latent for MLA, one per
layer and K/V for ``layer_first``), under ``<page key>.<i>``, in the
namespace ``KvLayout.namespace_for("sglang/<model>/<pool layout>/tpRofN")``
(MLA: no rank; ``<model>`` followed, where set, by a digest of the model
path ``path:<digest>`` where the model's name (the served model name) is
not its path, so two checkpoints served under one alias never share KV,
then by the model revision
``rev:...``, the quantization method ``quant:...`` and a digest of the HF
config overrides ``hf:<digest>`` (``--json-model-override-args``, which
carries RoPE scaling changes), read from SGLang's server arguments in the
scheduler process, or from the storage config where an SGLang version puts
them there, with its ``model_identity_hash`` as ``id:<hash>``), followed by
``ppRofN`` with pipeline parallelism, ``cpRofN`` with attention context
parallelism (each rank holds its own slice of a page) and, for an FP8 KV
cache, the logical dtype (``float8_e4m3fn``, ``float8_e5m2``). A page is
present only when all its objects are.

Batches: a call covers up to SGLang's whole batch (128 pages of 64 objects
with 32 layers ``layer_first``), more keys than the daemon takes in one
lookup or transfer (its ``max_batch_keys``, 1024 by default). Each call is
split into daemon calls of at most ``max_batch_keys`` keys, at page
boundaries (unless one page alone has more objects). ``batch_exists`` stops
at the first chunk that is not all stored.

Errors never escape: a failed lookup is 0 pages, a failed get or set is
False for each page it covered (SGLang then recomputes or retries); a get or
set reports each page on its own, so one bad page does not fail the others.
A NOT_FOUND object is a miss for a get; ABORTED (the daemon no longer has
the client's session, e.g. after a restart: the next call opens a new one)
fails a get or a put, counted and logged. After a call finds
kvdepotd unavailable (UNAVAILABLE or DEADLINE_EXCEEDED) the backend does not
call it for a back-off window (:class:`kvdepot.integrations.CircuitBreaker`:
``backoff_s``, doubling after each failed retry up to ``max_backoff_s``,
reset once it answers; one warning when it opens, one when it closes): every
call is then a miss, counted in ``counters["unavailable_skips"]``.
A host pool the backend cannot serve (an FP8 pool whose logical dtype is
unknown, a pool without page buffers, a hybrid model's extra pool), or a
model nothing names (no model name, no model path, no ``model`` in the extra
config), disables the backend with an error log instead of failing the
server: every lookup is then 0 pages, every get and set False.

Extra config: ``server`` (default ``$KVDEPOT_SERVER`` or
``127.0.0.1:50551``), ``model`` (default ``storage_config.model_name``, else
the model path, with the path digest, revision, quantization and overrides
above; given, the namespace's model name as it is),
``timeout_s`` (5), ``backoff_s`` (1; 0 turns the circuit breaker off),
``max_backoff_s`` (30), ``lease_s`` (0: the daemon's default),
``max_batch_keys`` (1024: set it to the daemon's ``max_batch_keys`` where
that is lower).
"""

from __future__ import annotations

import collections
import ctypes
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

from . import (DEFAULT_MAX_BATCH_KEYS, UNAVAILABLE_CODES, CircuitBreaker, batch_ranges,
               config_digest, model_label, model_variant, status_code)

logger = logging.getLogger(__name__)


# Statistics kept for get_stats at most (per list): SGLang calls get_stats
# only with its storage metrics on (enable_storage_metrics); this bounds the
# memory should nobody drain them.
_MAX_PENDING_STATS = 1024

# Whether the warning that the model path is unknown was logged (once per
# process: SGLang has one backend per scheduler process).
_warned_no_model_path = False

# torch dtype names of the 1-byte FP8 formats an FP8 KV cache is stored in.
# SGLang's host pool holds them as torch.uint8 (the device pool's
# store_dtype); the device pool's dtype names the format.
_FP8_DTYPES = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")

try:  # pragma: no cover - depends on the environment
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    HAVE_SGLANG = True
except Exception:  # SGLang missing: the stand-in.
    HAVE_SGLANG = False

    class _StandInHiCacheStorage:
        """A minimal local stand-in of SGLang's ``HiCacheStorage``, used only
        when SGLang cannot be imported: ``register_mem_pool_host``,
        ``register_mem_host_pool_v2`` and the default ``clear``/``get_stats``,
        as SGLang implements them."""

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            self.mem_pool_host = mem_pool_host

        def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
            if not hasattr(self, "registered_pools"):
                self.registered_pools = {}
            self.registered_pools[host_pool_name] = host_pool

        def clear(self) -> None:
            pass

        def get_stats(self) -> Any:
            return None

    HiCacheStorage = _StandInHiCacheStorage  # type: ignore[misc,assignment]

try:  # pragma: no cover - SGLang versions with the v2 (hybrid pool) interface
    from sglang.srt.mem_cache.hicache_storage import PoolTransferResult
except Exception:

    @dataclass
    class PoolTransferResult:  # type: ignore[no-redef]
        """Stand-in of SGLang's PoolTransferResult (``batch_exists_v2``'s
        answer: the usable KV prefix in pages, and the pages found per
        extra pool)."""

        kv_hit_pages: int
        extra_pool_hit_pages: Dict[str, int]

        @classmethod
        def empty(cls) -> "PoolTransferResult":
            return cls(0, {})

try:  # pragma: no cover - SGLang moved it between versions
    from sglang.srt.observability.metrics_collector import StorageMetrics
except Exception:
    try:
        from sglang.srt.metrics.collector import StorageMetrics  # type: ignore
    except Exception:

        @dataclass
        class StorageMetrics:  # type: ignore[no-redef]
            """Stand-in of SGLang's StorageMetrics (same fields)."""

            prefetch_pgs: List[int] = field(default_factory=list)
            backup_pgs: List[int] = field(default_factory=list)
            prefetch_bandwidth: List[float] = field(default_factory=list)
            backup_bandwidth: List[float] = field(default_factory=list)


def _cfg(storage_config: Any, name: str, default: Any) -> Any:
    value = getattr(storage_config, name, default) if storage_config is not None else default
    return default if value is None else value


def _server_args() -> Any:
    """SGLang's server arguments in this process (the scheduler's, where
    the HiCache storage backend lives), or None where they cannot be had
    (no SGLang, a version without ``get_global_server_args``, not set)."""
    try:
        from sglang.srt.server_args import get_global_server_args

        return get_global_server_args()
    except Exception:  # noqa: BLE001 - then the storage config alone
        return None


def _pool_name(name: Any) -> str:
    """A pool name (SGLang's PoolName enum, or its value) as its value."""
    return str(getattr(name, "value", name))


def _model_path(storage_config: Any) -> Optional[str]:
    """The model's ``--model-path`` (the weights the KV comes from), from
    the storage config where an SGLang version puts it there, else from
    SGLang's server arguments; None where neither has it."""
    value = getattr(storage_config, "model_path", None) if storage_config is not None else None
    if not value:
        args = _server_args()
        value = getattr(args, "model_path", None) if args is not None else None
    return str(value) if value else None


def _model_variant(storage_config: Any, model_name: str = "") -> List[str]:
    """Parts of the default namespace label, beside the model name, for what
    else makes two deployments of one model compute other KV: the model path
    where the name is not it (``path:<digest>``: SGLang's storage config
    names the model by ``--served-model-name``, often an alias two
    checkpoints may share), the model ``revision`` (``rev:<revision>``), the
    ``quantization`` method (``quant:<method>``) and the HF config overrides
    (``--json-model-override-args``, which carries RoPE scaling changes:
    ``hf:<digest>``), each only where set, from the storage config where an
    SGLang version puts them there (and its ``model_identity_hash``:
    ``id:<hash>``), else from SGLang's server arguments."""
    args = _server_args()
    path = _model_path(storage_config)
    parts = [f"path:{config_digest(path)}"] if path and path != model_name else []

    def setting(name: str) -> Any:
        value = getattr(storage_config, name, None) if storage_config is not None else None
        if value is None and args is not None:
            value = getattr(args, name, None)
        return value

    overrides = setting("json_model_override_args")
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides) if overrides.strip() else None
        except ValueError:
            pass  # named by its text
    return parts + model_variant(identity=getattr(storage_config, "model_identity_hash", None),
                                 revision=setting("revision"),
                                 quantization=setting("quantization"), overrides=overrides)


def _is_draft_key(key: Any) -> bool:
    """Whether ``key`` names a speculative-decoding draft page: SGLang's
    cache controller stores those, for backends other than mooncake,
    through the generic ``batch_set`` / ``batch_get`` under ``<page
    hash>.<PoolName.DRAFT>`` (``draft``; versions naming the drafter:
    ``draft-<drafter>``). Their pages are the draft pool's, of another size
    than the target pool's, which this backend's namespace and objects
    describe: not stored (see KvDepotHiCacheStorage.batch_set). Storing
    them would take a namespace of their own named by the drafter, which
    SGLang does not tell the backend (under the target model's alone,
    another drafter of the same shape would read them). Page hashes
    themselves have no dot."""
    _, dot, tail = str(key).rpartition(".")
    return bool(dot) and tail.startswith("draft")


def _dtype_name(dtype: Any) -> str:
    """``torch.float8_e5m2`` -> ``float8_e5m2`` (by name: torch versions
    differ in which FP8 dtypes they have)."""
    return str(dtype).rsplit(".", 1)[-1]


class KvDepotHiCacheStorage(HiCacheStorage):  # type: ignore[misc,valid-type]
    """SGLang HiCache storage in kvdepotd (see the module docstring).

    Thread-safe as SGLang uses it (prefetch and backup threads call it
    concurrently): the kvdepot client is thread-safe and the statistics are
    under a lock."""

    def __init__(self, storage_config: Any = None, kwargs: Optional[Dict[str, Any]] = None):
        import kvdepot

        self._kvdepot = kvdepot
        extra = dict(_cfg(storage_config, "extra_config", {}) or {})
        self._server = str(
            extra.get("server") or os.environ.get("KVDEPOT_SERVER") or "127.0.0.1:50551"
        )
        self._timeout_s = float(extra.get("timeout_s", 5.0))
        self._lease_s = float(extra.get("lease_s", 0.0))
        self._max_batch_keys = max(1, int(extra.get("max_batch_keys", DEFAULT_MAX_BATCH_KEYS)))
        # After kvdepotd was found unavailable, no call for a back-off window
        # (see CircuitBreaker): every lookup 0 pages, every get and set False.
        self._breaker = CircuitBreaker(
            "SGLang HiCache", min_s=float(extra.get("backoff_s", 1.0)),
            max_s=float(extra.get("max_backoff_s", 30.0)), log=logger)
        # The model's name ("" if nothing names it: the pool's registration
        # then disables the backend; see _namespace_for).
        self._model = str(extra.get("model") or _cfg(storage_config, "model_name", "") or "")
        # What else sets the model's KV apart (see _model_variant, read when
        # the pool is registered); a model named in the extra config is the
        # namespace's name as given.
        self._storage_config = storage_config
        self._model_given = bool(extra.get("model"))
        self._tp_rank = int(_cfg(storage_config, "tp_rank", 0))
        self._tp_size = int(_cfg(storage_config, "tp_size", 1))
        self._pp_rank = int(_cfg(storage_config, "pp_rank", 0))
        self._pp_size = int(_cfg(storage_config, "pp_size", 1))
        # Attention context parallelism (SGLang versions without the fields:
        # none). Each CP rank's host pool holds its own slice of a page.
        self._cp_rank = int(_cfg(storage_config, "attn_cp_rank", 0))
        self._cp_size = int(_cfg(storage_config, "attn_cp_size", 1))
        self._is_mla = bool(_cfg(storage_config, "is_mla_model", False))
        # SGLang calls get_stats only with storage metrics on; versions
        # without the field: recorded (bounded either way).
        self._record_stats = bool(_cfg(storage_config, "enable_storage_metrics", True))
        self._client = kvdepot.Client(
            self._server, timeout_s=self._timeout_s, lease_s=self._lease_s,
            client_name="kvdepot-sglang")
        self.mem_pool_host: Any = None
        # None until a pool is registered, and when the backend is disabled:
        # every call is then a miss.
        self._namespace: Optional[str] = None
        self._disabled_reason: Optional[str] = None
        # Extra host pools SGLang registered for a hybrid model
        # (register_mem_host_pool_v2): they disable the backend.
        self._side_pools: List[str] = []
        self._v2_logged = False
        self._host_pool_registered = False
        self._objects_per_page = 0
        self._object_sizes: List[int] = []
        self._lock = threading.Lock()
        self._prefetch_pgs: Deque[int] = collections.deque(maxlen=_MAX_PENDING_STATS)
        self._backup_pgs: Deque[int] = collections.deque(maxlen=_MAX_PENDING_STATS)
        self._prefetch_bw: Deque[float] = collections.deque(maxlen=_MAX_PENDING_STATS)
        self._backup_bw: Deque[float] = collections.deque(maxlen=_MAX_PENDING_STATS)
        self.counters: Dict[str, int] = {
            "exists_calls": 0, "exists_hit_pages": 0, "get_pages": 0,
            "get_hit_pages": 0, "set_pages": 0, "set_ok_pages": 0, "errors": 0,
            # Draft pages (speculative decoding) refused by the generic
            # batch_set / batch_get (see _is_draft_key).
            "draft_skipped": 0,
            # Calls not made while kvdepotd was unavailable (the breaker's
            # back-off window), each answered as a miss.
            "unavailable_skips": 0,
        }

    # ------------------------------------------------------------------
    # Setup

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Takes the host KV pool (SGLang's HostKVCache): its page size,
        layout and ``get_page_buffer_meta`` define the stored objects, and
        its tensors are registered with the client (UCX). A pool the backend
        cannot serve disables it (error log) instead of raising."""
        super().register_mem_pool_host(mem_pool_host)
        self._namespace = None
        if self._side_pools:
            return  # disabled (see register_mem_host_pool_v2)
        try:
            namespace = self._namespace_for(mem_pool_host)
        except Exception as e:  # noqa: BLE001 - disable, never fail SGLang
            self._disable(str(e))
            return
        self._disabled_reason = None
        self._host_pool_registered = self._register_host_memory(mem_pool_host)
        self._namespace = namespace

    def _disable(self, reason: str) -> None:
        """Every call a miss from now on (error log)."""
        self._namespace = None
        self._disabled_reason = reason
        logger.error("kvdepot: HiCache storage backend disabled (every page a miss): %s",
                     reason)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang registers the extra host pools of a hybrid model here (DSA
        indexer, Mamba/GDN states, SWA; the v2 interface). This backend
        stores only the KV pool's pages, and KV pages without the state of
        those pools are no use to such a model, so such a pool disables the
        backend (error log); every call is then a miss. The KV pool (which
        some SGLang versions register here too) and the draft KV pools of
        speculative decoding (``draft*``, which SGLang reads and writes
        best-effort: a draft miss only costs acceptance) do not: their v2
        calls are misses (warning). (SGLang registers a draft pool here only
        for the mooncake backend; for this one it sends the draft pages
        through the generic calls, refused as ``_is_draft_key`` says.)
        Never raises."""
        try:
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
        except Exception:  # noqa: BLE001 - an SGLang version without it
            pass
        name = _pool_name(host_pool_name)
        if name == "kv":
            return
        if name.startswith("draft"):
            logger.warning("kvdepot: SGLang registered the %r host pool (speculative "
                           "decoding's draft KV): not stored, its pages are misses", name)
            return
        self._side_pools.append(name)
        self._disable(f"SGLang registered a {name!r} host pool (a hybrid model's extra "
                      f"state, the v2 interface): this backend stores only KV pages")

    def _namespace_for(self, pool: Any) -> str:
        """The pool's namespace; sets the per-page object count and sizes.
        Raises for a pool the backend cannot serve."""
        import torch

        if not self._model_given:
            if not self._model:
                # Unnamed: the model path names it, or nothing does.
                self._model = _model_path(self._storage_config) or ""
            if not self._model:
                raise ValueError(
                    "nothing names the model (no model_name in the storage config, no "
                    "model path in SGLang's server arguments): set extra config "
                    "\"model\" to a name of the weights")
            global _warned_no_model_path
            if _model_path(self._storage_config) is None and not _warned_no_model_path:
                _warned_no_model_path = True  # once per process
                logger.warning(
                    "kvdepot: SGLang's model path is not known here: the namespace is "
                    "named by the model name %r alone; if that is an alias "
                    "(--served-model-name) that other weights may share, set extra "
                    "config \"model\" to a name of these weights", self._model)
        page = int(pool.page_size)
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
        if not ptrs:
            raise ValueError(f"the host pool ({type(pool).__name__}) lists no page buffers")
        kv = self._kvdepot
        dtype, fp8_name = self._kv_dtype(pool)
        layer_num = int(pool.layer_num)
        variant = [] if self._model_given else _model_variant(self._storage_config, self._model)
        if self._is_mla:
            width = int(getattr(pool, "kv_lora_rank", 0)) + int(
                getattr(pool, "qk_rope_head_dim", 0))
            if width <= 0:
                width = int(pool.head_dim)
            layout = kv.KvLayout.mla(kv.KvCacheLayout.MLA, layer_num, page, width, dtype)
            label = model_label("sglang", self._model, *variant, pool.layout, "mla")
        else:
            layout = kv.KvLayout.mha(kv.KvCacheLayout.FLASH_ATTN_NHD, layer_num, page,
                                     int(pool.head_num), int(pool.head_dim), dtype)
            label = model_label("sglang", self._model, *variant, pool.layout,
                                f"tp{self._tp_rank}of{self._tp_size}")
        if self._pp_size > 1:
            label = model_label(label, f"pp{self._pp_rank}of{self._pp_size}")
        if self._cp_size > 1:
            label = model_label(label, f"cp{self._cp_rank}of{self._cp_size}")
        if fp8_name is not None:
            label = model_label(label, fp8_name)
        self._objects_per_page = len(ptrs)
        self._object_sizes = [int(s) for s in sizes]
        # The layout fingerprint only separates models of other shapes; the
        # objects are SGLang's host-pool bytes, named apart by "sglang/...".
        return layout.namespace_for(label)

    def _kv_dtype(self, pool: Any) -> Tuple[Any, Optional[str]]:
        """The pool's element type as a KvDtype, and for an FP8 pool the
        logical dtype's name (which goes into the namespace label). An FP8
        KV cache's host pool is torch.uint8 (SGLang's store_dtype); its
        device pool's dtype names the format. The bytes move as they are;
        the layout only needs the element size (formats other than e4m3fn
        use FLOAT8_E4M3 as a 1-byte type; the label keeps them apart).
        Raises ValueError for a dtype the backend cannot name."""
        import torch

        kv = self._kvdepot
        if pool.dtype != torch.uint8:
            return kv.dtype_from_torch(pool.dtype), None
        logical = getattr(getattr(pool, "device_pool", None), "dtype", None)
        name = _dtype_name(logical) if logical is not None else None
        if name not in _FP8_DTYPES:
            raise ValueError(f"the host pool holds uint8 whose logical dtype ({logical}, "
                             f"from its device_pool) is not one of {', '.join(_FP8_DTYPES)}")
        return kv.KvDtype.FLOAT8_E4M3, name

    def _register_host_memory(self, pool: Any) -> bool:
        """Registers the pool's tensors with the client so that the page
        buffers move over UCX; on failure warns (gRPC byte path)."""
        buffers = getattr(pool, "kv_buffer", None)
        tensors = list(buffers) if isinstance(buffers, (list, tuple)) else [buffers]
        tensors = [t for t in tensors if t is not None]
        try:
            if not tensors:
                raise ValueError("the pool has no kv_buffer")
            for t in tensors:
                self._client.register_buffer(t)
            return True
        except Exception as e:  # noqa: BLE001 - the gRPC path still works
            logger.warning("kvdepot: could not register the host KV pool for UCX (%s); "
                           "pages take the slower gRPC byte path", e)
            return False

    @property
    def namespace(self) -> Optional[str]:
        return self._namespace

    @property
    def disabled_reason(self) -> Optional[str]:
        """Why the backend does nothing, or None."""
        return self._disabled_reason

    def _object_keys(self, keys: List[str]) -> List[bytes]:
        n = self._objects_per_page
        return [f"{k}.{i}".encode() for k in keys for i in range(n)]

    def _buffers(self, host_indices: Any, num_pages: int) -> List[Any]:
        """Views of the host pool at the addresses SGLang gives."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if len(ptrs) != num_pages * self._objects_per_page:
            raise ValueError(f"{len(ptrs)} page buffers for {num_pages} pages of "
                             f"{self._objects_per_page} objects")
        return [(ctypes.c_char * int(s)).from_address(int(p)) for p, s in zip(ptrs, sizes)]

    def _per_page(self, flags: List[bool]) -> List[bool]:
        n = self._objects_per_page
        return [all(flags[i * n:(i + 1) * n]) for i in range(len(flags) // n)]

    def _count(self, name: str, value: int = 1) -> None:
        with self._lock:
            self.counters[name] += value

    # ------------------------------------------------------------------
    # Daemon calls, in chunks of at most max_batch_keys keys

    def _chunks(self, num_objects: int) -> List[Tuple[int, int]]:
        """[lo, hi) object ranges of at most max_batch_keys, ending at page
        boundaries (a page with more objects than that: max_batch_keys
        each, the last of a page ending at its boundary)."""
        return batch_ranges(num_objects, self._max_batch_keys, self._objects_per_page)

    def _skip(self) -> bool:
        """True (counted) when kvdepotd is not to be called now: the
        breaker's back-off window after it was found unavailable."""
        if self._breaker.allow():
            return False
        self._count("unavailable_skips")
        return True

    def _stored_prefix(self, okeys: List[bytes]) -> int:
        """How many of ``okeys``, from the first, are stored."""
        hits = 0
        for lo, hi in self._chunks(len(okeys)):
            reply = self._client.lookup(self._namespace, okeys[lo:hi], prefix=True)
            got = int(reply.prefix_hits)
            hits += got
            if got < hi - lo:
                break
        self._breaker.succeeded()
        return hits

    def _transfer(self, start: Callable[[int, int], Any], num_objects: int,
                  what: str, concurrent: bool, misses: bool) -> List[bool]:
        """Runs one async op per chunk (``start(lo, hi)``) and returns a
        flag per object. ``concurrent``: all chunks in flight at once, else
        one after the other. ``misses``: a NOT_FOUND object is a miss (a
        get's), not an error (a put's: e.g. the daemon restarted and no
        longer knows the session). Every op started is waited for before
        this returns or raises (its buffers are the caller's again). The
        outcome goes to the breaker."""
        flags = [False] * num_objects
        pending: List[Tuple[int, Any]] = []
        failure: Optional[Tuple[str, str]] = None
        down: Optional[Tuple[str, str]] = None
        try:
            for lo, hi in self._chunks(num_objects):
                if down is not None and self._breaker.blocked():
                    break  # kvdepotd went away: the rest are not tried
                pending.append((lo, start(lo, hi)))
                if not concurrent:
                    err, unavailable = self._finish(*pending.pop(), flags, misses)
                    failure, down = failure or err, down or unavailable
                    if unavailable is not None:
                        self._breaker.failed(unavailable)
        finally:
            for lo, op in pending:
                err, unavailable = self._finish(lo, op, flags, misses)
                failure, down = failure or err, down or unavailable
        if down is not None:
            self._breaker.failed(down)
        else:
            self._breaker.succeeded()
        if failure is not None:
            self._count("errors")
            logger.warning("kvdepot: %s: %s: %s", what, *failure)
        return flags

    @staticmethod
    def _finish(lo: int, op: Any, flags: List[bool], misses: bool
                ) -> Tuple[Optional[Tuple[str, str]], Optional[Tuple[str, str]]]:
        """Waits for ``op``; its flags go to ``flags[lo:]``. Returns its
        first error (other than a miss, with ``misses``) and its first
        error saying kvdepotd is unavailable (or None)."""
        op.wait()
        ok = op.ok()
        flags[lo:lo + len(ok)] = ok
        first = down = None
        for err in op.errors():
            if err is None or (misses and err[0] == "NOT_FOUND"):
                continue
            first = first or err
            if down is None and status_code(err) in UNAVAILABLE_CODES:
                down = err
        return first, down

    def _get_objects(self, okeys: List[bytes], bufs: Sequence[Any], what: str) -> List[bool]:
        """Reads ``okeys`` into ``bufs``; True per object read (a failed
        object, e.g. DATA_LOSS, fails alone)."""
        return self._transfer(
            lambda lo, hi: self._client.get_into_async(self._namespace, okeys[lo:hi],
                                                       bufs[lo:hi]),
            len(okeys), what, concurrent=True, misses=True)

    def _put_objects(self, okeys: List[bytes], bufs: Sequence[Any],
                     parents: Optional[Sequence[bytes]], what: str) -> List[bool]:
        """Stores ``bufs`` under ``okeys`` (put-if-absent: an object already
        stored is OK), linked to ``parents`` (None: no links); True per
        object stored. Chunks go one after the other, so each links to its
        parent, stored by the one before."""
        return self._transfer(
            lambda lo, hi: self._client.put_async(
                self._namespace, okeys[lo:hi], bufs[lo:hi],
                parents[lo:hi] if parents is not None else None),
            len(okeys), what, concurrent=False, misses=False)

    # ------------------------------------------------------------------
    # Zero-copy interface

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, are stored (whole pages)."""
        self._count("exists_calls")
        if not keys or self._namespace is None or self._skip():
            return 0
        try:
            pages = self._stored_prefix(self._object_keys(keys)) // self._objects_per_page
            self._count("exists_hit_pages", pages)
            return pages
        except Exception as e:  # noqa: BLE001 - a failed lookup is a miss
            self._breaker.failed(e)
            self._count("errors")
            logger.warning("kvdepot: batch_exists failed: %s", e)
            return 0

    def batch_get_v1(self, keys: List[str], host_indices: Any,
                     extra_info: Any = None) -> List[bool]:
        """Reads the pages into the host pool; True per page read."""
        if not keys:
            return []
        if self._namespace is None or self._skip():
            return [False] * len(keys)
        start = time.perf_counter()
        self._count("get_pages", len(keys))
        try:
            bufs = self._buffers(host_indices, len(keys))
            pages = self._per_page(self._get_objects(
                self._object_keys(keys), bufs, f"batch_get_v1 of {len(keys)} pages"))
        except Exception as e:  # noqa: BLE001
            self._breaker.failed(e)
            self._count("errors")
            logger.warning("kvdepot: batch_get_v1 of %d pages failed: %s", len(keys), e)
            return [False] * len(keys)
        hits = sum(pages)
        self._count("get_hit_pages", hits)
        self._record(self._prefetch_pgs, self._prefetch_bw, hits, start)
        return pages

    def batch_set_v1(self, keys: List[str], host_indices: Any,
                     extra_info: Any = None) -> List[bool]:
        """Stores the pages straight from the host pool (put-if-absent: a
        page already stored counts as stored); True per page."""
        if not keys:
            return []
        if self._namespace is None or self._skip():
            return [False] * len(keys)
        start = time.perf_counter()
        self._count("set_pages", len(keys))
        try:
            bufs = self._buffers(host_indices, len(keys))
            okeys = self._object_keys(keys)
            # The page before the first, where SGLang names it: its
            # HiCacheStorageExtraInfo.prefix_keys defaults to (None,), so
            # None and empty entries are not keys.
            prefix = [k for k in (getattr(extra_info, "prefix_keys", None) or ()) if k]
            first_parent = f"{prefix[-1]}.{self._objects_per_page - 1}".encode() if prefix else b""
            parents = [first_parent, *okeys[:-1]]
            pages = self._per_page(self._put_objects(
                okeys, bufs, parents, f"batch_set_v1 of {len(keys)} pages"))
        except Exception as e:  # noqa: BLE001
            self._breaker.failed(e)
            self._count("errors")
            logger.warning("kvdepot: batch_set_v1 of %d pages failed: %s", len(keys), e)
            return [False] * len(keys)
        stored = sum(pages)
        self._count("set_ok_pages", stored)
        self._record(self._backup_pgs, self._backup_bw, stored, start)
        return pages

    def _record(self, pgs: Deque[int], bw: Deque[float], pages: int, start: float) -> None:
        if not self._record_stats:
            return
        elapsed = time.perf_counter() - start
        nbytes = pages * sum(self._object_sizes)
        with self._lock:
            pgs.append(pages)
            if elapsed > 0 and pages:
                bw.append(nbytes / elapsed / (1 << 30))

    # ------------------------------------------------------------------
    # Generic interface (SGLang stages pages through flat tensors)

    def _flat_size(self) -> int:
        return sum(self._object_sizes)

    def _flat_views(self, raw: Any) -> List[Any]:
        """The objects of one flat page (SGLang's ``get_data_page`` order) as
        byte views, in the zero-copy path's object order, so both paths store
        the same bytes under the same keys. A flat MHA ``layer_first`` page is
        [K/V, layer, ...] while its page buffers go layer by layer, K then V."""
        n = self._objects_per_page
        layer_num = int(getattr(self.mem_pool_host, "layer_num", 0))
        if (not self._is_mla and getattr(self.mem_pool_host, "layout", "") == "layer_first"
                and n == 2 * layer_num):
            kv = raw.view(2, layer_num, -1)
            return [kv[c, layer] for layer in range(layer_num) for c in (0, 1)]
        views, off = [], 0
        for size in self._object_sizes:
            views.append(raw[off:off + size])
            off += size
        return views

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        out = self.batch_get([key], [target_location] if target_location is not None else None)
        return out[0]

    def batch_get(self, keys: List[str], target_locations: Any = None,
                  target_sizes: Any = None) -> List[Any]:
        """Pages as flat tensors of the pool's dtype (written into
        ``target_locations`` when given); None per miss, and for each draft
        page (see :func:`_is_draft_key`: never stored, not read)."""
        drafts = [_is_draft_key(k) for k in keys or ()]
        if any(drafts):
            self._count("draft_skipped", sum(drafts))
            out: List[Any] = [None] * len(keys)
            rest = [i for i, d in enumerate(drafts) if not d]
            if rest:
                targets = None
                if target_locations is not None:
                    targets = [target_locations[i] if i < len(target_locations) else None
                               for i in rest]
                for i, page in zip(rest, self.batch_get([keys[i] for i in rest], targets)):
                    out[i] = page
            return out
        if not keys or self._namespace is None or self._skip():
            return [None] * len(keys)
        try:
            import torch

            outs: List[Any] = []
            # Targets whose memory is not one run (strided): read into a
            # page of their own, copied into the target once it is in (a
            # reshape would read into a copy, and the target would be
            # returned as a hit, unwritten).
            strided: Dict[int, Any] = {}
            for i in range(len(keys)):
                if target_locations is not None and target_locations[i] is not None:
                    t = target_locations[i]
                    if not t.is_contiguous():
                        strided[i] = t
                        t = torch.empty_like(t, memory_format=torch.contiguous_format)
                    outs.append(t)
                else:
                    dtype = self.mem_pool_host.dtype
                    item = torch.tensor([], dtype=dtype).element_size()
                    outs.append(torch.empty(self._flat_size() // item, dtype=dtype))
            views = []
            for t in outs:
                views.extend(self._flat_views(t.view(-1).view(torch.uint8)))
            pages = self._per_page(self._get_objects(
                self._object_keys(keys), views, f"batch_get of {len(keys)} pages"))
            for i, target in strided.items():
                if pages[i]:
                    target.copy_(outs[i])
                outs[i] = target
        except Exception as e:  # noqa: BLE001
            self._breaker.failed(e)
            self._count("errors")
            logger.warning("kvdepot: batch_get failed: %s", e)
            return [None] * len(keys)
        return [t if ok else None for t, ok in zip(outs, pages)]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Stores flat page tensors (the generic path); True if all stored.
        Draft pages (see :func:`_is_draft_key`) are not: False, without a
        warning or an error (the other pages of the call are stored)."""
        drafts = [_is_draft_key(k) for k in keys or ()]
        if any(drafts):
            self._count("draft_skipped", sum(drafts))
            rest = [i for i, d in enumerate(drafts) if not d]
            if rest and values is not None and len(values) == len(keys):
                self.batch_set([keys[i] for i in rest], [values[i] for i in rest])
            return False
        if self._namespace is None or self._skip():
            return False
        try:
            import torch

            if len(values) != len(keys):
                raise ValueError(f"{len(values)} values for {len(keys)} keys")
            views = []
            for v in values:
                raw = v.contiguous().view(torch.uint8).reshape(-1)
                if raw.numel() != self._flat_size():
                    raise ValueError(f"a page has {raw.numel()} bytes, expected "
                                     f"{self._flat_size()}")
                views.extend(self._flat_views(raw))
            okeys = self._object_keys(keys)
            stored = self._put_objects(okeys, views, None,
                                       f"batch_set of {len(keys)} pages")
            return all(stored)
        except Exception as e:  # noqa: BLE001
            self._breaker.failed(e)
            self._count("errors")
            logger.warning("kvdepot: batch_set failed: %s", e)
            return False

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------------
    # The v2 interface (hybrid models: KV plus extra pools), not served

    def _v2_miss(self, call: str) -> None:
        if not self._v2_logged:
            self._v2_logged = True
            logger.warning("kvdepot: SGLang called %s (the v2 interface of hybrid models); "
                           "this backend does not serve it: every page is a miss", call)

    def batch_exists_v2(self, keys: List[str], pool_transfers: Any = None,
                        extra_info: Any = None) -> Any:
        """A miss: no usable prefix (``PoolTransferResult`` with 0 KV pages
        and 0 pages of each pool asked about). Never raises."""
        self._v2_miss("batch_exists_v2")
        hits: Dict[Any, int] = {}
        try:
            for t in pool_transfers or ():
                hits[t.name] = 0
        except Exception:  # noqa: BLE001 - the miss either way
            hits = {}
        return PoolTransferResult(0, hits)

    def _v2_flags(self, transfers: Any) -> Dict[Any, List[bool]]:
        """False for every page of every transfer (a miss)."""
        out: Dict[Any, List[bool]] = {}
        try:
            for t in transfers or ():
                out[t.name] = [False] * len(getattr(t, "keys", None) or ())
        except Exception:  # noqa: BLE001 - never raise into SGLang's threads
            pass
        return out

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> Dict[Any, List[bool]]:
        """Reads nothing: False for every page of every pool. Never
        raises."""
        self._v2_miss("batch_get_v2")
        return self._v2_flags(transfers)

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> Dict[Any, List[bool]]:
        """Stores nothing: False for every page of every pool. Never
        raises."""
        self._v2_miss("batch_set_v2")
        return self._v2_flags(transfers)

    # ------------------------------------------------------------------

    def clear(self) -> None:
        """Evicts this backend's namespace (blocks pinned elsewhere stay)."""
        if self._namespace is None or self._skip():
            return
        try:
            self._client.evict(self._namespace, all=True)
            self._breaker.succeeded()
        except Exception as e:  # noqa: BLE001
            self._breaker.failed(e)
            logger.warning("kvdepot: clear failed: %s", e)

    def get_stats(self) -> Any:
        """Pages and bandwidth (GiB/s) per prefetch and backup since the last
        call (the last 1024 of each at most), as SGLang's StorageMetrics; the
        lists are then reset. Nothing is recorded when SGLang's
        ``enable_storage_metrics`` is off."""
        metrics = StorageMetrics()
        with self._lock:
            metrics.prefetch_pgs.extend(self._prefetch_pgs)
            metrics.backup_pgs.extend(self._backup_pgs)
            metrics.prefetch_bandwidth.extend(self._prefetch_bw)
            metrics.backup_bandwidth.extend(self._backup_bw)
            for pending in (self._prefetch_pgs, self._backup_pgs,
                            self._prefetch_bw, self._backup_bw):
                pending.clear()
        return metrics

    def close(self) -> None:
        self._client.close()


__all__ = ["DEFAULT_MAX_BATCH_KEYS", "HAVE_SGLANG", "KvDepotHiCacheStorage", "StorageMetrics"]
