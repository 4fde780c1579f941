"""Tests of kvdepot.integrations.vllm.KvDepotConnector against a live kvdepotd,
driven by engine_harness.VllmEngine in vLLM's call order with real torch paged
caches. vLLM itself is not installed here: the connector subclasses its local
stand-in base (see the module's docstring).

Run with PYTHONPATH=<build>/python (the package, with integrations/) and
KVDEPOT_DAEMON=<path of kvdepotd>. Exits 77 (ctest: skipped) when torch,
numpy or the kvdepot package is missing.
"""

import os
import shlex
import shutil
import signal
import sys
import tempfile
import unittest
from types import SimpleNamespace
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

try:
    import numpy  # noqa: F401
    import torch
    import kvdepot
    from kvdepot.integrations import vllm as kv_vllm
    from engine_harness import (FakeClock, FakeCUDAGraphMode, FakeRequest, VllmEngine,
                                make_vllm_config)
    from live_daemon import Daemon
except ImportError as e:  # pragma: no cover
    print(f"skipping: {e}", file=sys.stderr)
    sys.exit(77)

BS = 16
LAYERS = 3
HEADS = 2
HEAD = 32


def prompt(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (n,), generator=g).tolist()


class CallLog:
    """A stand-in kvdepot client that passes every call on to the real one
    and records, in ``calls``, each daemon call's kind and keys (and, for
    puts, parents): lookups, puts and reads, a read per batch of
    ``load_into_cache_async``. ``fail`` (kind, n): the n-th call of that
    kind (from 1) raises RuntimeError instead, with status ``code``
    (INTERNAL: an error of the daemon that answered; UNAVAILABLE would also
    open the connector's circuit breaker). ``down``: while True, every call
    raises UNAVAILABLE (counted in ``attempts``, not recorded in ``calls``),
    as a daemon that is gone."""

    def __init__(self, inner, calls, fail=None, code="INTERNAL"):
        self._inner = inner
        self.calls = calls
        self._fail = fail
        self._code = code
        self._count = {}
        self.down = False
        self.attempts = 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _record(self, kind, keys, parents=None):
        self.attempts += 1
        if self.down:
            raise RuntimeError(f"UNAVAILABLE: injected: the daemon is gone ({kind})")
        self._count[kind] = self._count.get(kind, 0) + 1
        if self._fail == (kind, self._count[kind]):
            raise RuntimeError(f"{self._code}: injected failure of {kind} call "
                               f"{self._count[kind]}")
        self.calls.append((kind, list(keys), None if parents is None else list(parents)))

    def unpin(self, pin):
        if self.down:
            self.attempts += 1
            raise RuntimeError("UNAVAILABLE: injected: the daemon is gone (unpin)")
        return self._inner.unpin(pin)

    def lookup(self, ns, keys, *args, **kwargs):
        self._record("lookup", keys)
        return self._inner.lookup(ns, keys, *args, **kwargs)

    def put(self, ns, keys, buffers, parents=None):
        self._record("put", keys, parents)
        return self._inner.put(ns, keys, buffers, parents)

    def put_async(self, ns, keys, buffers, parents=None):
        self._record("put", keys, parents)
        return self._inner.put_async(ns, keys, buffers, parents)

    def get_into(self, ns, keys, *args, **kwargs):
        self._record("get", keys)
        return self._inner.get_into(ns, keys, *args, **kwargs)

    def get_into_async(self, ns, keys, *args, **kwargs):
        self._record("get", keys)
        return self._inner.get_into_async(ns, keys, *args, **kwargs)

    def load_into_cache_async(self, ns, keys, objects, layout, caches, block_ids,
                              batch_sizes=None):
        lo = 0
        for n in batch_sizes or [len(keys)]:
            self._record("get", keys[lo:lo + n])
            lo += n
        return self._inner.load_into_cache_async(ns, keys, objects, layout, caches,
                                                 block_ids, batch_sizes)

    def sizes(self, kind=None):
        return [len(k) for c, k, _ in self.calls if kind in (None, c)]


class VllmConnectorTest(unittest.TestCase):
    def setUp(self):
        self.daemon = Daemon()

    def tearDown(self):
        self.daemon.resume()  # a test that failed with it stopped
        for e in getattr(self, "engines", []):
            e.scheduler.shutdown()
            e.worker.shutdown()
        self.daemon.stop()

    def engine(self, dtype=torch.bfloat16, tp=None, cudagraph_mode=None,
               num_blocks=32, block_size=BS, executor=None, model_config=None,
               physical="NHD", **extra):
        """An engine; ``model_config``: attributes set on its model config
        (revision=..., ...); ``extra``: the connector's extra config."""
        kw = {} if cudagraph_mode is None else {"cudagraph_mode": cudagraph_mode}
        cfg = make_vllm_config(self.daemon.address, num_layers=LAYERS,
                               block_size=block_size, num_kv_heads=HEADS,
                               head_size=HEAD, dtype=dtype, extra=extra,
                               executor=executor, **kw)
        if tp is not None:  # (rank, size): one worker of a TP engine
            cfg.parallel_config.rank, cfg.parallel_config.tensor_parallel_size = tp
        for name, value in (model_config or {}).items():
            setattr(cfg.model_config, name, value)
        e = VllmEngine(kv_vllm.KvDepotConnector, cfg, num_blocks=num_blocks,
                       role_enum=kv_vllm.KVConnectorRole, physical=physical)
        self.engines = getattr(self, "engines", []) + [e]
        self.assertIsNone(e.worker.disabled_reason)
        return e

    def run_prefill(self, e, req):
        ext = e.admit(req)
        n = len(req.all_token_ids) - req.num_computed_tokens
        e.step([req], [], {req.request_id: n})
        return ext

    def assert_a_fresh_engine_loads(self, prompt_token_ids, num_blocks):
        """A fresh engine finds ``num_blocks`` blocks of ``prompt_token_ids``
        stored, loads them without errors, and they hold the KV the prompt
        computes."""
        z_eng = self.engine()
        z = FakeRequest("Z", list(prompt_token_ids))
        self.assertEqual(z_eng.admit(z), num_blocks * BS)
        z_eng.step([z], [], {"Z": 1})
        self.assertEqual(z_eng.load_errors, [])
        for i in range(num_blocks):
            for got, want in zip(z_eng.block_kv(z, i),
                                 z_eng.expected_block_kv(z.all_token_ids, i)):
                self.assertTrue(torch.equal(got, want), i)

    def engine_loading_a_stored_prompt(self, seed, **engine_args):
        """An engine that admitted request A, whose prompt (4 blocks and a
        token, from ``prompt(seed)``) another engine stored: A loads its 4
        blocks. Returns (the engine, A, the prompt)."""
        p = prompt(seed, 4 * BS + 1)
        self.run_prefill(self.engine(**engine_args), FakeRequest("A0", list(p)))
        e = self.engine(**engine_args)
        a = FakeRequest("A", list(p))
        self.assertEqual(e.admit(a), 4 * BS)
        return e, a, p

    def admit_on_as_blocks(self, e, b):
        """Admits ``b``, whose first 4 blocks are A's: vLLM's prefix cache
        hands it the blocks A loads (local hits), and nothing is loaded for
        it."""
        self.assertEqual(e.admit(b, num_local_computed=4 * BS,
                                 local_blocks=e.blocks["A"][:4]), 0)

    def test_metadata_and_interface(self):
        if not kv_vllm.HAVE_VLLM:  # the stand-in base is in use
            self.assertIs(kv_vllm.KVConnectorBase_V1, kv_vllm._StandInConnectorBase)
        for name in ("get_num_new_matched_tokens", "update_state_after_alloc",
                     "build_connector_meta", "request_finished", "register_kv_caches",
                     "start_load_kv", "wait_for_layer_load", "save_kv_layer",
                     "wait_for_save", "get_finished", "get_block_ids_with_load_errors",
                     "update_connector_output", "shutdown"):
            self.assertTrue(callable(getattr(kv_vllm.KvDepotConnector, name)), name)

    def shared_prefix_round_trip(self, staging):
        a_eng = self.engine(staging=staging)
        # Request A: 5 full blocks + 3 tokens; nothing stored yet.
        a = FakeRequest("A", prompt(1, 5 * BS + 3))
        self.assertEqual(self.run_prefill(a_eng, a), 0)
        self.assertEqual(a_eng.worker.stats["saved_blocks"], 5)
        # Decode until the 6th block is full (96 tokens): it is saved then.
        while len(a.all_token_ids) < 6 * BS + 1:
            a.output_token_ids.append(7)
            a_eng.step([], [a], {"A": 1})
        self.assertEqual(a_eng.worker.stats["saved_blocks"], 6)
        self.assertEqual(a_eng.finish(a), (False, None))
        a_blocks = [a_eng.block_kv(a, i) for i in range(6)]
        # The stand-in model's K/V are what was cached.
        for i in range(6):
            for got, want in zip(a_blocks[i], a_eng.expected_block_kv(a.all_token_ids, i)):
                self.assertTrue(torch.equal(got, want))

        # Request B on a second engine (empty caches): shares A's first 4
        # blocks, then differs.
        b_eng = self.engine(staging=staging)
        b = FakeRequest("B", a.prompt_token_ids[:4 * BS] + prompt(2, 40))
        ext = b_eng.admit(b)
        self.assertEqual(ext, 4 * BS)
        meta = b_eng.step([b], [], {"B": len(b.all_token_ids) - 4 * BS})
        self.assertEqual(len(meta.loads), 1)
        self.assertEqual(b_eng.load_errors, [])
        self.assertEqual(b_eng.worker.stats["loaded_blocks"], 4)
        for i in range(4):
            for got, want in zip(b_eng.block_kv(b, i), a_blocks[i]):
                # Loaded bytes are exactly A's.
                self.assertTrue(torch.equal(got.view(torch.int16), want.view(torch.int16)))
        # B's own blocks are computed, and its full new blocks saved (4..5).
        for i in range(4, 6):
            for got, want in zip(b_eng.block_kv(b, i),
                                 b_eng.expected_block_kv(b.all_token_ids, i)):
                self.assertTrue(torch.equal(got, want))
        self.assertEqual(meta.saves[0].block_ids, b_eng.blocks["B"][4:6])
        b_eng.finish(b)
        stats = kvdepot.Client(self.daemon.address).stats()
        self.assertEqual(stats["pins"], 0)  # every pin released

    def test_shared_prefix_loads_first_requests_bytes(self):
        self.shared_prefix_round_trip("auto")

    def test_torch_staging_path_same_bytes(self):
        # The path used for GPU caches, run here on CPU tensors.
        self.shared_prefix_round_trip("torch")

    def test_kvshim_staging_path_same_bytes(self):
        # The path of CUDA caches (kvdepot.kvshim), with the library's CPU
        # build on CPU tensors.
        self.shared_prefix_round_trip("kvshim")

    def test_torch_staging_matches_native_gather(self):
        e = self.engine(staging="torch")
        for name, t in e.kv_caches.items():
            t.copy_(torch.randn(t.shape).to(t.dtype))
        objs = e.worker._torch_gather([3, 1])
        layout = e.worker._layout
        native = [numpy.empty(layout.object_bytes, numpy.uint8) for _ in range(2)]
        kvdepot.gather(layout, [e.kv_caches[n] for n in e.layer_names], [3, 1], native)
        for o, n in zip(objs, native):
            self.assertEqual(o.contiguous().view(torch.uint8).numpy().tobytes(), n.tobytes())

    def test_local_prefix_hit_loads_only_the_rest(self):
        a_eng = self.engine()
        a = FakeRequest("A", prompt(3, 4 * BS + 5))
        self.run_prefill(a_eng, a)
        a_eng.finish(a)
        # Same engine, B's first block is a local prefix-cache hit (A's block).
        b = FakeRequest("B", list(a.prompt_token_ids))
        ext = a_eng.admit(b, num_local_computed=BS, local_blocks=a_eng.blocks["A"][:1])
        self.assertEqual(ext, 3 * BS)
        meta = a_eng.step([b], [], {"B": len(b.all_token_ids) - 4 * BS})
        self.assertEqual(len(meta.loads[0].block_ids), 3)
        self.assertEqual(meta.loads[0].block_ids, a_eng.blocks["B"][1:4])
        for i in range(4):
            for got, want in zip(a_eng.block_kv(b, i),
                                 a_eng.expected_block_kv(b.all_token_ids, i)):
                self.assertTrue(torch.equal(got, want))

    def test_last_token_is_never_matched(self):
        a_eng = self.engine()
        a = FakeRequest("A", prompt(4, 3 * BS))
        self.run_prefill(a_eng, a)  # saves 3 blocks
        b_eng = self.engine()
        b = FakeRequest("B", list(a.prompt_token_ids))
        # 48 tokens stored, but vLLM must compute at least one: 2 blocks.
        self.assertEqual(b_eng.admit(b), 2 * BS)

    def stored_then_engine(self, seed):
        """A request of 4 blocks (and a token) prefilled, and saved, by one
        engine; returns it and a second engine."""
        a = FakeRequest("A", prompt(seed, 4 * BS + 1))
        self.run_prefill(self.engine(), a)
        return a, self.engine()

    def test_a_resumed_request_is_offered_no_more_than_its_first_schedule_found(self):
        # vLLM recomputes a failed load's blocks only within the request's
        # num_cached_tokens, set at its first schedule and kept across a
        # preemption. A resumed request whose first schedule found nothing
        # was offered its whole stored prefix: a failed load (a TP rank
        # without the blocks, a daemon restart) left those blocks
        # unrecomputed, decoded from and saved again.
        a, b_eng = self.stored_then_engine(14)
        sched = b_eng.scheduler
        never = FakeRequest("N", list(a.prompt_token_ids))
        self.assertEqual(sched.get_num_new_matched_tokens(never, 0), (4 * BS, False))
        sched.update_state_after_alloc(never, None, 0)
        resumed = FakeRequest("R", list(a.prompt_token_ids))
        resumed.num_cached_tokens = 0  # its first schedule found nothing
        self.assertEqual(sched.get_num_new_matched_tokens(resumed, 0), (0, False))
        partly = FakeRequest("P", list(a.prompt_token_ids))
        partly.num_cached_tokens = 2 * BS + 3  # two whole blocks then
        self.assertEqual(sched.get_num_new_matched_tokens(partly, 0), (2 * BS, False))
        sched.update_state_after_alloc(partly, None, 0)
        self.assertEqual(sched.stats["resumed_caps"], 2)
        self.assertEqual(self.pins(), 0)

    def test_local_hits_kvdepot_holds_are_not_saved_again(self):
        # A request whose whole prefix is in vLLM's own prefix cache loads
        # nothing; its blocks were still gathered and sent again in every
        # such request's save (a shared system prompt's, each time). The
        # scheduler now asks kvdepot (unpinned) how many it holds.
        e = self.engine()
        toks = prompt(17, 8 * BS + 1)
        a = FakeRequest("A", list(toks))
        self.run_prefill(e, a)
        saved = e.worker.stats["saved_blocks"]
        self.assertEqual(saved, 8)
        for i in range(3):
            b = FakeRequest("B%d" % i, list(toks))
            self.assertEqual(e.admit(b, num_local_computed=8 * BS,
                                     local_blocks=e.blocks["A"][:8]), 0)
            meta = e.step([b], [], {b.request_id: 1})
            self.assertEqual([len(sv.block_ids) for sv in meta.saves if sv.block_ids], [])
            e.finish(b)
        self.assertEqual(e.worker.stats["saved_blocks"], saved)
        self.assertEqual(self.pins(), 0)
        # Blocks kvdepot does not hold (evicted) are saved again.
        e.scheduler._get_client().evict(e.scheduler._scheduler_namespace, [], all=True)
        c = FakeRequest("C", list(toks))
        e.admit(c, num_local_computed=8 * BS, local_blocks=e.blocks["A"][:8])
        e.step([c], [], {"C": 1})
        e.finish(c)
        self.assertEqual(e.worker.stats["saved_blocks"], saved + 8)

    def test_offers_pause_while_every_load_fails(self):
        # A worker that turned itself off (caches it does not take) fails
        # every load it is given, while the scheduler side, whose checks
        # passed, kept offering hits: each request wasted a forward pass.
        # After 3 steps whose every load failed, offers pause; they resume
        # after the pause, and a load that succeeds ends the back-off.
        a, b_eng = self.stored_then_engine(16)
        sched = b_eng.scheduler
        now = [1000.0]
        sched._clock = lambda: now[0]
        # As register_kv_caches leaves a worker whose caches it refuses.
        store, b_eng.worker._store = b_eng.worker._store, None
        b_eng.worker._disable("caches it does not take (a test)")
        for i in range(3):
            r = FakeRequest("F%d" % i, list(a.prompt_token_ids))
            self.assertEqual(b_eng.admit(r), 4 * BS)
            b_eng.step([r], [], {r.request_id: 1})
            self.assertEqual(len(b_eng.load_errors), 4 * (i + 1))
        self.assertEqual(sched.stats["offer_pauses"], 1)
        paused = FakeRequest("P", list(a.prompt_token_ids))
        self.assertEqual(sched.get_num_new_matched_tokens(paused, 0), (0, False))
        self.assertEqual(sched.stats["paused_offers"], 1)
        self.assertEqual(self.pins(), 0)
        # After the pause: offered again; a load that works ends the back-off.
        now[0] += 31
        b_eng.worker._store, b_eng.worker._disabled_reason = store, None
        ok = FakeRequest("OK", list(a.prompt_token_ids))
        self.assertEqual(b_eng.admit(ok), 4 * BS)
        b_eng.step([ok], [], {"OK": 1})
        self.assertEqual(len(b_eng.load_errors), 12)  # this one loaded
        self.assertEqual(sched._load_pause_s, sched._load_pause_min_s)

    def test_lora_adapters_of_one_name_at_other_paths_do_not_share_blocks(self):
        # The adapter's name is an engine's local alias: two engines (or one
        # that reloaded it) may serve other weights under it.
        toks = prompt(15, 2 * BS + 1)
        keys = []
        for path in ("/adapters/v1", "/adapters/v2", "/adapters/v1"):
            r = FakeRequest("L", list(toks))
            r.lora_request = SimpleNamespace(lora_name="support", lora_int_id=1,
                                             lora_path=path)
            keys.append(kv_vllm.KvDepotConnector._extra_keys(r))
        self.assertNotEqual(keys[0], keys[1])
        self.assertEqual(keys[0], keys[2])
        plain = FakeRequest("P", list(toks))
        self.assertEqual(kv_vllm.KvDepotConnector._extra_keys(plain), ())

    def test_daemon_gone_degrades_to_recompute(self):
        a_eng = self.engine()
        a = FakeRequest("A", prompt(5, 4 * BS + 1))
        self.run_prefill(a_eng, a)
        b_eng = self.engine()
        b = FakeRequest("B", a.prompt_token_ids[:4 * BS] + prompt(9, BS + 1))
        self.assertEqual(b_eng.admit(b), 4 * BS)  # looked up and pinned
        self.daemon.terminate()  # gone between the lookup and the load
        b_eng.step([b], [], {"B": 1})  # must not raise
        self.assertEqual(sorted(b_eng.load_errors), sorted(b_eng.blocks["B"][:4]))
        b_eng.recompute_failed(b, b_eng.load_errors)
        self.assertEqual(b.num_computed_tokens, 0)
        b_eng.step([], [b], {"B": len(b.all_token_ids)})  # recompute; saves fail quietly
        self.assertGreater(b_eng.worker.stats["save_errors"], 0)
        for i in range(5):
            for got, want in zip(b_eng.block_kv(b, i),
                                 b_eng.expected_block_kv(b.all_token_ids, i)):
                self.assertTrue(torch.equal(got, want))
        # A new request's lookup fails: 0 tokens, no exception.
        c = FakeRequest("C", list(a.prompt_token_ids))
        self.assertEqual(b_eng.scheduler.get_num_new_matched_tokens(c, 0), (0, False))
        self.assertEqual(b_eng.finish(b), (False, None))

    def test_missing_blocks_are_reported_not_zeroed(self):
        a_eng = self.engine()
        a = FakeRequest("A", prompt(6, 4 * BS + 1))
        self.run_prefill(a_eng, a)
        b_eng = self.engine()
        b = FakeRequest("B", list(a.prompt_token_ids))
        self.assertEqual(b_eng.admit(b), 4 * BS)
        # Block 2 is lost after the lookup (its pin gone, e.g. the session
        # lease ran out, and evicted): blocks 0-1 load, 2-3 are reported.
        st = b_eng.scheduler._requests["B"]
        b_eng.scheduler._unpin(st)
        with kvdepot.Client(self.daemon.address) as c:
            ev = c.evict(b_eng.scheduler._scheduler_namespace, [st.keys[2]])
            self.assertEqual(ev["evicted_blocks"], 1)
        b_eng.step([b], [], {"B": 1})
        self.assertEqual(sorted(b_eng.load_errors), sorted(b_eng.blocks["B"][2:4]))
        self.assertEqual(b_eng.worker.stats["loaded_blocks"], 2)
        for i in range(2):
            for got, want in zip(b_eng.block_kv(b, i), a_eng.block_kv(a, i)):
                self.assertTrue(torch.equal(got, want))
        # The missing block is left untouched (vLLM recomputes it and the
        # ones after it).
        for got in b_eng.block_kv(b, 2):
            self.assertEqual(int(got.view(torch.int16).abs().sum()), 0)

    def test_multimodal_and_consumer_roles(self):
        e = self.engine(save=False)
        r = FakeRequest("M", prompt(7, 3 * BS))
        self.run_prefill(e, r)
        self.assertEqual(e.worker.stats["saved_blocks"], 0)  # load-only role
        e2 = self.engine()
        mm = FakeRequest("MM", prompt(8, 3 * BS), mm_features=[object()])
        self.assertEqual(e2.scheduler.get_num_new_matched_tokens(mm, 0), (0, False))

    def test_prompt_embeds_are_neither_looked_up_nor_saved(self):
        # vLLM gives a prompt sent as embeddings prompt_token_ids=None and
        # all_token_ids=[0]*n: those zeros do not name the content.
        z_eng = self.engine()
        z = FakeRequest("Z", [0] * (4 * BS + 1))  # real token ids, all zero
        self.run_prefill(z_eng, z)
        self.assertEqual(z_eng.worker.stats["saved_blocks"], 4)
        a_eng = self.engine()
        a = FakeRequest("EA", None, prompt_embeds=torch.randn(4 * BS + 1, 8))
        self.assertEqual(a.all_token_ids, z.all_token_ids)
        self.assertEqual(self.run_prefill(a_eng, a), 0)
        self.assertEqual(a_eng.worker.stats["saved_blocks"], 0)
        self.assertEqual(a_eng.scheduler.stats["lookups"], 0)
        b_eng = self.engine()
        b = FakeRequest("EB", None, prompt_embeds=torch.randn(4 * BS + 1, 8))
        self.assertEqual(b_eng.scheduler.get_num_new_matched_tokens(b, 0), (0, False))
        b_eng.scheduler.request_finished(b, [])

    def test_failed_load_saves_nothing_then_recompute_saves(self):
        p = prompt(16, 6 * BS + 1)
        c_eng = self.engine()
        c = FakeRequest("C", p)
        self.run_prefill(c_eng, c)  # stores blocks 0-5 of p
        x_eng = self.engine()
        x = FakeRequest("X", p[:4 * BS] + prompt(17, 2 * BS + 1))
        self.assertEqual(x_eng.admit(x), 4 * BS)
        # Block 2 is lost after the lookup: blocks 2-3 fail to load, in the
        # step that also computes X's blocks 4-5 (over their stale KV).
        st = x_eng.scheduler._requests["X"]
        x_eng.scheduler._unpin(st)
        keys = list(st.keys[:4])
        with kvdepot.Client(self.daemon.address) as cl:
            self.assertEqual(cl.evict(x_eng.scheduler._scheduler_namespace,
                                      [keys[2]])["evicted_blocks"], 1)
        meta = x_eng.step([x], [], {"X": len(x.all_token_ids) - 4 * BS})
        self.assertEqual(sorted(x_eng.load_errors), sorted(x_eng.blocks["X"][2:4]))
        self.assertEqual([s.block_ids for s in meta.saves], [x_eng.blocks["X"][4:6]])
        x_keys = kvdepot.integrations.block_hashes(x.all_token_ids, BS)[:6]
        store = x_eng.worker._store
        # Nothing of that step was saved: blocks 4-5 are not stored.
        self.assertEqual(x_eng.worker.stats["saved_blocks"], 0)
        self.assertEqual(x_eng.worker.stats["saves_dropped"], 2)
        self.assertEqual(store.lookup(x_keys[4:], prefix=False), 0)
        # vLLM recomputes from block 2; the recomputed blocks 2-5 are saved.
        x_eng.recompute_failed(x, x_eng.load_errors)
        self.assertEqual(x.num_computed_tokens, 2 * BS)
        meta2 = x_eng.step([], [x], {"X": len(x.all_token_ids) - 2 * BS})
        self.assertEqual([s.block_ids for s in meta2.saves], [x_eng.blocks["X"][2:6]])
        self.assertEqual(meta2.saves[0].parents[0], x_keys[1])
        self.assertEqual(x_eng.worker.stats["saved_blocks"], 4)
        self.assertEqual(store.lookup(x_keys, prefix=False), 6)
        x_eng.finish(x)
        # A fresh engine loads X's whole prompt, as X computed it.
        self.assert_a_fresh_engine_loads(x.prompt_token_ids, 6)

    def test_tp_rank_missing_blocks_saves_them_once_recomputed(self):
        # With tensor parallelism the scheduler looks at rank 0's namespace;
        # a block rank 1 lacks fails there, is recomputed and then saved, so
        # the next request loads it on rank 1 too.
        p = prompt(18, 4 * BS + 1)
        r0 = self.engine(tp=(0, 2))
        a = FakeRequest("A", p)
        self.run_prefill(r0, a)
        self.assertEqual(r0.worker.stats["saved_blocks"], 4)
        r1 = self.engine(tp=(1, 2))
        b = FakeRequest("B", list(p))
        self.assertEqual(r1.admit(b), 4 * BS)
        r1.step([b], [], {"B": 1})
        self.assertEqual(sorted(r1.load_errors), sorted(r1.blocks["B"][:4]))
        r1.recompute_failed(b, r1.load_errors)
        meta = r1.step([], [b], {"B": len(p) - b.num_computed_tokens})
        self.assertEqual([s.block_ids for s in meta.saves], [r1.blocks["B"][:4]])
        r1.finish(b)
        r1b = self.engine(tp=(1, 2))
        c = FakeRequest("C", list(p))
        self.assertEqual(r1b.admit(c), 4 * BS)
        r1b.step([c], [], {"C": 1})
        self.assertEqual(r1b.load_errors, [])
        self.assertEqual(r1b.worker.stats["loaded_blocks"], 4)

    def test_async_scheduling_keeps_the_next_steps_pins(self):
        # With async scheduling vLLM plans step N+1 before step N's output
        # comes back: N's output must not release the pins of N+1's loads.
        a_eng = self.engine()
        x = FakeRequest("X", prompt(20, 3 * BS + 1))
        y = FakeRequest("Y", prompt(21, 3 * BS + 1))
        self.run_prefill(a_eng, x)
        self.run_prefill(a_eng, y)
        b_eng = self.engine()
        x2 = FakeRequest("X2", list(x.prompt_token_ids))
        y2 = FakeRequest("Y2", list(y.prompt_token_ids))
        self.assertEqual(b_eng.admit(x2), 3 * BS)
        step_n = b_eng.schedule([x2], [], {"X2": 1})
        self.assertEqual(b_eng.admit(y2), 3 * BS)
        step_n1 = b_eng.schedule([y2], [], {"Y2": 1})
        b_eng.execute(step_n)
        # Y2's blocks are still pinned: eviction cannot take them.
        y_keys = b_eng.scheduler._requests["Y2"].keys[:3]
        with kvdepot.Client(self.daemon.address) as cl:
            ev = cl.evict(b_eng.scheduler._scheduler_namespace, y_keys)
            self.assertEqual(ev["evicted_blocks"], 0)
            self.assertEqual(cl.stats()["pins"], 1)
            b_eng.execute(step_n1)
            self.assertEqual(b_eng.load_errors, [])
            self.assertEqual(b_eng.worker.stats["loaded_blocks"], 6)
            self.assertEqual(cl.stats()["pins"], 0)

    def test_tp_saves_wait_for_the_load_outcome(self):
        # Rank 0's load succeeding says nothing of rank 1's: if that one
        # failed, the all-reduce spreads its attention's garbage into every
        # rank's later layers. So what a loading step computes is saved once
        # the step's output (invalid_block_ids) is in.
        p = prompt(22, 6 * BS + 1)
        a_eng = self.engine(tp=(0, 2))
        a = FakeRequest("A", p[:4 * BS + 1])
        self.run_prefill(a_eng, a)
        r0 = self.engine(tp=(0, 2))
        x = FakeRequest("X", list(p))
        self.assertEqual(r0.admit(x), 4 * BS)
        meta = r0.step([x], [], {"X": len(p) - 4 * BS})
        self.assertEqual(r0.load_errors, [])
        self.assertEqual(meta.saves, [])
        self.assertEqual(r0.worker.stats["saved_blocks"], 0)
        x.output_token_ids.append(5)
        meta = r0.step([], [x], {"X": 1})
        self.assertEqual([s.block_ids for s in meta.saves], [r0.blocks["X"][4:6]])
        keys = kvdepot.integrations.block_hashes(p, BS)[:6]
        self.assertEqual(r0.worker._store.lookup(keys, prefix=True), 6)

    def test_tp_request_ending_in_its_load_step_saves_later(self):
        # With tensor parallelism the blocks a request computes in its load
        # step wait for the load's outcome; a request that ends in that step
        # (max_tokens=1, say) keeps its blocks (request_finished answers
        # True) until the next step saves them, in get_finished, which then
        # reports it finished sending.
        p = prompt(24, 6 * BS + 1)
        a_eng = self.engine(tp=(0, 2))
        a = FakeRequest("A", p[:4 * BS + 1])
        self.run_prefill(a_eng, a)
        # Nothing waits for A: its blocks are freed at once.
        self.assertEqual(a_eng.finish(a), (False, None))
        self.assertNotIn("A", a_eng.scheduler._requests)
        r0 = self.engine(tp=(0, 2))
        x = FakeRequest("X", list(p))
        self.assertEqual(r0.admit(x), 4 * BS)
        x.output_token_ids.append(5)  # its one token, sampled in this step
        meta = r0.step([x], [], {"X": len(p) - 4 * BS}, finishing=[x])
        self.assertEqual(r0.load_errors, [])
        self.assertEqual(meta.saves, [])
        self.assertEqual(r0.sending, {"X"})  # blocks held for the saves
        self.assertEqual(r0.worker.stats["saved_blocks"], 0)
        # The next step has no tokens (vLLM's kv_connector_no_forward: no
        # wait_for_save); get_finished saves blocks 4-5 and reports X.
        meta = r0.step([], [], {})
        self.assertEqual(meta.finishing, ["X"])
        self.assertEqual([s.block_ids for s in meta.finishing_saves],
                         [r0.blocks["X"][4:6]])
        self.assertEqual(r0.sent, {"X"})
        self.assertEqual(r0.sending, set())
        self.assertNotIn("X", r0.scheduler._requests)
        keys = kvdepot.integrations.block_hashes(p, BS)[:6]
        self.assertEqual(r0.worker._store.lookup(keys, prefix=True), 6)
        with kvdepot.Client(self.daemon.address) as cl:
            self.assertEqual(cl.stats()["pins"], 0)
        # Reported once: the step after reports nothing.
        meta = r0.step([], [], {})
        self.assertEqual(meta.finishing, [])
        # Another rank-0 engine loads X's whole prompt, as X computed it.
        z_eng = self.engine(tp=(0, 2))
        z = FakeRequest("Z", list(p))
        self.assertEqual(z_eng.admit(z), 6 * BS)
        z_eng.step([z], [], {"Z": 1})
        self.assertEqual(z_eng.load_errors, [])
        for i in (4, 5):
            for got, want in zip(z_eng.block_kv(z, i), z_eng.expected_block_kv(p, i)):
                self.assertTrue(torch.equal(got, want))

    def test_tp_request_ending_with_a_failed_load_saves_nothing_past_it(self):
        # The same, but the load failed at block 2 and the request ended
        # anyway (an abort): its blocks are freed a step later with nothing
        # saved from the failed block on (that KV attended to stale blocks).
        p = prompt(25, 6 * BS + 1)
        a_eng = self.engine(tp=(0, 2))
        self.run_prefill(a_eng, FakeRequest("A", p[:4 * BS + 1]))
        r0 = self.engine(tp=(0, 2))
        x = FakeRequest("X", list(p))
        self.assertEqual(r0.admit(x), 4 * BS)
        keys = kvdepot.integrations.block_hashes(p, BS)[:6]
        with kvdepot.Client(self.daemon.address) as cl:
            r0.scheduler._unpin(r0.scheduler._requests["X"])
            self.assertEqual(cl.evict(r0.scheduler._scheduler_namespace,
                                      [keys[2]])["evicted_blocks"], 1)
        x.output_token_ids.append(5)
        r0.step([x], [], {"X": len(p) - 4 * BS}, finishing=[x])
        self.assertEqual(sorted(r0.load_errors), sorted(r0.blocks["X"][2:4]))
        self.assertEqual(r0.sending, {"X"})
        meta = r0.step([], [], {})
        self.assertEqual(meta.finishing, ["X"])
        self.assertEqual(meta.finishing_saves, [])
        self.assertEqual(r0.sent, {"X"})
        self.assertEqual(r0.worker.stats["saved_blocks"], 0)
        self.assertEqual(r0.worker._store.lookup(keys[4:], prefix=False), 0)

    def test_async_request_ending_before_its_held_saves_saves_them(self):
        # Async scheduling: block 4 fills in step N+1, planned before the
        # outcome of N's load, so its save waits; X ends with N+1. Its
        # blocks are held and block 4 is saved in the next step.
        a_eng = self.engine()
        p = prompt(26, 5 * BS - 1)
        self.run_prefill(a_eng, FakeRequest("A", p[:4 * BS + 1]))
        b_eng = self.engine()
        x = FakeRequest("X", list(p))
        self.assertEqual(b_eng.admit(x), 4 * BS)
        step_n = b_eng.schedule([x], [], {"X": BS - 1})
        x.num_computed_tokens += BS - 1
        x.output_token_ids.append(5)
        step_n1 = b_eng.schedule([], [x], {"X": 1})
        self.assertEqual(step_n1.meta.saves, [])
        x.num_computed_tokens -= BS - 1
        b_eng.execute(step_n)
        x.output_token_ids.append(6)  # sampled in N+1, the last one
        b_eng.execute(step_n1, finishing=[x])
        self.assertEqual(b_eng.sending, {"X"})
        meta = b_eng.step([], [], {})
        self.assertEqual([s.block_ids for s in meta.finishing_saves],
                         [b_eng.blocks["X"][4:5]])
        self.assertEqual(b_eng.sent, {"X"})
        keys = kvdepot.integrations.block_hashes(x.all_token_ids, BS)[:5]
        self.assertEqual(b_eng.worker._store.lookup(keys, prefix=True), 5)

    def test_async_step_before_the_load_outcome_saves_nothing(self):
        # Async scheduling: step N+1 is planned before step N's output. A
        # block X fills in N+1, after a load in N, is saved once N's outcome
        # is known (a failed load is recomputed, and N+1 used its KV).
        a_eng = self.engine()
        p = prompt(23, 5 * BS - 1)
        self.run_prefill(a_eng, FakeRequest("A", p[:4 * BS + 1]))
        b_eng = self.engine()
        x = FakeRequest("X", list(p))
        self.assertEqual(b_eng.admit(x), 4 * BS)
        step_n = b_eng.schedule([x], [], {"X": BS - 1})
        self.assertEqual(len(step_n.meta.loads), 1)
        # vLLM advances the request when it schedules it.
        x.num_computed_tokens += BS - 1
        x.output_token_ids.append(5)
        step_n1 = b_eng.schedule([], [x], {"X": 1})  # block 4 fills here
        self.assertEqual(step_n1.meta.saves, [])
        x.num_computed_tokens -= BS - 1  # (the harness advances it in execute)
        b_eng.execute(step_n)
        b_eng.execute(step_n1)
        self.assertEqual(b_eng.load_errors, [])
        x.output_token_ids.append(6)
        meta = b_eng.step([], [x], {"X": 1})
        self.assertEqual([s.block_ids for s in meta.saves], [b_eng.blocks["X"][4:5]])
        for got, want in zip(b_eng.block_kv(x, 4), b_eng.expected_block_kv(x.all_token_ids, 4)):
            self.assertTrue(torch.equal(got, want))

    def test_a_failed_load_spoils_no_save_of_a_request_sharing_its_blocks(self):
        # vLLM caches the blocks a request loads in its prefix cache once they
        # are allocated: B, scheduled in A's load step, gets A's blocks 0-3 as
        # local hits, and the connector plans no load for it. A's load fails
        # at block 2: B's blocks 2-5, computed over the stale blocks 2-3, are
        # not saved (put-if-absent would keep them), and once vLLM
        # recomputed, they are.
        e, a, p = self.engine_loading_a_stored_prompt(27)
        st = e.scheduler._requests["A"]
        e.scheduler._unpin(st)
        with kvdepot.Client(self.daemon.address) as cl:
            self.assertEqual(cl.evict(e.scheduler._scheduler_namespace,
                                      [st.keys[2]])["evicted_blocks"], 1)
        b = FakeRequest("B", p[:4 * BS] + prompt(28, 2 * BS + 1))
        self.admit_on_as_blocks(e, b)
        meta = e.step([a, b], [], {"A": 1, "B": 2 * BS + 1})
        self.assertEqual(sorted(e.load_errors), sorted(e.blocks["A"][2:4]))
        b_keys = kvdepot.integrations.block_hashes(b.all_token_ids, BS)[:6]
        store = e.worker._store
        self.assertEqual(store.lookup(b_keys[4:], prefix=False), 0)
        self.assertEqual(store.lookup(b_keys[:4], prefix=True), 2)  # block 2 still lost
        self.assertEqual(e.worker.stats["saved_blocks"], 0)
        self.assertEqual(e.worker.stats["saves_dropped"], 4)
        # One rank: B's save was planned, naming the loads it attended to,
        # and the worker dropped what the failed blocks spoiled: all of it.
        self.assertEqual([(s.req_id, s.block_ids, s.after) for s in meta.saves],
                         [("B", e.blocks["B"][2:6], e.blocks["A"][:2])])
        # vLLM recomputes: A (the first request holding the failed blocks)
        # from block 2; B keeps its cached tokens (A recomputes the shared
        # blocks in the same forward pass) and recomputes its own.
        a.num_computed_tokens = 2 * BS
        b.num_computed_tokens = 4 * BS
        meta = e.step([], [a, b], {"A": len(p) - 2 * BS, "B": 2 * BS + 1})
        self.assertEqual(sorted((s.req_id, s.block_ids) for s in meta.saves),
                         [("A", e.blocks["A"][2:4]), ("B", e.blocks["B"][2:6])])
        self.assertEqual(store.lookup(b_keys, prefix=True), 6)
        e.finish(a)
        e.finish(b)
        # A fresh engine loads B's whole prompt, as B computed it.
        self.assert_a_fresh_engine_loads(b.prompt_token_ids, 6)

    def test_blocks_after_a_failed_shared_block_wait_for_its_recompute(self):
        # As above, but vLLM's token budget cuts A's recompute short: the
        # next step recomputes only block 2, while B (reset to its cached
        # tokens) goes on over block 3, which still holds the KV computed
        # over the failed block. Neither B nor C, which gets blocks 0-3 from
        # vLLM's prefix cache after that step, may save block 3 or any
        # block computed over it (their own 4-5): those keys name the right
        # prefix and would serve the wrong KV.
        e, a, p = self.engine_loading_a_stored_prompt(44)
        st = e.scheduler._requests["A"]
        e.scheduler._unpin(st)
        with kvdepot.Client(self.daemon.address) as cl:
            self.assertEqual(cl.evict(e.scheduler._scheduler_namespace,
                                      [st.keys[2]])["evicted_blocks"], 1)
        b = FakeRequest("B", p[:4 * BS] + prompt(45, 2 * BS + 1))
        self.admit_on_as_blocks(e, b)
        e.step([a, b], [], {"A": 1, "B": 2 * BS + 1})
        self.assertEqual(sorted(e.load_errors), sorted(e.blocks["A"][2:4]))
        a.num_computed_tokens = 2 * BS
        b.num_computed_tokens = 4 * BS
        meta = e.step([], [a, b], {"A": BS, "B": 2 * BS + 1})
        self.assertEqual(sorted((s.req_id, s.block_ids) for s in meta.saves),
                         [("A", e.blocks["A"][2:3]), ("B", e.blocks["B"][2:3])])
        c = FakeRequest("C", p[:4 * BS] + prompt(46, 2 * BS + 1))
        self.admit_on_as_blocks(e, c)
        meta = e.step([c], [], {"C": 2 * BS + 1})
        self.assertEqual(meta.saves, [])
        # A recomputes block 3; B and C decode over their spoiled 4-5.
        b.output_token_ids.append(5)
        c.output_token_ids.append(5)
        meta = e.step([], [a, b, c], {"A": len(p) - 3 * BS, "B": 1, "C": 1})
        # (C's lookup found blocks 0-3 stored: block 3 from the first
        # engine, never evicted.)
        self.assertEqual(sorted((s.req_id, s.block_ids) for s in meta.saves),
                         [("A", e.blocks["A"][3:4]), ("B", e.blocks["B"][3:4])])
        store = e.worker._store
        for r in (b, c):
            keys = kvdepot.integrations.block_hashes(r.all_token_ids, BS)[:6]
            self.assertEqual(store.lookup(keys, prefix=True), 4)
            self.assertEqual(store.lookup(keys[4:], prefix=False), 0)
        self.assertEqual(e.finish(b), (False, None))
        self.assertEqual(e.finish(c), (False, None))
        self.assertEqual(e.scheduler.stats["lookup_errors"], 0)

    def test_async_step_saves_nothing_over_another_requests_load(self):
        # Async scheduling: B shares the blocks A loads in step N (vLLM's
        # prefix cache) and fills a block of its own in N+1, planned before
        # N's outcome is in: that save waits for it, as A's own would.
        e, a, p = self.engine_loading_a_stored_prompt(29)
        step_n = e.schedule([a], [], {"A": 1})
        self.assertEqual(len(step_n.meta.loads), 1)
        b = FakeRequest("B", p[:4 * BS] + prompt(30, BS + 1))
        self.admit_on_as_blocks(e, b)
        step_n1 = e.schedule([b], [], {"B": BS + 1})  # B's block 4 fills here
        self.assertEqual(step_n1.meta.saves, [])
        e.execute(step_n)
        e.execute(step_n1)
        self.assertEqual(e.load_errors, [])
        b.output_token_ids.append(5)
        meta = e.step([], [b], {"B": 1})
        self.assertEqual([(s.req_id, s.block_ids) for s in meta.saves],
                         [("B", e.blocks["B"][4:5])])
        keys = kvdepot.integrations.block_hashes(b.all_token_ids, BS)[:5]
        self.assertEqual(e.worker._store.lookup(keys, prefix=True), 5)

    def test_tp_saves_of_a_request_sharing_a_load_wait_for_its_outcome(self):
        # With tensor parallelism another rank's load may fail where this
        # one's did not (and the worker here cannot see it): B, computing
        # over the blocks A loads, saves nothing in A's load step, and its
        # block once the outcome is in.
        e, a, p = self.engine_loading_a_stored_prompt(36, tp=(0, 2))
        b = FakeRequest("B", p[:4 * BS] + prompt(37, BS + 1))
        self.admit_on_as_blocks(e, b)
        meta = e.step([a, b], [], {"A": 1, "B": BS + 1})
        self.assertEqual(e.load_errors, [])
        self.assertEqual(meta.saves, [])
        b.output_token_ids.append(5)
        meta = e.step([], [b], {"B": 1})
        self.assertEqual([(s.req_id, s.block_ids) for s in meta.saves],
                         [("B", e.blocks["B"][4:5])])

    def test_async_no_token_steps_output_is_not_a_later_load_steps(self):
        # Async scheduling, as vLLM's step_with_batch_queue runs it: plan S1
        # (tokens), plan S2 (none), output of S1, plan S3 (Y2's load),
        # output of S2. An executor that aggregates the workers' outputs
        # ("mp", "ray") passes S2's output to update_connector_output though
        # it reports nothing: it is S2's, and Y2's pins stay until S3's.
        # ("uni" sends none for S2.)
        y = FakeRequest("Y", prompt(21, 3 * BS + 1))
        self.run_prefill(self.engine(), y)
        for i, executor in enumerate(("mp", "uni", None)):
            with self.subTest(executor=executor):
                e = self.engine(executor=executor)
                x = FakeRequest("X", prompt(40 + i, 2 * BS + 1))  # not stored
                self.assertEqual(e.admit(x), 0)
                s1 = e.schedule([x], [], {"X": len(x.all_token_ids)})
                s2 = e.schedule([], [], {})
                e.execute(s1)
                y2 = FakeRequest("Y2", list(y.prompt_token_ids))
                self.assertEqual(e.admit(y2), 3 * BS)
                s3 = e.schedule([y2], [], {"Y2": 1})
                e.execute(s2)
                self.assertTrue(e.scheduler._requests["Y2"].load_in_flight)
                self.assertEqual(self.pins(), 1)
                with kvdepot.Client(self.daemon.address) as cl:
                    keys = e.scheduler._requests["Y2"].keys[:3]
                    self.assertEqual(cl.evict(e.scheduler._scheduler_namespace,
                                              keys)["evicted_blocks"], 0)
                e.execute(s3)
                self.assertEqual(e.load_errors, [])
                self.assertEqual(e.worker.stats["loaded_blocks"], 3)
                self.assertFalse(e.scheduler._requests["Y2"].load_in_flight)
                self.assertEqual(self.pins(), 0)
                e.finish(x)
                e.finish(y2)
        # Which executors send every step's output (vLLM's choice for each).
        reported = kv_vllm._every_output_reported
        for backend, tp, want in (("mp", 1, True), ("ray", 1, True), ("uni", 1, False),
                                  ("external_launcher", 2, False), (None, 1, False),
                                  (None, 2, True)):
            cfg = SimpleNamespace(parallel_config=SimpleNamespace(
                distributed_executor_backend=backend))
            self.assertEqual(reported(cfg, tp), want, (backend, tp))
        # An executor class: by what it derives from.
        UniProcExecutor = type("UniProcExecutor", (), {})
        for cls, want in ((type("Mine", (UniProcExecutor,), {}), False),
                          (type("MultiprocExecutor", (), {}), True)):
            cfg = SimpleNamespace(parallel_config=SimpleNamespace(
                distributed_executor_backend=cls))
            self.assertEqual(reported(cfg, 1), want, cls)

    def test_async_no_token_step_reporting_a_finished_request(self):
        # The same with one rank's own executor ("uni"), where a step without
        # tokens reaches update_connector_output because it reports a
        # request finished sending (X, whose last block waited for its
        # load's outcome): that output is not Y2's load step's.
        p = prompt(31, 5 * BS - 1)
        a_eng = self.engine()
        self.run_prefill(a_eng, FakeRequest("A", p[:4 * BS + 1]))
        y = FakeRequest("Y", prompt(32, 3 * BS + 1))
        self.run_prefill(a_eng, y)
        b = self.engine(executor="uni")
        x = FakeRequest("X", list(p))
        self.assertEqual(b.admit(x), 4 * BS)
        step_n = b.schedule([x], [], {"X": BS - 1})
        x.num_computed_tokens += BS - 1
        x.output_token_ids.append(5)
        step_n1 = b.schedule([], [x], {"X": 1})
        x.num_computed_tokens -= BS - 1
        b.execute(step_n)
        x.output_token_ids.append(6)
        b.execute(step_n1, finishing=[x])
        self.assertEqual(b.sending, {"X"})
        s2 = b.schedule([], [], {})
        self.assertEqual(s2.meta.finishing, ["X"])
        y2 = FakeRequest("Y2", list(y.prompt_token_ids))
        self.assertEqual(b.admit(y2), 3 * BS)
        s3 = b.schedule([y2], [], {"Y2": 1})
        b.execute(s2)
        self.assertEqual(b.sent, {"X"})
        self.assertTrue(b.scheduler._requests["Y2"].load_in_flight)
        self.assertEqual(self.pins(), 1)
        b.execute(s3)
        self.assertEqual(b.load_errors, [])
        self.assertEqual(self.pins(), 0)
        keys = kvdepot.integrations.block_hashes(x.all_token_ids, BS)[:5]
        self.assertEqual(b.worker._store.lookup(keys, prefix=True), 5)

    def test_requests_that_read_no_prefix_cache_are_not_looked_up(self):
        # Prompt logprobs need every prompt position computed: vLLM marks
        # such requests skip_reading_prefix_cache (older vLLM: by
        # sampling_params.prompt_logprobs). They load nothing; they save.
        p = prompt(33, 4 * BS + 1)
        self.run_prefill(self.engine(), FakeRequest("A", list(p)))
        e = self.engine()
        skip = FakeRequest("S", list(p))
        skip.skip_reading_prefix_cache = True
        older = FakeRequest("L", list(p), sampling_params=SimpleNamespace(prompt_logprobs=0))
        self.assertEqual(e.scheduler.get_num_new_matched_tokens(skip, 0), (0, False))
        self.assertEqual(e.scheduler.get_num_new_matched_tokens(older, 0), (0, False))
        self.assertEqual(e.scheduler.stats["lookups"], 0)
        # The attribute, where vLLM has it, decides; no prompt logprobs reads.
        reads = FakeRequest("R", list(p), sampling_params=SimpleNamespace(prompt_logprobs=0))
        reads.skip_reading_prefix_cache = False
        plain = FakeRequest("P", list(p), sampling_params=SimpleNamespace(prompt_logprobs=None))
        self.assertEqual(e.scheduler.get_num_new_matched_tokens(reads, 0), (4 * BS, False))
        self.assertEqual(e.scheduler.get_num_new_matched_tokens(plain, 0), (4 * BS, False))
        e.scheduler.request_finished(reads, [])
        e.scheduler.request_finished(plain, [])
        self.assertEqual(self.pins(), 0)
        # Its blocks are saved as any request's.
        f = self.engine()
        q = FakeRequest("Q", prompt(34, 3 * BS + 1))
        q.skip_reading_prefix_cache = True
        self.assertEqual(self.run_prefill(f, q), 0)
        self.assertEqual(f.worker.stats["saved_blocks"], 3)

    def test_namespace_names_revision_quantization_rope_and_overrides(self):
        # Deployments of one model path with another revision, quantization,
        # RoPE scaling or hf_overrides compute other KV: other namespaces.
        def label(**model_config):
            cfg = make_vllm_config(self.daemon.address, num_layers=LAYERS, block_size=BS,
                                   num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
            for name, value in model_config.pop("extra", {}).items():
                cfg.kv_transfer_config.kv_connector_extra_config[name] = value
            for name, value in model_config.items():
                setattr(cfg.model_config, name, value)
            c = kv_vllm.KvDepotConnector(cfg, kv_vllm.KVConnectorRole.SCHEDULER)
            self.assertIsNone(c.disabled_reason)
            c.shutdown()
            return c._model_label(0), c._scheduler_namespace

        plain = label()
        self.assertEqual(plain[0], "vllm/test/tiny-llama/tp0of1")  # as before
        yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
        variants = {
            "revision": label(revision="v2"),
            "other revision": label(revision="refs/pr/7"),
            "quantization": label(quantization="fp8"),
            "rope scaling": label(hf_config=SimpleNamespace(rope_scaling=yarn)),
            "other rope scaling": label(hf_config=SimpleNamespace(
                rope_scaling=dict(yarn, factor=2.0))),
            "older vLLM rope_theta": label(rope_theta=500000.0),
            "hf_overrides": label(hf_overrides={"rope_scaling": yarn}),
            "all": label(revision="v2", quantization="awq", hf_overrides={"a": 1}),
        }
        namespaces = [plain[1]] + [ns for _, ns in variants.values()]
        self.assertEqual(len(set(namespaces)), len(namespaces), variants)
        self.assertEqual(variants["revision"][0], "vllm/test/tiny-llama/rev:v2/tp0of1")
        self.assertIn("quant:fp8", variants["quantization"][0])
        self.assertIn("rope:", variants["rope scaling"][0])
        self.assertIn("hf:", variants["hf_overrides"][0])
        # The same settings give the same namespace (key order aside).
        self.assertEqual(label(hf_config=SimpleNamespace(rope_scaling=dict(
            reversed(list(yarn.items()))))), variants["rope scaling"])
        self.assertEqual(label(revision="v2"), variants["revision"])
        # A model named in the extra config is the name as given.
        self.assertEqual(label(revision="v2", extra={"model": "mine"})[0],
                         "vllm/mine/tp0of1")
        # End to end: what one revision saved, another does not load.
        p = prompt(35, 4 * BS + 1)
        self.run_prefill(self.engine(model_config={"revision": "v2"}), FakeRequest("A", p))
        self.assertEqual(self.engine().admit(FakeRequest("B", list(p))), 0)
        self.assertEqual(self.engine(model_config={"revision": "v2"}).admit(
            FakeRequest("C", list(p))), 4 * BS)

    def test_full_cudagraph_replay_finds_loads_before_attention(self):
        # vLLM 0.11 replays FULL CUDA graphs (FULL_AND_PIECEWISE, its
        # default, for uniform decode batches) without the per-layer hooks:
        # the load must then be in the caches when start_load_kv returns.
        self.assertTrue(kv_vllm.KvDepotConnector.requires_piecewise_for_cudagraph({}))
        a_eng = self.engine()
        a = FakeRequest("A", prompt(19, 4 * BS + 1))
        self.run_prefill(a_eng, a)
        a_blocks = [a_eng.block_kv(a, i) for i in range(4)]
        b_eng = self.engine(cudagraph_mode=FakeCUDAGraphMode.FULL_AND_PIECEWISE)
        b = FakeRequest("B", list(a.prompt_token_ids))
        self.assertEqual(b_eng.admit(b), 4 * BS)
        seen = []

        def hook(event, layer):
            seen.append((event, layer))
            if event == "before_load":
                # Stopped while the load starts, continued a little later
                # from elsewhere: start_load_kv must wait for it.
                self.daemon.pause()
                self.addCleanup(self.daemon.resume_after(0.3).wait)
            elif event == "after_start_load":
                self.assertIsNone(b_eng.worker._pending_load)
            elif event == "before_attention":
                for i in range(4):
                    for got, want in zip(b_eng.block_kv(b, i), a_blocks[i]):
                        self.assertTrue(torch.equal(got, want), f"block {i} layer {layer}")

        b_eng.step([b], [], {"B": 1}, hook=hook, graph_replay=True)
        self.assertEqual([e for e, _ in seen].count("before_attention"), LAYERS)
        self.assertNotIn("layer_loaded", [e for e, _ in seen])
        self.assertEqual(b_eng.load_errors, [])
        self.assertEqual(b_eng.worker.stats["loaded_blocks"], 4)

    def test_layers_are_loaded_before_their_attention_runs(self):
        self.layers_loaded_before_attention("auto")

    def test_kvshim_layers_are_loaded_before_their_attention_runs(self):
        self.layers_loaded_before_attention("kvshim")

    def layers_loaded_before_attention(self, staging):
        a_eng = self.engine()
        a = FakeRequest("A", prompt(10, 5 * BS + 1))
        self.run_prefill(a_eng, a)
        a_blocks = [a_eng.block_kv(a, i) for i in range(5)]
        b_eng = self.engine(staging=staging)
        if staging == "kvshim":
            self.assertIsNotNone(b_eng.worker._store._forced_shim)
        # A first load (one block) opens the worker's session, staging
        # buffers and UCX endpoint.
        w = FakeRequest("W", a.prompt_token_ids[:BS] + prompt(11, 5))
        self.assertEqual(self.run_prefill(b_eng, w), BS)
        b = FakeRequest("B", a.prompt_token_ids[:4 * BS] + prompt(12, 9))
        self.assertEqual(b_eng.admit(b), 4 * BS)
        loaded = b_eng.blocks["B"][:4]
        seen = []

        def hook(event, layer):
            seen.append((event, layer))
            if event == "before_load":
                self.daemon.pause()
            elif event == "after_start_load":
                # start_load_kv returned with the daemon stopped: the load is
                # in flight, and nothing of it is in the caches yet.
                pending = b_eng.worker._pending_load
                self.assertIsNotNone(pending)
                self.assertFalse(pending.handle.done)
                self.assertEqual(pending.handle.ready_layers, 0)
                for i in range(4):
                    for got in b_eng.block_kv(b, i):
                        self.assertEqual(int(got.view(torch.int16).abs().sum()), 0)
                # Continued from elsewhere a little later: a wait that did not
                # wait would see layer 0 missing.
                self.addCleanup(self.daemon.resume_after(0.3).wait)
            elif event == "layer_loaded":
                # This layer and the ones before it are in place before the
                # layer's attention runs.
                for i in range(4):
                    got = b_eng.block_kv(b, i)
                    for m in range(layer + 1):
                        self.assertTrue(torch.equal(got[m], a_blocks[i][m]),
                                        f"layer {m} of block {i} at layer {layer}")

        meta = b_eng.step([b], [], {"B": len(b.all_token_ids) - 4 * BS}, hook=hook)
        self.assertEqual(meta.loads[0].block_ids, loaded)
        self.assertEqual([e for e, _ in seen].count("layer_loaded"), LAYERS)
        self.assertIsNone(b_eng.worker._pending_load)  # finished in the step
        self.assertEqual(b_eng.load_errors, [])
        self.assertEqual(b_eng.worker.stats["loaded_blocks"], 1 + 4)
        for i in range(4):
            for got, want in zip(b_eng.block_kv(b, i), a_blocks[i]):
                self.assertTrue(torch.equal(got, want))

    def test_one_load_per_step_reported_per_request(self):
        a_eng = self.engine()
        a = FakeRequest("A", prompt(13, 4 * BS + 1))
        self.run_prefill(a_eng, a)
        keys = kvdepot.integrations.block_hashes(a.all_token_ids, BS)[:4]
        w = self.engine().worker
        # Two requests' loads in one step, called without any layer wait: X
        # loads whole; Y misses its second block, so its blocks from there
        # on are reported (and left as they were).
        meta = kv_vllm.KvDepotConnectorMetadata(loads=[
            kv_vllm.LoadSpec("X", [3, 4], keys[:2]),
            kv_vllm.LoadSpec("Y", [7, 8, 9], [keys[2], b"missing", keys[3]]),
        ])
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        self.assertIsNotNone(w._pending_load)
        self.assertEqual(w.get_block_ids_with_load_errors(), {8, 9})
        self.assertIsNone(w._pending_load)
        self.assertEqual((w.stats["loaded_blocks"], w.stats["load_errors"]), (3, 2))
        for block, src in ((3, 0), (4, 1), (7, 2)):
            want = [a_eng.kv_caches[n][:, a_eng.blocks["A"][src]] for n in a_eng.layer_names]
            for name, wl in zip(a_eng.layer_names, want):
                self.assertTrue(torch.equal(w._caches[w._layer_index[name]][:, block], wl))
        for c in w._caches:
            self.assertEqual(int(c[:, 8].view(torch.int16).abs().sum()), 0)
        w.clear_connector_metadata()
        # A load still in flight at shutdown is finished and reported.
        w.bind_connector_metadata(kv_vllm.KvDepotConnectorMetadata(loads=[
            kv_vllm.LoadSpec("Z", [10, 11], [b"missing", keys[0]])]))
        w.start_load_kv(None)
        w.shutdown()
        self.assertIsNone(w._pending_load)
        self.assertEqual(w.stats["load_errors"], 2 + 2)
        # The next start_load_kv finishes one left over, too.
        w2 = self.engine().worker
        w2.bind_connector_metadata(kv_vllm.KvDepotConnectorMetadata(loads=[
            kv_vllm.LoadSpec("Q", [5], [b"missing"])]))
        w2.start_load_kv(None)
        w2.bind_connector_metadata(kv_vllm.KvDepotConnectorMetadata())
        w2.start_load_kv(None)
        self.assertIsNone(w2._pending_load)
        self.assertEqual(w2.stats["load_errors"], 1)
        self.assertEqual(w2.get_block_ids_with_load_errors(), {5})

    def test_a_bad_spec_fails_alone(self):
        a_eng = self.engine()
        a = FakeRequest("A", prompt(15, 3 * BS + 1))
        self.run_prefill(a_eng, a)
        keys = kvdepot.integrations.block_hashes(a.all_token_ids, BS)[:3]
        w = self.engine().worker
        n = w._caches[0].shape[1]
        # X loads; Y names a block outside the cache, Z repeats X's block 3,
        # W has fewer keys than blocks: each is reported, X still loads.
        w.bind_connector_metadata(kv_vllm.KvDepotConnectorMetadata(loads=[
            kv_vllm.LoadSpec("X", [3, 4], keys[:2]),
            kv_vllm.LoadSpec("Y", [5, n], keys[:2]),
            kv_vllm.LoadSpec("Z", [3], keys[2:3]),
            kv_vllm.LoadSpec("W", [6, 7], keys[:1]),
        ]))
        w.start_load_kv(None)
        self.assertEqual(w.get_block_ids_with_load_errors(), {5, n, 3, 6, 7})
        self.assertEqual((w.stats["loaded_blocks"], w.stats["load_errors"]), (2, 5))
        for block, src in ((3, 0), (4, 1)):
            for name in a_eng.layer_names:
                self.assertTrue(torch.equal(w._caches[w._layer_index[name]][:, block],
                                            a_eng.kv_caches[name][:, a_eng.blocks["A"][src]]))
        for c in w._caches:  # Y's valid block was not loaded either
            self.assertEqual(int(c[:, 5].view(torch.int16).abs().sum()), 0)

    def test_a_load_that_cannot_be_planned_is_reported_failed(self):
        # vLLM counts the tokens it accepted in update_state_after_alloc as
        # computed: a load whose planning fails (here its keys) must still
        # report its blocks as load errors, or vLLM runs over blocks nothing
        # wrote. The load of B, planned in the same step, is not affected.
        for i, staging in enumerate(("auto", "torch")):
            with self.subTest(staging=staging):
                e, a, p = self.engine_loading_a_stored_prompt(47 + i, staging=staging)
                b = FakeRequest("B", list(p))
                self.assertEqual(e.admit(b), 4 * BS)
                keys_upto = e.scheduler._keys_upto

                def failing_keys(st, n):
                    if st.request.request_id == "A":
                        raise RuntimeError("injected: no keys for A")
                    return keys_upto(st, n)

                with mock.patch.object(e.scheduler, "_keys_upto", failing_keys):
                    step = e.schedule([a, b], [], {"A": 1, "B": 1})
                self.assertEqual([(s.req_id, s.block_ids, len(s.keys)) for s in step.meta.loads],
                                 [("A", e.blocks["A"][:4], 0), ("B", e.blocks["B"][:4], 4)])
                e.execute(step)
                self.assertEqual(sorted(e.load_errors), sorted(e.blocks["A"][:4]))
                self.assertEqual(e.worker.stats["loaded_blocks"], 4)  # B's
                self.assertEqual(self.pins(), 0)

    def test_torch_staging_loads_in_start_load_kv(self):
        a_eng = self.engine()
        a = FakeRequest("A", prompt(14, 3 * BS + 1))
        self.run_prefill(a_eng, a)
        b_eng = self.engine(staging="torch")
        b = FakeRequest("B", list(a.prompt_token_ids))
        self.assertEqual(b_eng.admit(b), 3 * BS)

        def hook(event, layer):
            if event == "after_start_load":  # synchronous: every layer is in
                self.assertIsNone(b_eng.worker._pending_load)
                for i in range(3):
                    for got, want in zip(b_eng.block_kv(b, i), a_eng.block_kv(a, i)):
                        self.assertTrue(torch.equal(got, want))

        b_eng.step([b], [], {"B": 1}, hook=hook)
        self.assertEqual(b_eng.load_errors, [])
        self.assertEqual(b_eng.worker.stats["loaded_blocks"], 3)

    # ------------------------------------------------------------------
    # Requests of more blocks than the daemon's max_batch_keys

    def limit_daemon_batches(self, max_batch_keys):
        """Replaces the test's daemon by one that takes at most
        ``max_batch_keys`` keys per call (from a config file: live_daemon
        passes no such flag, so $KVDEPOT_DAEMON is a script adding it)."""
        self.daemon.stop()
        d = tempfile.mkdtemp(prefix="kvdepot-vllm-")
        self.addCleanup(shutil.rmtree, d, True)
        config = os.path.join(d, "kvdepotd.yaml")
        with open(config, "w") as f:
            f.write(f"max_batch_keys: {max_batch_keys}\n")
        script = os.path.join(d, "kvdepotd")
        with open(script, "w") as f:
            f.write(f'#!/bin/sh\nexec {shlex.quote(os.environ["KVDEPOT_DAEMON"])} '
                    f'--config {shlex.quote(config)} "$@"\n')
        os.chmod(script, 0o755)
        with mock.patch.dict(os.environ, {"KVDEPOT_DAEMON": script}):
            self.daemon = Daemon()
        with kvdepot.Client(self.daemon.address) as cl:  # the limit holds
            with self.assertRaisesRegex(ValueError, "exceeds the limit"):
                cl.lookup("vllm-limit-check", [b"k%d" % i for i in range(max_batch_keys + 1)])

    def log_calls(self, e, fail=None):
        """Records the daemon calls of engine ``e``'s scheduler and worker
        (a CallLog; ``fail`` as CallLog's, for both)."""
        log = CallLog(e.scheduler._get_client(), [], fail)
        e.scheduler._client = log
        e.worker._store.client = CallLog(e.worker._store.client, log.calls, fail)
        return log

    def pins(self):
        with kvdepot.Client(self.daemon.address) as cl:
            return cl.stats()["pins"]

    def test_long_prompt_saves_and_loads_in_chunks(self):
        # 20 blocks, the daemon taking 8 keys a call: lookups, loads and
        # saves go in chunks of up to 8, the saves chained across chunks.
        self.limit_daemon_batches(8)
        for seed, staging in enumerate(("auto", "torch", "kvshim"), 40):
            with self.subTest(staging=staging):
                a_eng = self.engine(staging=staging, max_batch_keys=8)
                a_log = self.log_calls(a_eng)
                a = FakeRequest("A", prompt(seed, 20 * BS + 1))
                self.assertEqual(self.run_prefill(a_eng, a), 0)
                self.assertEqual(a_eng.worker.stats["save_errors"], 0)
                self.assertEqual(a_eng.worker.stats["saved_blocks"], 20)
                keys = kvdepot.integrations.block_hashes(a.all_token_ids, BS)[:20]
                puts = [(k, p) for c, k, p in a_log.calls if c == "put"]
                self.assertEqual([len(k) for k, _ in puts], [8, 8, 4])
                self.assertEqual([x for k, _ in puts for x in k], keys)
                # Each chunk's first block links to the chunk before's last.
                self.assertEqual([x for _, p in puts for x in p],
                                 kvdepot.integrations.parents_of(keys, b""))
                a_eng.finish(a)
                a_blocks = [a_eng.block_kv(a, i) for i in range(20)]

                b_eng = self.engine(staging=staging, max_batch_keys=8)
                b_log = self.log_calls(b_eng)
                b = FakeRequest("B", list(a.prompt_token_ids))
                self.assertEqual(b_eng.admit(b), 20 * BS)
                self.assertEqual(b_log.sizes("lookup"), [8, 8, 4])
                self.assertEqual(self.pins(), 3)  # one per chunk
                b_eng.step([b], [], {"B": 1})
                self.assertEqual(b_eng.load_errors, [])
                self.assertEqual(b_eng.worker.stats["loaded_blocks"], 20)
                self.assertEqual(sum(b_log.sizes("get")), 20)
                self.assertLessEqual(max(b_log.sizes("get")), 8)
                for i in range(20):
                    for got, want in zip(b_eng.block_kv(b, i), a_blocks[i]):
                        self.assertTrue(torch.equal(got.view(torch.int16),
                                                    want.view(torch.int16)), i)
                # The loaded KV is what recomputing gives.
                for i in (0, 8, 19):
                    for got, want in zip(b_eng.block_kv(b, i),
                                         b_eng.expected_block_kv(b.all_token_ids, i)):
                        self.assertTrue(torch.equal(got, want), i)
                self.assertEqual(self.pins(), 0)
                b_eng.finish(b)
                self.assertEqual(self.pins(), 0)

    def test_long_prompt_with_the_default_limit(self):
        # The daemon's and the connector's default of 1024 keys a call, and
        # a prompt of 1100 blocks (block_size 2 keeps the stand-in model
        # cheap; with vLLM's 16 that is 17600 tokens).
        bs, n = 2, 1100
        a_eng = self.engine(block_size=bs, num_blocks=n + 8)
        a_log = self.log_calls(a_eng)
        a = FakeRequest("A", prompt(50, n * bs + 1))
        self.assertEqual(self.run_prefill(a_eng, a), 0)
        self.assertEqual(a_eng.worker.stats["save_errors"], 0)
        self.assertEqual(a_eng.worker.stats["saved_blocks"], n)
        a_eng.finish(a)
        b_eng = self.engine(block_size=bs, num_blocks=n + 8)
        b_log = self.log_calls(b_eng)
        b = FakeRequest("B", list(a.prompt_token_ids))
        self.assertEqual(b_eng.admit(b), n * bs)
        self.assertEqual(self.pins(), 2)
        b_eng.step([b], [], {"B": 1})
        self.assertEqual(b_eng.load_errors, [])
        self.assertEqual(b_eng.worker.stats["loaded_blocks"], n)
        for i in range(n):
            for got, want in zip(b_eng.block_kv(b, i), a_eng.block_kv(a, i)):
                self.assertTrue(torch.equal(got, want), i)
        for i in (0, n - 1):
            for got, want in zip(b_eng.block_kv(b, i),
                                 b_eng.expected_block_kv(b.all_token_ids, i)):
                self.assertTrue(torch.equal(got, want), i)
        b_eng.finish(b)
        self.assertEqual(self.pins(), 0)
        sizes = a_log.sizes() + b_log.sizes()
        self.assertLessEqual(max(sizes), kv_vllm.DEFAULT_MAX_BATCH_KEYS)

    def test_prefix_ends_in_a_partly_missing_chunk(self):
        # A block missing in the second chunk (blocks 8-15) ends the prefix
        # there: exactly the leading hits are offered and loaded, and the
        # third chunk is not looked up.
        self.limit_daemon_batches(8)
        a_eng = self.engine(max_batch_keys=8)
        a = FakeRequest("A", prompt(51, 20 * BS + 1))
        self.run_prefill(a_eng, a)
        a_eng.finish(a)
        keys = kvdepot.integrations.block_hashes(a.all_token_ids, BS)[:20]
        ns = a_eng.scheduler._scheduler_namespace
        # (missing block, pins held: the second chunk's too if it hit any)
        for missing, pins in ((10, 2), (8, 1)):
            with self.subTest(missing=missing):
                with kvdepot.Client(self.daemon.address) as cl:
                    self.assertEqual(cl.evict(ns, [keys[missing]])["evicted_blocks"], 1)
                b_eng = self.engine(max_batch_keys=8)
                b_log = self.log_calls(b_eng)
                b = FakeRequest("B", list(a.prompt_token_ids))
                self.assertEqual(b_eng.admit(b), missing * BS)
                self.assertEqual(b_log.sizes("lookup"), [8, 8])
                self.assertEqual(self.pins(), pins)
                b_eng.step([b], [], {"B": len(b.all_token_ids) - missing * BS})
                self.assertEqual(b_eng.load_errors, [])
                self.assertEqual(b_eng.worker.stats["loaded_blocks"], missing)
                for i in range(missing):
                    for got, want in zip(b_eng.block_kv(b, i), a_eng.block_kv(a, i)):
                        self.assertTrue(torch.equal(got, want), i)
                # B computed the rest, and saved it from the missing block on.
                self.assertEqual(b_eng.worker.stats["saved_blocks"], 20 - missing)
                b_eng.finish(b)
                self.assertEqual(self.pins(), 0)
                with kvdepot.Client(self.daemon.address) as cl:  # all 20 again
                    self.assertEqual(sum(cl.lookup(ns, keys[lo:lo + 8], prefix=True)
                                         .prefix_hits for lo in (0, 8, 16)), 20)

    def test_load_miss_in_a_later_chunk_reports_from_there(self):
        # Block 11 (second chunk) is lost between the lookup and the load:
        # blocks 0-10 load, 11-19 are reported; the torch path reads no
        # chunk past it. A read that fails in the second chunk likewise.
        self.limit_daemon_batches(8)
        a_eng = self.engine(max_batch_keys=8)
        a = FakeRequest("A", prompt(52, 20 * BS + 1))
        self.run_prefill(a_eng, a)
        a_eng.finish(a)
        ns = a_eng.scheduler._scheduler_namespace
        keys = kvdepot.integrations.block_hashes(a.all_token_ids, BS)[:20]
        cases = (("auto", None, 11), ("torch", None, 11), ("torch", ("get", 2), 8))
        for staging, fail, first_bad in cases:
            with self.subTest(staging=staging, fail=fail):
                b_eng = self.engine(staging=staging, max_batch_keys=8)
                b = FakeRequest("B", list(a.prompt_token_ids))
                self.assertEqual(b_eng.admit(b), 20 * BS)
                b_log = self.log_calls(b_eng, fail=fail)
                if fail is None:
                    b_eng.scheduler._unpin(b_eng.scheduler._requests["B"])
                    with kvdepot.Client(self.daemon.address) as cl:
                        self.assertEqual(cl.evict(ns, [keys[11]])["evicted_blocks"], 1)
                b_eng.step([b], [], {"B": 1})
                self.assertEqual(sorted(b_eng.load_errors),
                                 sorted(b_eng.blocks["B"][first_bad:20]))
                self.assertEqual(b_eng.worker.stats["loaded_blocks"], first_bad)
                for i in range(first_bad):
                    for got, want in zip(b_eng.block_kv(b, i), a_eng.block_kv(a, i)):
                        self.assertTrue(torch.equal(got, want), i)
                for got in b_eng.block_kv(b, first_bad):  # untouched
                    self.assertEqual(int(got.view(torch.int16).abs().sum()), 0)
                if staging == "torch":
                    self.assertEqual(b_log.sizes("get"), [8] if fail else [8, 8])
                b_eng.recompute_failed(b, b_eng.load_errors)
                b_eng.step([], [b], {"B": len(b.all_token_ids) - b.num_computed_tokens})
                b_eng.finish(b)
                self.assertEqual(self.pins(), 0)
                # The recomputed blocks were saved again: all 20 are stored.
                with kvdepot.Client(self.daemon.address) as cl:
                    self.assertEqual(sum(cl.lookup(ns, keys[lo:lo + 8], prefix=True)
                                         .prefix_hits for lo in (0, 8, 16)), 20)

    def test_chunked_lookups_release_every_pin(self):
        # Three chunks, three pins: each way a lookup's pins end releases
        # them all, once.
        self.limit_daemon_batches(8)
        a_eng = self.engine(max_batch_keys=8)
        a = FakeRequest("A", prompt(53, 20 * BS + 1))
        self.run_prefill(a_eng, a)
        a_eng.finish(a)
        e = self.engine(max_batch_keys=8)
        sched = e.scheduler
        unpins = []
        real_unpin = sched._get_client().unpin
        sched._client.unpin = lambda pin: (unpins.append(pin), real_unpin(pin))[1]

        def request(rid):
            return FakeRequest(rid, list(a.prompt_token_ids))

        # vLLM does not take the offer.
        r = request("R1")
        self.assertEqual(sched.get_num_new_matched_tokens(r, 0), (20 * BS, False))
        self.assertEqual((self.pins(), len(sched._requests["R1"].pin_ids)), (3, 3))
        sched.update_state_after_alloc(r, None, 0)
        self.assertEqual((self.pins(), len(unpins)), (0, 3))
        # A second lookup replaces the first; the request then finishes.
        r = request("R2")
        sched.get_num_new_matched_tokens(r, 0)
        sched.get_num_new_matched_tokens(r, 0)
        self.assertEqual((self.pins(), len(unpins)), (3, 6))
        self.assertEqual(sched.request_finished(r, []), (False, None))
        self.assertEqual((self.pins(), len(unpins)), (0, 9))
        # The hits (10 blocks, two chunks) are all computed locally already:
        # nothing offered.
        r = FakeRequest("R3", a.prompt_token_ids[:10 * BS] + prompt(54, 10 * BS + 1))
        self.assertEqual(sched.get_num_new_matched_tokens(r, 12 * BS), (0, False))
        self.assertEqual((self.pins(), len(unpins)), (0, 11))
        sched.request_finished(r, [])
        # The second chunk's lookup fails: the first chunk's pin goes too.
        log = self.log_calls(e, fail=("lookup", 2))
        r = request("R4")
        self.assertEqual(sched.get_num_new_matched_tokens(r, 0), (0, False))
        self.assertEqual(sched.stats["lookup_errors"], 1)
        self.assertEqual(self.pins(), 0)
        self.assertEqual(sched._requests["R4"].pin_ids, [])
        sched.request_finished(r, [])
        # Loaded, then shut down with another lookup's pins held.
        sched._client = log._inner
        r = request("R5")
        self.assertEqual(e.admit(r), 20 * BS)
        e.step([r], [], {"R5": 1})
        self.assertEqual(self.pins(), 0)
        r6 = request("R6")
        sched.get_num_new_matched_tokens(r6, 0)
        self.assertEqual(self.pins(), 3)
        sched.shutdown()
        self.assertEqual(self.pins(), 0)
        self.assertEqual(len(set(unpins)), len(unpins))  # each released once

    # ------------------------------------------------------------------
    # vLLM's load failure policy, context parallelism

    def test_load_failure_policy_fail_is_set_to_recompute(self):
        # vLLM's kv_load_failure_policy defaults to "fail", which ends a
        # request with an error for each block the connector reports through
        # get_block_ids_with_load_errors; its scheduler reads the policy after
        # creating its connector.
        def scheduler_config(policy=None, **extra):
            cfg = make_vllm_config(self.daemon.address, num_layers=LAYERS, block_size=BS,
                                   num_kv_heads=HEADS, head_size=HEAD,
                                   dtype=torch.bfloat16, extra=extra)
            if policy is not None:
                cfg.kv_transfer_config.kv_load_failure_policy = policy
            return cfg

        def connector(cfg):
            c = kv_vllm.KvDepotConnector(cfg, kv_vllm.KVConnectorRole.SCHEDULER)
            self.addCleanup(c.shutdown)
            return c

        cfg = scheduler_config("fail")
        with self.assertLogs("kvdepot.integrations.vllm", "WARNING") as logs:
            connector(cfg)
        self.assertEqual(cfg.kv_transfer_config.kv_load_failure_policy, "recompute")
        self.assertTrue(any("recompute" in line and "keep_load_failure_policy" in line
                            for line in logs.output), logs.output)
        # Opted out: kept, and said so.
        cfg = scheduler_config("fail", keep_load_failure_policy=True)
        with self.assertLogs("kvdepot.integrations.vllm", "WARNING") as logs:
            kept = connector(cfg)
        self.assertEqual(cfg.kv_transfer_config.kv_load_failure_policy, "fail")
        self.assertTrue(any("kept" in line for line in logs.output), logs.output)
        self.assertFalse(kept._recompute_failures)
        # "recompute" stays; a vLLM without the field (which always
        # recomputes) gets none.
        cfg = scheduler_config("recompute")
        self.assertTrue(connector(cfg)._recompute_failures)
        self.assertEqual(cfg.kv_transfer_config.kv_load_failure_policy, "recompute")
        cfg = scheduler_config()
        self.assertTrue(connector(cfg)._recompute_failures)
        self.assertFalse(hasattr(cfg.kv_transfer_config, "kv_load_failure_policy"))

    def test_context_parallelism_disables(self):
        # With decode or prefill context parallelism each rank's block holds
        # only its slice of the block's tokens: not what the keys name.
        a_eng = self.engine()
        a = FakeRequest("A", prompt(70, 2 * BS + 1))
        self.run_prefill(a_eng, a)
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            with self.subTest(name=name):
                cfg = make_vllm_config(self.daemon.address, num_layers=LAYERS,
                                       block_size=BS, num_kv_heads=1, head_size=HEAD,
                                       dtype=torch.bfloat16)
                cfg.model_config.use_mla = True
                cfg.parallel_config.tensor_parallel_size = 2
                setattr(cfg.parallel_config, name, 2)
                sched = kv_vllm.KvDepotConnector(cfg, kv_vllm.KVConnectorRole.SCHEDULER)
                worker = kv_vllm.KvDepotConnector(cfg, kv_vllm.KVConnectorRole.WORKER)
                self.addCleanup(sched.shutdown)
                self.addCleanup(worker.shutdown)
                for c in (sched, worker):
                    self.assertIn("context parallelism", c.disabled_reason or "")
                    self.assertIn(name, c.disabled_reason)
                worker.register_kv_caches({f"model.layers.{i}.self_attn.attn":
                                           torch.zeros(8, BS, HEAD, dtype=torch.bfloat16)
                                           for i in range(LAYERS)})
                self.assertIsNone(worker._store)
                r = FakeRequest("R", list(a.prompt_token_ids))
                self.assertEqual(sched.get_num_new_matched_tokens(r, 0), (0, False))
        # Dual batch overlap: the worker side's calls on two threads.
        cfg = make_vllm_config(self.daemon.address, num_layers=LAYERS, block_size=BS,
                               num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
        cfg.parallel_config.enable_dbo = True
        worker = kv_vllm.KvDepotConnector(cfg, kv_vllm.KVConnectorRole.WORKER)
        self.addCleanup(worker.shutdown)
        self.assertIn("enable_dbo", worker.disabled_reason or "")
        # Size 1 (vLLM's default) is no context parallelism.
        cfg = make_vllm_config(self.daemon.address, num_layers=LAYERS, block_size=BS,
                               num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
        cfg.parallel_config.decode_context_parallel_size = 1
        cfg.parallel_config.prefill_context_parallel_size = 1
        sched = kv_vllm.KvDepotConnector(cfg, kv_vllm.KVConnectorRole.SCHEDULER)
        self.addCleanup(sched.shutdown)
        self.assertIsNone(sched.disabled_reason)

    def test_caches_laid_out_head_major_share_blocks_with_token_major_ones(self):
        # FlashAttention's HND stride order (views of [2, N, H, T, D]
        # memory), and vLLM's CPU backend, whose [2, N, H, T, D] caches look
        # like token-major ones where heads == block size: both read and
        # write the objects a token-major engine does.
        for physical, block_size, cpu in (("HND", BS, False), ("CPU_ATTN", HEADS, True)):
            with self.subTest(physical=physical):
                seed = 80 + block_size
                p = prompt(seed, 3 * block_size + 1)
                # Stored by a token-major engine, loaded by this one (whose
                # worker alone runs on vLLM's CPU platform, if any).
                self.run_prefill(self.engine(block_size=block_size),
                                 FakeRequest("N", list(p)))
                with mock.patch.object(kv_vllm, "_vllm_cpu_platform", return_value=cpu):
                    e = self.engine(block_size=block_size, physical=physical)
                r = FakeRequest("R", list(p))
                self.assertEqual(e.admit(r), 3 * block_size)
                e.step([r], [], {"R": 1})
                self.assertEqual(e.load_errors, [])
                for i in range(3):
                    for got, want in zip(e.block_kv(r, i), e.expected_block_kv(p, i)):
                        self.assertTrue(torch.equal(got, want), (physical, i))
                # Stored by this one, loaded by a token-major engine.
                q = prompt(seed + 1, 3 * block_size + 1)
                self.run_prefill(e, FakeRequest("S", list(q)))
                t = self.engine(block_size=block_size)
                s = FakeRequest("T", list(q))
                self.assertEqual(t.admit(s), 3 * block_size)
                t.step([s], [], {"T": 1})
                self.assertEqual(t.load_errors, [])
                for i in range(3):
                    for got, want in zip(t.block_kv(s, i), t.expected_block_kv(q, i)):
                        self.assertTrue(torch.equal(got, want), (physical, i))

    def test_only_full_attention_caches_are_served(self):
        # A sliding-window group's block table holds vLLM's null block for
        # positions its window left behind: refused, whether vLLM names the
        # group's kind or only the model's window can tell.
        FullAttentionSpec = type("FullAttentionSpec", (), {})
        specs = {
            "SlidingWindowSpec": (type("SlidingWindowSpec", (), {}), "SlidingWindowSpec"),
            "ChunkedLocalAttentionSpec": (type("ChunkedLocalAttentionSpec", (), {}),
                                          "ChunkedLocalAttentionSpec"),
            "MLAAttentionSpec": (type("MLAAttentionSpec", (FullAttentionSpec,), {}), None),
            "FullAttentionSpec": (FullAttentionSpec, None),
        }

        def connectors(cfg, kv_cache_config):
            made = [kv_vllm.KvDepotConnector(cfg, role, kv_cache_config)
                    for role in (kv_vllm.KVConnectorRole.SCHEDULER,
                                 kv_vllm.KVConnectorRole.WORKER)]
            for c in made:
                self.addCleanup(c.shutdown)
            return made

        for name, (cls, refused) in specs.items():
            with self.subTest(spec=name):
                cfg = make_vllm_config(self.daemon.address, num_layers=LAYERS,
                                       block_size=BS, num_kv_heads=HEADS,
                                       head_size=HEAD, dtype=torch.bfloat16)
                groups = SimpleNamespace(kv_cache_groups=[
                    SimpleNamespace(kv_cache_spec=FullAttentionSpec()),
                    SimpleNamespace(kv_cache_spec=cls())])
                for c in connectors(cfg, groups):
                    if refused:
                        self.assertIn(refused, c.disabled_reason or "")
                    else:
                        self.assertIsNone(c.disabled_reason)
        # No kv_cache_config (older vLLM): the model's sliding window says.
        for window, refused in ((4096, True), (None, False)):
            with self.subTest(window=window):
                cfg = make_vllm_config(self.daemon.address, num_layers=LAYERS,
                                       block_size=BS, num_kv_heads=HEADS,
                                       head_size=HEAD, dtype=torch.bfloat16)
                cfg.model_config.get_sliding_window = lambda w=window: w
                for c in connectors(cfg, None):
                    if refused:
                        self.assertIn("sliding-window", c.disabled_reason or "")
                    else:
                        self.assertIsNone(c.disabled_reason)

    def test_speculative_proposers_with_kv_caches_disable_the_scheduler_too(self):
        # EAGLE / MTP / draft-model layers add KV caches the worker refuses
        # (more caches than the model's layers); a scheduler that still
        # offered kvdepot's hits would have every load fail. Proposers
        # without layers (n-gram) are served.
        a, _ = self.stored_then_engine(48)
        extra_layer = SimpleNamespace(kv_cache_groups=[SimpleNamespace(
            kv_cache_spec=type("FullAttentionSpec", (), {})(),
            layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
            + ["drafter.layers.0.self_attn.attn"])])
        for method, kv_cache_config, refused in (("eagle", None, "speculative"),
                                                 ("deepseek_mtp", None, "speculative"),
                                                 (None, extra_layer, "layers have KV"),
                                                 ("ngram", None, None)):
            with self.subTest(method=method):
                cfg = make_vllm_config(self.daemon.address, num_layers=LAYERS,
                                       block_size=BS, num_kv_heads=HEADS,
                                       head_size=HEAD, dtype=torch.bfloat16)
                if method is not None:
                    cfg.speculative_config = SimpleNamespace(method=method,
                                                             num_speculative_tokens=3)
                sched = kv_vllm.KvDepotConnector(cfg, kv_vllm.KVConnectorRole.SCHEDULER,
                                                 kv_cache_config)
                self.addCleanup(sched.shutdown)
                r = FakeRequest("R", list(a.prompt_token_ids))
                got = sched.get_num_new_matched_tokens(r, 0)
                sched.update_state_after_alloc(r, None, 0)
                if refused:
                    self.assertIn(refused, sched.disabled_reason or "")
                    self.assertEqual(got, (0, False))
                else:
                    self.assertIsNone(sched.disabled_reason)
                    self.assertEqual(got, (4 * BS, False))

    def test_the_null_block_is_never_saved(self):
        # A block table with vLLM's null block (id 0) where a request has no
        # block of its own: what precedes it is saved, nothing from it on.
        e = self.engine()
        r = FakeRequest("R", prompt(71, 6 * BS + 1))
        self.assertEqual(e.admit(r, num_local_computed=2 * BS,
                                 local_blocks=[e.free.pop(0), e.free.pop(0), 0]), 0)
        meta = e.step([r], [], {"R": len(r.all_token_ids) - 2 * BS})
        saved = [b for spec in meta.saves + meta.finishing_saves for b in spec.block_ids]
        self.assertNotIn(0, saved)
        self.assertEqual(saved, e.blocks["R"][:2])
        self.assertEqual(e.worker.stats["saved_blocks"], 2)

    # ------------------------------------------------------------------
    # An unavailable daemon: the circuit breaker

    def test_unavailable_daemon_backs_off_lookups(self):
        a_eng = self.engine()
        stored = FakeRequest("P", prompt(71, 4 * BS + 1))
        self.run_prefill(a_eng, stored)
        e = self.engine(backoff_s=1.0, max_backoff_s=4.0)
        clock = FakeClock()
        e.scheduler._breaker.clock = clock
        log = self.log_calls(e)
        seeds = iter(range(100, 200))

        def lookup():
            r = FakeRequest(f"R{next(seeds)}", prompt(next(seeds), 4 * BS + 1))
            return e.scheduler.get_num_new_matched_tokens(r, 0)

        # A request pinned its hits before the daemon went away.
        held = FakeRequest("H", list(stored.prompt_token_ids))
        self.assertEqual(e.scheduler.get_num_new_matched_tokens(held, 0), (4 * BS, False))
        self.assertEqual(self.pins(), 1)
        log.down = True
        attempts = log.attempts
        with self.assertLogs("kvdepot.integrations.vllm", "WARNING") as logs:
            self.assertEqual(lookup(), (0, False))  # finds it gone: open for 1 s
            self.assertEqual(log.attempts, attempts + 1)
            for _ in range(3):  # within the window: answered without a call
                self.assertEqual(lookup(), (0, False))
            self.assertEqual(log.attempts, attempts + 1)
            self.assertEqual(e.scheduler.stats["unavailable_skips"], 3)
            # The held pin is kept without a call, to be released later
            # (the session's keep-alives would hold it for good).
            self.assertEqual(e.scheduler.request_finished(held, []), (False, None))
            self.assertEqual(log.attempts, attempts + 1)
            # Past each window one call probes; each failed probe doubles
            # the window, up to max_backoff_s: 1, 2, 4, 4 s.
            for window in (1, 2, 4, 4):
                clock.advance(window - 0.01)
                self.assertEqual(lookup(), (0, False))
                self.assertEqual(log.attempts, attempts + 1)
                clock.advance(0.02)
                self.assertEqual(lookup(), (0, False))
                attempts += 1
                self.assertEqual(log.attempts, attempts + 1)
            # Back: the next probe finds it, and every lookup calls again.
            log.down = False
            clock.advance(4.01)
            again = FakeRequest("A2", list(stored.prompt_token_ids))
            self.assertEqual(e.scheduler.get_num_new_matched_tokens(again, 0),
                             (4 * BS, False))
            e.scheduler.request_finished(again, [])
            calls = len(log.calls)
            for _ in range(3):
                self.assertEqual(lookup(), (0, False))
            self.assertEqual(len(log.calls), calls + 3)
        self.assertEqual(e.scheduler.stats["lookup_errors"], 5)
        opened = [line for line in logs.output if "not calling it" in line]
        closed = [line for line in logs.output if "answers again" in line]
        self.assertEqual((len(opened), len(closed)), (1, 1), logs.output)
        # The held pin was released with the first unpin once it answered.
        self.assertEqual(self.pins(), 0)
        self.assertEqual(list(e.scheduler._owed_unpins), [])

    def test_hung_daemon_lookup_deadline_then_back_off(self):
        # A stopped (hung) daemon: the scheduler's lookup gives up after
        # lookup_timeout_s, and the lookups after it, within the back-off
        # window, make no call at all.
        e = self.engine(lookup_timeout_s=0.5, backoff_s=30.0)
        log = self.log_calls(e)
        self.assertEqual(e.scheduler.get_num_new_matched_tokens(
            FakeRequest("R0", prompt(72, 4 * BS + 1)), 0), (0, False))  # session opened
        self.daemon.pause()
        self.addCleanup(self.daemon.resume)
        with self.assertLogs("kvdepot.integrations.vllm", "WARNING") as logs:
            self.assertEqual(e.scheduler.get_num_new_matched_tokens(
                FakeRequest("R1", prompt(73, 4 * BS + 1)), 0), (0, False))
        self.assertTrue(any("DEADLINE_EXCEEDED" in line for line in logs.output), logs.output)
        attempts = log.attempts
        for i in range(3):
            self.assertEqual(e.scheduler.get_num_new_matched_tokens(
                FakeRequest(f"R{i + 2}", prompt(74 + i, 4 * BS + 1)), 0), (0, False))
        self.assertEqual(log.attempts, attempts)
        self.assertEqual(e.scheduler.stats["unavailable_skips"], 3)

    def test_unavailable_daemon_backs_off_loads_and_saves(self):
        a_eng = self.engine()
        p = prompt(75, 4 * BS + 1)
        self.run_prefill(a_eng, FakeRequest("A", list(p)))
        e = self.engine()
        clock = FakeClock()
        e.worker._breaker.clock = clock
        self.log_calls(e)
        worker_log = e.worker._store.client
        b = FakeRequest("B", list(p))
        self.assertEqual(e.admit(b), 4 * BS)
        worker_log.down = True  # gone between the lookup and the load
        with self.assertLogs("kvdepot.integrations.vllm", "WARNING") as logs:
            e.step([b], [], {"B": 1})
        self.assertEqual(sorted(e.load_errors), sorted(e.blocks["B"][:4]))
        self.assertEqual(len([line for line in logs.output if "not calling it" in line]), 1)
        attempts = worker_log.attempts
        # Within the window: the recomputed blocks are not saved, and a load
        # is not tried; nothing reaches the daemon.
        e.recompute_failed(b, e.load_errors)
        e.step([], [b], {"B": len(b.all_token_ids)})
        self.assertEqual(e.worker.stats["save_errors"], 4)
        c = FakeRequest("C", list(p))
        self.assertEqual(e.admit(c), 4 * BS)  # the scheduler still finds them
        e.step([c], [], {"C": 1})
        self.assertEqual(sorted(e.load_errors[4:]), sorted(e.blocks["C"][:4]))
        self.assertEqual(worker_log.attempts, attempts)
        self.assertEqual(e.worker.stats["unavailable_skips"], 2)
        self.assertEqual(e.worker.stats["saved_blocks"], 0)
        # Back, and the window over: C's recomputed blocks are saved.
        worker_log.down = False
        clock.advance(1.01)
        e.recompute_failed(c, e.blocks["C"][:4])
        with self.assertLogs("kvdepot.integrations.vllm", "WARNING") as logs:
            e.step([], [c], {"C": len(c.all_token_ids)})
        self.assertEqual(e.worker.stats["saved_blocks"], 4)
        self.assertTrue(any("answers again" in line for line in logs.output), logs.output)
        self.assertFalse(e.worker._breaker.is_open)

    # ------------------------------------------------------------------
    # Staging memory

    def test_staging_rounds_bound_memory(self):
        # With max_staging_blocks 4, a 10-block save goes in puts of at
        # most 4 blocks and a 10-block load in rounds of at most 4 (the
        # last streaming layer by layer): the store's staging memory stays
        # at its minimum of 8 objects (below 2 x 4 in general) instead of
        # growing to the 10 blocks of the largest step.
        for seed, staging in enumerate(("auto", "kvshim", "torch"), 76):
            with self.subTest(staging=staging):
                a_eng = self.engine(staging=staging, max_staging_blocks=4, num_blocks=40)
                a_log = self.log_calls(a_eng)
                a = FakeRequest("A", prompt(seed, 10 * BS + 1))
                self.run_prefill(a_eng, a)
                self.assertEqual(a_eng.worker.stats["saved_blocks"], 10)
                self.assertEqual(a_log.sizes("put"), [4, 4, 2])
                a_blocks = [a_eng.block_kv(a, i) for i in range(10)]
                b_eng = self.engine(staging=staging, max_staging_blocks=4, num_blocks=40)
                b_log = self.log_calls(b_eng)
                b = FakeRequest("B", list(a.prompt_token_ids))
                self.assertEqual(b_eng.admit(b), 10 * BS)

                def hook(event, layer):
                    if event == "layer_loaded":  # layers 0..layer of all 10 blocks
                        for i in range(10):
                            got = b_eng.block_kv(b, i)
                            for m in range(layer + 1):
                                self.assertTrue(torch.equal(got[m], a_blocks[i][m]),
                                                f"layer {m} of block {i} at {layer}")

                b_eng.step([b], [], {"B": 1}, hook=hook)
                self.assertEqual(b_eng.load_errors, [])
                self.assertEqual(b_eng.worker.stats["loaded_blocks"], 10)
                self.assertEqual(sum(b_log.sizes("get")), 10)
                self.assertLessEqual(max(b_log.sizes("get")), 4)
                for i in range(10):
                    for got, want in zip(b_eng.block_kv(b, i), a_blocks[i]):
                        self.assertTrue(torch.equal(got, want), i)
                for eng in (a_eng, b_eng):
                    self.assertLessEqual(len(eng.worker._store._buffers), 8)

    def test_bad_config_disables_instead_of_failing(self):
        cfg = make_vllm_config(self.daemon.address, num_layers=LAYERS, block_size=BS,
                               num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
        w = kv_vllm.KvDepotConnector(cfg, kv_vllm.KVConnectorRole.WORKER)
        w.register_kv_caches({"model.layers.0.attn": torch.zeros(2, 4, BS, HEADS, HEAD)})
        self.assertIsNotNone(w.disabled_reason)
        w.start_load_kv(None)
        w.wait_for_save()
        self.assertEqual(w.get_block_ids_with_load_errors(), set())
        w.shutdown()


if __name__ == "__main__":
    unittest.main()
