"""The load behind :meth:`kvdepot.KvCacheStore.load_async` for caches that a
:class:`kvdepot.kvshim.KvShim` scatters (CUDA caches): the same interface as
the native ``CacheLoad`` (what :class:`kvdepot.LoadHandle` wraps), driven by
the caller instead of a loader thread.

On a CUDA stream a scatter is a kernel launch that returns at once, so there
is nothing for a thread to overlap: ``wait_for_layer(l)`` waits for the
batches to arrive (the GIL released), then enqueues the scatters of the
layers not yet enqueued up to ``l``, lowest first, on the load's stream --
the caller's current stream at the first call that enqueues a scatter --
and returns. Each call that enqueues scatters records an event on the
load's stream after them (for caches on a GPU, whose streams have
``record_event``; host caches have no stream and no events).

What a caller may rely on, whichever its stream: when ``wait_for_layer(l)``
returns, work that the calling thread queues afterwards on its current
stream sees layers ``0..l``: on the load's stream by stream order, on any
other stream because that stream was made to wait (``wait_event``, the
host not blocked) for the event of those layers. ``ready_layers`` likewise
orders the caller's current stream after the layers it reports. Work on a
stream that is neither the load's stream nor the current stream of a
thread that called ``wait_for_layer``/``ready_layers`` is not ordered:
call ``wait_for_layer`` on that stream first (it does not block once the
layer is enqueued), or ``wait``. ``wait`` enqueues the rest and
synchronizes the load's stream, so that when it returns the blocks are in
the caches for every stream and the staging buffers free.
``ready_layers`` never waits on the host: once every batch has arrived it
enqueues the layers left, as ``wait_for_layer(num_layers - 1)`` would, so
that an engine polling it (or ``ready``, then it) sees it reach
``num_layers``.

A scatter that fails fails the hits (they hold some layers only): no
further layer is scattered, ``ready_layers`` stays below the layer that
failed, and ``wait_for_layer`` of that layer or a later one synchronizes
the stream (nothing of the load runs any more) and raises the error, as
``wait`` reports it.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

_BlockError = Optional[Tuple[str, str]]


def wait_listed(ops: List[Any]) -> None:
    """Waits for the transfer ops in ``ops``, removing each from the list
    once it is ready: a wait an exception cuts short (Ctrl-C) leaves the
    rest listed, for a later call."""
    while ops:
        ops[0].wait()
        ops.pop(0)


def _split_status(e: Exception) -> Tuple[str, str]:
    """("CODE", "message") of an exception whose message is "CODE: ..."."""
    code, sep, msg = str(e).partition(": ")
    if sep and code.isupper() and code.replace("_", "").isalpha():
        return code, msg
    return "INTERNAL", str(e)


def _raise_status(code: str, message: str) -> None:
    """Raises "CODE: message" as the native module does: KeyError for
    NOT_FOUND, ValueError for INVALID_ARGUMENT / OUT_OF_RANGE, else
    RuntimeError."""
    text = f"{code}: {message}"
    if code == "NOT_FOUND":
        raise KeyError(text)
    if code in ("INVALID_ARGUMENT", "OUT_OF_RANGE"):
        raise ValueError(text)
    raise RuntimeError(text)


class DeviceLoad:
    """One load in flight; see the module docstring. Thread-safe."""

    def __init__(
        self,
        client: Any,
        ns: str,
        keys: Sequence[bytes],
        objects: Sequence[Any],
        layout: Any,
        shim: Any,
        caches: Sequence[Any],
        block_ids: Sequence[int],
        batch_sizes: Sequence[int],
        stream_fn: Callable[[], Optional[int]],
        keep: Any = None,
        unfinished: Optional[List[Any]] = None,
    ) -> None:
        if sum(batch_sizes) != len(keys):
            raise ValueError(
                f"INVALID_ARGUMENT: batches of {sum(batch_sizes)} blocks for {len(keys)} keys")
        self._layout = layout
        self._shim = shim
        self._caches = list(caches)
        self._ids = list(block_ids)
        self._objects = list(objects)
        self._stream_fn = stream_fn
        # Held until this load is gone (after close() synchronized): the
        # staging memory's registration, which scatters still read.
        self._keep = keep
        self._num_layers: int = layout.num_layers
        # Through the shim: a kvdepot.KvLayout or the shim's own LayoutSpec.
        self._layer_bytes: int = shim.layout_info(layout).layer_bytes
        self._lock = threading.Lock()
        self._errors: List[_BlockError] = [None] * len(keys)
        self._hits: List[int] = []
        self._arrived = False
        self._layers = 0  # layers [0, _layers) of every hit are enqueued
        # The first failure (code, message) of a scatter or of the stream,
        # and the lowest layer it may have left unwritten (_num_layers while
        # nothing failed).
        self._failure: _BlockError = None
        self._failed_layer = self._num_layers
        self._stream: Any = None  # a torch.cuda.Stream
        # (upto, event): an event recorded on _stream after the scatters of
        # layers [.., upto), in increasing upto; appended before _layers
        # moves to upto, so a reader that saw _layers == n finds an entry
        # with upto >= n. Empty where the stream records no events (host
        # caches: no stream).
        self._events: List[Tuple[int, Any]] = []
        self._enqueued_any = False
        self._synced = False
        self._ops: List[Tuple[int, Any]] = []
        lo = 0
        try:
            for n in batch_sizes:
                self._ops.append((lo, client.get_into_async(
                    ns, list(keys[lo:lo + n]), self._objects[lo:lo + n])))
                lo += n
        except BaseException:
            # No staging buffer is in flight past here. Should a wait be cut
            # short (a second KeyboardInterrupt), the gets left stay in
            # `unfinished` (the store's), which the store waits for before
            # it reuses the buffers they write.
            left = unfinished if unfinished is not None else []
            left.extend(op for _, op in self._ops)
            wait_listed(left)
            raise

    def __len__(self) -> int:
        return len(self._errors)

    def num_layers(self) -> int:
        return self._num_layers

    def _acquire(self, timeout: Optional[float]) -> bool:
        return self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout))

    def _arrive(self, deadline: Optional[float]) -> bool:
        """Waits for every batch (lock held); records hits and errors."""
        if self._arrived:
            return True
        for _, op in self._ops:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not op.wait(left):
                return False
        for lo, op in self._ops:
            for i, err in enumerate(op.errors()):
                if err is None:
                    self._hits.append(lo + i)
                else:
                    self._errors[lo + i] = err
        self._arrived = True
        return True

    def _fail_hits(self, code: str, message: str, layer: int) -> None:
        """Fails every hit (lock held): layers from ``layer`` on may be
        missing from their blocks. Nothing more is scattered."""
        for i in self._hits:
            self._errors[i] = (code, message)
        self._hits = []
        if self._failure is None:
            self._failure = (code, message)
        self._failed_layer = min(self._failed_layer, layer)

    def _enqueue(self, upto: int) -> None:
        """Enqueues the scatter of layers [_layers, upto) of every hit (lock
        held). A failure makes every hit an error (their blocks may hold
        some layers) and ends the load's scatters."""
        if self._layers >= upto or self._failure is not None:
            return
        if not self._hits:
            self._layers = upto
            return
        if self._stream is None:
            self._stream = self._stream_fn()
        # One call (one kernel launch per batch of blocks) for the whole
        # range; each object's part is its bytes of those layers.
        begin, lb = self._layers, self._layer_bytes
        ids = [self._ids[i] for i in self._hits]
        objs = [self._objects[i][begin * lb:upto * lb] for i in self._hits]
        try:
            self._enqueued_any = True
            self._shim.scatter(self._layout, self._caches, ids, objs,
                               layers=(begin, upto), stream=self._stream)
        except Exception as e:  # noqa: BLE001 - reported per block
            code, msg = _split_status(e)
            self._fail_hits(code, f"scatter of layers [{begin}, {upto}): {msg}", begin)
            return
        record = getattr(self._stream, "record_event", None)
        if record is not None:
            try:
                self._events.append((upto, record()))
            except Exception as e:  # noqa: BLE001 - reported per block
                # Without the event no other stream can be ordered after
                # these layers: treat it as the scatter failing.
                code, msg = _split_status(e)
                self._fail_hits(code, f"recording the event of layers [{begin}, {upto}): "
                                f"{msg}", begin)
                return
        self._layers = upto

    def _order_caller(self, n: int) -> None:
        """Makes the caller's current stream wait (on the device, the host
        not blocked) for the scatters of layers [0, n), unless it is the
        load's stream (ordered already). Nothing without events (host
        caches) or for n == 0."""
        if n <= 0 or not self._events:
            return
        event = None
        for upto, e in list(self._events):
            event = e
            if upto >= n:
                break
        current = self._stream_fn()
        if current is None or current is self._stream or current == self._stream:
            return
        current.wait_event(event)

    def _sync(self) -> None:
        """Waits until every enqueued scatter ran (lock held)."""
        if self._synced:
            return
        self._synced = True
        if not self._enqueued_any:
            return
        try:
            self._shim.synchronize(self._stream)
        except Exception as e:  # noqa: BLE001 - reported per block
            code, msg = _split_status(e)
            # Any enqueued layer may be the one that failed.
            self._fail_hits(code, f"synchronizing the scatters: {msg}", 0)

    def _after_arrival(self, timeout: Optional[float], then: Callable[[], None]) -> bool:
        """Waits (up to ``timeout``) for the batches to arrive, then runs
        ``then`` under the lock. False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._acquire(timeout):
            return False
        try:
            if not self._arrive(deadline):
                return False
            then()
            return True
        finally:
            self._lock.release()

    def wait_for_layer(self, layer: int, timeout: Optional[float] = None) -> bool:
        """False if ``timeout`` passed first; see the module docstring.
        On True, the caller's current stream is ordered after the scatters
        of layers ``0..layer``. Raises the failure of a scatter that left
        ``layer`` (or an earlier one) unwritten, once the stream is
        synchronized."""
        if not 0 <= layer < self._num_layers:
            raise ValueError(
                f"OUT_OF_RANGE: layer {layer} is outside [0, {self._num_layers})")

        def enqueue() -> None:
            self._enqueue(layer + 1)
            if self._failure is not None and layer >= self._failed_layer:
                self._sync()  # no scatter of this load runs past here
                _raise_status(*self._failure)
            self._order_caller(layer + 1)

        return self._after_arrival(timeout, enqueue)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Arrival, every layer enqueued, the stream synchronized. False if
        ``timeout`` passed before the batches arrived."""

        def finish() -> None:
            self._enqueue(self._num_layers)
            self._sync()

        return self._after_arrival(timeout, finish)

    def ready_layers(self) -> int:
        """Layers enqueued for every hit. Never waits: once every batch has
        arrived, enqueues the layers left first (see the module
        docstring), so it reaches num_layers unless a scatter fails. The
        caller's current stream is ordered after the layers it returns."""
        self._poll()
        n = min(self._layers, self._failed_layer)
        self._order_caller(n)
        return n

    def _poll(self) -> None:
        """Enqueues the layers left if every batch has arrived, without
        waiting: nothing while one is in flight or another thread holds the
        load (it is then arriving or enqueueing itself)."""
        if self._layers >= self._num_layers or self._failure is not None:
            return
        if not all(op.ready() for _, op in self._ops):
            return
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._arrive(time.monotonic()):  # every op is ready: no wait
                self._enqueue(self._num_layers)
        finally:
            self._lock.release()

    def ready(self) -> bool:
        """True once every batch has arrived: wait() then no longer waits
        for the network (it still enqueues what is left and synchronizes)."""
        if self._synced:
            return True
        return all(op.ready() for _, op in self._ops)

    def errors(self) -> List[_BlockError]:
        if not self._synced:
            raise RuntimeError("FAILED_PRECONDITION: the load is not done; wait() first")
        return list(self._errors)

    def ok(self) -> List[bool]:
        return [e is None for e in self.errors()]

    def close(self) -> None:
        """Ends the load without scattering further layers: waits for the
        transfers and for the scatters already enqueued, so the staging
        buffers can be reused. The blocks not wholly scattered end
        CANCELLED (their cache blocks may hold some layers)."""
        with self._lock:
            if self._synced:
                return
            for _, op in self._ops:
                op.wait()
            self._arrive(None)
            if self._layers < self._num_layers:
                self._fail_hits("CANCELLED", "the load was dropped before it finished",
                                self._layers)
            self._sync()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing to report to in __del__
            pass

    def __repr__(self) -> str:
        """As the native CacheLoad's: "DeviceLoad(4 blocks, 2 of 2 batches
        started, 1 of 32 layers ready)" (ready: enqueued; every batch starts
        in the constructor) or "DeviceLoad(4 blocks, done, 3 loaded)"."""
        if not self._synced:
            batches = len(self._ops)
            ready = min(self._layers, self._failed_layer)
            return (f"DeviceLoad({len(self._errors)} blocks, {batches} of {batches} "
                    f"batches started, {ready} of {self._num_layers} layers ready)")
        ok = sum(1 for e in self._errors if e is None)
        return f"DeviceLoad({len(self._errors)} blocks, done, {ok} loaded)"
