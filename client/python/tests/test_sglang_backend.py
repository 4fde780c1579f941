"""Tests of kvdepot.integrations.sglang.KvDepotHiCacheStorage against a live
kvdepotd, created the way SGLang's StorageBackendFactory creates a "dynamic"
backend and called as its HiCacheController calls it, with a real torch host
pool laid out like SGLang's MHATokenToKVPoolHost. SGLang itself is not
installed here: the backend subclasses its local stand-in base.

Run with PYTHONPATH=<build>/python and KVDEPOT_DAEMON=<path of kvdepotd>.
Exits 77 (ctest: skipped) when torch, numpy or the kvdepot package is missing.
"""

import dataclasses
import os
import sys
import unittest
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

try:
    import numpy  # noqa: F401
    import torch
    import kvdepot
    from kvdepot.integrations import sglang as kv_sglang
    from engine_harness import (FakeMHAHostPool, FakeStorageConfig,
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


PAGE = 16
LAYERS = 3
HEADS = 2
DIM = 32
POOL_TOKENS = 40 * PAGE


class SglangBackendTest(unittest.TestCase):
    def setUp(self):
        self.daemon = Daemon()
        self.backends = []

    def tearDown(self):
        for b in self.backends:
            b.close()
        self.daemon.stop()

    def backend(self, layout="page_first", **extra):
        cfg = FakeStorageConfig(extra_config={
            "backend_name": "kvdepot", "module_path": "kvdepot.integrations.sglang",
            "class_name": "KvDepotHiCacheStorage", "interface_v1": 1,
            "server": self.daemon.address, "timeout_s": 2.0, **extra})
        b = create_dynamic_backend(cfg, kv_sglang.HiCacheStorage)
        pool = FakeMHAHostPool(POOL_TOKENS, PAGE, LAYERS, HEADS, DIM, torch.bfloat16,
                               layout=layout)
        b.register_mem_pool_host(pool)  # as HiCacheController does
        self.backends.append(b)
        return b, pool

    @staticmethod
    def host_indices(pages):
        return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])

    def fill(self, pool, pages, seed):
        g = torch.Generator().manual_seed(seed)
        for p in pages:
            if pool.layout == "layer_first":
                view = pool.kv_buffer[:, :, p * PAGE:(p + 1) * PAGE]
            else:
                view = pool.kv_buffer[:, p * PAGE:(p + 1) * PAGE]
            view.copy_(torch.randn(view.shape, generator=g).to(view.dtype))

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

    def test_first_parent_ignores_sglangs_default_prefix_keys(self):
        b, pool = self.backend()
        puts = []

        class RecordingClient:
            """Passes every call on to the real client, recording puts."""

            def __init__(self, inner):
                self._inner = inner

            def put(self, namespace, keys, values, parents=None, **kwargs):
                puts.append((list(keys), list(parents)))
                return self._inner.put(namespace, keys, values, parents, **kwargs)

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
        self.assertGreaterEqual(b.counters["errors"], 5)


if __name__ == "__main__":
    unittest.main()
