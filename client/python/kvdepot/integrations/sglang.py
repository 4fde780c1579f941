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
``batch_set_v1(...)`` (zero-copy: kvdepot reads and writes the host pool's
memory in place, at the page addresses the pool's ``get_page_buffer_meta``
gives), ``get``/``set``/``batch_get``/``batch_set``/``exists`` (generic path),
``clear``, ``get_stats`` (a ``StorageMetrics`` where SGLang has it). The
``*_v2`` pool-transfer methods (hybrid models) are not implemented. Without
SGLang installed, the class subclasses :class:`_StandInHiCacheStorage`, a
local stand-in of the base class (its ``register_mem_pool_host`` and
prefix ``batch_exists``) that exists so tests can drive the backend; it is
not SGLang.

Storage: each page is stored as the objects ``get_page_buffer_meta`` lists
for it (K and V for an MHA ``page_first`` pool, one latent for MLA, one per
layer and K/V for ``layer_first``), under ``<page key>.<i>``, in the namespace
``KvLayout.namespace_for("sglang/<model>/<pool layout>/tpRofN")`` (MLA: no
rank). A page is present only when all its objects are.

Errors never escape: a failed lookup is 0 pages, a failed get or set is
False for each page it covered (SGLang then recomputes or retries).

Extra config: ``server`` (default ``$KVDEPOT_SERVER`` or
``127.0.0.1:50551``), ``model`` (default ``storage_config.model_name``),
``timeout_s`` (5), ``lease_s`` (0: the daemon's default).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from . import model_label

logger = logging.getLogger(__name__)

try:  # pragma: no cover - depends on the environment
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    HAVE_SGLANG = True
except Exception:  # SGLang missing: the stand-in.
    HAVE_SGLANG = False

    class _StandInHiCacheStorage:
        """A minimal local stand-in of SGLang's ``HiCacheStorage``, used only
        when SGLang cannot be imported: ``register_mem_pool_host`` and the
        default ``clear``/``get_stats``, as SGLang implements them."""

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            self.mem_pool_host = mem_pool_host

        def clear(self) -> None:
            pass

        def get_stats(self) -> Any:
            return None

    HiCacheStorage = _StandInHiCacheStorage  # type: ignore[misc,assignment]

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
        self._model = str(extra.get("model") or _cfg(storage_config, "model_name", "") or "model")
        self._tp_rank = int(_cfg(storage_config, "tp_rank", 0))
        self._tp_size = int(_cfg(storage_config, "tp_size", 1))
        self._pp_rank = int(_cfg(storage_config, "pp_rank", 0))
        self._pp_size = int(_cfg(storage_config, "pp_size", 1))
        self._is_mla = bool(_cfg(storage_config, "is_mla_model", False))
        self._client = kvdepot.Client(
            self._server, timeout_s=self._timeout_s, lease_s=self._lease_s,
            client_name="kvdepot-sglang")
        self.mem_pool_host: Any = None
        self._namespace: Optional[str] = None
        self._objects_per_page = 0
        self._object_sizes: List[int] = []
        self._lock = threading.Lock()
        self._prefetch_pgs: List[int] = []
        self._backup_pgs: List[int] = []
        self._prefetch_bw: List[float] = []
        self._backup_bw: List[float] = []
        self.counters: Dict[str, int] = {
            "exists_calls": 0, "exists_hit_pages": 0, "get_pages": 0,
            "get_hit_pages": 0, "set_pages": 0, "set_ok_pages": 0, "errors": 0,
        }

    # ------------------------------------------------------------------
    # Setup

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Takes the host KV pool (SGLang's HostKVCache): its page size,
        layout and ``get_page_buffer_meta`` define the stored objects."""
        super().register_mem_pool_host(mem_pool_host)
        import torch

        pool = mem_pool_host
        page = int(pool.page_size)
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
        self._objects_per_page = len(ptrs)
        self._object_sizes = [int(s) for s in sizes]
        kv = self._kvdepot
        dtype = kv.dtype_from_torch(pool.dtype)
        layer_num = int(pool.layer_num)
        if self._is_mla:
            width = int(getattr(pool, "kv_lora_rank", 0)) + int(
                getattr(pool, "qk_rope_head_dim", 0))
            if width <= 0:
                width = int(pool.head_dim)
            layout = kv.KvLayout.mla(kv.KvCacheLayout.MLA, layer_num, page, width, dtype)
            label = model_label("sglang", self._model, pool.layout, "mla")
        else:
            layout = kv.KvLayout.mha(kv.KvCacheLayout.FLASH_ATTN_NHD, layer_num, page,
                                     int(pool.head_num), int(pool.head_dim), dtype)
            label = model_label("sglang", self._model, pool.layout,
                                f"tp{self._tp_rank}of{self._tp_size}")
        if self._pp_size > 1:
            label = model_label(label, f"pp{self._pp_rank}of{self._pp_size}")
        # The layout fingerprint only separates models of other shapes; the
        # objects are SGLang's host-pool bytes, named apart by "sglang/...".
        self._namespace = layout.namespace_for(label)

    @property
    def namespace(self) -> Optional[str]:
        return self._namespace

    def _object_keys(self, keys: List[str]) -> List[bytes]:
        n = self._objects_per_page
        return [f"{k}.{i}".encode() for k in keys for i in range(n)]

    def _buffers(self, host_indices: Any, num_pages: int) -> List[Any]:
        """Zero-copy views of the host pool at the addresses SGLang gives."""
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
    # Zero-copy interface

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, are stored (whole pages)."""
        self._count("exists_calls")
        if not keys or self._namespace is None:
            return 0
        try:
            reply = self._client.lookup(self._namespace, self._object_keys(keys),
                                        prefix=True)
            pages = int(reply.prefix_hits) // self._objects_per_page
            self._count("exists_hit_pages", pages)
            return pages
        except Exception as e:  # noqa: BLE001 - a failed lookup is a miss
            self._count("errors")
            logger.warning("kvdepot: batch_exists failed: %s", e)
            return 0

    def batch_get_v1(self, keys: List[str], host_indices: Any,
                     extra_info: Any = None) -> List[bool]:
        """Reads the pages into the host pool in place; True per page read."""
        if not keys:
            return []
        start = time.perf_counter()
        self._count("get_pages", len(keys))
        try:
            bufs = self._buffers(host_indices, len(keys))
            filled = self._client.get_into(self._namespace, self._object_keys(keys), bufs)
            pages = self._per_page(filled)
        except Exception as e:  # noqa: BLE001
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
            self._client.put(self._namespace, okeys, bufs, parents)
        except Exception as e:  # noqa: BLE001
            self._count("errors")
            logger.warning("kvdepot: batch_set_v1 of %d pages failed: %s", len(keys), e)
            return [False] * len(keys)
        self._count("set_ok_pages", len(keys))
        self._record(self._backup_pgs, self._backup_bw, len(keys), start)
        return [True] * len(keys)

    def _record(self, pgs: List[int], bw: List[float], pages: int, start: float) -> None:
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
        """Pages as flat uint8-backed tensors of the pool's dtype (written
        into ``target_locations`` when given); None per miss."""
        import torch

        outs: List[Any] = []
        for i in range(len(keys)):
            if target_locations is not None and target_locations[i] is not None:
                outs.append(target_locations[i])
            else:
                dtype = self.mem_pool_host.dtype
                item = torch.tensor([], dtype=dtype).element_size()
                outs.append(torch.empty(self._flat_size() // item, dtype=dtype))
        try:
            views = []
            for t in outs:
                views.extend(self._flat_views(t.view(torch.uint8).reshape(-1)))
            filled = self._client.get_into(self._namespace, self._object_keys(keys), views)
            pages = self._per_page(filled)
        except Exception as e:  # noqa: BLE001
            self._count("errors")
            logger.warning("kvdepot: batch_get failed: %s", e)
            return [None] * len(keys)
        return [t if ok else None for t, ok in zip(outs, pages)]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Stores flat page tensors (the generic path); True if all stored."""
        import torch

        try:
            views = []
            for v in values:
                raw = v.contiguous().view(torch.uint8).reshape(-1)
                if raw.numel() != self._flat_size():
                    raise ValueError(f"a page has {raw.numel()} bytes, expected "
                                     f"{self._flat_size()}")
                views.extend(self._flat_views(raw))
            self._client.put(self._namespace, self._object_keys(keys), views)
            return True
        except Exception as e:  # noqa: BLE001
            self._count("errors")
            logger.warning("kvdepot: batch_set failed: %s", e)
            return False

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------------

    def clear(self) -> None:
        """Evicts this backend's namespace (blocks pinned elsewhere stay)."""
        if self._namespace is None:
            return
        try:
            self._client.evict(self._namespace, all=True)
        except Exception as e:  # noqa: BLE001
            logger.warning("kvdepot: clear failed: %s", e)

    def get_stats(self) -> Any:
        """Pages and bandwidth (GiB/s) per prefetch and backup since the last
        call, as SGLang's StorageMetrics; the lists are then reset."""
        metrics = StorageMetrics()
        with self._lock:
            metrics.prefetch_pgs.extend(self._prefetch_pgs)
            metrics.backup_pgs.extend(self._backup_pgs)
            metrics.prefetch_bandwidth.extend(self._prefetch_bw)
            metrics.backup_bandwidth.extend(self._backup_bw)
            self._prefetch_pgs, self._backup_pgs = [], []
            self._prefetch_bw, self._backup_bw = [], []
        return metrics

    def close(self) -> None:
        self._client.close()


__all__ = ["HAVE_SGLANG", "KvDepotHiCacheStorage", "StorageMetrics"]
