"""kvdepot: Python client of kvdepotd, the KV-cache block store.

Two levels:

* :class:`Client` -- the libkvdepot client: ``health``, ``lookup`` (with
  prefix matching and pinning), ``unpin``, ``put``, ``get_into``, ``evict``,
  ``stats``. Block bytes move straight from and into caller buffers (numpy
  arrays, ``bytes``, ``bytearray``, ``memoryview``, CPU torch tensors); the GIL
  is released during every RPC. Buffers inside ``allocate_buffer`` memory
  (shared memory with a daemon on this host) or ``register_buffer`` memory
  (any writable array, kept alive as long as the client) move over the UCX
  data plane, others over the gRPC byte path. ``get_into_async`` and
  ``put_async`` start a batch and return a :class:`TransferOp` to poll or
  wait on (per-block outcomes; a miss is a NOT_FOUND block, not an error).
* :class:`KvCacheStore` -- saves and loads blocks of an engine's paged KV
  cache (torch tensors or numpy arrays in one of the :class:`KvCacheLayout`
  layouts): gather into host buffers, then put; get, then scatter the hits.
  :meth:`KvCacheStore.load_async` returns a :class:`LoadHandle` at once and
  scatters in the background, layer by layer, so that an engine can run
  layer 0's attention (``handle.wait_for_layer(0)``) while the later layers
  are still being written.

Layouts: :class:`KvLayout` (``KvLayout.mha``, ``KvLayout.mla``,
``KvLayout.create``) describes the cache; :meth:`KvLayout.namespace_for` gives
the namespace its blocks live in; :func:`gather` and :func:`scatter` move
blocks between a cache and one contiguous object buffer per block (the CPU
implementation, on host memory). CUDA caches go through
:mod:`kvdepot.kvshim` (the CUDA kernels, loaded with ctypes), which
:class:`KvCacheStore` picks by the caches' device.

Errors raise ``KeyError`` (NOT_FOUND), ``ValueError`` (INVALID_ARGUMENT,
OUT_OF_RANGE) or ``RuntimeError`` (everything else), the message starting with
the gRPC/absl status code name, e.g. ``"UNAVAILABLE: ..."``.

Example::

    import torch, kvdepot
    layout = kvdepot.KvLayout.mha(kvdepot.KvCacheLayout.FLASH_ATTN_NHD,
                                  num_layers=32, block_size=16,
                                  num_kv_heads=8, head_size=128,
                                  dtype=kvdepot.KvDtype.BFLOAT16)
    store = kvdepot.KvCacheStore("127.0.0.1:50551", layout, "llama3-8b/tp0of1")
    store.save(kv_caches, block_ids=[1, 3], keys=[k1, k2], parents=[b"", k1])
    hits = store.load(kv_caches, block_ids=[7, 9], keys=[k1, k2])

    handle = store.load_async(kv_caches, block_ids=[7, 9], keys=[k1, k2])
    for layer in range(layout.num_layers):
        handle.wait_for_layer(layer)   # layers [0, layer] are in the caches
        ...                            # run that layer
    hits = handle.wait()
"""

from __future__ import annotations

import weakref
from typing import Any, List, Optional, Sequence, Tuple

try:
    from ._kvdepot import (
        BlockInfo,
        CacheLoad,
        Client as _NativeClient,
        KvCacheLayout,
        KvDtype,
        KvLayout,
        LookupReply,
        Tier,
        TransferOp,
        dtype_bytes,
        dtype_name,
        gather,
        scatter,
    )
except ImportError as e:  # pragma: no cover
    raise ImportError(
        "kvdepot: the native module _kvdepot is missing or does not load "
        f"({e}). It is built by CMake (target _kvdepot) into "
        "<build>/python/kvdepot/; see client/python/README.md."
    ) from e

__all__ = [
    "BlockInfo",
    "CacheLoad",
    "Client",
    "KvCacheLayout",
    "KvCacheStore",
    "KvDtype",
    "KvLayout",
    "LoadHandle",
    "LookupReply",
    "Tier",
    "TransferOp",
    "dtype_bytes",
    "dtype_from_torch",
    "dtype_name",
    "gather",
    "scatter",
]

__version__ = "0.1.0"


class Client(_NativeClient):
    """A connection to kvdepotd (thread-safe); see the module docstring.

    ``Client(server="127.0.0.1:50551", timeout_s=30.0, lease_s=0.0,
    client_name="kvdepot-python")``. No RPC is made until the first call.
    ``timeout_s`` must be positive and finite, ``lease_s`` 0 (the daemon's
    default) or from 0.001 to 4294967.295 seconds (ValueError otherwise).
    ``close()`` makes later calls raise RuntimeError (FAILED_PRECONDITION)
    and closes the session, releasing its pins, once no op is in flight;
    arrays of ``allocate_buffer`` stay valid (their memory goes back when
    the last view of it goes). The synchronous methods are the native ones;
    this class adds typed wrappers of the asynchronous transfers.
    """

    def get_into_async(
        self,
        ns: str,
        keys: Sequence[bytes],
        buffers: Sequence[Any],
        prefix: bool = False,
    ) -> TransferOp:
        """Starts reading the blocks ``keys`` into ``buffers`` and returns a
        :class:`TransferOp` without waiting for the daemon.

        ``buffers[i]`` receives ``keys[i]``: a writable C-contiguous buffer
        of exactly that block's size. Over the UCX data plane when every
        buffer lies in ``allocate_buffer`` or ``register_buffer`` memory;
        otherwise over the gRPC byte path, done before this returns (the op
        is then ready at once). With ``prefix`` the read stops at the first
        miss (the later blocks are misses too).

        Per block, ``op.ok()[i]`` says whether ``buffers[i]`` was filled; a
        key that is not stored is a miss (``("NOT_FOUND", ...)`` in
        ``op.errors()``) and leaves its buffer untouched. Other block errors
        (the daemon unreachable, DATA_LOSS, a wrong buffer size) may leave
        partial bytes: use only the blocks that are OK.

        Raises ValueError for bad input (counts differ, an invalid namespace
        or key, a read-only or non-contiguous buffer) and TypeError for an
        object that is not a buffer, before anything starts. The op keeps the
        buffers (and this client) referenced until it is ready; don't read
        or change them before then.
        """
        return super().get_into_async(ns, list(keys), list(buffers), prefix)

    def put_async(
        self,
        ns: str,
        keys: Sequence[bytes],
        buffers: Sequence[Any],
        parents: Optional[Sequence[bytes]] = None,
    ) -> TransferOp:
        """Starts storing ``buffers`` under ``keys`` (put-if-absent) and
        returns a :class:`TransferOp` without waiting for the daemon.

        ``parents[i]`` is the key of the block before ``keys[i]`` in its
        chain (``b""`` for a chain's first block). Over the UCX data plane
        when every buffer lies in ``allocate_buffer`` or ``register_buffer``
        memory; otherwise over the gRPC byte path, done before this returns.

        Per block, ``op.ok()[i]`` says the block is stored;
        ``op.already_stored(i)`` that it was stored before (the existing
        block is kept). Raises as :meth:`get_into_async`. The buffers must not
        change until the op is ready (the op keeps them referenced).
        """
        return super().put_async(
            ns,
            list(keys),
            list(buffers),
            list(parents) if parents is not None else None,
        )

    def load_into_cache_async(
        self,
        ns: str,
        keys: Sequence[bytes],
        objects: Sequence[Any],
        layout: KvLayout,
        caches: Sequence[Any],
        block_ids: Sequence[int],
        batch_sizes: Optional[Sequence[int]] = None,
    ) -> CacheLoad:
        """Starts loading the blocks ``keys`` into the blocks ``block_ids``
        of a paged cache and returns a :class:`CacheLoad` at once: the
        building block of :meth:`KvCacheStore.load_async` (use that).

        ``keys[i]`` is read into the staging buffer ``objects[i]`` (writable,
        ``layout.object_bytes`` each; over the UCX data plane when all lie
        in ``allocate_buffer``/``register_buffer`` memory) and scattered into
        block ``block_ids[i]`` of ``caches``, in batches of ``batch_sizes``
        blocks (None: one batch). A loader thread starts the reads and
        scatters, without the GIL, one layer of one arrived batch at a time
        (the lowest layer first), so layers become ready in order:
        ``load.wait_for_layer(l)``. A miss is a NOT_FOUND block whose cache
        block is left untouched.

        Raises ValueError, before anything is read or written, for counts
        that differ, an invalid namespace or key, block ids outside the
        caches or repeated, staging buffers of the wrong size, caches that do
        not fit ``layout``; TypeError for an object that is not a buffer.
        The load holds the caches, the objects and this client until it is
        done; don't touch the objects, or layers not yet ready, before then.
        """
        return super().load_into_cache_async(
            ns,
            list(keys),
            list(objects),
            layout,
            list(caches),
            list(block_ids),
            list(batch_sizes) if batch_sizes is not None else None,
        )


def dtype_from_torch(dtype: Any) -> KvDtype:
    """Returns the :class:`KvDtype` of a ``torch.dtype`` (fp16, bf16, fp32,
    float8_e4m3fn where torch has it). Raises ValueError for anything else."""
    import torch  # imported lazily: torch is optional

    table = {
        torch.float16: KvDtype.FLOAT16,
        torch.bfloat16: KvDtype.BFLOAT16,
        torch.float32: KvDtype.FLOAT32,
    }
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is not None:
        table[fp8] = KvDtype.FLOAT8_E4M3
    try:
        return table[dtype]
    except KeyError:
        raise ValueError(f"INVALID_ARGUMENT: no KvDtype for {dtype}") from None


def _raise_block_error(
    errors: Sequence[Optional[Tuple[str, str]]], ignore: Tuple[str, ...] = ()
) -> None:
    """Raises the first block error whose code is not in ``ignore``, as the
    synchronous calls would (ValueError for INVALID_ARGUMENT / OUT_OF_RANGE,
    else RuntimeError)."""
    for err in errors:
        if err is None or err[0] in ignore:
            continue
        message = f"{err[0]}: {err[1]}"
        if err[0] in ("INVALID_ARGUMENT", "OUT_OF_RANGE"):
            raise ValueError(message)
        raise RuntimeError(message)


class LoadHandle:
    """A :meth:`KvCacheStore.load_async` in flight.

    The blocks are read in the store's pipelined batches and scattered into
    the caches by a loader thread (native, without the GIL) one layer at a
    time, so layers become ready in order: once :meth:`wait_for_layer`
    ``(l)`` returns, layers ``0..l`` of every block that was hit are in the
    caches and the engine may run those layers' attention, while the later
    layers are still being written. :meth:`wait` waits for everything and
    returns one hit flag per key, as :meth:`KvCacheStore.load` does.

    Until :attr:`done`, don't read layers that are not ready yet, and don't
    write the blocks being loaded. Dropping an unfinished handle cancels it:
    no further layer is scattered (the blocks' contents are then
    unspecified), and the drop waits -- without the GIL, bounded by the
    client's transfer deadlines -- until no transfer or scatter uses the
    caches or the store's staging buffers any more.

    Safe to wait on from several threads.
    """

    __slots__ = ("_load", "_num_layers", "_size", "__weakref__")

    def __init__(self, load: Optional[CacheLoad], num_layers: int, size: int) -> None:
        # load is None for a load of no blocks (done at once).
        self._load = load
        self._num_layers = num_layers
        self._size = size

    def __len__(self) -> int:
        """The number of keys (blocks) loaded."""
        return self._size

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def ready_layers(self) -> int:
        """``n``: layers ``[0, n)`` of every block hit so far are in the
        caches, and stay so. Never blocks. Once :attr:`done` it is
        :attr:`num_layers` -- unless a scatter failed: it then stays below
        the layer that failed (see :meth:`wait_for_layer`).

        For caches a shim scatters (on a GPU), reading it once every batch
        has arrived enqueues the scatter of the layers left on the load's
        stream, as ``wait_for_layer(num_layers - 1)`` would, and "in the
        caches" means, as for :meth:`wait_for_layer`, seen by the work the
        reading thread queues afterwards on its current stream (that stream
        is made to wait for them on the device). A thread that polls for
        another stream does not order that one: call :meth:`wait_for_layer`
        on the stream that reads (it returns at once once the layer is
        enqueued)."""
        return self._num_layers if self._load is None else self._load.ready_layers()

    @property
    def done(self) -> bool:
        """True once every block has an outcome. For host caches every hit
        is then in the caches and :meth:`wait` returns at once (never
        blocks). For caches on a GPU the scatters are queued on the load's
        stream (the current stream of the first call that queues one) by
        :meth:`wait_for_layer`, :attr:`ready_layers` and :meth:`wait`
        themselves: done means nothing is left to come over the network;
        :attr:`ready_layers` then queues what is left, and :meth:`wait`
        queues it and synchronizes that stream."""
        return self._load is None or self._load.ready()

    def wait_for_layer(self, layer: int, timeout: Optional[float] = None) -> None:
        """Returns once layer ``layer`` (and every layer before it) of every
        block hit is in the caches: the engine may run that layer.

        For caches on a GPU "in the caches" is a promise about stream
        order, not that the copies have run: the scatters are queued on the
        load's stream (the caller's current stream at the first call that
        queued one), and before returning this makes the caller's current
        stream wait for them on the device (an event per call that queued
        scatters; the host is not blocked). So work the calling thread
        queues afterwards on its current stream -- whichever stream that is
        -- sees those layers; work on other streams is not ordered by this
        call (call it again from that stream, or :meth:`wait`, which
        synchronizes). For host caches the layers are written when it
        returns.

        Misses and blocks whose read failed are not waited for (their cache
        blocks are untouched); :meth:`wait` reports them. A failed scatter
        is different: its blocks hold some layers only, so for the layer
        that failed and every later one this raises that error, as
        :meth:`wait` would (RuntimeError, or ValueError for INVALID_ARGUMENT
        / OUT_OF_RANGE), once nothing of the load runs any more; the layers
        before it still return. ``timeout`` in seconds (None: no limit)
        raises TimeoutError when it passes first; the GIL is released while
        waiting. ValueError for a layer outside ``[0, num_layers)``.
        """
        if not 0 <= layer < self._num_layers:
            raise ValueError(
                f"OUT_OF_RANGE: layer {layer} is outside [0, {self._num_layers})")
        if self._load is not None and not self._load.wait_for_layer(layer, timeout):
            raise TimeoutError(f"layer {layer} of {self!r} not ready after {timeout} s")

    def wait(self, timeout: Optional[float] = None) -> List[bool]:
        """Waits until the load is done and returns one flag per key: True if
        the block was loaded, False if the key is not stored (a miss: that
        cache block is left untouched, never zero-filled).

        Any other block error (the daemon unreachable, a deadline,
        DATA_LOSS) raises once everything has ended, as :meth:`KvCacheStore.load`
        does: ValueError for INVALID_ARGUMENT / OUT_OF_RANGE, else
        RuntimeError, the message starting with the code (the blocks that
        did load are in the caches; :meth:`errors` tells them apart).
        ``timeout`` as in :meth:`wait_for_layer`.
        """
        if self._load is None:
            return []
        if not self._load.wait(timeout):
            raise TimeoutError(f"{self!r} not done after {timeout} s")
        _raise_block_error(self._load.errors(), ignore=("NOT_FOUND",))
        return self._load.ok()

    def errors(self) -> List[Optional[Tuple[str, str]]]:
        """One entry per key once done: None when loaded, else (code name,
        message), e.g. ``("NOT_FOUND", ...)`` for a miss. Never raises for
        block errors; RuntimeError (FAILED_PRECONDITION) before done."""
        if self._load is None:
            return []
        if self._load.ready():
            # Done: a load into GPU caches may still have scatters to queue
            # and a stream to synchronize (wait() no longer waits for the
            # network then).
            self._load.wait()
        return self._load.errors()

    def _finish(self) -> None:
        """Waits until done, reporting nothing (the results stay here)."""
        if self._load is not None:
            self._load.wait()

    def __repr__(self) -> str:
        if self._load is None:
            return "LoadHandle(0 blocks, done)"
        return f"LoadHandle({self._load!r})"


class _HostRegistration:
    """Staging memory registered with a device shim (page-locked for CUDA),
    unregistered when the last holder lets go: the store, and a load whose
    scatters may still read the memory after the store dropped it."""

    __slots__ = ("shim", "pool")

    def __init__(self, shim: Any, pool: Any) -> None:
        shim.register_host(pool)
        self.shim = shim
        self.pool = pool

    def __del__(self) -> None:
        try:
            self.shim.unregister_host(self.pool)
        except Exception:  # noqa: BLE001 - nothing to report to in __del__
            pass


class KvCacheStore:
    """Saves and loads blocks of one engine's paged KV cache in kvdepotd.

    ``caches`` arguments are the engine's cache tensors as the layout expects
    them: one per layer for the per-layer layouts (vLLM FlashAttention,
    FlashInfer, MLA), exactly one for the cross-layer layouts. They may be CPU
    torch tensors or numpy arrays (the native gather/scatter) or CUDA torch
    tensors (:mod:`kvdepot.kvshim`: the CUDA kernels between the GPU caches
    and the staging buffers, which the store page-locks), and must be
    C-contiguous, little-endian, on one device, of the layout's physical
    shape (e.g. ``[2, N, T, H, D]`` for FLASH_ATTN_NHD; an integer view of
    the bits may differ in the last dimension, a 1-D buffer in shape, see
    gpu/kv_layout.h); every tensor holds the same number of blocks.
    ``shim`` forces a :class:`kvdepot.kvshim.KvShim` for every cache (e.g.
    the library's CPU build, for CPU caches).

    With a shim, saves gather each batch on the caller's current stream
    (after the work it queued before) and wait for it; loads work as on the
    host except who scatters: ``LoadHandle.wait_for_layer(l)`` waits for the
    blocks to arrive and then *enqueues* the scatter of the layers up to
    ``l`` on the current stream (kernel launches; work queued on that
    stream afterwards sees them), and ``wait()`` enqueues the rest and
    synchronizes, so the blocks are in the caches when it returns. Nothing
    is scattered until the caller asks for a layer (``wait_for_layer``,
    ``wait``, or ``ready_layers`` once the blocks have arrived).

    Blocks are stored under ``layout.namespace_for(model)``, so engines whose
    objects differ in format never read each other's blocks; ``model`` must
    name what the layout cannot see (model and revision, tensor-parallel rank
    and size, KV quantization).

    Not thread-safe (it reuses its host staging buffers); use one store per
    thread, or share one :class:`Client` between several stores. For the same
    reason one load may be in flight per store: a ``load_async``, ``load`` or
    ``save`` called while an earlier :class:`LoadHandle` is not done first
    waits for it (its results stay with that handle).

    Saves and loads are pipelined: the blocks go in up to
    ``pipeline_batches`` batches in flight at once (each of
    ``min_batch_bytes`` or more),
    so the gather of one batch overlaps the put of the one before, and the
    scatter of one the transfer of the next: 64 blocks of 2 MiB over shared
    memory loaded 1.3x and saved 1.4x faster than in one batch on a 2-core
    machine (tools/compare_store_pipeline.py). 1 makes every save or load
    one batch. Loads scatter layer by layer (see :meth:`load_async`).
    """

    def __init__(
        self,
        server: str,
        layout: KvLayout,
        model: str,
        *,
        timeout_s: float = 30.0,
        client: Optional[Client] = None,
        pipeline_batches: int = 4,
        min_batch_bytes: int = 2 << 20,
        shim: Optional[Any] = None,
    ) -> None:
        if pipeline_batches < 1:
            raise ValueError("INVALID_ARGUMENT: pipeline_batches must be >= 1")
        # Smaller batches cost more in round trips than their overlap saves.
        self.min_batch_bytes = max(0, min_batch_bytes)
        self.layout = layout
        self.namespace: str = layout.namespace_for(model)
        self.client: Client = client if client is not None else Client(
            server, timeout_s=timeout_s
        )
        self.pipeline_batches = pipeline_batches
        self._buffers: List[Any] = []
        self._pool: Any = None  # the memory of _buffers
        # The last load_async's handle, until its staging buffers are free.
        self._pending: Optional["weakref.ReferenceType[LoadHandle]"] = None
        # Transfers whose wait an exception cut short (KeyboardInterrupt, a
        # watchdog's signal): a save's puts, still reading staging buffers,
        # or a device load's gets, still writing them, until waited for.
        self._unfinished: List[TransferOp] = []
        # Device caches: the KvShim that gathers/scatters them (None: pick
        # by the caches' device), and _pool's registrations with shims.
        self._forced_shim = shim
        self._registered: List[_HostRegistration] = []

    def _release_pool(self) -> None:
        """Drops the staging memory and its registrations (each unregisters
        once no load holds it either)."""
        self._registered = []
        self._buffers = []
        self._pool = None

    def shim_for(self, caches: Sequence[Any]) -> Optional[Any]:
        """The KvShim that moves blocks of ``caches``: None for host caches
        (numpy arrays, CPU tensors: the native gather/scatter), the CUDA
        one for CUDA tensors, or the shim the store was made with."""
        if self._forced_shim is not None:
            return self._forced_shim
        devices = {getattr(getattr(t, "device", None), "type", "cpu") for t in caches}
        if devices <= {"cpu"}:
            return None
        if len(devices) > 1:
            raise ValueError(
                f"INVALID_ARGUMENT: the caches are on several devices ({sorted(devices)})")
        (device,) = devices
        from .kvshim import KvShim

        return KvShim.for_device(device)  # one instance per library

    @staticmethod
    def _stream_of(caches: Sequence[Any]) -> Any:
        """The caller's current CUDA stream on the caches' device, as a
        torch.cuda.Stream (which knows its device: the default stream's
        handle alone would name the current device's); None for host
        caches."""
        t = caches[0] if caches else None
        # numpy 2 arrays have a `device` too: the string "cpu".
        dev = getattr(t, "device", None)
        if getattr(dev, "type", None) != "cuda":
            return None
        import torch

        return torch.cuda.current_stream(dev)

    def _batches(self, n: int) -> List[Tuple[int, int]]:
        """[lo, hi) ranges splitting n blocks into up to pipeline_batches
        batches of at least 2 blocks and min_batch_bytes each."""
        min_blocks = -(-self.min_batch_bytes // max(1, self.layout.object_bytes))
        step = max(2, min_blocks, -(-n // self.pipeline_batches))
        return [(lo, min(n, lo + step)) for lo in range(0, n, step)]

    def check_block_ids(self, caches: Sequence[Any], block_ids: Sequence[int]) -> None:
        """Raises ValueError (OUT_OF_RANGE) for a block id outside the
        caches. save and load_async call it before any batch moves (a later
        batch's bad id must not leave earlier batches written)."""
        if not caches:
            return
        t = caches[0]
        if hasattr(t, "element_size"):  # a torch tensor
            nbytes = t.numel() * t.element_size()
        else:  # numpy arrays, bytearrays, memoryviews...
            nbytes = memoryview(t).nbytes
        per_block = self.layout.tensor_bytes(1)
        n = nbytes // per_block if per_block else 0
        for b in block_ids:
            if not 0 <= b < n:
                raise ValueError(
                    f"OUT_OF_RANGE: block id {b} is outside the cache's {n} blocks")

    @staticmethod
    def _raise_first(ops: Sequence[TransferOp], ignore: Tuple[str, ...] = ()) -> None:
        """Raises the first block error of ``ops`` whose code is not in
        ``ignore`` (see _raise_block_error)."""
        for op in ops:
            _raise_block_error(op.errors(), ignore)

    def _wait_unfinished(self) -> None:
        """Waits for the transfers in _unfinished, dropping each once it is
        ready (another interruption leaves the rest listed)."""
        from ._device_load import wait_listed

        wait_listed(self._unfinished)

    def _wait_pending(self) -> None:
        """Waits for the load or the interrupted save in flight, if any, so
        that its staging buffers are free; a load's results stay with its
        handle. (A handle that was dropped waited for itself.)"""
        self._wait_unfinished()
        handle = self._pending() if self._pending is not None else None
        if handle is not None:
            handle._finish()
        self._pending = None

    def _staging(self, n: int, shim: Optional[Any] = None) -> List[Any]:
        """n host buffers of one object each, reused across calls: views of
        memory allocated through UCX (so the blocks move over the UCX data
        plane) when the client has it, else numpy arrays (gRPC byte path).
        With a device ``shim`` the memory is registered with it (page-locked
        for CUDA, so its kernels can read and write it)."""
        import numpy as np

        size = self.layout.object_bytes
        if len(self._buffers) < n:
            # Grow in one piece (at least doubling), so registrations stay few.
            count = max(n, 2 * len(self._buffers), 8)
            self._release_pool()
            try:
                pool = self.client.allocate_buffer(count * size)
            except RuntimeError:  # no UCX in this client: host memory
                pool = np.empty(count * size, dtype=np.uint8)
            self._pool = pool
            self._buffers = [pool[i * size:(i + 1) * size] for i in range(count)]
        if shim is not None and self._registration(shim) is None:
            self._registered.append(_HostRegistration(shim, self._pool))
        return self._buffers[:n]

    def _registration(self, shim: Any) -> Optional[_HostRegistration]:
        for r in self._registered:
            if r.shim is shim:
                return r
        return None

    def save(
        self,
        caches: Sequence[Any],
        block_ids: Sequence[int],
        keys: Sequence[bytes],
        parents: Optional[Sequence[bytes]] = None,
    ) -> List[bool]:
        """Stores the blocks ``block_ids`` of ``caches`` under ``keys``.

        ``parents[i]`` is the key of the block before ``keys[i]`` in its
        chain (``b""`` for a chain's first block); None means no parents.
        Returns one flag per block: True if stored now, False if the key was
        already stored (put-if-absent: the existing block is kept).
        """
        if len(block_ids) != len(keys):
            raise ValueError(
                f"INVALID_ARGUMENT: {len(block_ids)} block ids but {len(keys)} keys"
            )
        if not keys:
            return []
        if parents is not None and len(parents) != len(keys):
            raise ValueError(
                f"INVALID_ARGUMENT: {len(keys)} keys but {len(parents)} parents"
            )
        caches = list(caches)
        self.check_block_ids(caches, block_ids)
        shim = self.shim_for(caches)
        self._wait_pending()
        buffers = self._staging(len(keys), shim)
        stream = self._stream_of(caches)
        ops: List[Tuple[int, TransferOp]] = []
        try:
            for lo, hi in self._batches(len(keys)):
                # Gathered while the batches before it are being stored.
                if shim is None:
                    gather(self.layout, caches, list(block_ids[lo:hi]), buffers[lo:hi])
                else:  # on the caller's stream, after what it queued before
                    shim.gather(self.layout, caches, list(block_ids[lo:hi]),
                                buffers[lo:hi], stream=stream)
                    shim.synchronize(stream)
                ops.append((lo, self.client.put_async(
                    self.namespace,
                    keys[lo:hi],
                    buffers[lo:hi],
                    parents[lo:hi] if parents is not None else None,
                )))
        finally:
            # No staging buffer is in flight past here. Should a wait be cut
            # short (KeyboardInterrupt, a watchdog's exception), the puts
            # left stay listed, and the next save or load waits for them
            # before it reuses the buffers they read.
            self._unfinished.extend(op for _, op in ops)
            self._wait_unfinished()
        self._raise_first([op for _, op in ops])
        return [not op.already_stored(i)
                for _, op in ops for i in range(len(op))]

    def load(
        self,
        caches: Sequence[Any],
        block_ids: Sequence[int],
        keys: Sequence[bytes],
    ) -> List[bool]:
        """Loads the blocks stored under ``keys`` into ``block_ids`` of
        ``caches``: ``load_async(caches, block_ids, keys).wait()``.

        Returns one flag per key: True if the block was loaded, False if the
        key is not stored -- that cache block is then left untouched (never
        zero-filled), for the caller to recompute. Block ids must not repeat.
        Raises as :meth:`load_async` and :meth:`LoadHandle.wait`.
        """
        return self.load_async(caches, block_ids, keys).wait()

    def load_async(
        self,
        caches: Sequence[Any],
        block_ids: Sequence[int],
        keys: Sequence[bytes],
    ) -> LoadHandle:
        """Starts loading the blocks stored under ``keys`` into ``block_ids``
        of ``caches`` and returns a :class:`LoadHandle` at once.

        The reads go in the pipelined batches (``pipeline_batches``,
        ``min_batch_bytes``) into this store's staging buffers; a loader
        thread scatters the hits into the caches one layer of one arrived
        batch at a time, always the lowest layer left first. So layer 0 is
        ready one single-layer scatter after the last batch arrives, and
        ``handle.wait_for_layer(l)`` returns as soon as layers ``0..l`` are
        written, while the later ones are still being scattered.
        ``handle.wait()`` returns the hit flags (see :meth:`load`).

        Raises, before anything is read or written: ValueError when the
        counts differ, a block id repeats or is outside the caches, or the
        caches do not fit the layout. Waits first for a load of this store
        still in flight (see the class docstring). Until the handle is
        done, the caches' blocks being loaded must not be written, and their
        layers not yet ready not read.
        """
        if len(block_ids) != len(keys):
            raise ValueError(
                f"INVALID_ARGUMENT: {len(block_ids)} block ids but {len(keys)} keys"
            )
        if not keys:
            return LoadHandle(None, self.layout.num_layers, 0)
        if len(set(block_ids)) != len(block_ids):
            raise ValueError("INVALID_ARGUMENT: block ids repeat")
        caches = list(caches)
        self.check_block_ids(caches, block_ids)
        shim = self.shim_for(caches)
        self._wait_pending()
        buffers = self._staging(len(keys), shim)
        batch_sizes = [hi - lo for lo, hi in self._batches(len(keys))]
        load: Any
        if shim is None:
            load = self.client.load_into_cache_async(
                self.namespace, list(keys), buffers, self.layout, caches,
                list(block_ids), batch_sizes)
        else:
            from ._device_load import DeviceLoad

            # The caches against the layout and the device, before anything
            # is read (an empty scatter checks them and moves nothing).
            shim.scatter(self.layout, caches, [], [])
            load = DeviceLoad(self.client, self.namespace, list(keys), buffers,
                              self.layout, shim, caches, list(block_ids),
                              batch_sizes, lambda: self._stream_of(caches),
                              keep=self._registration(shim),
                              unfinished=self._unfinished)
        handle = LoadHandle(load, self.layout.num_layers, len(keys))
        self._pending = weakref.ref(handle)
        return handle

    def lookup(self, keys: Sequence[bytes], prefix: bool = True) -> int:
        """How many of ``keys`` are stored: with ``prefix``, the length of the
        longest stored prefix of the chain; else the number found."""
        reply = self.client.lookup(self.namespace, list(keys), prefix=prefix)
        if prefix:
            return reply.prefix_hits
        return sum(1 for e in reply.entries if e.found)
