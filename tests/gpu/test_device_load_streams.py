#!/usr/bin/env python3
"""CPU test of the stream ordering of kvdepot/_device_load.py (the load
behind KvCacheStore.load_async for CUDA caches), with fake streams, events,
shim and client: no GPU, torch, numpy, daemon or native module needed
(_device_load.py is loaded by path, alone).

The scatters of a load run on one stream, the current stream of the first
call that queues one. A caller on another stream -- an engine that waits
from its own stream, or after a polling thread queued the scatters with
ready_layers -- must have its current stream ordered after the scatters of
the layers it was told are ready, or it reads them before they are written.
The fakes record, per stream, what was queued on it in order (scatters,
event records, event waits); the checks read the device's order from them:
a stream sees layer l once it has waited on an event recorded after the
scatter of l. tests/gpu/test_cuda_kvshim.py checks the same on a GPU.

  /usr/bin/python3 tests/gpu/test_device_load_streams.py [-v]

Exit: 0 all passed, 1 a failure.
"""

import importlib.util
import os
import threading
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_module():
    path = os.path.join(REPO, "client", "python", "kvdepot", "_device_load.py")
    spec = importlib.util.spec_from_file_location("kvdepot_device_load_streams", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


DL = load_module()


class FakeEvent:
    def __init__(self, stream, position):
        self.stream = stream
        self.position = position  # ops of `stream` before it


class FakeStream:
    """A stream's queue as a list of ops: ("scatter", begin, end),
    ("record", event), ("wait", event). Equal only to itself."""

    def __init__(self, name, fail_record=False):
        self.name = name
        self.ops = []
        self.fail_record = fail_record

    def record_event(self):
        if self.fail_record:
            raise RuntimeError("INTERNAL: cudaEventRecord failed")
        e = FakeEvent(self, len(self.ops))
        self.ops.append(("record", e))
        return e

    def wait_event(self, event):
        self.ops.append(("wait", event))

    def layers_seen(self):
        """The layers [0, n) whose scatter work later queued on this stream
        is ordered after: its own scatters, and those before the events it
        waited on."""
        n = 0
        for op in self.ops:
            if op[0] == "scatter" and op[1] <= n:
                n = max(n, op[2])
            elif op[0] == "wait":
                src = op[1].stream
                for earlier in src.ops[:op[1].position]:
                    if earlier[0] == "scatter" and earlier[1] <= n:
                        n = max(n, earlier[2])
        return n

    def __repr__(self):
        return f"FakeStream({self.name})"


class FakeShim:
    """Records each scatter on the stream it is given."""

    class Info:
        layer_bytes = 4

    def __init__(self):
        self.streams = []

    def layout_info(self, layout):
        return self.Info()

    def scatter(self, layout, caches, ids, objs, layers, stream):
        self.streams.append(stream)
        if isinstance(stream, FakeStream):
            stream.ops.append(("scatter", layers[0], layers[1]))

    def synchronize(self, stream):
        pass


class ArrivedGet:
    def __init__(self, n):
        self.n = n

    def wait(self, timeout=None):
        return True

    def ready(self):
        return True

    def errors(self):
        return [None] * self.n


class FakeClient:
    def get_into_async(self, ns, keys, buffers):
        return ArrivedGet(len(keys))


class Layout:
    num_layers = 4


class CurrentStream:
    """torch.cuda.current_stream as a per-thread setting."""

    def __init__(self, default):
        self.local = threading.local()
        self.default = default

    def set(self, stream):
        self.local.stream = stream

    def __call__(self):
        return getattr(self.local, "stream", self.default)


def make_load(current, keys=2):
    objects = [bytearray(Layout.num_layers * FakeShim.Info.layer_bytes) for _ in range(keys)]
    shim = FakeShim()
    load = DL.DeviceLoad(FakeClient(), "ns", [b"k%d" % i for i in range(keys)], objects,
                         Layout(), shim, [object()], list(range(keys)), [keys], current)
    return load, shim


class DeviceLoadStreamTest(unittest.TestCase):
    def test_a_wait_from_another_stream_orders_that_stream(self):
        a, b = FakeStream("a"), FakeStream("b")
        current = CurrentStream(a)
        load, shim = make_load(current)
        self.assertTrue(load.wait_for_layer(0))  # queues layer 0 on a
        self.assertEqual(a.layers_seen(), 1)
        current.set(b)
        self.assertTrue(load.wait_for_layer(2))  # queues layers 1, 2 on a, from b
        self.assertEqual(shim.streams, [a, a])  # the load's stream stays a
        self.assertGreaterEqual(b.layers_seen(), 3)
        # Asking again for a layer already queued still orders the caller.
        c = FakeStream("c")
        current.set(c)
        self.assertTrue(load.wait_for_layer(1))
        self.assertGreaterEqual(c.layers_seen(), 2)
        self.assertTrue(load.wait())

    def test_the_loads_own_stream_waits_on_nothing(self):
        a = FakeStream("a")
        load, _ = make_load(CurrentStream(a))
        for layer in range(Layout.num_layers):
            self.assertTrue(load.wait_for_layer(layer))
        self.assertEqual([op for op in a.ops if op[0] == "wait"], [])
        self.assertEqual(a.layers_seen(), Layout.num_layers)

    def test_after_a_polling_thread_queued_everything_a_wait_orders_the_caller(self):
        poller, engine = FakeStream("poller"), FakeStream("engine")
        current = CurrentStream(engine)
        load, shim = make_load(current)
        seen = []

        def poll():
            current.set(poller)
            seen.append(load.ready_layers())

        t = threading.Thread(target=poll)
        t.start()
        t.join()
        self.assertEqual(seen, [Layout.num_layers])
        self.assertEqual(shim.streams, [poller])  # every layer, on the poller's stream
        self.assertEqual(engine.layers_seen(), 0)  # not ordered yet
        for layer in range(Layout.num_layers):
            self.assertTrue(load.wait_for_layer(layer))
            self.assertGreaterEqual(engine.layers_seen(), layer + 1)

    def test_ready_layers_orders_the_callers_stream(self):
        a, b = FakeStream("a"), FakeStream("b")
        current = CurrentStream(a)
        load, _ = make_load(current)
        self.assertTrue(load.wait_for_layer(1))
        current.set(b)
        n = load.ready_layers()  # queues the rest on a
        self.assertEqual(n, Layout.num_layers)
        self.assertEqual(b.layers_seen(), n)

    def test_host_caches_have_no_stream_and_no_events(self):
        load, shim = make_load(lambda: None)
        self.assertTrue(load.wait_for_layer(1))
        self.assertEqual(load.ready_layers(), Layout.num_layers)
        self.assertTrue(load.wait())
        self.assertEqual(shim.streams, [None, None])
        self.assertEqual(load.ok(), [True, True])

    def test_a_stream_without_events_is_used_as_is(self):
        # A raw cudaStream_t (an int) records no events: nothing to order.
        load, shim = make_load(lambda: 1234)
        self.assertTrue(load.wait_for_layer(3))
        self.assertEqual(shim.streams, [1234])
        self.assertTrue(load.wait())

    def test_an_event_that_cannot_be_recorded_fails_the_hits(self):
        a = FakeStream("a", fail_record=True)
        load, _ = make_load(CurrentStream(a))
        with self.assertRaisesRegex(RuntimeError, r"^INTERNAL: recording the event of "
                                    r"layers \[0, 1\)"):
            load.wait_for_layer(0)
        self.assertEqual(load.ready_layers(), 0)
        self.assertTrue(load.wait())
        self.assertEqual([e[0] for e in load.errors()], ["INTERNAL", "INTERNAL"])


if __name__ == "__main__":
    unittest.main()
