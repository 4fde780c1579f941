"""Integration tests of the kvdepot Python package against a live kvdepotd.

Run by ctest (python_kvdepot_test) with PYTHONPATH=<build>/python and
KVDEPOT_DAEMON=<path of kvdepotd>. Exits 77 (ctest: skipped) when numpy is
missing; the torch cases skip themselves when torch is.
"""

import gc
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time
import types
import unittest
import weakref

try:
    import numpy as np
except ImportError:  # pragma: no cover
    print("numpy is not installed; skipping", file=sys.stderr)
    sys.exit(77)

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

import kvdepot
from live_daemon import Daemon

NS = "pytest/ns"


class DaemonTestCase(unittest.TestCase):
    metrics = False  # the daemon also serves /metrics

    def setUp(self):
        self.daemon = Daemon(metrics=self.metrics)
        self.client = kvdepot.Client(self.daemon.address, timeout_s=10)
        self.client.health()

    def tearDown(self):
        del self.client  # closes the session before the daemon goes
        self.daemon.stop()

    def ucx_bytes(self, direction: str) -> float:
        """Block bytes the daemon moved over UCX (needs metrics = True)."""
        return self.daemon.metric(
            'kvdepot_bytes_total{direction="%s",transport="ucx"}' % direction)


def key(i: int) -> bytes:
    return b"key-%04d" % i


def none_pointers(n: int) -> bytes:
    """n PyObject pointers to None, as block bytes: an object array they are
    wrongly written into stays valid, so that a missing check fails its test
    instead of crashing the process."""
    return struct.pack("<%dQ" % n, *[id(None)] * n)


def tiny_layout() -> "kvdepot.KvLayout":
    """One layer of one token, one head of 4 fp16: objects of 16 bytes,
    caches of 16 bytes per block."""
    return kvdepot.KvLayout.mha(kvdepot.KvCacheLayout.FLASH_ATTN_NHD, 1, 1, 1, 4,
                                kvdepot.KvDtype.FLOAT16)


def rss_kib() -> int:
    """This process's resident memory (shared memory it maps included)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


class ClientTest(DaemonTestCase):
    def test_put_get_into_round_trip_numpy(self):
        rng = np.random.default_rng(1)
        blocks = [rng.integers(0, 256, 4096 + i, dtype=np.uint8) for i in range(3)]
        keys = [key(i) for i in range(3)]
        parents = [b"", keys[0], keys[1]]
        self.assertEqual(self.client.put(NS, keys, blocks, parents), [True] * 3)
        # Put-if-absent: the second put keeps the blocks.
        self.assertEqual(self.client.put(NS, keys, blocks, parents), [False] * 3)

        out = [np.zeros(b.size, dtype=np.uint8) for b in blocks]
        ptrs = [o.ctypes.data for o in out]
        self.assertEqual(self.client.get_into(NS, keys, out), [True] * 3)
        for b, o, p in zip(blocks, out, ptrs):
            self.assertEqual(o.ctypes.data, p)  # filled in place
            np.testing.assert_array_equal(b, o)

    def test_put_accepts_bytes_memoryview_and_typed_arrays(self):
        data = np.arange(1024, dtype=np.float32)
        raw = bytes(range(256)) * 4
        keys = [key(1), key(2), key(3)]
        self.assertEqual(
            self.client.put(NS, keys, [data, raw, memoryview(bytearray(raw))]),
            [True] * 3)
        out_f = np.empty_like(data)
        out_b = bytearray(len(raw))
        out_m = np.empty(len(raw), dtype=np.uint8)
        self.assertEqual(self.client.get_into(NS, keys, [out_f, out_b, out_m]),
                         [True] * 3)
        np.testing.assert_array_equal(out_f, data)
        self.assertEqual(bytes(out_b), raw)
        self.assertEqual(out_m.tobytes(), raw)

    def test_miss_returns_false_and_leaves_buffer_untouched(self):
        self.client.put(NS, [key(1)], [np.full(512, 7, dtype=np.uint8)])
        out = [np.full(512, 0xAB, dtype=np.uint8) for _ in range(3)]
        filled = self.client.get_into(NS, [key(0), key(1), key(2)], out)
        self.assertEqual(filled, [False, True, False])
        self.assertTrue((out[0] == 0xAB).all())
        self.assertTrue((out[1] == 7).all())
        self.assertTrue((out[2] == 0xAB).all())
        # All misses: nothing read at all.
        self.assertEqual(self.client.get_into(NS, [key(5)], [out[0]]), [False])
        self.assertTrue((out[0] == 0xAB).all())

    def test_wrong_buffer_size_is_value_error_and_writes_nothing(self):
        self.client.put(NS, [key(1), key(2)],
                        [np.full(512, 1, np.uint8), np.full(512, 2, np.uint8)])
        good = np.full(512, 0xCD, dtype=np.uint8)
        small = np.full(511, 0xCD, dtype=np.uint8)
        with self.assertRaises(ValueError) as cm:
            self.client.get_into(NS, [key(1), key(2)], [good, small])
        self.assertIn("INVALID_ARGUMENT", str(cm.exception))
        self.assertTrue((good == 0xCD).all())
        self.assertTrue((small == 0xCD).all())

    def test_read_only_and_non_contiguous_buffers_are_rejected(self):
        self.client.put(NS, [key(1)], [np.zeros(64, np.uint8)])
        with self.assertRaises(ValueError):
            self.client.get_into(NS, [key(1)], [bytes(64)])  # read-only
        with self.assertRaises(ValueError):
            self.client.put(NS, [key(2)], [np.zeros(128, np.uint8)[::2]])
        with self.assertRaises(TypeError):
            self.client.put(NS, [key(2)], [12345])
        with self.assertRaises(ValueError):
            self.client.put(NS, [key(2), key(3)], [np.zeros(8, np.uint8)])

    def test_big_endian_buffers_are_rejected(self):
        # Bytes are stored verbatim and read as little-endian: a big-endian
        # array would store byte-swapped blocks.
        be = np.ones(32, ">f2")
        with self.assertRaisesRegex(ValueError, r"^INVALID_ARGUMENT: buffers\[0\] holds "
                                    r"big-endian elements"):
            self.client.put(NS, [key(1)], [be])
        with self.assertRaisesRegex(ValueError, "big-endian"):
            self.client.put_async(NS, [key(1)], [be])
        self.assertEqual(self.client.put(NS, [key(1)], [be.astype("<f2")]), [True])
        with self.assertRaisesRegex(ValueError, "big-endian"):
            self.client.get_into(NS, [key(1)], [np.zeros(32, ">f2")])
        with self.assertRaisesRegex(ValueError, "big-endian"):
            self.client.get_into_async(NS, [key(1)], [np.zeros(16, ">i4")])
        # One-byte elements have no byte order.
        self.assertEqual(self.client.get_into(NS, [key(1)], [np.zeros(64, ">u1")]), [True])

    def test_lookup_prefix_pin_unpin_evict_stats(self):
        keys = [key(i) for i in range(4)]
        bufs = [np.full(256, i, np.uint8) for i in range(3)]
        self.client.put(NS, keys[:3], bufs, [b"", keys[0], keys[1]])
        reply = self.client.lookup(NS, keys, prefix=True, pin=True)
        self.assertEqual(reply.prefix_hits, 3)
        self.assertEqual([e.found for e in reply.entries], [True, True, True, False])
        self.assertEqual(reply.entries[0].size, 256)
        self.assertEqual(reply.entries[0].tier, kvdepot.Tier.DRAM)
        self.assertNotEqual(reply.pin_id, 0)
        self.client.unpin(reply.pin_id)
        stats = self.client.stats()
        self.assertIsInstance(stats, dict)
        self.assertGreaterEqual(stats["puts"], 3)
        self.assertEqual(stats["dram"]["blocks"], 3)
        evicted = self.client.evict(NS, [keys[0]])
        self.assertEqual(evicted["evicted_blocks"], 1)
        self.assertEqual(self.client.lookup(NS, keys[:1]).entries[0].found, False)
        with self.assertRaises(ValueError):
            self.client.lookup("bad namespace with spaces", keys)

    def test_unreachable_daemon_is_runtime_error(self):
        c = kvdepot.Client("127.0.0.1:1", timeout_s=0.5)
        with self.assertRaises(RuntimeError) as cm:
            c.health()
        self.assertRegex(str(cm.exception), "UNAVAILABLE|DEADLINE_EXCEEDED")

    def test_close_and_context_manager(self):
        with kvdepot.Client(self.daemon.address, timeout_s=10) as c:
            c.health()
            c.put(NS, [key(1)], [b"abc"])
            self.assertNotEqual(c.lookup(NS, [key(1)], pin=True).pin_id, 0)
        with self.assertRaises(RuntimeError) as cm:
            c.health()
        self.assertIn("FAILED_PRECONDITION", str(cm.exception))
        c.close()  # idempotent

    def test_lease_and_timeout_out_of_range_are_value_errors(self):
        address = self.daemon.address
        # A lease of -1 s used to wrap around to the daemon's longest (1 h).
        for lease in (-1.0, float("nan"), float("inf"), 1e10, 1e-4):
            with self.assertRaisesRegex(ValueError, "^INVALID_ARGUMENT: lease"):
                kvdepot.Client(address, lease_s=lease)
        for timeout in (0.0, -1.0, float("nan"), float("inf")):
            with self.assertRaisesRegex(ValueError, "^INVALID_ARGUMENT: timeout_s"):
                kvdepot.Client(address, timeout_s=timeout)
        for lease in (0.0, 0.001, 2.0, 4294967.295):
            with kvdepot.Client(address, timeout_s=10, lease_s=lease) as c:
                self.assertNotEqual(c.ensure_session(), 0)

    def test_the_constructor_releases_the_gil(self):
        # Connecting resolves the server's name (to pick UCX's devices) and
        # starts UCX: tens of milliseconds, during which a pure-Python
        # thread runs.
        stamps = []
        stop = threading.Event()

        def ticker():
            while not stop.is_set():
                stamps.append(time.monotonic())
                time.sleep(0.0005)

        t = threading.Thread(target=ticker)
        t.start()
        most = 0
        try:
            for _ in range(3):
                t0 = time.monotonic()
                c = kvdepot.Client(self.daemon.address, timeout_s=10)
                t1 = time.monotonic()
                most = max(most, sum(1 for s in list(stamps) if t0 < s < t1))
                c.close()
        finally:
            stop.set()
            t.join()
        self.assertGreaterEqual(most, 3, "the GIL was held")

    def test_concurrent_get_into_releases_the_gil(self):
        size = 1 << 20
        keys = [key(i) for i in range(8)]
        blocks = [np.full(size, i, np.uint8) for i in range(8)]
        self.client.put(NS, keys, blocks)
        errors = []
        done = []

        def reader(n):
            try:
                out = [np.empty(size, np.uint8) for _ in keys]
                for _ in range(n):
                    self.assertEqual(self.client.get_into(NS, keys, out), [True] * 8)
                    for i, o in enumerate(out):
                        self.assertEqual(int(o[0]), i)
                        self.assertEqual(int(o[-1]), i)
                done.append(n)
            except Exception as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=reader, args=(5,)) for _ in range(2)]
        # A pure-Python thread keeps running while the readers wait on I/O.
        ticks = [0]
        stop = threading.Event()

        def ticker():
            while not stop.is_set():
                ticks[0] += 1

        t = threading.Thread(target=ticker)
        t.start()
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        stop.set()
        t.join()
        self.assertEqual(errors, [])
        self.assertEqual(done, [5, 5])
        self.assertGreater(ticks[0], 0)


class ForkTest(DaemonTestCase):
    """A Client made before a fork is the parent's: in the child every call
    refuses (FAILED_PRECONDITION) and dropping it leaves the parent's
    session, connections and threads alone. (A child's call used to break
    the parent's gRPC connection for every client in it, and its teardown
    closed the parent's session and crashed joining threads it does not
    have.)"""

    def test_a_client_made_before_a_fork_is_the_parents(self):
        c = self.client
        block = np.arange(4096, dtype=np.uint8)
        self.assertEqual(c.put(NS, [key(1)], [block]), [True])
        pinned = c.lookup(NS, [key(1)], pin=True)  # held by the parent's session
        self.assertNotEqual(pinned.pin_id, 0)
        buf = c.allocate_buffer(4096)
        self.assertEqual(c.get_into(NS, [key(1)], [buf]), [True])  # registers it
        buf[:] = 0
        # An op in flight at the fork (the daemon stopped until after it;
        # into UCX memory: into other memory the call runs inline, over gRPC).
        self.daemon.pause()
        self.addCleanup(self.daemon.resume)
        in_flight = c.get_into_async(NS, [key(1)], [buf])
        pid = os.fork()
        if pid == 0:  # the child: exits with what it saw, never returns
            code = 0

            def refused(call, went_through, other):
                """0 when call() raises FAILED_PRECONDITION, else an exit code."""
                try:
                    call()
                    return went_through
                except RuntimeError as e:
                    return 0 if str(e).startswith("FAILED_PRECONDITION") else other

            try:
                codes = [
                    # Never ready here (its threads are the parent's):
                    # polling it raises instead of spinning for ever.
                    refused(in_flight.ready, 9, 10),
                    refused(c.health, 3, 4),
                    refused(lambda: c.get_into(NS, [key(1)], [np.zeros(4096, np.uint8)]),
                            5, 11),
                    # Nor a new client: gRPC would reuse (and break) the
                    # parent's connection.
                    refused(lambda: kvdepot.Client(self.daemon.address, timeout_s=2).health(),
                            7, 8),
                ]
                code = next((x for x in codes if x), 0)
                del in_flight
                # Every reference goes: the client's teardown runs here.
                del c, buf
                self.client = None
                gc.collect()
            except BaseException:  # noqa: BLE001 - reported by the exit code
                code = 6
            os._exit(code)
        deadline = time.monotonic() + 30
        status = None
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.01)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            self.fail("the forked child hung")
        self.daemon.resume()
        self.assertEqual(in_flight.wait(), True)
        self.assertEqual(in_flight.ok(), [True])
        np.testing.assert_array_equal(buf, block)
        self.assertTrue(os.WIFEXITED(status), f"child ended by signal {os.WTERMSIG(status)}"
                        if os.WIFSIGNALED(status) else status)
        self.assertEqual(os.WEXITSTATUS(status), 0)
        # The parent's session and connection are as they were: its pin is
        # still its own, and its calls work (several: a broken connection
        # failed the first after its timeout, then at once).
        c.unpin(pinned.pin_id)
        for _ in range(3):
            out = np.zeros(4096, np.uint8)
            self.assertEqual(c.get_into(NS, [key(1)], [out]), [True])
            np.testing.assert_array_equal(out, block)
        buf[:] = 7  # its allocated memory is still there


class BufferChecksTest(DaemonTestCase):
    """What memory a call takes: plain numbers or bytes only, and the
    buffers one call writes must not overlap."""

    @unittest.skipIf(torch is None, "torch is not installed")
    def test_tensors_whose_storage_was_freed_are_refused(self):
        """storage.resize_(0) (how FSDP frees parameters) leaves a tensor of
        the same numel() over no memory (data_ptr() 0): refused, where it
        was read or written through a null pointer (a crash)."""
        c = self.client
        self.assertEqual(c.put(NS, [key(1)], [np.zeros(4096, np.uint8)]), [True])
        t = torch.zeros(4096, dtype=torch.uint8)
        storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
        storage.resize_(0)
        self.assertEqual(t.numel(), 4096)
        msg = "storage does not hold its 4096 bytes"
        with self.assertRaisesRegex(ValueError, msg):
            c.put(NS, [key(2)], [t])
        with self.assertRaisesRegex(ValueError, msg):
            c.get_into(NS, [key(1)], [t])
        with self.assertRaisesRegex(ValueError, msg):
            c.get_into_async(NS, [key(1)], [t])
        with self.assertRaisesRegex(ValueError, msg):
            c.register_buffer(t)
        self.assertFalse(c.lookup(NS, [key(2)]).entries[0].found)
        from kvdepot.kvshim import _memory  # the shim's own check

        with self.assertRaisesRegex(ValueError, msg):
            _memory(t, True, "cache")
        # A view inside a live storage is taken.
        whole = torch.zeros(8192, dtype=torch.uint8)
        self.assertEqual(c.get_into(NS, [key(1)], [whole[4096:]]), [True])

    def test_object_arrays_are_refused_everywhere(self):
        c = self.client
        c.put(NS, [key(1)], [none_pointers(8)])
        c.put(NS, [key(3)], [none_pointers(2)])

        def objects(n):  # n PyObject* slots (None), 8 bytes each
            return np.empty(n, dtype=object)

        dst = objects(8)
        msg = r"^buffers\[0\] holds elements of buffer format 'O'"
        with self.assertRaisesRegex(TypeError, msg):
            c.get_into(NS, [key(1)], [dst])
        with self.assertRaisesRegex(TypeError, msg):
            c.get_into_async(NS, [key(1)], [dst])
        self.assertTrue(all(o is None for o in dst))
        with self.assertRaisesRegex(TypeError, msg):
            c.put(NS, [key(2)], [objects(8)])
        with self.assertRaisesRegex(TypeError, msg):
            c.put_async(NS, [key(2)], [objects(8)])
        self.assertFalse(c.lookup(NS, [key(2)]).entries[0].found)
        with self.assertRaisesRegex(TypeError, "^buffer holds elements of buffer format 'O'"):
            c.register_buffer(objects(8))
        # Nor other formats that are not plain numbers: records (which may
        # hold objects), unicode.
        with self.assertRaisesRegex(TypeError, r"format 'T\{"):
            c.put(NS, [key(2)], [np.zeros(4, [("a", "<i4"), ("b", "O")])])
        with self.assertRaisesRegex(TypeError, "format '2w'"):
            c.get_into(NS, [key(1)], [np.zeros(8, "U2")])
        # The caches and objects of gather, scatter and load_into_cache_async.
        layout = tiny_layout()
        cache = np.frombuffer(none_pointers(4), np.uint8).copy()  # 2 blocks
        obj = np.frombuffer(none_pointers(2), np.uint8).copy()
        calls = {
            "gather into objects": lambda: kvdepot.gather(layout, [cache], [0], [objects(2)]),
            "gather from a cache": lambda: kvdepot.gather(layout, [objects(4)], [0], [obj]),
            "scatter into a cache": lambda: kvdepot.scatter(layout, [objects(4)], [0], [obj]),
            "scatter from objects": lambda: kvdepot.scatter(layout, [cache], [0], [objects(2)]),
            "load into objects": lambda: c.load_into_cache_async(
                NS, [key(3)], [objects(2)], layout, [cache], [0]),
            "load into a cache": lambda: c.load_into_cache_async(
                NS, [key(3)], [obj], layout, [objects(4)], [0]),
        }
        for name, call in calls.items():
            with self.subTest(name), self.assertRaisesRegex(TypeError, "format 'O'"):
                call()
        # Plain numbers of any width and bytes are taken.
        kvdepot.gather(layout, [cache.view(np.uint64)], [1], [obj.view(np.int16)])
        self.assertEqual(obj.tobytes(), none_pointers(2))
        self.assertEqual(c.get_into(NS, [key(3)], [np.zeros(2, "S8")]), [True])

    def test_overlapping_destinations_are_refused(self):
        c = self.client
        ka, kb = key(1), key(2)
        c.put(NS, [ka, kb], [np.full(64, 0xAA, np.uint8), np.full(64, 0xBB, np.uint8)])
        buf = np.zeros(192, np.uint8)
        cases = {
            "the same buffer": [buf[:64], buf[:64]],
            "half of it": [buf[:64], buf[32:96]],
            "one byte": [buf[64:128], buf[1:65]],
            "a torch tensor and an array": [torch.from_numpy(buf[:64]), buf[63:127]]
            if torch is not None else [buf[:64], buf[63:127]],
        }
        for name, dst in cases.items():
            with self.subTest(name):
                with self.assertRaisesRegex(
                        ValueError, r"^INVALID_ARGUMENT: buffers\[1\] overlaps buffers\[0\]"):
                    c.get_into(NS, [ka, kb], dst)
                with self.assertRaisesRegex(ValueError, "overlaps"):
                    c.get_into_async(NS, [ka, kb], dst)
        # Found among three, whatever their order.
        with self.assertRaisesRegex(ValueError, r"buffers\[2\] overlaps buffers\[0\]"):
            c.get_into(NS, [ka, kb, ka], [buf[100:164], buf[:64], buf[120:184]])
        self.assertFalse(buf.any())  # nothing was written
        # Adjacent buffers share no byte; a key may repeat into buffers of
        # its own; empty buffers overlap nothing.
        self.assertEqual(c.get_into(NS, [ka, kb, ka], [buf[:64], buf[64:128], buf[128:]]),
                         [True] * 3)
        self.assertEqual(buf.tobytes(), b"\xaa" * 64 + b"\xbb" * 64 + b"\xaa" * 64)
        with self.assertRaisesRegex(ValueError, "^INVALID_ARGUMENT: .* has 0 bytes"):
            c.get_into(NS, [ka, kb], [buf[:0], buf[:0]])
        # The objects of gather and load_into_cache_async.
        layout = tiny_layout()
        cache = np.arange(layout.tensor_bytes(2), dtype=np.uint8)
        objs = np.zeros(32, np.uint8)
        with self.assertRaisesRegex(ValueError, r"objects\[1\] overlaps objects\[0\]"):
            kvdepot.gather(layout, [cache], [0, 1], [objs[:16], objs[8:24]])
        c.put(NS, [key(3), key(4)], [cache[:16], cache[16:]])
        with self.assertRaisesRegex(ValueError, r"objects\[1\] overlaps objects\[0\]"):
            c.load_into_cache_async(NS, [key(3), key(4)], [objs[:16], objs[:16]], layout,
                                    [np.zeros_like(cache)], [0, 1])
        self.assertFalse(objs.any())
        apart = [np.zeros(16, np.uint8) for _ in range(2)]
        kvdepot.gather(layout, [cache], [1, 0], apart)
        kvdepot.gather(layout, [cache], [1, 0], [objs[:16], objs[16:]])  # adjacent
        self.assertEqual(objs.tobytes(), apart[0].tobytes() + apart[1].tobytes())
        # Nor may an object lie in a cache: a gather would write over what
        # it reads, a scatter read what it writes, a load stage a block in
        # the cache it scatters into (it used to, silently).
        before = cache.copy()
        with self.assertRaisesRegex(ValueError, r"objects\[1\] overlaps caches\[0\]"):
            kvdepot.gather(layout, [cache], [0, 1], [apart[0], cache[8:24]])
        with self.assertRaisesRegex(ValueError, r"objects\[0\] overlaps caches\[0\]"):
            kvdepot.scatter(layout, [cache], [1], [cache[:16]])
        with self.assertRaisesRegex(ValueError, r"objects\[0\] overlaps caches\[0\]"):
            c.load_into_cache_async(NS, [key(3)], [cache[16:]], layout, [cache], [0])
        np.testing.assert_array_equal(cache, before)
        # Caches may share bytes: a model whose layers share one KV cache
        # tensor (vLLM's KV sharing) passes it for each of them.
        two = kvdepot.KvLayout.mha(kvdepot.KvCacheLayout.FLASH_ATTN_NHD, 2, 1, 1, 4,
                                   kvdepot.KvDtype.FLOAT16)
        shared = np.zeros(two.tensor_bytes(2), np.uint8)
        objs2 = np.zeros(2 * two.object_bytes, np.uint8)
        kvdepot.scatter(two, [shared, shared], [1], [objs2[:two.object_bytes]])
        kvdepot.gather(two, [shared, shared], [1], [objs2[two.object_bytes:]])
        self.assertFalse(objs2.any())


class UcxDataPlaneTest(DaemonTestCase):
    """Blocks in UCX-registered memory move over the data plane: the
    daemon's counters by transport say so."""

    metrics = True

    def test_allocated_buffers_move_blocks_over_ucx(self):
        self.assertEqual(self.client.data_plane_status(), "")
        pool = self.client.allocate_buffer(6 * 4096)
        self.assertEqual((pool.dtype, pool.shape), (np.uint8, (6 * 4096,)))
        src = [pool[i * 4096:(i + 1) * 4096] for i in range(3)]
        dst = [pool[(3 + i) * 4096:(4 + i) * 4096] for i in range(3)]
        for i, b in enumerate(src):
            b[:] = np.random.default_rng(i).integers(0, 256, 4096, dtype=np.uint8)
        keys = [key(40 + i) for i in range(3)]
        self.assertEqual(self.client.put(NS, keys, src), [True] * 3)
        self.assertEqual(self.ucx_bytes("in"), 3 * 4096)
        self.assertEqual(self.client.put(NS, keys, src), [False] * 3)
        dst[2][:] = 9
        self.assertEqual(self.client.get_into(NS, keys[:2] + [key(99)], dst),
                         [True, True, False])
        for i in range(2):
            np.testing.assert_array_equal(dst[i], src[i])
        self.assertTrue((dst[2] == 9).all())  # a miss is left untouched
        # The memory outlives close(): the array keeps it.
        self.client.close()
        pool[:4] = 1
        self.assertEqual(int(pool[:4].sum()), 4)

    def test_registered_arrays_move_blocks_over_ucx_in_place(self):
        self.assertEqual(self.client.data_plane_status(), "")
        arena = np.zeros(6 * 4096, dtype=np.uint8)
        self.client.register_buffer(arena)
        src = [arena[i * 4096:(i + 1) * 4096] for i in range(3)]
        dst = [arena[(3 + i) * 4096:(4 + i) * 4096] for i in range(3)]
        for i, b in enumerate(src):
            b[:] = np.random.default_rng(10 + i).integers(0, 256, 4096, dtype=np.uint8)
        keys = [key(60 + i) for i in range(3)]
        self.assertEqual(self.client.put(NS, keys, src), [True] * 3)
        self.assertEqual(self.ucx_bytes("in"), 3 * 4096)
        ptrs = [d.ctypes.data for d in dst]
        self.assertEqual(self.client.get_into(NS, keys, dst), [True] * 3)
        self.assertEqual(self.ucx_bytes("out"), 3 * 4096)
        for s_, d, p in zip(src, dst, ptrs):
            self.assertEqual(d.ctypes.data, p)
            np.testing.assert_array_equal(s_, d)
        # An array that is not registered takes the gRPC byte path.
        other = np.zeros(4096, dtype=np.uint8)
        self.assertEqual(self.client.get_into(NS, keys[:1], [other]), [True])
        np.testing.assert_array_equal(other, src[0])
        self.assertEqual(self.ucx_bytes("out"), 3 * 4096)
        # Read-only memory and closed clients are refused.
        with self.assertRaises(ValueError):
            self.client.register_buffer(bytes(4096))
        if torch is not None:
            t = torch.zeros(4096, dtype=torch.uint8)
            self.client.register_buffer(t)
            self.assertEqual(self.client.get_into(NS, keys[1:2], [t]), [True])
            self.assertTrue(torch.equal(t, torch.from_numpy(src[1].copy())))
            self.assertEqual(self.ucx_bytes("out"), 4 * 4096)
        self.client.close()
        with self.assertRaises(RuntimeError):
            self.client.register_buffer(np.zeros(16, dtype=np.uint8))


    def test_allocate_buffer_racing_close_keeps_its_memory(self):
        # close() on another thread while allocate_buffer runs (the GIL
        # released): the array must still be backed, and dropping it must
        # free it through a live client. The allocation was taking the
        # client after its own end, and close() had destroyed it: the
        # array's memory was unmapped (SIGSEGV on a write) and dropping the
        # array called a null client. In a child process, which may crash.
        child = (
            "import sys, threading, time\n"
            "import kvdepot\n"
            "c = kvdepot.Client(sys.argv[1], timeout_s=10)\n"
            "c.health()\n"
            "got = {}\n"
            "t = threading.Thread(target=lambda: got.setdefault('a', c.allocate_buffer(256 << 20)))\n"
            "t.start(); time.sleep(0.05); c.close(); t.join()\n"
            "a = got.pop('a')\n"
            "a[:] = 7\n"
            "assert int(a[::4096].sum()) == 7 * (a.size // 4096)\n"
            "del a\n"
            "print('ok', flush=True)\n")
        for _ in range(3):
            r = subprocess.run([sys.executable, "-c", child, self.daemon.address],
                               capture_output=True, text=True, timeout=120)
            self.assertEqual((r.returncode, r.stdout.strip()), (0, "ok"), r.stderr[-2000:])

    def test_buffers_allocated_and_freed_past_the_daemons_limit_stay_on_ucx(self):
        # The daemon keeps a session's buffers registered for its life,
        # freed ones too, at most 256 (max_buffers_per_session). A client
        # that kept allocating and freeing buffers got RESOURCE_EXHAUSTED
        # from then on and moved every block over gRPC for good; it opens a
        # new session now (once a minute at most).
        c = self.client
        c.put(NS, [key(1)], [np.full(4096, 5, np.uint8)])
        transports = []
        for _ in range(300):
            buf = c.allocate_buffer(4096)
            op = c.get_into_async(NS, [key(1)], [buf])
            self.assertIs(op.wait(), True)
            self.assertEqual(op.ok(), [True])
            self.assertTrue((buf == 5).all())
            transports.append(op.transport())
            del op, buf
        self.assertLessEqual(transports.count("grpc"), 1, transports)
        self.assertEqual(transports[-40:], ["ucx"] * 40)

    def test_close_ends_the_session_while_allocated_memory_lives(self):
        c = self.client
        c.put(NS, [key(1)], [np.full(64, 1, np.uint8)])
        self.assertNotEqual(c.lookup(NS, [key(1)], pin=True).pin_id, 0)
        pool = c.allocate_buffer(1 << 16)
        view = pool[:4096]
        other = kvdepot.Client(self.daemon.address, timeout_s=10)
        self.addCleanup(other.close)
        self.assertEqual(other.stats()["sessions"], 1)
        c.close()
        # The session is closed and its pin released: the block can go.
        self.assertEqual(other.stats()["sessions"], 0)
        self.assertEqual(other.evict(NS, [key(1)])["evicted_blocks"], 1)
        # The client is closed for good; the memory stays valid.
        for call in (lambda: c.put(NS, [key(2)], [view]), lambda: c.allocate_buffer(64),
                     lambda: c.get_into_async(NS, [key(1)], [view])):
            with self.assertRaisesRegex(RuntimeError, "^FAILED_PRECONDITION: the client is closed"):
                call()
        view[:] = 7
        self.assertEqual(int(pool[:4096].sum()), 7 * 4096)
        # A store always holds such memory (its staging buffers): closing
        # its client ends its session all the same.
        layout = tiny_layout()
        store = kvdepot.KvCacheStore(self.daemon.address, layout, "m", timeout_s=10)
        cache = np.arange(layout.tensor_bytes(2), dtype=np.uint8)
        self.assertEqual(store.save([cache], [0, 1], [key(5), key(6)]), [True, True])
        self.assertEqual(other.stats()["sessions"], 1)
        store.client.close()
        self.assertEqual(other.stats()["sessions"], 0)
        del store

    def test_registering_allocated_memory_again_keeps_nothing_alive(self):
        # Its memory is registered already. A view the client kept would
        # hold the pool, which holds the client: its UCX workers, threads
        # and mappings would stay for good after close() and del (a review
        # measured 11 more threads and 5 shared-memory mappings left). The
        # view's reference count shows it, without counting threads that
        # libraries start lazily.
        def client_life(register: bool) -> None:
            c = kvdepot.Client(self.daemon.address, timeout_s=10)
            pool = c.allocate_buffer(2 * 4096)
            view = pool[4096:]
            if register:
                refs = sys.getrefcount(view)
                c.register_buffer(view)
                self.assertEqual(sys.getrefcount(view), refs)
            # Blocks in it move, through the pool's registration.
            view[:] = 9
            k = os.urandom(16)
            self.assertEqual(c.put(NS, [k], [view]), [True])
            self.assertEqual(c.get_into(NS, [k], [pool[:4096]]), [True])
            self.assertTrue((pool[:4096] == 9).all())
            c.close()

        client_life(register=True)

    def test_a_store_saves_and_loads_bytearray_caches(self):
        layout = tiny_layout()  # blocks of 16 bytes
        store = kvdepot.KvCacheStore(self.daemon.address, layout, "m-bytes", timeout_s=10)
        src = bytearray(os.urandom(layout.tensor_bytes(2)))
        self.assertEqual(store.save([src], [0, 1], [key(41), key(42)]), [True, True])
        dst = bytearray(layout.tensor_bytes(2))
        self.assertEqual(store.load([dst], [1, 0], [key(41), key(42)]), [True, True])
        # FLASH_ATTN_NHD: every block's K (8 bytes here), then every V.
        for k_or_v in (0, 16):
            self.assertEqual(dst[k_or_v + 8:k_or_v + 16], src[k_or_v:k_or_v + 8])
            self.assertEqual(dst[k_or_v:k_or_v + 8], src[k_or_v + 8:k_or_v + 16])
        with self.assertRaisesRegex(ValueError, "OUT_OF_RANGE"):
            store.load([dst], [2], [key(41)])
        store.client.close()

    def test_allocated_memory_goes_back_once_no_view_is_left(self):
        c = self.client
        # A view outlives its array: the memory stays, and moves blocks
        # over UCX (registered with the session at its first use).
        pool = c.allocate_buffer(2 * 4096)
        src, dst = pool[:4096], pool[4096:]
        del pool
        gc.collect()
        src[:] = 5
        self.assertEqual(c.put(NS, [key(1)], [src]), [True])
        self.assertEqual(c.get_into(NS, [key(1)], [dst]), [True])
        self.assertTrue((dst == 5).all())
        self.assertEqual(self.ucx_bytes("in"), 4096)
        del src, dst
        gc.collect()
        # Once no view is left the memory goes: 8 x 32 MiB allocated (every
        # page of it touched) and dropped leave the process no bigger. The
        # new buffers move blocks over UCX too.
        before = rss_kib()
        for i in range(8):
            a = c.allocate_buffer(32 << 20)
            if i in (0, 7):
                self.assertEqual(c.get_into(NS, [key(1)], [a[-4096:]]), [True])
                self.assertTrue((a[-4096:] == 5).all())
            del a
            gc.collect()
        grown = rss_kib() - before
        self.assertLess(grown, 64 << 10, f"grew by {grown} KiB")
        self.assertEqual(self.ucx_bytes("out"), 3 * 4096)


class StoppableDaemonTestCase(DaemonTestCase):
    """A daemon (with /metrics) that a test may SIGSTOP, so that what it is
    sent cannot complete until it continues."""

    metrics = True

    def tearDown(self):
        # A test that failed with the daemon stopped: let it stop normally.
        self.daemon.resume()
        super().tearDown()

    def stop_daemon(self):
        """SIGSTOPs the daemon (continued at tearDown at the latest): a batch
        sent now cannot complete until it continues."""
        self.daemon.pause()

    def continue_daemon_after(self, seconds: float) -> subprocess.Popen:
        """SIGCONTs the daemon from another process after `seconds`, so that
        it continues whatever this process (and its GIL) are doing."""
        p = self.daemon.resume_after(seconds)
        self.addCleanup(p.wait)
        return p

    def runs_without_the_gil(self, fn):
        """Runs fn(), which must take 0.25 s or more, and checks that a
        pure-Python thread ran in the middle of it (0.05-0.25 s in): fn
        released the GIL. Returns fn's result and its duration."""
        window = [float("inf"), float("-inf")]
        ticks = [0]
        stop = threading.Event()

        def ticker():
            while not stop.is_set():
                if window[0] <= time.monotonic() <= window[1]:
                    ticks[0] += 1

        t = threading.Thread(target=ticker)
        t.start()
        try:
            t0 = time.monotonic()
            window[:] = [t0 + 0.05, t0 + 0.25]
            result = fn()
            took = time.monotonic() - t0
        finally:
            stop.set()
            t.join()
        self.assertGreaterEqual(took, 0.25)
        self.assertGreater(ticks[0], 0, "the GIL was held")
        return result, took


class AsyncTransferTest(StoppableDaemonTestCase):
    """get_into_async / put_async: TransferOp handles, per-block outcomes,
    and the lifetime of what an op in flight uses."""

    SIZE = 4096

    def stored(self, first: int, n: int, size: int = SIZE):
        """Stores n random blocks key(first..) over gRPC (plain arrays);
        returns their keys and copies of their bytes."""
        keys = [key(first + i) for i in range(n)]
        blocks = [np.random.default_rng(first + i).integers(0, 256, size, dtype=np.uint8)
                  for i in range(n)]
        self.assertEqual(self.client.put(NS, keys, blocks), [True] * n)
        self.assertEqual(self.ucx_bytes("in"), 0)
        return keys, blocks

    def check_get(self, dst_of):
        """Gets 3 stored blocks and one miss (third) into dst_of(4) over UCX."""
        self.assertEqual(self.client.data_plane_status(), "")
        keys, blocks = self.stored(0, 3)
        dst = dst_of(4)
        for d in dst:
            d[:] = 0xAB  # a miss must leave this as it is
        ptrs = [d.ctypes.data for d in dst]
        op = self.client.get_into_async(NS, keys[:2] + [key(99), keys[2]], dst)
        self.assertIsInstance(op, kvdepot.TransferOp)
        self.assertEqual(len(op), 4)
        self.assertIs(op.wait(), True)
        self.assertTrue(op.ready())
        self.assertEqual(op.ok(), [True, True, False, True])
        errors = op.errors()
        self.assertEqual([e is None for e in errors], [True, True, False, True])
        self.assertEqual(errors[2][0], "NOT_FOUND")
        self.assertEqual(op.ok_prefix(), 2)
        self.assertEqual(op.transport(), "ucx")
        self.assertEqual(self.ucx_bytes("out"), 3 * self.SIZE)
        for d, b, p in zip([dst[0], dst[1], dst[3]], blocks, [ptrs[0], ptrs[1], ptrs[3]]):
            self.assertEqual(d.ctypes.data, p)  # filled in place
            self.assertEqual(d.tobytes(), b.tobytes())
        self.assertTrue((dst[2] == 0xAB).all())
        self.assertIn("ready", repr(op))

    def test_get_into_async_allocated_buffer_over_ucx(self):
        pool = self.client.allocate_buffer(4 * self.SIZE)
        self.check_get(lambda n: [pool[i * self.SIZE:(i + 1) * self.SIZE]
                                  for i in range(n)])

    def test_get_into_async_registered_numpy_over_ucx(self):
        arena = np.zeros(4 * self.SIZE, dtype=np.uint8)
        self.client.register_buffer(arena)
        self.check_get(lambda n: [arena[i * self.SIZE:(i + 1) * self.SIZE]
                                  for i in range(n)])

    @unittest.skipIf(torch is None, "torch is not installed")
    def test_get_into_async_registered_torch_tensor(self):
        keys, blocks = self.stored(0, 2)
        t = torch.zeros(2, self.SIZE, dtype=torch.uint8)
        self.client.register_buffer(t)
        op = self.client.get_into_async(NS, keys, [t[0], t[1]])
        self.assertTrue(op.wait(timeout=10))
        self.assertEqual((op.ok(), op.transport()), ([True, True], "ucx"))
        for i in range(2):
            self.assertEqual(t[i].numpy().tobytes(), blocks[i].tobytes())
        self.assertEqual(self.ucx_bytes("out"), 2 * self.SIZE)

    def test_unregistered_buffers_take_grpc_and_are_ready_at_once(self):
        keys, blocks = self.stored(0, 2)
        dst = [np.full(self.SIZE, 0xAB, np.uint8) for _ in range(3)]
        op = self.client.get_into_async(NS, [keys[0], key(99), keys[1]], dst)
        self.assertTrue(op.ready())  # the gRPC path ran inside the call
        self.assertEqual(op.transport(), "grpc")
        self.assertEqual(op.ok(), [True, False, True])
        self.assertEqual(op.errors()[1][0], "NOT_FOUND")
        self.assertEqual(dst[0].tobytes(), blocks[0].tobytes())
        self.assertEqual(dst[2].tobytes(), blocks[1].tobytes())
        self.assertTrue((dst[1] == 0xAB).all())
        self.assertEqual(self.ucx_bytes("out"), 0)

    def test_prefix_stops_at_the_first_miss(self):
        keys, _ = self.stored(0, 2)
        pool = self.client.allocate_buffer(3 * self.SIZE)
        pool[:] = 0xAB
        dst = [pool[i * self.SIZE:(i + 1) * self.SIZE] for i in range(3)]
        op = self.client.get_into_async(NS, [keys[0], key(99), keys[1]], dst,
                                        prefix=True)
        self.assertTrue(op.wait())
        self.assertEqual(op.transport(), "ucx")
        self.assertEqual(op.ok(), [True, False, False])
        self.assertEqual(op.ok_prefix(), 1)
        self.assertTrue((dst[1] == 0xAB).all())

    def test_prefix_over_grpc_writes_nothing_from_the_first_miss_on(self):
        keys, _ = self.stored(0, 2)
        # Not registered: the gRPC byte path.
        dst = [np.full(self.SIZE, 0xAB, np.uint8) for _ in range(3)]
        op = self.client.get_into_async(NS, [keys[0], key(99), keys[1]], dst,
                                        prefix=True)
        self.assertTrue(op.wait())
        self.assertEqual(op.transport(), "grpc")
        self.assertEqual(op.ok(), [True, False, False])
        self.assertTrue((dst[1] == 0xAB).all())
        self.assertTrue((dst[2] == 0xAB).all(), "a block after the miss was written")

    def test_many_ops_in_flight_waited_in_reverse_order(self):
        n_ops, per_op, size = 6, 3, 64 << 10
        keys, blocks = self.stored(0, n_ops * per_op, size)
        pool = self.client.allocate_buffer(n_ops * per_op * size)
        dst = [pool[i * size:(i + 1) * size] for i in range(n_ops * per_op)]
        warm = self.client.get_into_async(NS, keys[:1], dst[:1])
        self.assertTrue(warm.wait(timeout=30))
        pool[:] = 0
        # Every op is sent before the daemon may answer any.
        self.stop_daemon()
        ops = []
        for j in range(n_ops):
            part = slice(j * per_op, (j + 1) * per_op)
            ops.append(self.client.get_into_async(NS, keys[part], dst[part]))
        self.assertEqual([op.ready() for op in ops], [False] * n_ops)
        os.kill(self.daemon.proc.pid, signal.SIGCONT)
        for j in reversed(range(n_ops)):
            self.assertTrue(ops[j].wait(timeout=30), f"op {j}")
            self.assertEqual(ops[j].ok(), [True] * per_op, f"op {j}")
            self.assertEqual(ops[j].transport(), "ucx")
        for i, (d, b) in enumerate(zip(dst, blocks)):
            self.assertEqual(d.tobytes(), b.tobytes(), f"block {i}")
        self.assertEqual(self.ucx_bytes("out"), (n_ops * per_op + 1) * size)

    def test_put_async_then_get_back(self):
        pool = self.client.allocate_buffer(6 * self.SIZE)
        src = [pool[i * self.SIZE:(i + 1) * self.SIZE] for i in range(3)]
        for i, b in enumerate(src):
            b[:] = np.random.default_rng(20 + i).integers(0, 256, self.SIZE,
                                                          dtype=np.uint8)
        keys = [key(20 + i) for i in range(3)]
        op = self.client.put_async(NS, keys, src, parents=[b"", keys[0], keys[1]])
        self.assertTrue(op.wait(timeout=30))
        self.assertEqual(op.transport(), "ucx")
        self.assertEqual(op.ok(), [True] * 3)
        self.assertEqual([op.already_stored(i) for i in range(3)], [False] * 3)
        self.assertEqual(self.ucx_bytes("in"), 3 * self.SIZE)
        self.assertEqual(self.client.lookup(NS, keys, prefix=True).prefix_hits, 3)
        # Put-if-absent: a second put keeps the blocks and says so.
        again = self.client.put_async(NS, keys + [key(23)], src + [src[0]])
        self.assertTrue(again.wait(timeout=30))
        self.assertEqual(again.ok(), [True] * 4)
        self.assertEqual([again.already_stored(i) for i in range(4)],
                         [True, True, True, False])
        self.assertIs(again.already_stored(-1), False)
        with self.assertRaises(IndexError):
            again.already_stored(4)
        # Back over UCX, async, and over gRPC, sync.
        dst = [pool[(3 + i) * self.SIZE:(4 + i) * self.SIZE] for i in range(3)]
        get = self.client.get_into_async(NS, keys, dst)
        self.assertTrue(get.wait(timeout=30))
        self.assertEqual((get.ok(), get.transport()), ([True] * 3, "ucx"))
        plain = [np.zeros(self.SIZE, np.uint8) for _ in range(3)]
        self.assertEqual(self.client.get_into(NS, keys, plain), [True] * 3)
        for s_, d, p in zip(src, dst, plain):
            self.assertEqual(d.tobytes(), s_.tobytes())
            self.assertEqual(p.tobytes(), s_.tobytes())

    def test_grpc_path_releases_the_gil_during_the_call(self):
        keys, blocks = self.stored(0, 2)
        self.client.ensure_session()
        dst = [np.zeros(self.SIZE, np.uint8) for _ in range(2)]
        self.stop_daemon()
        self.continue_daemon_after(0.3)
        # Not registered: the gRPC path runs inside the call.
        op, _ = self.runs_without_the_gil(
            lambda: self.client.get_into_async(NS, keys, dst))
        self.assertTrue(op.ready())
        self.assertEqual((op.ok(), op.transport()), ([True, True], "grpc"))
        self.assertEqual([d.tobytes() for d in dst], [b.tobytes() for b in blocks])
        self.stop_daemon()
        self.continue_daemon_after(0.3)
        op, _ = self.runs_without_the_gil(
            lambda: self.client.put_async(NS, [key(50)], [blocks[0]]))
        self.assertEqual((op.ok(), op.transport()), ([True], "grpc"))

    def test_dropping_a_client_releases_the_gil(self):
        # Its destructor closes the session: an RPC that waits for the daemon.
        other = kvdepot.Client(self.daemon.address, timeout_s=5)
        other.ensure_session()
        held = [other]
        del other
        self.stop_daemon()
        self.continue_daemon_after(0.3)
        self.runs_without_the_gil(held.clear)

    def test_put_async_from_plain_buffers_takes_grpc(self):
        data = [bytes([i]) * 100 for i in range(2)]
        op = self.client.put_async(NS, [key(1), key(2)], data)
        self.assertTrue(op.ready())
        self.assertEqual((op.ok(), op.transport()), ([True, True], "grpc"))
        out = [bytearray(100) for _ in range(2)]
        self.assertEqual(self.client.get_into(NS, [key(1), key(2)], out), [True] * 2)
        self.assertEqual([bytes(o) for o in out], data)
        self.assertEqual(self.ucx_bytes("in"), 0)

    @unittest.skipIf(torch is None, "torch is not installed")
    def test_an_op_holds_the_storage_of_its_torch_tensors(self):
        # t.set_() while the op is in flight swaps the tensor's storage: the
        # op must hold the storage it uses, not only the tensor. The tensor
        # of torch.from_numpy keeps its array alive through its storage, so
        # the array's weakref tells when that storage goes.
        for start in ("put_async", "get_into_async"):
            with self.subTest(op=start):
                arr = np.full(self.SIZE, 7, np.uint8)
                alive = weakref.ref(arr)
                t = torch.from_numpy(arr)
                del arr
                # Over gRPC (plain memory): done at once, but held until seen
                # ready.
                op = getattr(self.client, start)(NS, [key(1)], [t])
                t.set_(torch.zeros(0, dtype=torch.uint8))
                gc.collect()
                self.assertIsNotNone(alive(), "the op let the tensor's memory go")
                self.assertTrue(op.wait())
                gc.collect()
                self.assertIsNone(alive())  # released once seen ready

    def test_results_before_ready_raise_and_wait_timeout_returns(self):
        keys, blocks = self.stored(0, 2)
        pool = self.client.allocate_buffer(2 * self.SIZE)
        dst = [pool[:self.SIZE], pool[self.SIZE:]]
        # Session and buffer registration first (synchronous RPCs).
        warm = self.client.get_into_async(NS, keys[:1], dst[:1])
        self.assertTrue(warm.wait(timeout=30))
        pool[:] = 0
        self.stop_daemon()
        op = self.client.get_into_async(NS, keys, dst)
        t0 = time.monotonic()
        self.assertIs(op.wait(timeout=0), False)
        self.assertLess(time.monotonic() - t0, 0.5)  # no waiting for the daemon
        self.assertIs(op.ready(), False)
        self.assertIn("in flight", repr(op))
        self.assertEqual(len(op), 2)
        for call in (op.ok, op.errors, op.ok_prefix, op.transport,
                     lambda: op.already_stored(0)):
            with self.assertRaises(RuntimeError) as cm:
                call()
            self.assertIn("FAILED_PRECONDITION", str(cm.exception))
        # A bounded wait gives up after its timeout, with the GIL released.
        ready, waited = self.runs_without_the_gil(lambda: op.wait(timeout=0.3))
        self.assertIs(ready, False)
        self.assertGreaterEqual(waited, 0.29)
        os.kill(self.daemon.proc.pid, signal.SIGCONT)
        self.assertIs(op.wait(timeout=30), True)
        self.assertEqual(op.ok(), [True, True])
        for d, b in zip(dst, blocks):
            self.assertEqual(d.tobytes(), b.tobytes())

    def test_dropped_get_waits_for_its_batch(self):
        size, n = 1 << 20, 8
        keys, blocks = self.stored(0, n, size)
        arena = np.zeros(n * size, dtype=np.uint8)
        self.client.register_buffer(arena)
        dst = [arena[i * size:(i + 1) * size] for i in range(n)]
        warm = self.client.get_into_async(NS, keys[:1], dst[:1])
        self.assertTrue(warm.wait(timeout=30))
        arena[:] = 0
        self.stop_daemon()
        op = self.client.get_into_async(NS, keys, dst)
        self.assertFalse(op.ready())
        self.continue_daemon_after(0.3)

        def drop():
            nonlocal op
            del op  # waits for the batch, the GIL released

        self.runs_without_the_gil(drop)
        for i, (d, b) in enumerate(zip(dst, blocks)):
            self.assertEqual(d.tobytes(), b.tobytes(), f"block {i}")
        self.assertEqual(self.ucx_bytes("out"), (n + 1) * size)  # with warm

    def test_dropped_put_waits_for_its_batch(self):
        size, n = 1 << 20, 8
        pool = self.client.allocate_buffer(n * size)
        warm = self.client.put_async(NS, [b"warm"], [pool[:16]])
        self.assertTrue(warm.wait(timeout=30))
        pool[:] = np.random.default_rng(5).integers(0, 256, n * size, dtype=np.uint8)
        expected = pool.copy()
        keys = [key(100 + i) for i in range(n)]
        self.stop_daemon()
        op = self.client.put_async(NS, keys, [pool[i * size:(i + 1) * size]
                                              for i in range(n)])
        self.assertFalse(op.ready())
        del pool  # only the op holds the memory now
        self.continue_daemon_after(0.3)

        def drop():
            nonlocal op
            del op  # waits for the batch, the GIL released

        self.runs_without_the_gil(drop)
        self.client.close()  # the last holder of the memory goes too
        self.assertEqual(self.ucx_bytes("in"), 16 + n * size)
        with kvdepot.Client(self.daemon.address, timeout_s=10) as c:
            out = np.zeros(n * size, dtype=np.uint8)
            self.assertEqual(
                c.get_into(NS, keys, [out[i * size:(i + 1) * size] for i in range(n)]),
                [True] * n)
        np.testing.assert_array_equal(out, expected)

    def test_ready_and_results_do_not_wait_for_the_session_to_close(self):
        # An op that holds the client's last reference once close() ran:
        # dropping that reference closes the session, an RPC. ready() and
        # the result accessors (which never block) used to make it, and
        # waited up to timeout_s for a daemon that does not answer; they
        # leave it to wait() (or the op's end) now.
        keys, blocks = self.stored(0, 1)
        dst = np.zeros(self.SIZE, np.uint8)  # not registered: the gRPC path
        op = self.client.get_into_async(NS, keys, [dst])
        while "in flight" in repr(op):  # repr() does not settle the op
            time.sleep(0.01)
        self.client.close()
        self.stop_daemon()
        seen = {}

        def poll():
            seen["ready"] = op.ready()
            seen["ok"] = op.ok() if seen["ready"] else None

        t = threading.Thread(target=poll)
        t.start()
        # Without the daemon, a CloseSession waits out its deadline: 2 s.
        t.join(timeout=1)
        stuck = t.is_alive()
        self.continue_daemon_after(0)
        t.join()
        self.assertFalse(stuck, "ready() waited for the daemon")
        self.assertEqual(seen, {"ready": True, "ok": [True]})
        np.testing.assert_array_equal(dst, blocks[0])
        self.assertIs(op.wait(), True)  # drops the client: the session closes

    def test_op_outlives_close_of_its_client(self):
        # Registered numpy memory does not hold the client (allocate_buffer
        # memory would): only the op keeps the native client alive.
        keys, blocks = self.stored(0, 2)
        arena = np.zeros(2 * self.SIZE, dtype=np.uint8)
        self.client.register_buffer(arena)
        dst = [arena[:self.SIZE], arena[self.SIZE:]]
        warm = self.client.get_into_async(NS, keys[:1], dst[:1])
        self.assertTrue(warm.wait(timeout=30))
        del warm
        arena[:] = 0
        other = kvdepot.Client(self.daemon.address, timeout_s=10)
        self.addCleanup(other.close)
        self.assertEqual(other.stats()["sessions"], 1)
        self.stop_daemon()
        op = self.client.get_into_async(NS, keys, dst)
        t0 = time.monotonic()
        # Not torn down under the op: that would close the session, an RPC
        # that waits for the stopped daemon (up to 2 s).
        self.client.close()
        self.assertLess(time.monotonic() - t0, 1.0)
        with self.assertRaises(RuntimeError):
            self.client.get_into_async(NS, keys, dst)
        os.kill(self.daemon.proc.pid, signal.SIGCONT)
        self.assertEqual(other.stats()["sessions"], 1)  # still the op's
        self.assertTrue(op.wait(timeout=30))
        self.assertEqual((op.ok(), op.transport()), ([True, True], "ucx"))
        for d, b in zip(dst, blocks):
            self.assertEqual(d.tobytes(), b.tobytes())
        # Seen ready, the op let the client go: its session is closed.
        self.assertEqual(other.stats()["sessions"], 0)

    def test_bad_input_raises_before_anything_starts(self):
        self.client.put(NS, [key(1)], [np.zeros(64, np.uint8)])
        with self.assertRaises(ValueError):  # counts differ
            self.client.get_into_async(NS, [key(1), key(2)], [bytearray(64)])
        with self.assertRaises(ValueError):
            self.client.put_async(NS, [key(1)], [b"x", b"y"])
        with self.assertRaises(ValueError):
            self.client.put_async(NS, [key(1)], [b"x"], parents=[b"", b""])
        with self.assertRaises(ValueError):  # read-only destination
            self.client.get_into_async(NS, [key(1)], [bytes(64)])
        with self.assertRaises(ValueError):  # not contiguous
            self.client.get_into_async(NS, [key(1)], [np.zeros(128, np.uint8)[::2]])
        with self.assertRaises(ValueError):
            self.client.put_async(NS, [key(2)], [np.zeros(128, np.uint8)[::2]])
        with self.assertRaises(ValueError):  # bad namespace, empty key
            self.client.get_into_async("bad namespace", [key(1)], [bytearray(64)])
        with self.assertRaises(ValueError):
            self.client.put_async(NS, [b""], [b"x"])
        with self.assertRaises(TypeError):
            self.client.put_async(NS, [key(2)], [12345])
        with self.assertRaises(TypeError):
            self.client.get_into_async(NS, [key(1)], [object()])
        # Nothing was stored by the refused calls.
        self.assertEqual(self.client.lookup(NS, [key(2)]).entries[0].found, False)
        with self.assertRaises(ValueError):
            self.client.put_async(NS, [key(1)], [b"x"]).wait(timeout=float("nan"))


class LayoutTest(unittest.TestCase):
    def test_layout_factories_and_fingerprint(self):
        nhd = kvdepot.KvLayout.mha(kvdepot.KvCacheLayout.FLASH_ATTN_NHD, 4, 16, 2, 64,
                                   kvdepot.KvDtype.BFLOAT16)
        hnd = kvdepot.KvLayout.mha(kvdepot.KvCacheLayout.FLASH_ATTN_HND, 4, 16, 2, 64,
                                   kvdepot.KvDtype.BFLOAT16)
        fp16 = kvdepot.KvLayout.mha(kvdepot.KvCacheLayout.FLASH_ATTN_NHD, 4, 16, 2, 64,
                                    kvdepot.KvDtype.FLOAT16)
        self.assertEqual(nhd.object_bytes, 4 * 2 * 16 * 2 * 64 * 2)
        self.assertEqual(nhd.fingerprint, hnd.fingerprint)
        self.assertNotEqual(nhd.fingerprint, fp16.fingerprint)
        self.assertEqual(nhd.namespace_for("m/tp0"), "m/tp0/%016x" % nhd.fingerprint)
        mla = kvdepot.KvLayout.mla(kvdepot.KvCacheLayout.MLA, 2, 16, 576,
                                   kvdepot.KvDtype.BFLOAT16)
        self.assertEqual(mla.num_components, 1)
        cross = kvdepot.KvLayout.create(kvdepot.KvCacheLayout.CROSS_LAYER_NHD, 4, 2,
                                        16, 2, 64, kvdepot.KvDtype.BFLOAT16)
        self.assertEqual(cross.num_tensors, 1)
        self.assertEqual(cross.fingerprint, nhd.fingerprint)
        with self.assertRaises(ValueError):
            kvdepot.KvLayout.mha(kvdepot.KvCacheLayout.MLA, 4, 16, 2, 64,
                                 kvdepot.KvDtype.BFLOAT16)

    def test_numpy_gather_scatter_cross_layer(self):
        layout = kvdepot.KvLayout.create(kvdepot.KvCacheLayout.CROSS_LAYER_NHD, 3, 2,
                                         4, 2, 8, kvdepot.KvDtype.FLOAT32)
        n = 5
        cache = np.random.default_rng(2).standard_normal(
            layout.tensor_bytes(n) // 4).astype(np.float32)
        objs = [np.empty(layout.object_bytes, np.uint8) for _ in range(2)]
        kvdepot.gather(layout, [cache], [4, 1], objs)
        per_block = cache.size // n
        # Cross-layer NHD: a block's object is its contiguous run.
        np.testing.assert_array_equal(objs[0].view(np.float32),
                                      cache[4 * per_block:5 * per_block])
        restored = np.zeros_like(cache)
        kvdepot.scatter(layout, [restored], [4, 1], objs)
        for b in range(n):
            part = slice(b * per_block, (b + 1) * per_block)
            if b in (1, 4):
                np.testing.assert_array_equal(restored[part], cache[part])
            else:
                self.assertTrue((restored[part] == 0).all())
        # A layer range: bytes [1 * layer_bytes, 3 * layer_bytes) of each object.
        part_objs = [np.empty(2 * layout.layer_bytes, np.uint8)]
        kvdepot.gather(layout, [cache], [4], part_objs, layers=(1, 3))
        np.testing.assert_array_equal(
            part_objs[0], objs[0][layout.layer_bytes:3 * layout.layer_bytes])
        with self.assertRaises(ValueError):  # out of range: nothing written
            kvdepot.scatter(layout, [restored], [5], objs[:1])
        with self.assertRaises(ValueError):  # wrong object size
            kvdepot.gather(layout, [cache], [0], [np.empty(7, np.uint8)])
        with self.assertRaises(ValueError):  # wrong tensor count
            kvdepot.gather(layout, [cache, cache], [0], objs[:1])


    def test_big_endian_caches_and_objects_are_rejected(self):
        layout = kvdepot.KvLayout.mha(kvdepot.KvCacheLayout.FLASH_ATTN_NHD, 2, 4, 2, 8,
                                      kvdepot.KvDtype.FLOAT16)
        shape = (2, 3, 4, 2, 8)
        objs = [np.full(layout.object_bytes, 0x77, np.uint8)]
        for bad in (">f2", ">u2", ">i2"):
            caches = [np.ones(shape, bad)] * 2
            for op in (kvdepot.gather, kvdepot.scatter):
                with self.subTest(dtype=bad, op=op.__name__):
                    with self.assertRaisesRegex(ValueError, r"^INVALID_ARGUMENT: caches\[0\] "
                                                r"holds big-endian elements"):
                        op(layout, caches, [1], objs)
                    self.assertTrue((objs[0] == 0x77).all())
        caches = [np.ones(shape, "<f2")] * 2  # explicitly little-endian: fine
        kvdepot.gather(layout, caches, [1], objs)
        with self.assertRaisesRegex(ValueError, r"objects\[0\] holds big-endian"):
            kvdepot.gather(layout, caches, [1], [np.zeros(layout.object_bytes // 4, ">f4")])

    def test_cache_shapes_must_be_the_layouts(self):
        K = kvdepot.KvCacheLayout
        L, N, T, H, D = 2, 3, 4, 2, 8
        nhd = kvdepot.KvLayout.mha(K.FLASH_ATTN_NHD, L, T, H, D, kvdepot.KvDtype.FLOAT16)
        objs = [np.full(nhd.object_bytes, 0x77, np.uint8)]
        rng = np.random.default_rng(3)
        # FlashInfer's [N, 2, T, H, D], HND's [2, N, H, T, D], merged dimensions.
        for wrong in ((N, 2, T, H, D), (2, N, H, T, D), (2, N, T, H * D), (2, N, T, 2 * H, D // 2)):
            caches = [rng.standard_normal(wrong).astype(np.float16) for _ in range(L)]
            for op in (kvdepot.gather, kvdepot.scatter):
                with self.subTest(shape=wrong, op=op.__name__):
                    with self.assertRaisesRegex(
                            ValueError, r"^INVALID_ARGUMENT: caches\[0\] has shape \[.*\]; "
                            r"layout flash-attn-nhd takes"):
                        op(nhd, caches, [1], objs)
                    self.assertTrue((objs[0] == 0x77).all())
        # The right shape, and views of it: integers of other widths (the
        # last dimension differs), flat arrays, bytes.
        right = [rng.standard_normal((2, N, T, H, D)).astype(np.float16) for _ in range(L)]
        want = [np.zeros(nhd.object_bytes, np.uint8)]
        kvdepot.gather(nhd, right, [1], want)
        for view in ([c.view(np.uint8) for c in right], [c.view(np.int16) for c in right],
                     [c.view(np.uint32) for c in right], [c.reshape(-1) for c in right],
                     [c.tobytes() for c in right]):
            got = [np.zeros(nhd.object_bytes, np.uint8)]
            kvdepot.gather(nhd, view, [1], got)
            np.testing.assert_array_equal(got[0], want[0])
        # With one KV head NHD and HND are the same bytes: either shape fits.
        one = kvdepot.KvLayout.mha(K.FLASH_ATTN_NHD, L, T, 1, D, kvdepot.KvDtype.FLOAT16)
        kvdepot.gather(one, [np.zeros((2, N, 1, T, D), np.float16)] * L, [0],
                       [np.zeros(one.object_bytes, np.uint8)])

    def test_a_buffer_that_cannot_be_exported_says_why(self):
        layout = kvdepot.KvLayout.mha(kvdepot.KvCacheLayout.FLASH_ATTN_NHD, 1, 4, 2, 8,
                                      kvdepot.KvDtype.FLOAT32)
        dates = np.zeros((2, 3, 4, 2, 8), "M8[s]")  # numpy exports no buffer of these
        with self.assertRaises(ValueError) as cm:
            kvdepot.gather(layout, [dates], [0], [np.zeros(layout.object_bytes, np.uint8)])
        self.assertIn("caches[0]", str(cm.exception))
        self.assertIn("cannot include dtype 'M'", str(cm.exception))


@unittest.skipIf(torch is None, "torch is not installed")
class TorchStoreTest(DaemonTestCase):
    NUM_LAYERS = 4
    NUM_BLOCKS = 8
    BLOCK_SIZE = 16
    KV_HEADS = 2
    HEAD_SIZE = 64

    def make_caches(self, dtype, random):
        shape = (2, self.NUM_BLOCKS, self.BLOCK_SIZE, self.KV_HEADS, self.HEAD_SIZE)
        g = torch.Generator().manual_seed(3)
        if random:
            return [torch.randn(shape, generator=g).to(dtype)
                    for _ in range(self.NUM_LAYERS)]
        return [torch.zeros(shape, dtype=dtype) for _ in range(self.NUM_LAYERS)]

    def round_trip(self, dtype, cache_layout):
        layout = kvdepot.KvLayout.mha(cache_layout, self.NUM_LAYERS, self.BLOCK_SIZE,
                                      self.KV_HEADS, self.HEAD_SIZE,
                                      kvdepot.dtype_from_torch(dtype))
        store = kvdepot.KvCacheStore(self.daemon.address, layout, "pytest-model",
                                     client=self.client)
        src = self.make_caches(dtype, random=True)
        if cache_layout == kvdepot.KvCacheLayout.FLASH_ATTN_HND:
            # Physically [2, N, H, T, D]: a contiguous tensor in that order.
            src = [t.permute(0, 1, 3, 2, 4).contiguous() for t in src]
        keys = [b"blk-1", b"blk-3", b"blk-5"]
        self.assertEqual(store.save(src, [1, 3, 5], keys, [b"", keys[0], keys[1]]),
                         [True] * 3)
        self.assertEqual(store.lookup(keys), 3)

        dst = [torch.zeros_like(t) for t in src]
        filled = store.load(dst, [1, 3, 5], keys)
        self.assertEqual(filled, [True] * 3)
        for s, d in zip(src, dst):
            for b in range(self.NUM_BLOCKS):
                if b in (1, 3, 5):
                    self.assertTrue(torch.equal(s[:, b], d[:, b]), f"block {b}")
                else:
                    self.assertTrue(torch.equal(d[:, b], torch.zeros_like(d[:, b])))

        # A missing key: a miss, and its block stays zero.
        dst = [torch.zeros_like(t) for t in src]
        filled = store.load(dst, [2, 6], [b"blk-3", b"never-stored"])
        self.assertEqual(filled, [True, False])
        for s, d in zip(src, dst):
            self.assertTrue(torch.equal(d[:, 2], s[:, 3]))
            self.assertTrue(torch.equal(d[:, 6], torch.zeros_like(d[:, 6])))

    def test_numpy_caches_whose_device_is_a_string(self):
        """numpy 2's arrays have a `device` too (the string "cpu"): a store of
        numpy caches takes them as host caches (it raised AttributeError)."""

        class Numpy2Array(np.ndarray):
            @property
            def device(self):
                return "cpu"

        layout = kvdepot.KvLayout.mha(kvdepot.KvCacheLayout.FLASH_ATTN_NHD,
                                      self.NUM_LAYERS, self.BLOCK_SIZE, self.KV_HEADS,
                                      self.HEAD_SIZE, kvdepot.KvDtype.FLOAT32)
        store = kvdepot.KvCacheStore(self.daemon.address, layout, "pytest-numpy2",
                                     client=self.client)
        shape = (2, self.NUM_BLOCKS, self.BLOCK_SIZE, self.KV_HEADS, self.HEAD_SIZE)
        rng = np.random.default_rng(5)
        src = [rng.standard_normal(shape, dtype=np.float32).view(Numpy2Array)
               for _ in range(self.NUM_LAYERS)]
        dst = [np.zeros(shape, np.float32).view(Numpy2Array) for _ in src]
        self.assertEqual(store.save(src, [2], [b"np2"]), [True])
        self.assertEqual(store.load(dst, [5], [b"np2"]), [True])
        for s, d in zip(src, dst):
            np.testing.assert_array_equal(np.asarray(d)[:, 5], np.asarray(s)[:, 2])

    def test_round_trip_bf16(self):
        self.round_trip(torch.bfloat16, kvdepot.KvCacheLayout.FLASH_ATTN_NHD)

    def test_round_trip_fp16(self):
        self.round_trip(torch.float16, kvdepot.KvCacheLayout.FLASH_ATTN_NHD)

    def test_round_trip_bf16_hnd(self):
        self.round_trip(torch.bfloat16, kvdepot.KvCacheLayout.FLASH_ATTN_HND)

    def test_round_trip_other_layouts(self):
        L, N, T, H, D = self.NUM_LAYERS, self.NUM_BLOCKS, self.BLOCK_SIZE, 2, 32
        K = kvdepot.KvCacheLayout
        bf16 = kvdepot.KvDtype.BFLOAT16
        # (layout, cache shapes, the block dimension of each tensor)
        cases = [
            (kvdepot.KvLayout.mha(K.FLASH_INFER_NHD, L, T, H, D, bf16),
             [(N, 2, T, H, D)] * L),
            (kvdepot.KvLayout.mha(K.FLASH_INFER_HND, L, T, H, D, bf16),
             [(N, 2, H, T, D)] * L),
            (kvdepot.KvLayout.mla(K.MLA, L, T, 576, bf16), [(N, T, 576)] * L),
            (kvdepot.KvLayout.mha(K.CROSS_LAYER_NHD, L, T, H, D, bf16),
             [(N, L, 2, T, H, D)]),
            (kvdepot.KvLayout.mha(K.CROSS_LAYER_HND, L, T, H, D, bf16),
             [(N, L, 2, H, T, D)]),
        ]
        g = torch.Generator().manual_seed(4)
        for layout, shapes in cases:
            with self.subTest(layout=repr(layout)):
                store = kvdepot.KvCacheStore(self.daemon.address, layout,
                                             "pytest-" + layout.layout.name,
                                             client=self.client)
                src = [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]
                keys = [b"a", b"b"]
                store.save(src, [0, 7], keys)
                dst = [torch.zeros_like(t) for t in src]
                self.assertEqual(store.load(dst, [7, 2], keys),
                                 [True, True])
                for s_, d_ in zip(src, dst):
                    self.assertTrue(torch.equal(d_[7], s_[0]))
                    self.assertTrue(torch.equal(d_[2], s_[7]))
                    for b in (0, 1, 3, 4, 5, 6):
                        self.assertEqual(int(d_[b].abs().sum()), 0)

    def test_pipelined_batches_round_trip_and_report_per_block(self):
        layout = kvdepot.KvLayout.mha(kvdepot.KvCacheLayout.FLASH_ATTN_NHD,
                                      self.NUM_LAYERS, self.BLOCK_SIZE, self.KV_HEADS,
                                      self.HEAD_SIZE, kvdepot.KvDtype.BFLOAT16)
        store = kvdepot.KvCacheStore(self.daemon.address, layout, "pytest-pipe",
                                     client=self.client, pipeline_batches=3,
                                     min_batch_bytes=0)
        src = self.make_caches(torch.bfloat16, random=True)
        ids = [7, 0, 5, 2, 6, 1, 3]  # 3 batches: [7, 0, 5], [2, 6, 1], [3]
        keys = [b"p%d" % b for b in ids]
        # Two of them stored before: put-if-absent says so per block, in order.
        self.assertEqual(store.save(src, [5, 6], [b"p5", b"p6"]), [True, True])
        self.assertEqual(store.save(src, ids, keys),
                         [True, True, False, True, False, True, True])
        dst = self.make_caches(torch.bfloat16, random=False)
        load_ids = [1, 2, 3, 4, 5, 6, 7]
        load_keys = [b"p0", b"p1", b"p2", b"missing", b"p5", b"p6", b"p7"]
        self.assertEqual(store.load(dst, load_ids, load_keys),
                         [True, True, True, False, True, True, True])
        for s_, d_ in zip(src, dst):
            for block, key in zip(load_ids, load_keys):
                if key == b"missing":  # a miss is never written
                    self.assertTrue(torch.equal(d_[:, block], torch.zeros_like(d_[:, block])))
                else:
                    self.assertTrue(torch.equal(d_[:, block], s_[:, int(key[1:])]),
                                    f"block {block}")
        with self.assertRaises(ValueError):
            kvdepot.KvCacheStore(self.daemon.address, layout, "pytest-pipe",
                                 client=self.client, pipeline_batches=0)

    def test_a_bad_block_id_in_a_later_batch_moves_nothing(self):
        layout = kvdepot.KvLayout.mha(kvdepot.KvCacheLayout.FLASH_ATTN_NHD,
                                      self.NUM_LAYERS, self.BLOCK_SIZE, self.KV_HEADS,
                                      self.HEAD_SIZE, kvdepot.KvDtype.BFLOAT16)
        store = kvdepot.KvCacheStore(self.daemon.address, layout, "pytest-bad-id",
                                     client=self.client, pipeline_batches=2,
                                     min_batch_bytes=0)
        src = self.make_caches(torch.bfloat16, random=True)
        keys = [b"b0", b"b1", b"b2", b"b3"]
        with self.assertRaises(ValueError):
            store.save(src, [0, 1, 2, self.NUM_BLOCKS], keys)
        self.assertEqual(store.lookup(keys, prefix=False), 0)  # nothing stored
        self.assertEqual(store.save(src, [0, 1, 2, 3], keys), [True] * 4)
        dst = self.make_caches(torch.bfloat16, random=False)
        with self.assertRaises(ValueError):
            store.load(dst, [0, 1, 2, -1], keys)
        for d_ in dst:  # nothing scattered
            self.assertEqual(int(d_.abs().sum()), 0)

    def test_put_and_get_into_torch_tensors_directly(self):
        t = torch.randn(1024).to(torch.bfloat16)
        self.assertEqual(self.client.put(NS, [b"t"], [t]), [True])
        out = torch.zeros_like(t)
        self.assertEqual(self.client.get_into(NS, [b"t"], [out]), [True])
        self.assertTrue(torch.equal(out, t))
        with self.assertRaises(ValueError):
            self.client.get_into(NS, [b"t"], [torch.zeros(2048, 2)[:, 0]])

    def test_layout_mismatch_is_value_error(self):
        layout = kvdepot.KvLayout.mha(kvdepot.KvCacheLayout.FLASH_ATTN_NHD,
                                      self.NUM_LAYERS, self.BLOCK_SIZE, self.KV_HEADS,
                                      self.HEAD_SIZE, kvdepot.KvDtype.BFLOAT16)
        store = kvdepot.KvCacheStore(self.daemon.address, layout, "pytest-model",
                                     client=self.client)
        caches = self.make_caches(torch.bfloat16, random=False)
        with self.assertRaises(ValueError):
            store.save(caches[:3], [0], [b"k"])
        with self.assertRaises(ValueError):
            store.save(caches, [self.NUM_BLOCKS], [b"k"])
        # Same shape and bytes, another dtype: the layout's fingerprint names
        # bf16, so fp16 caches must not be stored (or loaded) under it.
        with self.assertRaises(ValueError):
            store.save(self.make_caches(torch.float16, random=False), [0], [b"k"])
        with self.assertRaises(ValueError):
            kvdepot.gather(layout, self.make_caches(torch.float16, random=False), [0],
                           [torch.zeros(layout.object_bytes, dtype=torch.uint8)])
        self.assertFalse(store.load(self.make_caches(torch.bfloat16, random=False), [0],
                                    [b"k"])[0], "a block was stored")
        # A uint8 view of the right caches is plain bytes: taken.
        self.assertEqual(store.save([c.view(torch.uint8) for c in caches], [0], [b"k"]),
                         [True])
        # FlashInfer-shaped caches ([N, 2, T, H, D]: the same bytes) under
        # FlashAttention: neither saved nor loaded.
        flashinfer = [torch.zeros((self.NUM_BLOCKS, 2, self.BLOCK_SIZE, self.KV_HEADS,
                                   self.HEAD_SIZE), dtype=torch.bfloat16)
                      for _ in range(self.NUM_LAYERS)]
        with self.assertRaisesRegex(ValueError, "has shape"):
            store.save(flashinfer, [1], [b"k1"])
        with self.assertRaisesRegex(ValueError, "has shape"):
            store.load_async(flashinfer, [1], [b"k"])
        self.assertEqual(store.lookup([b"k1"]), 0)


@unittest.skipIf(torch is None, "torch is not installed")
class LoadAsyncTest(StoppableDaemonTestCase):
    """KvCacheStore.load_async: a LoadHandle whose layers become ready in
    order, misses, errors, bad input, a second call while one is in flight,
    and dropped handles."""

    L, N, T, H, D = 4, 8, 16, 2, 32

    def cases(self):
        """(layout, cache shapes, part(caches, layer, block)) for every
        layout: part is that layer of that block."""
        L, N, T, H, D = self.L, self.N, self.T, self.H, self.D
        K = kvdepot.KvCacheLayout
        bf16 = kvdepot.KvDtype.BFLOAT16
        mha = kvdepot.KvLayout.mha
        per_layer_kv = lambda c, layer, b: c[layer][:, b]  # noqa: E731
        per_layer = lambda c, layer, b: c[layer][b]  # noqa: E731
        cross = lambda c, layer, b: c[0][b, layer]  # noqa: E731
        return [
            (mha(K.FLASH_ATTN_NHD, L, T, H, D, bf16), [(2, N, T, H, D)] * L, per_layer_kv),
            (mha(K.FLASH_ATTN_HND, L, T, H, D, bf16), [(2, N, H, T, D)] * L, per_layer_kv),
            (mha(K.FLASH_INFER_NHD, L, T, H, D, bf16), [(N, 2, T, H, D)] * L, per_layer),
            (mha(K.FLASH_INFER_HND, L, T, H, D, bf16), [(N, 2, H, T, D)] * L, per_layer),
            (kvdepot.KvLayout.mla(K.MLA, L, T, 576, bf16), [(N, T, 576)] * L, per_layer),
            (mha(K.CROSS_LAYER_NHD, L, T, H, D, bf16), [(N, L, 2, T, H, D)], cross),
            (mha(K.CROSS_LAYER_HND, L, T, H, D, bf16), [(N, L, 2, H, T, D)], cross),
        ]

    def setup_store(self, layout, shapes, name, client=None, batches=2, **store_kw):
        """A store of `batches` batches (of at least 2 blocks), random
        source caches with blocks 0-3 stored under s0..s3, and zeroed
        destination caches."""
        store = kvdepot.KvCacheStore(self.daemon.address, layout, "pytest-" + name,
                                     client=client or self.client,
                                     pipeline_batches=batches, min_batch_bytes=0,
                                     **self.store_kw(**store_kw))
        g = torch.Generator().manual_seed(11)
        src = [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]
        keys = [b"s%d" % b for b in range(4)]
        self.assertEqual(store.save(src, [0, 1, 2, 3], keys), [True] * 4)
        dst = [torch.zeros(s, dtype=torch.bfloat16) for s in shapes]
        return store, src, keys, dst

    def store_kw(self, **kw):
        """KvCacheStore's further arguments in this class's stores."""
        return kw

    def test_errors_answer_once_done_without_a_wait(self):
        """errors() answers once `done` (every block has an outcome), as
        documented, also for a load through a shim, whose last scatters are
        queued and synchronized only by a wait (it raised
        FAILED_PRECONDITION until wait() was called)."""
        layout, shapes, part = self.cases()[0]
        store, src, keys, dst = self.setup_store(layout, shapes, "errors-done")
        h = store.load_async(dst, [4, 5], [keys[0], b"missing"])
        deadline = time.monotonic() + 30
        while not h.done:
            self.assertLess(time.monotonic(), deadline, repr(h))
            time.sleep(0.001)
        errors = h.errors()
        self.assertIsNone(errors[0])
        self.assertEqual(errors[1][0], "NOT_FOUND")
        self.assert_layers(dst, src, part, [(4, 0)], self.L)
        self.assertEqual(h.wait(), [True, False])

    def nhd(self, name, **kw):
        layout, shapes, part = self.cases()[0]
        return self.setup_store(layout, shapes, name, **kw) + (layout, part)

    def assert_layers(self, dst, src, part, loads, upto):
        """Layers [0, upto) of each (dst block, src block) in `loads` match."""
        for dst_block, src_block in loads:
            for layer in range(upto):
                self.assertTrue(torch.equal(part(dst, layer, dst_block),
                                            part(src, layer, src_block)),
                                f"layer {layer} of block {dst_block}")

    def test_layers_become_ready_in_order_in_every_layout(self):
        for layout, shapes, part in self.cases():
            with self.subTest(layout=layout.layout.name):
                store, src, keys, dst = self.setup_store(
                    layout, shapes, "layers-" + layout.layout.name, batches=3)
                for d in dst:
                    d.fill_(7.0)  # what nothing loaded may change
                # Three batches ([7, 6], [4, 3], [1, 0]); block 4 misses.
                ids = [7, 6, 4, 3, 1, 0]
                load_keys = [keys[0], keys[1], b"missing", keys[3], keys[2], keys[0]]
                loads = [(7, 0), (6, 1), (3, 3), (1, 2), (0, 0)]
                h = store.load_async(dst, ids, load_keys)
                self.assertIsInstance(h, kvdepot.LoadHandle)
                self.assertEqual((len(h), h.num_layers), (6, self.L))
                for layer in range(self.L):
                    h.wait_for_layer(layer)
                    self.assertGreaterEqual(h.ready_layers, layer + 1)
                    self.assert_layers(dst, src, part, loads, layer + 1)
                self.assertEqual(h.wait(), [True, True, False, True, True, True])
                self.assertTrue(h.done)
                self.assertEqual(h.ready_layers, self.L)
                self.assertEqual([e is None for e in h.errors()],
                                 [True, True, False, True, True, True])
                self.assertEqual(h.errors()[2][0], "NOT_FOUND")
                self.assert_layers(dst, src, part, loads, self.L)
                # The miss (4) and the blocks not loaded keep their bytes.
                for b in (2, 4, 5):
                    for layer in range(self.L):
                        self.assertTrue(bool((part(dst, layer, b) == 7.0).all()),
                                        f"layer {layer} of block {b}")

    def test_polling_done_then_ready_layers_is_num_layers(self):
        # An engine may poll instead of wait: done, then ready_layers must
        # reach num_layers without anyone calling wait_for_layer or wait.
        store, src, keys, dst, layout, part = self.nhd("poll")
        loads = [(4, 0), (5, 1), (6, 2), (7, 3)]
        h = store.load_async(dst, [4, 5, 6, 7], keys)
        deadline = time.monotonic() + 30
        while not h.done:
            self.assertLess(time.monotonic(), deadline, repr(h))
            time.sleep(0.001)
        self.assertEqual(h.ready_layers, self.L, repr(h))
        self.assert_layers(dst, src, part, loads, self.L)
        self.assertEqual(h.wait(), [True] * 4)
        # Polling ready_layers alone gets there too.
        dst2 = [torch.zeros_like(d) for d in dst]
        h = store.load_async(dst2, [4, 5, 6, 7], keys)
        while h.ready_layers < self.L:
            self.assertLess(time.monotonic(), deadline, repr(h))
            time.sleep(0.001)
        self.assertTrue(h.done)
        self.assert_layers(dst2, src, part, loads, self.L)
        self.assertEqual(h.wait(), [True] * 4)

    def test_load_async_returns_before_the_daemon_answers(self):
        store, src, keys, dst, layout, part = self.nhd("in-flight")
        # Session, staging buffers and UCX endpoint first (a miss is a round
        # trip too).
        self.assertEqual(store.load(dst, [0], [b"warm"]), [False])
        self.stop_daemon()
        h = store.load_async(dst, [4, 5, 6, 7], keys)
        self.assertFalse(h.done)
        self.assertEqual(h.ready_layers, 0)
        self.assertIn("0 of 4 layers ready", repr(h))
        with self.assertRaises(TimeoutError):
            h.wait_for_layer(0, timeout=0)
        with self.assertRaises(TimeoutError):
            h.wait(timeout=0)
        with self.assertRaises(RuntimeError) as cm:
            h.errors()
        self.assertIn("FAILED_PRECONDITION", str(cm.exception))
        for d in dst:  # nothing has arrived, so nothing is written
            self.assertEqual(int(d.abs().sum()), 0)
        # Continued a little later: a wait that did not wait would see
        # layer 0 missing.
        self.continue_daemon_after(0.3)
        loads = [(4, 0), (5, 1), (6, 2), (7, 3)]
        for layer in range(self.L):
            h.wait_for_layer(layer)
            self.assert_layers(dst, src, part, loads, layer + 1)
            self.after_wait_for_layer(h, dst, part, loads, layer)
        self.assertEqual(h.wait(), [True] * 4)
        self.assertEqual(self.ucx_bytes("out"), 4 * layout.object_bytes)

    def wait_until_started(self, h):
        """Waits (no daemon needed) until every batch of load `h` has been
        started, as its repr says."""
        deadline = time.monotonic() + 30
        while True:
            m = re.search(r"(\d+) of (\d+) batches started", repr(h))
            self.assertIsNotNone(m, repr(h))
            if m.group(1) == m.group(2):
                return
            self.assertLess(time.monotonic(), deadline, repr(h))
            time.sleep(0.001)

    def after_wait_for_layer(self, h, dst, part, loads, layer):
        """More checks once wait_for_layer(layer) returned (DeviceLoadTest:
        the later layers are not scattered yet)."""

    def test_unregistered_staging_takes_grpc_in_the_loader(self):
        # The native call with plain numpy staging: the gRPC reads run in
        # the loader thread, not in the call.
        store, src, keys, dst, layout, part = self.nhd("grpc")
        objects = [np.full(layout.object_bytes, 0xAB, np.uint8) for _ in range(4)]
        load = self.client.load_into_cache_async(
            store.namespace, [keys[1], b"missing", keys[2], keys[3]], objects, layout,
            dst, [4, 5, 6, 7], batch_sizes=[1, 3])
        self.assertIsInstance(load, kvdepot.CacheLoad)
        self.assertEqual((len(load), load.num_layers), (4, self.L))
        self.assertTrue(load.wait_for_layer(self.L - 1, timeout=30))
        self.assertTrue(load.wait(timeout=30))
        self.assertTrue(load.ready())
        self.assertEqual(load.ready_layers(), self.L)
        self.assertEqual(load.ok(), [True, False, True, True])
        self.assertEqual(load.errors()[1][0], "NOT_FOUND")
        self.assertIn("done, 3 loaded", repr(load))
        self.assert_layers(dst, src, part, [(4, 1), (6, 2), (7, 3)], self.L)
        self.assertEqual(int(dst[0][:, 5].abs().sum()), 0)
        self.assertTrue((objects[1] == 0xAB).all())  # the miss's staging
        self.assertEqual(self.ucx_bytes("out"), 0)

    def test_bad_input_raises_before_anything_moves(self):
        store, src, keys, dst, layout, part = self.nhd("bad-input")
        with self.assertRaises(ValueError):  # in the second batch
            store.load_async(dst, [4, 5, 6, self.N], keys)
        with self.assertRaises(ValueError):
            store.load_async(dst, [4, 5, 6, -1], keys)
        with self.assertRaises(ValueError):
            store.load_async(dst, [4, 5, 5, 6], keys)
        with self.assertRaises(ValueError):
            store.load_async(dst, [4, 5], keys)
        with self.assertRaises(ValueError):  # one cache tensor short
            store.load_async(dst[:3], [4, 5, 6, 7], keys)
        ns, staging = store.namespace, store._staging(4)
        with self.assertRaises(ValueError):  # staging of the wrong size
            self.client.load_into_cache_async(ns, keys, [np.empty(3, np.uint8)] * 4,
                                              layout, dst, [4, 5, 6, 7])
        with self.assertRaises(ValueError):  # batches that do not add up
            self.client.load_into_cache_async(ns, keys, staging, layout, dst,
                                              [4, 5, 6, 7], [3])
        with self.assertRaises(ValueError):
            self.client.load_into_cache_async(ns, keys, staging, layout, dst,
                                              [4, 5, 6, 7], [4, 0])
        with self.assertRaises(ValueError):  # a sum that wraps around to 4
            self.client.load_into_cache_async(ns, keys, staging, layout, dst,
                                              [4, 5, 6, 7], [2**63 - 1, 2**63 - 1, 6])
        with self.assertRaises(ValueError):  # repeated, out of range
            self.client.load_into_cache_async(ns, keys, staging, layout, dst, [4, 4, 6, 7])
        with self.assertRaises(ValueError):
            self.client.load_into_cache_async(ns, keys, staging, layout, dst,
                                              [4, 5, 6, self.N])
        with self.assertRaises(ValueError):
            self.client.load_into_cache_async("bad namespace", keys, staging, layout,
                                              dst, [4, 5, 6, 7])
        with self.assertRaises(TypeError):
            self.client.load_into_cache_async(ns, keys, [object()] * 4, layout, dst,
                                              [4, 5, 6, 7])
        for d in dst:
            self.assertEqual(int(d.abs().sum()), 0)
        self.assertEqual(self.ucx_bytes("out"), 0)  # nothing was read
        h = store.load_async(dst, [4, 5, 6, 7], keys)
        for bad in (self.L, -1):
            with self.assertRaises(ValueError):
                h.wait_for_layer(bad)
        self.assertEqual(h.wait(), [True] * 4)
        empty = store.load_async(dst, [], [])
        self.assertTrue(empty.done)
        self.assertEqual((empty.ready_layers, empty.wait(), empty.errors()),
                         (self.L, [], []))
        empty.wait_for_layer(self.L - 1)

    def test_a_second_call_waits_for_the_load_in_flight(self):
        store, src, keys, dst, layout, part = self.nhd("second-call")
        self.assertEqual(store.load(dst, [0], [b"warm"]), [False])
        dst2 = [torch.zeros_like(d) for d in dst]
        self.stop_daemon()
        first = store.load_async(dst, [4, 5, 6, 7], keys)
        self.assertFalse(first.done)
        self.continue_daemon_after(0.3)
        # The staging buffers are the first load's until it is done: the
        # second call waits for it.
        second = store.load_async(dst2, [0, 1, 2, 3], keys)
        self.assertTrue(first.done)
        self.assertEqual(second.wait(), [True] * 4)
        self.assertEqual(first.wait(), [True] * 4)  # its results stayed with it
        self.assert_layers(dst, src, part, [(4, 0), (5, 1), (6, 2), (7, 3)], self.L)
        self.assert_layers(dst2, src, part, [(0, 0), (1, 1), (2, 2), (3, 3)], self.L)
        # A save (it gathers into the same staging buffers) waits too.
        self.stop_daemon()
        third = store.load_async(dst2, [4, 5, 6, 7], keys)
        self.assertFalse(third.done)
        self.continue_daemon_after(0.3)
        self.assertEqual(store.save(src, [4, 5], [b"s4", b"s5"]), [True, True])
        self.assertTrue(third.done)
        self.assertEqual(third.wait(), [True] * 4)
        self.assertEqual(store.load(dst, [0, 1], [b"s4", b"s5"]), [True, True])
        self.assert_layers(dst, src, part, [(0, 4), (1, 5)], self.L)

    def test_a_save_cut_short_leaves_no_put_reading_reused_staging(self):
        # A save's wait cut short by an exception (a watchdog's signal
        # here) left its put in flight, reading the staging buffer that the
        # next save gathered other blocks into: the first key was stored
        # with the second block's bytes (and their checksum). The next call
        # waits for such puts first now.
        store, src, keys, dst, layout, part = self.nhd("cut-short", batches=1)

        class Watchdog(Exception):
            pass

        def on_alarm(*_):
            raise Watchdog()

        self.addCleanup(signal.signal, signal.SIGALRM,
                        signal.signal(signal.SIGALRM, on_alarm))
        self.addCleanup(signal.setitimer, signal.ITIMER_REAL, 0)
        self.stop_daemon()
        self.continue_daemon_after(1.0)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        cut_short = None
        try:
            store.save(src, [4], [b"cut"])  # its put is in flight at 0.3 s
        except Watchdog as e:
            # Kept, as a caller handling it would: its traceback keeps the
            # save's frame, and so its op, alive (dropping the op would
            # wait for it).
            cut_short = e
        self.assertIsNotNone(cut_short)
        self.assertEqual(store.save(src, [5], [b"next"]), [True])
        del cut_short
        self.assertEqual(store.load(dst, [0, 1], [b"cut", b"next"]), [True, True])
        self.assert_layers(dst, src, part, [(0, 4), (1, 5)], self.L)

    def test_dropping_a_handle_waits_for_its_batches(self):
        store, src, keys, dst, layout, part = self.nhd("drop")
        self.assertEqual(store.load(dst, [0], [b"warm"]), [False])
        self.stop_daemon()
        h = store.load_async(dst, [4, 5, 6, 7], keys)
        self.assertFalse(h.done)
        # Dropped once its reads have started (a load dropped before starts
        # none), so that the drop has batches in flight to wait for.
        self.wait_until_started(h)
        self.continue_daemon_after(0.3)

        def drop():
            nonlocal h
            del h  # cancels, and waits for the batches, the GIL released

        self.runs_without_the_gil(drop)
        # Every block had been read when the drop returned: nothing in flight.
        self.assertEqual(self.ucx_bytes("out"), 4 * layout.object_bytes)
        # The staging buffers are free at once: the next load does not wait.
        dst2 = [torch.zeros_like(d) for d in dst]
        self.assertEqual(store.load(dst2, [4, 5, 6, 7], keys), [True] * 4)
        self.assert_layers(dst2, src, part, [(4, 0), (5, 1), (6, 2), (7, 3)], self.L)
        # A handle outliving its store, dropped after the store, unfinished.
        self.stop_daemon()
        h2 = store.load_async(dst2, [0, 1], keys[:2])
        del store
        self.wait_until_started(h2)
        self.continue_daemon_after(0.3)
        del h2
        self.assertEqual(self.ucx_bytes("out"), 10 * layout.object_bytes)

    def test_a_failed_scatter_fails_wait_for_layer(self):
        # The loader's scatter of the hit fails at layer 0: that layer and
        # every later one must not be reported ready (the block may hold some
        # layers only); wait_for_layer raises the error, as wait() does.
        store, src, keys, dst, layout, part = self.nhd("null-cache")
        caches = [_NullCache(d.numel() * d.element_size()) for d in dst]
        h = store.load_async(caches, [4, 5], [keys[0], b"missing"])
        for layer in (0, self.L - 1):
            with self.assertRaisesRegex(ValueError, r"^INVALID_ARGUMENT: scatter of layer 0: "
                                        r"cache tensor 0 is null"):
                h.wait_for_layer(layer, timeout=30)
        self.assertTrue(h.done)
        self.assertEqual(h.ready_layers, 0)
        with self.assertRaisesRegex(ValueError, "cache tensor 0 is null"):
            h.wait()
        self.assertEqual([e[0] for e in h.errors()], ["INVALID_ARGUMENT", "NOT_FOUND"])

    def test_errors_other_than_misses_raise_once_everything_ended(self):
        client = kvdepot.Client(self.daemon.address, timeout_s=2)
        self.addCleanup(client.close)
        store, src, keys, dst, layout, part = self.nhd("errors", client=client)
        self.assertEqual(store.load(dst, [0], [b"warm"]), [False])
        self.daemon.terminate()
        h = store.load_async(dst, [4, 5, 6, 7], keys)
        with self.assertRaises(RuntimeError) as cm:
            h.wait()
        self.assertNotIn("NOT_FOUND", str(cm.exception))
        self.assertTrue(h.done)
        self.assertEqual(h.ready_layers, self.L)  # nothing more will come
        errors = h.errors()
        self.assertEqual(len(errors), 4)
        for e in errors:
            self.assertIsNotNone(e)
            self.assertNotEqual(e[0], "NOT_FOUND")
        for d in dst:  # nothing written
            self.assertEqual(int(d.abs().sum()), 0)
        with self.assertRaises(RuntimeError):  # load() is the same path
            store.load(dst, [4, 5], keys[:2])


class _NullCache:
    """Looks like a CPU torch cache tensor whose data pointer is null: the
    native binding takes it (it reads data_ptr, numel, element_size,
    is_contiguous, device and dtype), and the loader's scatter into it then
    fails with INVALID_ARGUMENT ("cache tensor 0 is null") before touching
    any memory -- a scatter failure without a fault hook in the loader."""

    device = types.SimpleNamespace(type="cpu", index=None)
    dtype = "torch.bfloat16"

    def __init__(self, nbytes):
        self._nbytes = nbytes

    def data_ptr(self):
        return 0

    def numel(self):
        return self._nbytes // 2

    def element_size(self):
        return 2

    def is_contiguous(self):
        return True


class _SpyShim:
    """A KvShim wrapper (the real CPU library underneath) that counts
    registrations and can fail the scatter of one layer."""

    def __init__(self, shim, fail_layer=None):
        self.shim = shim
        self.backend = shim.backend
        self.fail_layer = fail_layer
        self.registered = []
        self.unregistered = []
        self.scattered_layers = []
        self.syncs = 0

    def gather(self, *args, **kw):
        return self.shim.gather(*args, **kw)

    def layout_info(self, layout):
        return self.shim.layout_info(layout)

    def scatter(self, layout, caches, ids, objs, layers=None, stream=None):
        if layers is not None and layers[0] == self.fail_layer:
            raise RuntimeError("INTERNAL: injected failure")
        self.scattered_layers.append(layers)
        return self.shim.scatter(layout, caches, ids, objs, layers=layers, stream=stream)

    def synchronize(self, stream=None):
        self.syncs += 1
        return self.shim.synchronize(stream)

    def register_host(self, buf):
        self.registered.append(buf.ctypes.data)
        return self.shim.register_host(buf)

    def unregister_host(self, buf):
        self.unregistered.append(buf.ctypes.data)
        return self.shim.unregister_host(buf)


@unittest.skipIf(torch is None, "torch is not installed")
class DeviceLoadTest(LoadAsyncTest):
    """KvCacheStore through a kvdepot.kvshim.KvShim (the path of CUDA
    caches), driven here with the library's CPU build: the same bytes as the
    native path, scatters enqueued by wait_for_layer (so layers past the one
    asked for are not yet written), the staging memory registered once and
    unregistered before it is freed, failures per block."""

    def setUp(self):
        super().setUp()
        from kvdepot.kvshim import KvShim

        self.shim = KvShim.for_device("cpu")

    def store_kw(self, shim=None, **kw):
        return dict(kw, shim=shim or self.shim)

    # The native loader's own call; nothing of the shim path in it.
    test_unregistered_staging_takes_grpc_in_the_loader = None
    # A null cache pointer fails the shim's check in load_async itself; the
    # shim path's failed scatters are tested with _SpyShim below.
    test_a_failed_scatter_fails_wait_for_layer = None

    def after_wait_for_layer(self, h, dst, part, loads, layer):
        # Scattered as asked, and no further: everything has arrived, what
        # is left is enqueueing. (Not through h.ready_layers: once done,
        # polling it enqueues the rest.)
        self.assertIn(f"{layer + 1} of {self.L} layers ready", repr(h))
        self.assertTrue(h.done)
        for dst_block, _ in loads:
            for later in range(layer + 1, self.L):
                self.assertEqual(int(part(dst, later, dst_block).abs().sum()), 0,
                                 f"layer {later} of block {dst_block} after layer {layer}")

    def test_same_bytes_as_the_native_path_both_ways(self):
        layout, shapes, part = self.cases()[1]  # FlashAttention HND
        shim_store, src, keys, dst = self.setup_store(layout, shapes, "cross")
        native = kvdepot.KvCacheStore(self.daemon.address, layout, "pytest-cross",
                                      client=self.client, min_batch_bytes=0)
        self.assertEqual(native.namespace, shim_store.namespace)
        # Saved through the shim, loaded natively; saved natively, loaded
        # through the shim.
        self.assertEqual(native.load(dst, [4, 5, 6, 7], keys), [True] * 4)
        self.assert_layers(dst, src, part, [(4, 0), (5, 1), (6, 2), (7, 3)], self.L)
        self.assertEqual(native.save(src, [5], [b"n5"]), [True])
        dst2 = [torch.zeros_like(d) for d in dst]
        self.assertEqual(shim_store.load(dst2, [0], [b"n5"]), [True])
        self.assert_layers(dst2, src, part, [(0, 5)], self.L)

    def test_staging_memory_is_registered_once_and_unregistered_before_it_goes(self):
        spy = _SpyShim(self.shim)
        layout, shapes, part = self.cases()[0]
        store, src, keys, dst = self.setup_store(layout, shapes, "register", shim=spy)
        self.assertEqual(len(spy.registered), 1)
        self.assertEqual(store.load(dst, [4, 5], keys[:2]), [True, True])
        self.assertEqual(store.save(src, [6], [b"r6"]), [True])
        self.assertEqual(len(spy.registered), 1)  # the same pool, once
        self.assertEqual(spy.unregistered, [])
        # 40 blocks outgrow the pool: the old one is unregistered first.
        many = [b"m%d" % i for i in range(40)]
        big = [torch.zeros((2, 40, self.T, self.H, self.D), dtype=torch.bfloat16)
               for _ in range(self.L)]
        self.assertEqual(store.load(big, list(range(40)), many), [False] * 40)
        self.assertEqual(spy.unregistered, spy.registered[:1])
        self.assertEqual(len(spy.registered), 2)
        del store
        self.assertEqual(spy.unregistered, spy.registered)

    def test_a_failed_scatter_fails_the_hits_not_the_misses(self):
        spy = _SpyShim(self.shim, fail_layer=2)
        layout, shapes, part = self.cases()[0]
        store, src, keys, dst = self.setup_store(layout, shapes, "fail", shim=spy)
        h = store.load_async(dst, [4, 5, 6], [keys[0], b"missing", keys[1]])
        h.wait_for_layer(1)
        self.assert_layers(dst, src, part, [(4, 0), (6, 1)], 2)
        # Layer 2 fails: nothing more is scattered, and neither it nor a
        # later layer is reported ready (the hits are partly loaded).
        with self.assertRaisesRegex(RuntimeError, r"^INTERNAL: .*scatter of layers \[2, 4\)"):
            h.wait_for_layer(3)
        with self.assertRaisesRegex(RuntimeError, "^INTERNAL: "):
            h.wait_for_layer(2)
        h.wait_for_layer(1)  # scattered before the failure
        self.assertTrue(h.done)
        self.assertEqual(h.ready_layers, 2)
        with self.assertRaises(RuntimeError) as cm:
            h.wait()
        self.assertIn("INTERNAL", str(cm.exception))
        errors = h.errors()
        self.assertEqual(errors[1][0], "NOT_FOUND")
        for i in (0, 2):
            self.assertEqual(errors[i][0], "INTERNAL")
            self.assertIn("scatter of layers [2, 4)", errors[i][1])
        for layer in (2, 3):
            self.assertEqual(int(part(dst, layer, 4).abs().sum()), 0)
        self.assertEqual(h.ready_layers, 2)

    def test_a_failed_scatter_seen_by_polling_fails_wait_for_layer(self):
        spy = _SpyShim(self.shim, fail_layer=0)
        layout, shapes, part = self.cases()[0]
        store, src, keys, dst = self.setup_store(layout, shapes, "fail-poll", shim=spy)
        h = store.load_async(dst, [4, 5], keys[:2])
        deadline = time.monotonic() + 30
        while not h.done:
            self.assertLess(time.monotonic(), deadline, repr(h))
            time.sleep(0.001)
        self.assertEqual(h.ready_layers, 0)  # the scatter of every layer failed
        for layer in (0, self.L - 1):
            with self.assertRaisesRegex(RuntimeError, "^INTERNAL: .*injected failure"):
                h.wait_for_layer(layer)
        self.assertEqual([e[0] for e in h.errors()], ["INTERNAL"] * 2)
        with self.assertRaises(RuntimeError):
            h.wait()
        for d in dst:
            self.assertEqual(int(d.abs().sum()), 0)


if __name__ == "__main__":
    unittest.main()
