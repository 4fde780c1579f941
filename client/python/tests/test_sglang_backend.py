"""Tests of kvdepot.integrations.sglang.KvDepotHiCacheStorage against a live
kvdepotd, created the way SGLang's StorageBackendFactory creates a "dynamic"
backend and called as its HiCacheController calls it, with a real torch host
pool laid out like SGLang's MHATokenToKVPoolHost. SGLang itself is not
installed here: the backend subclasses its local stand-in base.

Run with PYTHONPATH=<build>/python and KVDEPOT_DAEMON=<path of kvdepotd>.
Exits 77 (ctest: skipped) when torch, numpy or the kvdepot package is missing.
"""

import dataclasses
import json
import os
import sys
import types
import unittest
from types import SimpleNamespace
from typing import List, Optional
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

try:
    import numpy  # noqa: F401
    import torch
    import kvdepot
    from kvdepot.integrations import sglang as kv_sglang
    from engine_harness import (FakeClock, FakeMHAHostPool, FakeStorageConfig,
                                create_dynamic_backend, sglang_page_hashes)
    from live_daemon import Daemon
except ImportError as e:  # pragma: no cover
    print(f"skipping: {e}", file=sys.stderr)
    sys.exit(77)



@dataclasses.dataclass
class SglangExtraInfo:
    """sglang.srt.mem_cache.hicache_storage.HiCacheStorageExtraInfo, with
    SGLang's default prefix_keys=(None,)."""

    prefix_keys: Optional[List[str]] = (None,)  # type: ignore[assignment]
    extra_info: Optional[dict] = None


class Passthrough:
    """A stand-in kvdepot client that passes every call on to the real one;
    subclasses override what a test watches."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


class CallSizes(Passthrough):
    """Records the number of keys of every lookup and transfer."""

    def __init__(self, backend):
        super().__init__(backend._client)
        self.sizes = []
        backend._client = self

    def lookup(self, ns, keys, *args, **kwargs):
        self.sizes.append(len(keys))
        return self._inner.lookup(ns, keys, *args, **kwargs)

    def get_into_async(self, ns, keys, *args, **kwargs):
        self.sizes.append(len(keys))
        return self._inner.get_into_async(ns, keys, *args, **kwargs)

    def put_async(self, ns, keys, *args, **kwargs):
        self.sizes.append(len(keys))
        return self._inner.put_async(ns, keys, *args, **kwargs)

    def get_into(self, ns, keys, *args, **kwargs):
        self.sizes.append(len(keys))
        return self._inner.get_into(ns, keys, *args, **kwargs)

    def put(self, ns, keys, *args, **kwargs):
        self.sizes.append(len(keys))
        return self._inner.put(ns, keys, *args, **kwargs)


class RecordRegistrations(Passthrough):
    """Records the buffers registered with the client."""

    def __init__(self, backend):
        super().__init__(backend._client)
        self.buffers = []
        backend._client = self

    def register_buffer(self, buffer):
        self.buffers.append(buffer)
        return self._inner.register_buffer(buffer)


class RefusingClient(Passthrough):
    """A client whose register_buffer fails (as without UCX)."""

    def register_buffer(self, buffer):
        raise RuntimeError("FAILED_PRECONDITION: no UCX data plane")



class FakeOp:
    """A finished transfer op whose objects all failed with ``error``."""

    def __init__(self, n, error):
        self._n, self._error = n, error

    def wait(self, timeout=None):
        return True

    def ok(self):
        return [False] * self._n

    def errors(self):
        return [self._error] * self._n


class GoneClient(Passthrough):
    """Passes calls on while ``down`` is False; while True, every lookup,
    get and put raises UNAVAILABLE (a daemon that is gone). Counts the
    calls that reach it (``attempts``)."""

    def __init__(self, backend):
        super().__init__(backend._client)
        self.down = False
        self.attempts = 0
        backend._client = self

    def _call(self, name, *args, **kwargs):
        self.attempts += 1
        if self.down:
            raise RuntimeError("UNAVAILABLE: injected: the daemon is gone")
        return getattr(self._inner, name)(*args, **kwargs)

    def lookup(self, *args, **kwargs):
        return self._call("lookup", *args, **kwargs)

    def get_into_async(self, *args, **kwargs):
        return self._call("get_into_async", *args, **kwargs)

    def put_async(self, *args, **kwargs):
        return self._call("put_async", *args, **kwargs)


def server_args_module(**fields):
    """A stand-in of ``sglang.srt.server_args`` whose
    ``get_global_server_args()`` has ``fields`` (and SGLang's defaults for
    the ones the backend reads)."""
    fake = types.ModuleType("sglang.srt.server_args")
    args = SimpleNamespace(revision=None, quantization=None, json_model_override_args="{}")
    args.__dict__.update(fields)
    fake.get_global_server_args = lambda: args
    return fake


class _NamedDtype:
    """A dtype this torch lacks (torch 1.13 has no float8), named as torch
    names it."""

    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"torch.{self.name}"


def torch_dtype(name):
    return getattr(torch, name, None) or _NamedDtype(name)


PAGE = 16
LAYERS = 3
HEADS = 2
DIM = 32
POOL_TOKENS = 40 * PAGE


class SglangBackendTest(unittest.TestCase):
    def setUp(self):
        self.daemon = Daemon(metrics=True)
        self.backends = []

    def tearDown(self):
        for b in self.backends:
            b.close()
        self.daemon.stop()

    def unregistered(self, config=None, **extra):
        """A backend as StorageBackendFactory creates it; ``config``:
        FakeStorageConfig fields."""
        cfg = FakeStorageConfig(**(config or {}), extra_config={
            "backend_name": "kvdepot", "module_path": "kvdepot.integrations.sglang",
            "class_name": "KvDepotHiCacheStorage", "interface_v1": 1,
            "server": self.daemon.address, "timeout_s": 2.0, **extra})
        b = create_dynamic_backend(cfg, kv_sglang.HiCacheStorage)
        self.backends.append(b)
        return b

    def backend(self, layout="page_first", config=None, pool=None, **extra):
        b = self.unregistered(config, **extra)
        if pool is None:
            pool = FakeMHAHostPool(POOL_TOKENS, PAGE, LAYERS, HEADS, DIM, torch.bfloat16,
                                   layout=layout)
        b.register_mem_pool_host(pool)  # as HiCacheController does
        return b, pool

    @staticmethod
    def host_indices(pages, page=PAGE):
        return torch.cat([torch.arange(p * page, (p + 1) * page) for p in pages])

    @staticmethod
    def page_view(pool, p):
        page = pool.page_size
        if pool.layout == "layer_first":
            return pool.kv_buffer[:, :, p * page:(p + 1) * page]
        return pool.kv_buffer[:, p * page:(p + 1) * page]

    def fill(self, pool, pages, seed):
        g = torch.Generator().manual_seed(seed)
        for p in pages:
            view = self.page_view(pool, p)
            if view.dtype == torch.uint8:
                view.copy_(torch.randint(0, 256, view.shape, generator=g, dtype=torch.uint8))
            else:
                view.copy_(torch.randn(view.shape, generator=g).to(view.dtype))

    def same_page(self, pool_a, a, pool_b, b):
        """Whether page ``a`` of pool_a and page ``b`` of pool_b hold the
        same bytes."""
        return torch.equal(self.page_view(pool_a, a).contiguous().view(torch.uint8),
                           self.page_view(pool_b, b).contiguous().view(torch.uint8))

    def ucx_bytes(self, direction):
        """Block bytes the daemon moved over UCX."""
        return self.daemon.metric(
            'kvdepot_bytes_total{direction="%s",transport="ucx"}' % direction)

    def round_trip(self, layout):
        src, src_pool = self.backend(layout)
        tokens = list(range(1000, 1000 + 5 * PAGE))
        keys = sglang_page_hashes(tokens, PAGE)
        self.assertEqual(len(keys), 5)
        self.assertEqual(src.batch_exists(keys), 0)
        # Backup (L2 -> L3): _page_set_zero_copy = all(batch_set_v1(...)).
        src_pages = [3, 7, 1, 9]
        self.fill(src_pool, src_pages, seed=1)
        self.assertEqual(src.batch_set_v1(keys[:4], self.host_indices(src_pages)),
                         [True] * 4)
        self.assertEqual(src.batch_set_v1(keys[:4], self.host_indices(src_pages)),
                         [True] * 4)  # already stored: still success
        # Prefetch on another instance (L3 -> L2): hit query, then get.
        dst, dst_pool = self.backend(layout)
        self.assertEqual(dst.namespace, src.namespace)
        self.assertEqual(dst.batch_exists(keys), 4)  # prefix count
        self.assertEqual(dst.batch_exists(keys[:2]), 2)
        self.assertEqual(dst.batch_exists(keys[1:]), 3)
        self.assertEqual(dst.batch_exists([keys[4]] + keys[:4]), 0)
        dst_pages = [20, 2, 31, 5, 11]
        got = dst.batch_get_v1(keys, self.host_indices(dst_pages))
        self.assertEqual(got, [True, True, True, True, False])
        for s, d in zip(src_pages, dst_pages[:4]):
            self.assertTrue(torch.equal(src_pool.page(s * PAGE).view(torch.int16),
                                        dst_pool.page(d * PAGE).view(torch.int16)))
        # The missing page's host memory is untouched.
        self.assertEqual(int(dst_pool.page(11 * PAGE).view(torch.int16).abs().sum()), 0)
        return src, dst

    def test_page_first_round_trip_and_stats(self):
        src, dst = self.round_trip("page_first")
        stats = src.get_stats()
        self.assertEqual(stats.backup_pgs, [4, 4])
        self.assertEqual(len(stats.backup_bandwidth), 2)
        self.assertEqual(stats.prefetch_pgs, [])
        dstats = dst.get_stats()
        self.assertEqual(dstats.prefetch_pgs, [4])
        self.assertEqual(dst.get_stats().prefetch_pgs, [])  # reset after a read
        self.assertEqual(dst.counters["get_pages"], 5)
        self.assertEqual(dst.counters["get_hit_pages"], 4)
        self.assertEqual(dst.counters["errors"], 0)

    def test_layer_first_round_trip(self):
        self.round_trip("layer_first")

    def test_generic_path_and_exists(self):
        self.generic_path("page_first")

    def test_generic_path_layer_first(self):
        self.generic_path("layer_first")

    def generic_path(self, layout):
        b, pool = self.backend(layout)
        self.fill(pool, [4], seed=2)
        # SGLang's flat data page: page_first [2, PAGE, L, H, D],
        # layer_first [2, L, PAGE, H, D].
        page = pool.page(4 * PAGE)
        flat = page.reshape(-1)
        self.assertTrue(b.batch_set(["k1"], [flat]))
        self.assertTrue(b.exists("k1"))
        self.assertFalse(b.exists("k2"))
        out = b.batch_get(["k1", "k2"])
        self.assertTrue(torch.equal(out[0].view(torch.int16), flat.view(torch.int16)))
        self.assertIsNone(out[1])
        # Targets whose memory is strided are written, not a copy of them;
        # a missed one is left as it was.
        backing = torch.zeros(2 * flat.numel(), dtype=flat.dtype)
        missed = torch.zeros(2 * flat.numel(), dtype=flat.dtype)
        targets = [backing[::2], missed[::2]]
        self.assertFalse(targets[0].is_contiguous())
        out = b.batch_get(["k1", "k2"], targets)
        self.assertIs(out[0], targets[0])
        self.assertTrue(torch.equal(backing[::2].view(torch.int16), flat.view(torch.int16)))
        self.assertEqual(int(backing[1::2].view(torch.int16).abs().sum()), 0)
        self.assertIsNone(out[1])
        self.assertEqual(int(missed.view(torch.int16).abs().sum()), 0)
        # The generic and zero-copy paths store the same objects.
        self.assertEqual(b.batch_get_v1(["k1"], self.host_indices([6])), [True])
        self.assertTrue(torch.equal(pool.page(6 * PAGE).view(torch.int16),
                                    page.view(torch.int16)))

    def test_namespaces_apart_by_rank_and_shape(self):
        a, _ = self.backend()
        cfg = FakeStorageConfig(tp_rank=1, tp_size=2, extra_config={
            "backend_name": "kvdepot", "module_path": "kvdepot.integrations.sglang",
            "class_name": "KvDepotHiCacheStorage", "server": self.daemon.address})
        b = create_dynamic_backend(cfg, kv_sglang.HiCacheStorage)
        self.backends.append(b)
        b.register_mem_pool_host(FakeMHAHostPool(POOL_TOKENS, PAGE, LAYERS, HEADS, DIM,
                                                 torch.bfloat16))
        self.assertNotEqual(a.namespace, b.namespace)
        self.assertIn("tp1of2", b.namespace)

    def test_namespaces_apart_by_revision_quantization_and_overrides(self):
        # Deployments of one model with another revision, quantization or HF
        # config overrides (--json-model-override-args: RoPE scaling) compute
        # other KV: other namespaces. SGLang's storage config has none of
        # these; its server arguments (in the scheduler process) do.
        def namespace(server_args=None, storage=None, **extra):
            modules = {}
            if server_args is not None:
                fake = types.ModuleType("sglang.srt.server_args")
                args = SimpleNamespace(revision=None, quantization=None,
                                       json_model_override_args="{}")
                args.__dict__.update(server_args)
                fake.get_global_server_args = lambda: args
                modules["sglang.srt.server_args"] = fake
            with mock.patch.dict(sys.modules, modules):
                cfg = FakeStorageConfig(extra_config={
                    "backend_name": "kvdepot", "module_path": "kvdepot.integrations.sglang",
                    "class_name": "KvDepotHiCacheStorage", "server": self.daemon.address,
                    **extra})
                for name, value in (storage or {}).items():
                    setattr(cfg, name, value)  # SGLang versions that have them
                b = create_dynamic_backend(cfg, kv_sglang.HiCacheStorage)
                self.backends.append(b)
                b.register_mem_pool_host(FakeMHAHostPool(POOL_TOKENS, PAGE, LAYERS, HEADS,
                                                         DIM, torch.bfloat16))
            self.assertIsNone(b.disabled_reason)
            return b

        plain = namespace().namespace
        self.assertTrue(plain.startswith("sglang/test/tiny-llama/page_first/tp0of1/"), plain)
        self.assertEqual(namespace(server_args={}).namespace, plain)  # defaults: as before
        yarn = {"rope_scaling": {"type": "yarn", "factor": 4.0}}
        variants = {
            "revision": namespace(server_args={"revision": "v2"}).namespace,
            "quantization": namespace(server_args={"quantization": "fp8"}).namespace,
            "overrides": namespace(server_args={
                "json_model_override_args": json.dumps(yarn)}).namespace,
            "other overrides": namespace(server_args={
                "json_model_override_args": '{"rope_scaling": {"factor": 2.0}}'}).namespace,
            "storage config revision": namespace(storage={"revision": "v3"}).namespace,
            "identity hash": namespace(storage={"model_identity_hash": "ab12"}).namespace,
        }
        names = [plain] + list(variants.values())
        self.assertEqual(len(set(names)), len(names), variants)
        self.assertIn("/rev:v2/", variants["revision"])
        self.assertIn("/quant:fp8/", variants["quantization"])
        # The same overrides, keys in another order: the same namespace.
        same = {"rope_scaling": {"factor": 4.0, "type": "yarn"}}
        self.assertEqual(namespace(server_args={
            "json_model_override_args": json.dumps(same)}).namespace, variants["overrides"])
        # A model named in the extra config is the name as given.
        self.assertTrue(namespace(server_args={"revision": "v2"}, model="mine").namespace
                        .startswith("sglang/mine/page_first/tp0of1/"))
        # What one revision stored, another does not find.
        v2 = namespace(server_args={"revision": "v2"})
        keys = sglang_page_hashes(list(range(2 * PAGE)), PAGE)
        self.assertEqual(v2.batch_set_v1(keys, self.host_indices([0, 1])), [True] * 2)
        self.assertEqual(namespace().batch_exists(keys), 0)
        self.assertEqual(namespace(server_args={"revision": "v2"}).batch_exists(keys), 2)

    def test_first_parent_ignores_sglangs_default_prefix_keys(self):
        b, pool = self.backend()
        puts = []

        class RecordingClient:
            """Passes every call on to the real client, recording puts."""

            def __init__(self, inner):
                self._inner = inner

            def put_async(self, namespace, keys, values, parents=None):
                puts.append((list(keys), list(parents)))
                return self._inner.put_async(namespace, keys, values, parents)

            def __getattr__(self, name):
                return getattr(self._inner, name)

        b._client = RecordingClient(b._client)
        keys = sglang_page_hashes(list(range(4 * PAGE)), PAGE)
        self.fill(pool, [0, 1, 2, 3], seed=4)
        # SGLang's HiCacheStorageExtraInfo() has prefix_keys=(None,): no
        # page before the first one.
        sglang_default = SglangExtraInfo()
        self.assertEqual(sglang_default.prefix_keys, (None,))
        self.assertEqual(b.batch_set_v1(keys[:2], self.host_indices([0, 1]), sglang_default),
                         [True] * 2)
        self.assertEqual(b.batch_set_v1(keys[2:3], self.host_indices([2]),
                                        SglangExtraInfo(prefix_keys=[])), [True])
        # A real prefix names its last page's last object.
        self.assertEqual(b.batch_set_v1(keys[3:], self.host_indices([3]),
                                        SglangExtraInfo(prefix_keys=[None, keys[2]])), [True])
        self.assertEqual(len(puts), 3)
        okeys, parents = puts[0]
        self.assertEqual(parents, [b"", okeys[0], okeys[1], okeys[2]])
        self.assertEqual(puts[1][1][0], b"")
        self.assertEqual(puts[2][1][0], f"{keys[2]}.1".encode())
        self.assertEqual(b.batch_exists(keys), 4)

    def test_daemon_gone_is_a_miss_not_an_error(self):
        b, pool = self.backend()
        keys = sglang_page_hashes(list(range(3 * PAGE)), PAGE)
        self.fill(pool, [0, 1, 2], seed=3)
        self.assertEqual(b.batch_set_v1(keys, self.host_indices([0, 1, 2])), [True] * 3)
        self.daemon.terminate()
        self.assertEqual(b.batch_exists(keys), 0)
        self.assertEqual(b.batch_get_v1(keys, self.host_indices([3, 4, 5])), [False] * 3)
        self.assertEqual(b.batch_set_v1(keys, self.host_indices([0, 1, 2])), [False] * 3)
        self.assertFalse(b.batch_set(["x"], [pool.page(0).reshape(-1)]))
        self.assertEqual(b.batch_get(["x"]), [None])
        # The first call found the daemon gone; the others failed too or,
        # within the breaker's back-off window, were not made.
        self.assertGreaterEqual(b.counters["errors"], 1)
        self.assertEqual(b.counters["errors"] + b.counters["unavailable_skips"], 5)

    def test_unavailable_daemon_backs_off(self):
        b, pool = self.backend(backoff_s=1.0, max_backoff_s=2.0)
        clock = FakeClock()
        b._breaker.clock = clock
        gone = GoneClient(b)
        keys = sglang_page_hashes(list(range(2 * PAGE)), PAGE)
        self.fill(pool, [0, 1], seed=12)
        self.assertEqual(b.batch_set_v1(keys, self.host_indices([0, 1])), [True] * 2)
        gone.down = True
        with self.assertLogs("kvdepot.integrations.sglang", "WARNING") as logs:
            self.assertEqual(b.batch_exists(keys), 0)  # finds it gone
            attempts = gone.attempts
            # Within the window every call is a miss without a call.
            self.assertEqual(b.batch_exists(keys), 0)
            self.assertEqual(b.batch_get_v1(keys, self.host_indices([4, 5])), [False] * 2)
            self.assertEqual(b.batch_set_v1(keys, self.host_indices([0, 1])), [False] * 2)
            self.assertEqual(b.batch_get(keys), [None, None])
            self.assertFalse(b.batch_set(["x"], [pool.page(0).reshape(-1)]))
            self.assertEqual(gone.attempts, attempts)
            self.assertEqual(b.counters["unavailable_skips"], 5)
            # Past it, one call probes; a failed probe doubles the window.
            clock.advance(1.01)
            self.assertEqual(b.batch_get_v1(keys, self.host_indices([4, 5])), [False] * 2)
            self.assertEqual(gone.attempts, attempts + 1)
            clock.advance(1.5)
            self.assertEqual(b.batch_exists(keys), 0)
            self.assertEqual(gone.attempts, attempts + 1)
            # Back: the next probe finds it and calls resume.
            gone.down = False
            clock.advance(0.51)
            self.assertEqual(b.batch_exists(keys), 2)
            self.assertEqual(b.batch_get_v1(keys, self.host_indices([4, 5])), [True] * 2)
        opened = [line for line in logs.output if "not calling it" in line]
        closed = [line for line in logs.output if "answers again" in line]
        self.assertEqual((len(opened), len(closed)), (1, 1), logs.output)
        # A real daemon gone: after the first failed call, no call at all.
        self.daemon.terminate()
        self.assertEqual(b.batch_exists(keys), 0)
        attempts = gone.attempts
        self.assertEqual(b.batch_get_v1(keys, self.host_indices([4, 5])), [False] * 2)
        self.assertEqual(b.batch_set_v1(keys, self.host_indices([0, 1])), [False] * 2)
        self.assertEqual(gone.attempts, attempts)

    def test_a_put_not_found_is_an_error(self):
        # After a daemon restart a put may fail NOT_FOUND ("unknown
        # session"): an error, counted and logged; a get's NOT_FOUND is a
        # miss.
        b, pool = self.backend()
        keys = sglang_page_hashes(list(range(2 * PAGE)), PAGE)
        error = ("NOT_FOUND", "unknown session 7")

        class Restarted(Passthrough):
            def put_async(self, ns, okeys, *args, **kwargs):
                return FakeOp(len(okeys), error)

            def get_into_async(self, ns, okeys, *args, **kwargs):
                return FakeOp(len(okeys), ("NOT_FOUND", "no such block"))

        b._client = Restarted(b._client)
        with self.assertLogs("kvdepot.integrations.sglang", "WARNING") as logs:
            self.assertEqual(b.batch_set_v1(keys, self.host_indices([0, 1])), [False] * 2)
        self.assertEqual(b.counters["errors"], 1)
        self.assertTrue(any("unknown session" in line for line in logs.output), logs.output)
        self.assertFalse(b.batch_set(["x"], [pool.page(0).reshape(-1)]))
        self.assertEqual(b.counters["errors"], 2)
        self.assertEqual(b.batch_get_v1(keys, self.host_indices([4, 5])), [False] * 2)
        self.assertEqual(b.counters["errors"], 2)  # a miss

    # ------------------------------------------------------------------
    # Hybrid models (the v2 interface), the model's name

    def test_v2_interface_answers_misses_and_side_pools_disable(self):
        b, pool = self.backend()
        keys = sglang_page_hashes(list(range(2 * PAGE)), PAGE)
        self.fill(pool, [0, 1], seed=13)
        self.assertEqual(b.batch_set_v1(keys, self.host_indices([0, 1])), [True] * 2)
        # SGLang's PoolTransfer: a pool name (PoolName, a str enum), keys,
        # host indices.
        indexer = SimpleNamespace(name="indexer", keys=keys,
                                  host_indices=self.host_indices([4, 5]))
        mamba = SimpleNamespace(name="mamba", keys=keys[-1:], host_indices=torch.arange(1))
        result = b.batch_exists_v2(keys, [indexer, mamba], SglangExtraInfo())
        self.assertEqual((result.kv_hit_pages, result.extra_pool_hit_pages),
                         (0, {"indexer": 0, "mamba": 0}))
        self.assertEqual(b.batch_exists_v2(keys).kv_hit_pages, 0)
        self.assertEqual(b.batch_get_v2([indexer, mamba]),
                         {"indexer": [False, False], "mamba": [False]})
        self.assertEqual(b.batch_set_v2([indexer, mamba], SglangExtraInfo()),
                         {"indexer": [False, False], "mamba": [False]})
        self.assertEqual(b.batch_get_v2([SimpleNamespace(name="kv", keys=None)]),
                         {"kv": []})
        # The KV pool registered through v2 (some SGLang versions), or a
        # draft KV pool (speculative decoding, best-effort): still served.
        b.register_mem_host_pool_v2(pool, "kv")
        with self.assertLogs("kvdepot.integrations.sglang", "WARNING"):
            b.register_mem_host_pool_v2(object(), "draft")
        self.assertIsNone(b.disabled_reason)
        self.assertEqual(b.batch_exists(keys), 2)
        # A side pool: the backend is disabled; stored pages are misses.
        with self.assertLogs("kvdepot.integrations.sglang", "ERROR"):
            b.register_mem_host_pool_v2(object(), "indexer")
        self.assertIn("indexer", b.disabled_reason)
        self.assertEqual(b.batch_exists(keys), 0)
        self.assertEqual(b.batch_get_v1(keys, self.host_indices([4, 5])), [False] * 2)
        self.assertEqual(b.batch_set_v1(keys, self.host_indices([0, 1])), [False] * 2)
        # It stays disabled when the main pool is registered (again).
        b.register_mem_pool_host(pool)
        self.assertIsNotNone(b.disabled_reason)
        self.assertIsNone(b.namespace)

    def test_served_model_alias_namespaced_by_the_model_path(self):
        # SGLang's storage config names the model by --served-model-name,
        # often an alias: two checkpoints served as "llm" must not share KV.
        def backend(model_name="llm", **server_args):
            modules = {}
            if server_args:
                modules["sglang.srt.server_args"] = server_args_module(**server_args)
            with mock.patch.dict(sys.modules, modules):
                b = self.unregistered(config={"model_name": model_name})
                b.register_mem_pool_host(FakeMHAHostPool(POOL_TOKENS, PAGE, LAYERS, HEADS,
                                                         DIM, torch.bfloat16))
            return b

        v1 = backend(model_path="/models/llama3-8b-finetune-v1")
        v2 = backend(model_path="/models/llama3-8b-finetune-v2")
        self.assertIsNone(v1.disabled_reason)
        self.assertNotEqual(v1.namespace, v2.namespace)
        self.assertTrue(v1.namespace.startswith("sglang/llm/path:"), v1.namespace)
        keys = sglang_page_hashes(list(range(2 * PAGE)), PAGE)
        self.assertEqual(v1.batch_set_v1(keys, self.host_indices([0, 1])), [True] * 2)
        self.assertEqual(v2.batch_exists(keys), 0)
        self.assertEqual(backend(model_path="/models/llama3-8b-finetune-v1")
                         .batch_exists(keys), 2)
        # Served under its path (SGLang's default name): no path part, the
        # label as before.
        plain = backend(model_name="meta/llama", model_path="meta/llama")
        self.assertTrue(plain.namespace.startswith("sglang/meta/llama/page_first/tp0of1/"),
                        plain.namespace)
        # No name: the path names it; nothing at all: disabled, not "model".
        unnamed = backend(model_name=None, model_path="meta/llama")
        self.assertEqual(unnamed.namespace, plain.namespace)
        with self.assertLogs("kvdepot.integrations.sglang", "ERROR"):
            nameless = backend(model_name=None)
        self.assertIn("nothing names the model", nameless.disabled_reason)
        self.assertIsNone(nameless.namespace)
        self.assertEqual(nameless.batch_exists(keys), 0)

    # ------------------------------------------------------------------
    # Batches over the daemon's max_batch_keys

    def test_layer_first_batches_beyond_the_daemons_key_limit(self):
        # 32 layers layer_first: 64 objects a page, so SGLang's batches (up
        # to 128 pages) exceed the daemon's 1024 keys a call beyond 16 pages.
        page, layers, n = 4, 32, 40
        pool = FakeMHAHostPool(3 * n * page, page, layers, 2, 16, torch.bfloat16,
                               layout="layer_first")
        b, _ = self.backend(pool=pool)
        calls = CallSizes(b)
        self.assertEqual(b._objects_per_page, 64)
        self.fill(pool, range(n), seed=5)
        keys = sglang_page_hashes(list(range(n * page)), page)
        self.assertEqual(b.batch_set_v1(keys, self.host_indices(range(n), page)), [True] * n)
        self.assertEqual(b.batch_exists(keys), n)
        self.assertEqual(b.batch_get_v1(keys, self.host_indices(range(n, 2 * n), page)),
                         [True] * n)
        for p in range(n):
            self.assertTrue(self.same_page(pool, p, pool, n + p), p)
        # A page missing in the second chunk (pages 16..31) ends the prefix.
        other = [k + "-b" for k in keys]
        self.assertEqual(b.batch_set_v1(other[:20], self.host_indices(range(20), page)),
                         [True] * 20)
        self.assertEqual(b.batch_set_v1(other[21:], self.host_indices(range(21, n), page)),
                         [True] * (n - 21))
        self.assertEqual(b.batch_exists(other), 20)
        got = b.batch_get_v1(other, self.host_indices(range(2 * n, 3 * n), page))
        self.assertEqual(got, [True] * 20 + [False] + [True] * (n - 21))
        # The generic path too.
        flat = [self.page_view(pool, p).reshape(-1).clone() for p in range(20)]
        self.assertTrue(b.batch_set([f"g{i}" for i in range(20)], flat))
        out = b.batch_get([f"g{i}" for i in range(20)])
        for f, o in zip(flat, out):
            self.assertTrue(torch.equal(f.view(torch.int16), o.view(torch.int16)))
        self.assertEqual(b.counters["errors"], 0)
        self.assertLessEqual(max(calls.sizes), kv_sglang.DEFAULT_MAX_BATCH_KEYS)
        self.assertGreater(len(calls.sizes), 8)

    def test_max_batch_keys_below_one_page(self):
        # extra_config max_batch_keys, here smaller than a page's 64 objects:
        # a page's objects span several calls and still count as one page.
        page, layers, n = 4, 32, 6
        pool = FakeMHAHostPool(3 * n * page, page, layers, 2, 16, torch.bfloat16,
                               layout="layer_first")
        b, _ = self.backend(pool=pool, max_batch_keys=40)
        calls = CallSizes(b)
        self.fill(pool, range(n), seed=6)
        keys = sglang_page_hashes(list(range(n * page)), page)
        stored = [0, 1, 2, 4, 5]  # page 3 missing
        for p in stored:
            self.assertEqual(b.batch_set_v1([keys[p]], self.host_indices([p], page)), [True])
        self.assertEqual(b.batch_exists(keys), 3)
        self.assertEqual(b.batch_get_v1(keys, self.host_indices(range(n, 2 * n), page)),
                         [True, True, True, False, True, True])
        for p in stored:
            self.assertTrue(self.same_page(pool, p, pool, n + p), p)
        self.assertLessEqual(max(calls.sizes), 40)

    # ------------------------------------------------------------------
    # Namespaces: attention context parallelism, FP8

    def test_context_parallel_ranks_do_not_share_pages(self):
        for mla in (False, True):
            with self.subTest(mla=mla):
                base, _ = self.backend(config={"is_mla_model": mla})
                b0, pool0 = self.backend(config={"is_mla_model": mla, "attn_cp_rank": 0,
                                                 "attn_cp_size": 2})
                b1, pool1 = self.backend(config={"is_mla_model": mla, "attn_cp_rank": 1,
                                                 "attn_cp_size": 2})
                self.assertNotEqual(b0.namespace, b1.namespace)
                self.assertIn("cp1of2", b1.namespace)
                self.assertNotEqual(b0.namespace, base.namespace)
                keys = sglang_page_hashes(list(range(2 * PAGE)), PAGE)
                keys = [k + f"-{mla}" for k in keys]
                pool0.kv_buffer.fill_(1.0)
                pool1.kv_buffer.zero_()
                self.assertEqual(b0.batch_set_v1(keys, self.host_indices([0, 1])), [True] * 2)
                # Rank 1 holds another slice of these pages: never rank 0's.
                self.assertEqual(b1.batch_exists(keys), 0)
                self.assertEqual(b1.batch_get_v1(keys, self.host_indices([2, 3])),
                                 [False] * 2)
                self.assertEqual(int(pool1.kv_buffer.abs().sum()), 0)
                pool1.kv_buffer.fill_(2.0)
                self.assertEqual(b1.batch_set_v1(keys, self.host_indices([0, 1])), [True] * 2)
                pool1.kv_buffer[:, 2 * PAGE:].zero_()
                self.assertEqual(b1.batch_get_v1(keys, self.host_indices([2, 3])), [True] * 2)
                self.assertTrue(bool((pool1.kv_buffer[:, :4 * PAGE] == 2.0).all()))

    def fp8_pool(self, logical):
        """An FP8 KV cache's host pool: uint8 (SGLang's store_dtype), its
        device pool's dtype the FP8 format."""
        pool = FakeMHAHostPool(POOL_TOKENS, PAGE, LAYERS, HEADS, DIM, torch.uint8)
        pool.device_pool = SimpleNamespace(dtype=logical, store_dtype=torch.uint8)
        return pool

    def test_fp8_pool_namespaced_by_its_format(self):
        e4m3 = self.fp8_pool(torch_dtype("float8_e4m3fn"))
        e5m2 = self.fp8_pool(torch_dtype("float8_e5m2"))
        a, _ = self.backend(pool=e4m3)
        b, _ = self.backend(pool=e5m2)
        self.assertIsNone(a.disabled_reason)
        self.assertIn("float8_e4m3fn", a.namespace)
        self.assertIn("float8_e5m2", b.namespace)
        self.assertNotEqual(a.namespace, b.namespace)
        keys = sglang_page_hashes(list(range(3 * PAGE)), PAGE)
        self.fill(e4m3, [0, 1, 2], seed=7)
        self.assertEqual(a.batch_set_v1(keys, self.host_indices([0, 1, 2])), [True] * 3)
        self.assertEqual(a.batch_exists(keys), 3)
        self.assertEqual(b.batch_exists(keys), 0)  # e5m2 never reads e4m3 bytes
        self.assertEqual(a.batch_get_v1(keys, self.host_indices([5, 6, 7])), [True] * 3)
        for s_, d in zip([0, 1, 2], [5, 6, 7]):
            self.assertTrue(self.same_page(e4m3, s_, e4m3, d))
        flat = e4m3.page(0).reshape(-1)
        self.assertTrue(a.batch_set(["flat"], [flat]))
        self.assertTrue(torch.equal(a.batch_get(["flat"])[0], flat))

    def test_unknown_uint8_pool_disables_the_backend(self):
        for pool in (self.fp8_pool(torch.int8),
                     FakeMHAHostPool(POOL_TOKENS, PAGE, LAYERS, HEADS, DIM, torch.uint8)):
            b = self.unregistered()
            with self.assertLogs("kvdepot.integrations.sglang", "ERROR"):
                b.register_mem_pool_host(pool)  # must not raise: SGLang re-raises
            self.assertIsNone(b.namespace)
            self.assertIn("uint8", b.disabled_reason)
            keys = ["a", "b"]
            self.assertEqual(b.batch_exists(keys), 0)
            self.assertEqual(b.batch_set_v1(keys, self.host_indices([0, 1])), [False] * 2)
            self.assertEqual(b.batch_get_v1(keys, self.host_indices([0, 1])), [False] * 2)
            self.assertFalse(b.batch_set(["a"], [pool.page(0).reshape(-1)]))
            self.assertEqual(b.batch_get(["a"]), [None])

    # ------------------------------------------------------------------
    # Data plane

    def test_host_pool_registered_and_moved_over_ucx(self):
        self.assertEqual(self.unregistered()._client.data_plane_status(), "")
        src = self.unregistered()
        registered = RecordRegistrations(src)
        src_pool = FakeMHAHostPool(POOL_TOKENS, PAGE, LAYERS, HEADS, DIM, torch.bfloat16)
        src.register_mem_pool_host(src_pool)
        self.assertEqual(len(registered.buffers), 1)
        self.assertIs(registered.buffers[0], src_pool.kv_buffer)
        dst, dst_pool = self.backend()
        keys = sglang_page_hashes(list(range(4 * PAGE)), PAGE)
        self.fill(src_pool, [0, 1, 2, 3], seed=8)
        page_bytes = self.page_view(src_pool, 0).numel() * 2
        self.assertEqual(src.batch_set_v1(keys, self.host_indices([0, 1, 2, 3])), [True] * 4)
        self.assertEqual(self.ucx_bytes("in"), 4 * page_bytes)
        self.assertEqual(dst.batch_get_v1(keys, self.host_indices([9, 8, 7, 6])), [True] * 4)
        self.assertEqual(self.ucx_bytes("out"), 4 * page_bytes)
        for s_, d in zip([0, 1, 2, 3], [9, 8, 7, 6]):
            self.assertTrue(self.same_page(src_pool, s_, dst_pool, d))

    def test_failed_registration_falls_back_to_grpc(self):
        b = self.unregistered()
        b._client = RefusingClient(b._client)
        pool = FakeMHAHostPool(POOL_TOKENS, PAGE, LAYERS, HEADS, DIM, torch.bfloat16)
        with self.assertLogs("kvdepot.integrations.sglang", "WARNING"):
            b.register_mem_pool_host(pool)
        self.assertIsNotNone(b.namespace)
        keys = sglang_page_hashes(list(range(2 * PAGE)), PAGE)
        self.fill(pool, [0, 1], seed=9)
        self.assertEqual(b.batch_set_v1(keys, self.host_indices([0, 1])), [True] * 2)
        self.assertEqual(b.batch_get_v1(keys, self.host_indices([4, 5])), [True] * 2)
        self.assertTrue(self.same_page(pool, 0, pool, 4) and self.same_page(pool, 1, pool, 5))
        self.assertEqual(self.ucx_bytes("in") + self.ucx_bytes("out"), 0)

    def test_a_bad_page_fails_alone(self):
        for ucx in (True, False):
            with self.subTest(ucx=ucx):
                b = self.unregistered()
                pool = FakeMHAHostPool(POOL_TOKENS, PAGE, LAYERS, HEADS, DIM, torch.bfloat16)
                if ucx:
                    b.register_mem_pool_host(pool)
                else:
                    b._client = RefusingClient(b._client)
                    with self.assertLogs("kvdepot.integrations.sglang", "WARNING"):
                        b.register_mem_pool_host(pool)
                keys = sglang_page_hashes(list(range(4 * PAGE)), PAGE)
                keys = [k + f"-{ucx}" for k in keys]
                self.fill(pool, [0, 1, 2, 3], seed=10)
                self.assertEqual(b.batch_set_v1(keys, self.host_indices([0, 1, 2, 3])),
                                 [True] * 4)
                # Page 2's V object replaced by one of another size (as a page
                # stored by an engine of another shape would be).
                bad = f"{keys[2]}.1".encode()
                b._client.evict(b.namespace, [bad])
                b._client.put(b.namespace, [bad], [bytes(100)])
                got = b.batch_get_v1(keys, self.host_indices([10, 11, 12, 13]))
                self.assertEqual(got, [True, True, False, True])
                for s_, d in ((0, 10), (1, 11), (3, 13)):
                    self.assertTrue(self.same_page(pool, s_, pool, d))
                self.assertEqual(b.counters["errors"], 1)

    # ------------------------------------------------------------------
    # Statistics and the generic path's errors

    def test_statistics_stay_bounded_without_get_stats(self):
        b, pool = self.backend()
        keys = sglang_page_hashes(list(range(PAGE)), PAGE)
        self.assertEqual(b.batch_set_v1(keys, self.host_indices([0])), [True])
        for _ in range(5000):
            b.batch_get_v1(keys, self.host_indices([1]))
        stats = b.get_stats()
        self.assertLessEqual(len(stats.prefetch_pgs), 1024)
        self.assertLessEqual(len(stats.prefetch_bandwidth), 1024)
        self.assertEqual(stats.backup_pgs, [1])
        # With SGLang's storage metrics off (it never calls get_stats),
        # nothing is kept.
        off, _ = self.backend(config={"enable_storage_metrics": False})
        self.assertEqual(off.batch_get_v1(keys, self.host_indices([2])), [True])
        self.assertEqual(off.batch_set_v1(keys, self.host_indices([2])), [True])
        self.assertEqual(off.get_stats().prefetch_pgs, [])
        self.assertEqual(off.get_stats().backup_pgs, [])

    def test_generic_get_errors_are_misses(self):
        u = self.unregistered()  # no host pool yet
        self.assertEqual(u.batch_get(["x"]), [None])
        self.assertIsNone(u.get("x"))
        b, pool = self.backend()
        self.fill(pool, [0, 1], seed=11)
        self.assertTrue(b.batch_set(["a", "b"], [pool.page(0).reshape(-1),
                                                 pool.page(PAGE).reshape(-1)]))
        # Fewer targets than keys.
        self.assertEqual(b.batch_get(["a", "b"], [None]), [None, None])
        self.assertEqual(b.batch_get(["a", "b"], [])[0], None)

    def test_draft_pages_are_refused_quietly(self):
        # Speculative decoding (EAGLE, MTP): for backends other than mooncake
        # SGLang's cache controller backs up and prefetches the draft pool's
        # pages through the generic batch_set / batch_get, under
        # "<hash>.draft" ("<hash>.draft-<drafter>" in versions naming it),
        # each page the draft pool's size, best-effort. They were refused as
        # a size mismatch: a warning and an error on every backup.
        b, pool = self.backend()
        self.fill(pool, [0], seed=17)
        target = pool.page(0).reshape(-1)
        draft = torch.ones(target.numel() // LAYERS, dtype=target.dtype)  # one layer
        h = sglang_page_hashes(list(range(PAGE)), PAGE)[0]
        with self.assertNoLogs("kvdepot.integrations.sglang", "WARNING"):
            self.assertFalse(b.batch_set([h + ".draft"], [draft]))
            self.assertFalse(b.set(h + ".draft-a30db4b7", draft))
            self.assertEqual(b.batch_get([h + ".draft"],
                                         [torch.zeros_like(draft)]), [None])
            self.assertIsNone(b.get(h + ".draft-a30db4b7"))
            # A call mixing target and draft pages still serves the target's.
            self.assertFalse(b.batch_set([h, h + ".draft"], [target, draft]))
            got = b.batch_get([h + ".draft", h], [torch.zeros_like(draft), None])
        self.assertIsNone(got[0])
        self.assertTrue(torch.equal(got[1].view(torch.int16), target.view(torch.int16)))
        self.assertEqual(b.counters["errors"], 0)
        self.assertEqual(b.counters["draft_skipped"], 6)
        self.assertEqual(b.batch_exists([h]), 1)


if __name__ == "__main__":
    unittest.main()
