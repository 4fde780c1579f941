"""Tests of kvdepot.kvshim, the ctypes wrapper of the C ABI of gather/scatter
(gpu/kv_capi.h), with the CPU library (libkvdepot_kv_cpu.so).

The reference is the native module's ``kvdepot.gather`` / ``kvdepot.scatter``
(the same CPU twin, through pybind11): for every layout and dtype the shim
must give the same bytes. Also: torch and numpy inputs, buffers, layer
ranges, every error path, host registration, loading kvshim.py on its own
(as tests/gpu/test_cuda_kvshim.py does on a GPU machine), staging memory of
a live kvdepotd's ``Client.allocate_buffer``, and -- where the CUDA library
is built (KVDEPOT_KV_CUDA_LIB) -- its checks that need no GPU.

Run by ctest (python_kvshim_test) with PYTHONPATH=<build>/python. Exits 77
(ctest: skipped) when numpy is missing; the torch cases skip themselves
without torch, the daemon case without KVDEPOT_DAEMON.
"""

import array
import contextlib
import ctypes
import os
import subprocess
import sys
import types
import unittest
from unittest import mock

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
from kvdepot import kvshim
from kvdepot.kvshim import KvShim, LayoutSpec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from live_daemon import Daemon  # noqa: E402

K = kvdepot.KvCacheLayout
DT = kvdepot.KvDtype
ALL_DTYPES = [DT.FLOAT16, DT.BFLOAT16, DT.FLOAT8_E4M3, DT.FLOAT32]
NP_DTYPE = {DT.FLOAT16: np.float16, DT.BFLOAT16: np.uint16,  # bf16: raw bits
            DT.FLOAT8_E4M3: np.uint8, DT.FLOAT32: np.float32}
L, N, T, H, HD = 3, 7, 4, 2, 8  # layers, blocks, tokens, heads, head size
LATENT = 12


def layout_cases(dtype):
    """(KvLayout, cache tensor shapes in elements) for every layout, plus
    the one-latent cross-layer layout."""
    mha = kvdepot.KvLayout.mha
    return [
        (mha(K.FLASH_ATTN_NHD, L, T, H, HD, dtype), [(2, N, T, H, HD)] * L),
        (mha(K.FLASH_ATTN_HND, L, T, H, HD, dtype), [(2, N, H, T, HD)] * L),
        (mha(K.FLASH_INFER_NHD, L, T, H, HD, dtype), [(N, 2, T, H, HD)] * L),
        (mha(K.FLASH_INFER_HND, L, T, H, HD, dtype), [(N, 2, H, T, HD)] * L),
        (kvdepot.KvLayout.mla(K.MLA, L, T, LATENT, dtype), [(N, T, LATENT)] * L),
        (mha(K.CROSS_LAYER_NHD, L, T, H, HD, dtype), [(N, L, 2, T, H, HD)]),
        (mha(K.CROSS_LAYER_HND, L, T, H, HD, dtype), [(N, L, 2, H, T, HD)]),
        (kvdepot.KvLayout.mla(K.CROSS_LAYER_NHD, L, T, LATENT, dtype),
         [(N, L, 1, T, 1, LATENT)]),
    ]


def random_np_caches(shapes, dtype, seed):
    rng = np.random.default_rng(seed)
    np_dtype = NP_DTYPE[dtype]
    out = []
    for shape in shapes:
        count = int(np.prod(shape))
        raw = rng.integers(0, 256, count * np.dtype(np_dtype).itemsize, dtype=np.uint8)
        out.append(raw.view(np_dtype).reshape(shape))
    return out


def filled(count, size, value):
    return [np.full(size, value, np.uint8) for _ in range(count)]


def raw(obj):
    """The bytes of a numpy array, buffer or CPU torch tensor."""
    if torch is not None and isinstance(obj, torch.Tensor):
        return obj.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return bytes(memoryview(obj).cast("B"))


class FakeTensor:
    """Looks like a torch tensor on another device (no such device here):
    the shim reads data_ptr, numel, element_size, is_contiguous and device."""

    def __init__(self, device_type, index, nbytes, ptr=0x10000):
        self.device = types.SimpleNamespace(type=device_type, index=index)
        self._nbytes, self._ptr = nbytes, ptr

    def data_ptr(self):
        return self._ptr

    def numel(self):
        return self._nbytes

    def element_size(self):
        return 1

    def is_contiguous(self):
        return True


class ShimTestCase(unittest.TestCase):
    def setUp(self):
        self.shim = KvShim.for_device("cpu")


class LibraryTest(ShimTestCase):
    def test_loads_the_cpu_library_beside_the_package(self):
        self.assertEqual(self.shim.backend, "cpu")
        self.assertEqual(self.shim.library, kvshim.library_path("cpu"))
        self.assertEqual(os.path.dirname(self.shim.library),
                         os.path.dirname(os.path.abspath(kvdepot.__file__)))
        self.assertIs(KvShim.for_device("cpu"), self.shim)  # one per library
        self.assertEqual(self.shim.current_device(), 0)
        self.shim.synchronize()  # nothing to wait for
        self.shim.synchronize(12345)  # the CPU library ignores the stream

    def test_enums_mirror_the_native_ones(self):
        for mirror, native in ((kvshim.CacheLayout, K), (kvshim.Dtype, DT)):
            self.assertEqual({m.name: int(m) for m in mirror},
                             {name: int(v) for name, v in native.__members__.items()})

    def test_layout_info_matches_kvlayout_for_every_layout_and_dtype(self):
        for dtype in ALL_DTYPES:
            for layout, shapes in layout_cases(dtype):
                with self.subTest(layout=repr(layout)):
                    info = self.shim.layout_info(layout)
                    self.assertEqual(info, (layout.num_tensors, layout.element_bytes,
                                            layout.layer_bytes, layout.object_bytes,
                                            layout.tensor_bytes(1)))
                    self.assertEqual(len(shapes), info.num_tensors)
                    spec = LayoutSpec(layout.layout.name.lower(), layout.num_layers,
                                      layout.num_components, layout.block_size,
                                      layout.num_kv_heads, layout.head_size,
                                      int(layout.dtype))
                    self.assertEqual(self.shim.layout_info(spec), info)

    def test_unknown_device_missing_or_wrong_library_raise(self):
        with self.assertRaisesRegex(ValueError, "INVALID_ARGUMENT: .*'tpu'"):
            KvShim.for_device("tpu")
        missing = os.path.join(os.path.dirname(kvshim.library_path("cpu")), "nope.so")
        with self.assertRaisesRegex(ImportError, "nope.so is not built"):
            KvShim.for_device("cpu", library=missing)
        with self.assertRaisesRegex(ImportError, "is the cpu library, not the cuda one"):
            KvShim.for_device("cuda", library=kvshim.library_path("cpu"))
        not_a_library = os.path.abspath(__file__)
        with self.assertRaisesRegex(ImportError, "does not load"):
            KvShim(not_a_library)
        with self.assertRaisesRegex(ImportError, "lacks a kvdepot_kv_ function"):
            KvShim(kvdepot._kvdepot.__file__)  # a shared object, not ours

    def test_kvshim_loads_on_its_own_without_the_native_module(self):
        # As tests/gpu/test_cuda_kvshim.py loads it where _kvdepot does not
        # import: by path, nothing else of the package.
        script = r"""
import importlib.util, sys
import numpy as np
spec = importlib.util.spec_from_file_location("kvshim", sys.argv[1])
k = importlib.util.module_from_spec(spec)
spec.loader.exec_module(k)
shim = k.KvShim.for_device("cpu", library=sys.argv[2])
layout = k.LayoutSpec.mha(k.CacheLayout.CROSS_LAYER_NHD, 2, 1, 1, 4, k.Dtype.FLOAT32)
cache = np.arange(3 * 2 * 2 * 4, dtype=np.float32)
obj = np.zeros(2 * 2 * 4, np.float32)
shim.gather(layout, [cache], [1], [obj])
assert (obj == cache[16:32]).all(), obj
loaded = sorted(m for m in sys.modules if "kvdepot" in m)
print("loaded:", loaded)
"""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        out = subprocess.run(
            [sys.executable, "-c", script, kvshim.__file__, self.shim.library],
            env=env, capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("loaded: []", out.stdout)


class GatherScatterTest(ShimTestCase):
    IDS = [5, 0, 3, 3, 6, 5]  # repeats: fine for a gather
    TO = [2, 6, 0]  # distinct: a scatter's targets

    def check_against_native(self, layout, caches, make_objects):
        """The shim's gather gives the native gather's bytes (whole objects
        and a layer range); its scatter into zeroed caches restores exactly
        those blocks, as the native scatter does."""
        size = layout.object_bytes
        got = make_objects(len(self.IDS), size, 0xA5)
        want = filled(len(self.IDS), size, 0x5A)
        self.shim.gather(layout, caches, self.IDS, got)
        kvdepot.gather(layout, caches, self.IDS, want)
        for i in range(len(self.IDS)):
            self.assertEqual(raw(got[i]), raw(want[i]), f"object {i}")
            self.assertNotEqual(raw(want[i]), bytes([0x5A]) * size)
        # A layer range: the matching slice of each object.
        part = make_objects(2, 2 * layout.layer_bytes, 0)
        self.shim.gather(layout, caches, [6, 0], part, layers=(1, 3))
        lb = layout.layer_bytes
        self.assertEqual(raw(part[0]), raw(want[4])[lb:3 * lb])
        self.assertEqual(raw(part[1]), raw(want[1])[lb:3 * lb])

        # Scatter objects of blocks 5, 3, 6 into blocks 2, 6, 0 of zeroed
        # caches, through the shim and through the native module.
        src = [got[0], got[2], got[4]]
        mine = [self.zeros_like(c) for c in caches]
        ref = [self.zeros_like(c) for c in caches]
        self.shim.scatter(layout, mine, self.TO, src)
        kvdepot.scatter(layout, ref, self.TO, src)
        for m, r in zip(mine, ref):
            self.assertEqual(raw(m), raw(r))
        back = filled(N, size, 0x11)
        kvdepot.gather(layout, mine, list(range(N)), back)
        for b in range(N):
            if b in self.TO:
                self.assertEqual(raw(back[b]), raw(src[self.TO.index(b)]), f"block {b}")
            else:
                self.assertEqual(raw(back[b]), bytes(size), f"block {b} changed")
        # A layer range scattered: only those layers of that block change.
        mine = [self.zeros_like(c) for c in caches]
        self.shim.scatter(layout, mine, [4], [part[0]], layers=(1, 3))
        one = filled(1, size, 0x22)
        kvdepot.gather(layout, mine, [4], one)
        self.assertEqual(raw(one[0]), bytes(lb) + raw(part[0]))

    @staticmethod
    def zeros_like(cache):
        if torch is not None and isinstance(cache, torch.Tensor):
            return torch.zeros_like(cache)
        return np.zeros_like(cache)

    def test_numpy_every_layout_and_dtype(self):
        for dtype in ALL_DTYPES:
            for i, (layout, shapes) in enumerate(layout_cases(dtype)):
                with self.subTest(layout=repr(layout)):
                    caches = random_np_caches(shapes, dtype, seed=10 * int(dtype) + i)
                    self.check_against_native(layout, caches, filled)

    @unittest.skipIf(torch is None, "torch is not installed")
    def test_torch_every_layout_and_dtype(self):
        dtypes = {DT.FLOAT16: torch.float16, DT.BFLOAT16: torch.bfloat16,
                  DT.FLOAT32: torch.float32}
        if hasattr(torch, "float8_e4m3fn"):
            dtypes[DT.FLOAT8_E4M3] = torch.float8_e4m3fn
        g = torch.Generator().manual_seed(5)

        def torch_objects(count, size, value):
            return [torch.full((size,), value, dtype=torch.uint8) for _ in range(count)]

        for dtype, tdtype in dtypes.items():
            for layout, shapes in layout_cases(dtype):
                with self.subTest(layout=repr(layout)):
                    caches = []
                    for shape in shapes:
                        count = int(np.prod(shape)) * torch.tensor([], dtype=tdtype).element_size()
                        bits = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=g)
                        caches.append(bits.view(tdtype).reshape(shape))
                    self.check_against_native(layout, caches, torch_objects)

    def test_layout_spec_and_names_stand_for_kvlayout(self):
        layout, shapes = layout_cases(DT.BFLOAT16)[1]  # FlashAttention HND
        caches = random_np_caches(shapes, DT.BFLOAT16, seed=3)
        spec = LayoutSpec.mha("flash_attn_hnd", L, T, H, HD, "bfloat16")
        a = filled(2, layout.object_bytes, 0)
        b = filled(2, layout.object_bytes, 1)
        self.shim.gather(spec, caches, [1, 4], a)
        kvdepot.gather(layout, caches, [1, 4], b)
        self.assertEqual([raw(x) for x in a], [raw(x) for x in b])
        mla = LayoutSpec.mla(kvshim.CacheLayout.MLA, L, T, LATENT, kvshim.Dtype.FLOAT32)
        self.assertEqual(self.shim.layout_info(mla).object_bytes, L * T * LATENT * 4)

    def test_objects_may_be_any_buffer(self):
        layout, shapes = layout_cases(DT.FLOAT16)[0]
        caches = random_np_caches(shapes, DT.FLOAT16, seed=4)
        size = layout.object_bytes
        want = filled(3, size, 0)
        kvdepot.gather(layout, caches, [0, 1, 2], want)
        pool = bytearray(3 * size)
        views = [memoryview(pool)[i * size:(i + 1) * size] for i in range(2)]
        typed = np.zeros(size // 4, np.float32)  # any element type
        self.shim.gather(layout, caches, [0, 1, 2], views + [typed])
        self.assertEqual(bytes(pool[:2 * size]), raw(want[0]) + raw(want[1]))
        self.assertEqual(raw(typed), raw(want[2]))
        # A scatter reads read-only sources too.
        dst = [np.zeros_like(c) for c in caches]
        self.shim.scatter(layout, dst, [6], [bytes(pool[size:2 * size])])
        back = filled(1, size, 9)
        kvdepot.gather(layout, dst, [6], back)
        self.assertEqual(raw(back[0]), raw(want[1]))


class ErrorTest(ShimTestCase):
    def setUp(self):
        super().setUp()
        self.layout, shapes = layout_cases(DT.BFLOAT16)[3]  # FlashInfer HND
        self.caches = random_np_caches(shapes, DT.BFLOAT16, seed=8)
        self.before = [c.copy() for c in self.caches]
        self.objects = filled(2, self.layout.object_bytes, 0x77)

    def assert_untouched(self):
        for c, b in zip(self.caches, self.before):
            np.testing.assert_array_equal(c, b)
        for o in self.objects:
            self.assertTrue((o == 0x77).all())

    def assert_rejected(self, exc, pattern, *, caches=None, ids=(1, 2), objects=None,
                        layout=None, layers=None, gather=True, scatter=True):
        """The gather and the scatter with these arguments raise `exc`
        matching `pattern` and write nothing."""
        for op, on in (("gather", gather), ("scatter", scatter)):
            if not on:
                continue
            with self.subTest(op=op, pattern=pattern):
                with self.assertRaisesRegex(exc, pattern):
                    getattr(self.shim, op)(
                        self.layout if layout is None else layout,
                        self.caches if caches is None else caches, list(ids),
                        self.objects if objects is None else objects, layers=layers)
                self.assert_untouched()

    def test_a_valid_call_passes(self):
        # The baseline the cases below break one argument of.
        self.shim.gather(self.layout, self.caches, [1, 2], self.objects)
        self.assertFalse((self.objects[0] == 0x77).all())

    def test_block_ids_out_of_range_write_nothing(self):
        for bad in (N, -1, 2 ** 63 - 1):
            self.assert_rejected(ValueError, r"^INVALID_ARGUMENT: block id .* outside",
                                 ids=(0, bad))
        self.assert_rejected(ValueError, "not a 64-bit integer", ids=(0, 2 ** 64))

    def test_scatter_rejects_repeated_ids(self):
        self.assert_rejected(ValueError, "^INVALID_ARGUMENT: block id 3 appears more than once",
                             ids=(3, 3), gather=False)
        self.shim.gather(self.layout, self.caches, [3, 3], self.objects)  # allowed
        self.assertEqual(raw(self.objects[0]), raw(self.objects[1]))

    def test_counts_and_sizes(self):
        self.assert_rejected(ValueError, "takes 3 cache tensors, got 2",
                             caches=self.caches[:2])
        odd = list(self.caches)
        odd[1] = odd[1][:-1]  # one block fewer
        self.assert_rejected(ValueError, r"caches\[1\] has .* the same size", caches=odd)
        part = [c.reshape(-1)[:-1] for c in self.caches]  # not whole blocks
        self.assert_rejected(ValueError, "positive multiple", caches=part)
        short = [self.objects[0], np.zeros(self.layout.object_bytes - 1, np.uint8)]
        self.assert_rejected(ValueError, r"objects\[1\] has \d+ bytes, expected", objects=short)
        self.assert_rejected(ValueError, "3 block ids but 2 objects", ids=(0, 1, 2))

    def test_block_ids_and_layers_must_be_integers(self):
        # Bug: int() made block id 2.9 block 2, layers (0, 1.7) (0, 1).
        self.assert_rejected(TypeError, r"block_ids\[1\] must be an integer", ids=(0, 2.9))
        self.assert_rejected(TypeError, r"block_ids\[0\] must be an integer",
                             ids=(np.float64(1.0), 2))
        self.assert_rejected(TypeError, r"layers\[1\] must be an integer", layers=(0, 1.7))
        self.assert_rejected(TypeError, r"block_ids\[1\] must be an integer", ids=(0, True))
        # Integers of every kind are.
        self.shim.gather(self.layout, self.caches, [np.int64(1), np.int32(2)], self.objects)
        self.shim.gather(self.layout, self.caches, [torch.tensor(1), 2], self.objects)

    def test_gathered_objects_must_not_overlap(self):
        # Bug: two objects sharing bytes were both written, one over the
        # other, where the native module refuses them.
        ob = self.layout.object_bytes
        big = np.full(2 * ob, 0x77, np.uint8)
        self.assert_rejected(ValueError, r"objects\[1\] overlaps objects\[0\]",
                             objects=[big[:ob], big[ob - 2:2 * ob - 2]], scatter=False)
        self.assertTrue((big == 0x77).all())
        self.shim.gather(self.layout, self.caches, [1, 2], [big[:ob], big[ob:]])  # adjacent

    def test_objects_must_lie_apart_from_the_caches(self):
        # Bug: an object inside a cache tensor was taken, and a gather wrote
        # it over the cache it read, a scatter read it from a cache it wrote.
        flat = self.caches[1].reshape(-1).view(np.uint8)
        inside = [flat[:self.layout.object_bytes], self.objects[1]]
        self.before[1] = self.caches[1].copy()
        self.assert_rejected(ValueError, r"objects\[0\] overlaps caches\[1\]",
                             objects=inside)
        # Caches may share bytes (layers sharing one KV cache tensor).
        shared = [self.caches[0]] * len(self.caches)
        self.shim.gather(self.layout, shared, [1, 2], self.objects)
        want = filled(2, self.layout.object_bytes, 0)
        kvdepot.gather(self.layout, shared, [1, 2], want)
        self.assertEqual([bytes(o) for o in self.objects], [bytes(w) for w in want])

    def test_buffers_of_floats_must_have_the_layouts_dtype(self):
        # Bug: an array.array of float32 passed as a bf16 cache (its elements
        # were taken as bytes).
        floats = [array.array("f", c.tobytes()) for c in self.caches]
        self.assert_rejected(ValueError, r"caches\[0\] holds float32 elements but the "
                             r"layout's dtype is BFLOAT16", caches=floats)
        halves = [array.array("H", c.tobytes()) for c in self.caches]  # raw bits: fine
        self.shim.gather(self.layout, halves, [1, 2], self.objects)

    def test_bad_layer_ranges(self):
        for layers in ((0, 0), (2, 1), (0, L + 1), (-1, 1)):
            self.assert_rejected(ValueError, r"^INVALID_ARGUMENT: layer range", layers=layers)

    def test_layer_ranges_that_wrap_in_32_bits_write_nothing(self):
        # ctypes passes the layer range as int32, modulo 2**32: (0, 2**32 + 1)
        # would reach the library as (0, 1) and write a whole layer into the
        # 16-byte object below. The guard bytes after it must stay.
        pool = np.full(2 * self.layout.layer_bytes, 0x77, np.uint8)
        small = [pool[:16]]
        for layers in ((0, 2 ** 32 + 1), (2 ** 32, 2 ** 32 + 1), (-2 ** 32, 1), (-1, 1),
                       (0, 2 ** 64 + 1)):
            self.assert_rejected(ValueError, r"^INVALID_ARGUMENT: layer range",
                                 ids=(1,), objects=small, layers=layers)
            self.assertTrue((pool == 0x77).all(), f"layers {layers} wrote past the object")
        # A valid range still checks the object's size (before: skipped
        # for ranges outside [0, num_layers)).
        self.assert_rejected(ValueError, r"objects\[0\] has 16 bytes, expected",
                             ids=(1,), objects=small, layers=(0, 1))
        self.assertTrue((pool == 0x77).all())

    def test_layout_fields_that_wrap_in_32_bits_are_rejected(self):
        spec = LayoutSpec.mha(K.FLASH_INFER_HND, L, T, H, HD, DT.BFLOAT16)
        for field, value in (("num_layers", 2 ** 32 + L), ("block_size", 2 ** 32 + T),
                             ("num_kv_heads", -2 ** 32 + H), ("head_size", 2 ** 33 + HD),
                             ("num_components", 2 ** 32 + 2),
                             ("layout", 2 ** 32 + int(K.FLASH_INFER_HND)),
                             ("dtype", 2 ** 32 + int(DT.BFLOAT16))):
            bad = spec._replace(**{field: value})
            with self.subTest(field=field):
                with self.assertRaisesRegex(ValueError, f"^INVALID_ARGUMENT: .*{field}.*32-bit"):
                    self.shim.layout_info(bad)
                self.assert_rejected(ValueError, f"^INVALID_ARGUMENT: .*{field}.*32-bit",
                                     layout=bad)

    def test_big_endian_memory_is_rejected(self):
        # Element bytes are stored verbatim, little-endian: a big-endian
        # array would put byte-swapped blocks into the shared namespace.
        layout, shapes = layout_cases(DT.FLOAT16)[0]
        objs = filled(2, layout.object_bytes, 0x77)
        for bad in (">f2", ">i2", ">u2"):
            caches = [np.ones(s, bad) for s in shapes]
            for op in ("gather", "scatter"):
                with self.subTest(dtype=bad, op=op):
                    with self.assertRaisesRegex(ValueError, r"^INVALID_ARGUMENT: caches\[0\] "
                                                r"holds big-endian elements"):
                        getattr(self.shim, op)(layout, caches, [0, 1], objs)
                    self.assertTrue(all((o == 0x77).all() for o in objs))
        size = layout.object_bytes
        caches = [np.ones(s, "<f2") for s in shapes]  # explicitly little-endian: fine
        self.shim.gather(layout, caches, [0, 1], objs)
        with self.assertRaisesRegex(ValueError, r"objects\[1\] holds big-endian"):
            self.shim.gather(layout, caches, [0, 1], [objs[0], np.zeros(size // 4, ">f4")])
        be_buffer = (ctypes.c_int16.__ctype_be__ * (size // 2))()  # a '>h' buffer
        with self.assertRaisesRegex(ValueError, r"objects\[0\] holds big-endian"):
            self.shim.scatter(layout, caches, [0], [be_buffer])
        with self.assertRaisesRegex(ValueError, "buffer holds big-endian"):
            self.shim.register_host(np.zeros(64, ">u4"))

    def test_bad_layouts(self):
        spec = LayoutSpec.mha(K.FLASH_INFER_HND, L, T, H, HD, DT.BFLOAT16)
        self.assert_rejected(ValueError, "INVALID_ARGUMENT: .*2 components",
                             layout=spec._replace(num_components=1))
        self.assert_rejected(ValueError, "INVALID_ARGUMENT: unknown cache layout 9",
                             layout=spec._replace(layout=9))
        self.assert_rejected(ValueError, "INVALID_ARGUMENT: layout 300 is not",
                             layout=spec._replace(layout=300))
        self.assert_rejected(ValueError, "INVALID_ARGUMENT: unknown dtype 0",
                             layout=spec._replace(dtype=0))
        self.assert_rejected(ValueError, "INVALID_ARGUMENT: unknown dtype 'fp64'",
                             layout=spec._replace(dtype="fp64"))
        self.assert_rejected(TypeError, "layout must be", layout=object())

    def test_memory_the_library_cannot_take(self):
        size = self.layout.object_bytes
        self.assert_rejected(ValueError, r"objects\[0\] is read-only",
                             objects=[bytes(size), self.objects[1]], scatter=False)
        strided = np.zeros(2 * size, np.uint8)[::2]
        self.assert_rejected(ValueError, r"objects\[1\] is not C-contiguous",
                             objects=[self.objects[0], strided])
        self.assert_rejected(TypeError, r"objects\[0\] must be", objects=[12345, 1])
        fake = FakeTensor("cuda", 0, size)
        self.assert_rejected(ValueError, r"objects\[1\] is a torch tensor on cuda; the cpu "
                             r"library \(libkvdepot_kv_cpu.so\) moves host memory only",
                             objects=[self.objects[0], fake])
        cuda_caches = [FakeTensor("cuda", 0, c.nbytes) for c in self.caches]
        self.assert_rejected(ValueError, r"caches\[0\] is a torch tensor on cuda",
                             caches=cuda_caches)

    def test_objects_records_and_unicode_are_type_errors(self):
        # As the native module (README: "record and unicode arrays are a
        # TypeError everywhere"): only plain numbers or bytes, from numpy
        # arrays (typestr) and other buffers (struct format) alike. ('<U1'
        # was taken, its element size misread as 1 byte.)
        size = self.layout.object_bytes
        record = [("a", "<i4"), ("b", "<i4")]
        refused = {
            "unicode": np.zeros(size, "<U1"),
            "record": np.zeros(size // 8, record),
            "void": np.zeros(size // 8, "V8"),
            "object": np.empty(size // 8, object),
            "datetime": np.zeros(size // 8, "<M8[s]"),
            "memoryview of records": memoryview(np.zeros(size // 8, record)),
            "memoryview of unicode": memoryview(np.zeros(size // 4, "<U1")),
            "memoryview of objects": memoryview(np.empty(size // 8, object)),
        }
        for name, obj in refused.items():
            with self.subTest(name):
                self.assert_rejected(TypeError, r"^objects\[1\] holds elements of ",
                                     objects=[self.objects[0], obj])
                if name != "datetime":  # numpy exports no buffer of those
                    with self.assertRaises(TypeError):
                        kvdepot.gather(self.layout, self.caches, [1, 2],
                                       [self.objects[0], obj])
        # Plain numbers and bytes of every kind still pass.
        for dtype in ("S1", "?", "<c8", "<f2", "<i8", "u1"):
            with self.subTest(dtype=dtype):
                itemsize = np.dtype(dtype).itemsize
                obj = np.zeros(size // itemsize, dtype)
                self.shim.gather(self.layout, self.caches, [1], [obj])
                want = filled(1, size, 0)
                kvdepot.gather(self.layout, self.caches, [1], want)
                self.assertEqual(obj.tobytes(), want[0].tobytes())
        self.shim.gather(self.layout, self.caches, [1], [memoryview(bytearray(size))])

    @unittest.skipIf(torch is None, "torch is not installed")
    def test_torch_tensors_off_the_host_and_non_contiguous(self):
        meta = [torch.empty(c.shape, dtype=torch.bfloat16, device="meta")
                for c in self.caches]
        self.assert_rejected(ValueError, r"caches\[0\] is a torch tensor on meta", caches=meta)
        t = [torch.from_numpy(c.view(np.int16))[..., ::2] for c in self.caches]
        self.assert_rejected(ValueError, r"caches\[0\] is not contiguous \(nor a permuted "
                             r"view of a contiguous tensor\)", caches=t)
        # A permuted view, but not one of the layout's: [2, N, H, T, D] for
        # FlashInfer HND's logical [N, 2, T, H, D].
        t = [torch.from_numpy(c.view(np.int16)).transpose(0, 1) for c in self.caches]
        self.assert_rejected(ValueError, r"caches\[0\] is a permuted view of shape "
                             r"\[2, 7, 2, 4, 8\] with strides \[64, 128, 32, 8, 1\]",
                             caches=t)

    def test_not_found_is_key_error(self):
        with self.assertRaisesRegex(KeyError, "NOT_FOUND: host memory at"):
            self.shim.unregister_host(np.zeros(16, np.uint8))


class ShapeTest(ShimTestCase):
    """Caches with more than one dimension must have the layout's physical
    shape: layouts share a namespace (the fingerprint leaves the physical
    order out), so a cache of another layout's shape would store, or load,
    wrong blocks for every engine."""

    def check(self, layout, good_shapes, wrong_shapes):
        objs = filled(2, layout.object_bytes, 0x77)
        for wrong in wrong_shapes:
            arrays = random_np_caches([wrong] * len(good_shapes), DT.BFLOAT16, seed=1)
            # A memoryview has the shape of what it views (bug: it was taken
            # as flat bytes, and another layout's array passed through one).
            for kind, caches in (("array", arrays),
                                 ("memoryview", [memoryview(c) for c in arrays])):
                for op in ("gather", "scatter"):
                    with self.subTest(layout=layout.layout.name, shape=wrong, op=op, kind=kind):
                        with self.assertRaisesRegex(
                                ValueError, r"^INVALID_ARGUMENT: caches\[0\] has shape \[.*\]; "
                                r"layout .* takes"):
                            getattr(self.shim, op)(layout, caches, [0, 1], objs)
                        self.assertTrue(all((o == 0x77).all() for o in objs))
        # The right shape, and views of it: raw bits of other widths (the
        # last dimension then counts other elements), flat buffers.
        right = random_np_caches(good_shapes, DT.BFLOAT16, seed=2)
        want = filled(2, layout.object_bytes, 0)
        kvdepot.gather(layout, right, [0, 1], want)
        for name, view in (("uint16", right), ("uint8", [c.view(np.uint8) for c in right]),
                           ("int32", [c.view(np.int32) for c in right]),
                           ("flat", [c.reshape(-1) for c in right]),
                           ("memoryview", [memoryview(c) for c in right]),
                           ("bytes", [c.view(np.uint8).reshape(-1) for c in right])):
            with self.subTest(layout=layout.layout.name, view=name):
                got = filled(2, layout.object_bytes, 0x77)
                self.shim.gather(layout, view, [0, 1], got)
                self.assertEqual([raw(g) for g in got], [raw(w) for w in want])

    def test_flash_attention_nhd(self):
        layout = kvdepot.KvLayout.mha(K.FLASH_ATTN_NHD, L, T, H, HD, DT.BFLOAT16)
        self.check(layout, [(2, N, T, H, HD)] * L,
                   [(N, 2, T, H, HD),  # FlashInfer's
                    (2, N, H, T, HD),  # HND
                    (2, N, T, H * HD), (2 * N, T, H, HD), (2, N, T, 2 * H, HD // 2)])

    def test_every_layout_rejects_the_others_shapes(self):
        cases = layout_cases(DT.BFLOAT16)
        for layout, shapes in cases:
            nbytes = int(np.prod(shapes[0]))
            others = {tuple(s[0]) for _, s in cases
                      if tuple(s[0]) != tuple(shapes[0]) and int(np.prod(s[0])) == nbytes
                      and len(s) == len(shapes)}
            self.check(layout, shapes, sorted(others))

    def test_singleton_dimensions_do_not_order_bytes(self):
        # With one KV head, NHD and HND are the same bytes: either shape fits.
        nhd = kvdepot.KvLayout.mha(K.FLASH_ATTN_NHD, L, T, 1, HD, DT.BFLOAT16)
        self.check(nhd, [(2, N, 1, T, HD)] * L, [(N, 2, T, 1, HD)])
        self.check(nhd, [(2, N, T, 1, HD)] * L, [(2, N, T, HD, 1)])

    @unittest.skipIf(torch is None, "torch is not installed")
    def test_torch_caches(self):
        layout = kvdepot.KvLayout.mha(K.FLASH_ATTN_NHD, L, T, H, HD, DT.BFLOAT16)
        objs = [torch.zeros(layout.object_bytes, dtype=torch.uint8) for _ in range(2)]
        flashinfer = [torch.zeros((N, 2, T, H, HD), dtype=torch.bfloat16) for _ in range(L)]
        with self.assertRaisesRegex(ValueError, r"caches\[0\] has shape \[7, 2, 4, 2, 8\]"):
            self.shim.gather(layout, flashinfer, [0, 1], objs)
        right = [torch.zeros((2, N, T, H, HD), dtype=torch.bfloat16) for _ in range(L)]
        self.shim.gather(layout, right, [0, 1], objs)
        self.shim.gather(layout, [c.view(torch.uint8) for c in right], [0, 1], objs)
        self.shim.gather(layout, [c.view(torch.int16) for c in right], [0, 1], objs)


@unittest.skipIf(torch is None, "torch is not installed")
class PermutedViewTest(ShimTestCase):
    """Torch caches that are permuted views of contiguous tensors -- how
    vLLM builds HND caches: the physical [2, N, H, T, D] tensor permuted to
    the engine's [2, N, T, H, D]. Their strides give the physical order, so
    HND is told from NHD even when block_size == num_kv_heads, where the
    shapes are the same."""

    S = 4  # block_size == num_kv_heads

    # (layout, physical shape, the permutation to the logical shape)
    def cases(self):
        S = self.S
        mha = kvdepot.KvLayout.mha
        return [
            (mha(K.FLASH_ATTN_HND, L, S, S, HD, DT.BFLOAT16), [(2, N, S, S, HD)] * L,
             (0, 1, 3, 2, 4)),
            (mha(K.FLASH_INFER_HND, L, S, S, HD, DT.BFLOAT16), [(N, 2, S, S, HD)] * L,
             (0, 1, 3, 2, 4)),
            (mha(K.CROSS_LAYER_HND, L, S, S, HD, DT.BFLOAT16), [(N, L, 2, S, S, HD)],
             (0, 1, 2, 4, 3, 5)),
        ]

    def test_hnd_views_gather_and_scatter_their_physical_bytes(self):
        for layout, shapes, perm in self.cases():
            with self.subTest(layout=layout.layout.name):
                phys = random_np_caches(shapes, DT.BFLOAT16, seed=3)
                views = [torch.from_numpy(p.view(np.int16)).permute(*perm) for p in phys]
                self.assertFalse(views[0].is_contiguous())
                want = filled(3, layout.object_bytes, 0)
                kvdepot.gather(layout, phys, [6, 1, 6], want)
                got = filled(3, layout.object_bytes, 0x77)
                self.shim.gather(layout, views, [6, 1, 6], got)
                self.assertEqual([raw(g) for g in got], [raw(w) for w in want])
                # As raw bits of another width, too.
                got = filled(3, layout.object_bytes, 0x77)
                self.shim.gather(layout, [v.view(torch.uint8) for v in views], [6, 1, 6],
                                 got)
                self.assertEqual([raw(g) for g in got], [raw(w) for w in want])
                # Scatter through the views writes the physical bytes.
                back = [np.zeros_like(p) for p in phys]
                self.shim.scatter(
                    layout, [torch.from_numpy(b.view(np.int16)).permute(*perm) for b in back],
                    [2], [want[1]])
                ref = [np.zeros_like(p) for p in phys]
                kvdepot.scatter(layout, ref, [2], [want[1]])
                for b, r in zip(back, ref):
                    np.testing.assert_array_equal(b, r)

    def test_an_hnd_view_is_refused_as_nhd_though_the_shapes_agree(self):
        S = self.S
        mha = kvdepot.KvLayout.mha
        for hnd, nhd, shapes, perm in (
                (K.FLASH_ATTN_HND, K.FLASH_ATTN_NHD, [(2, N, S, S, HD)] * L, (0, 1, 3, 2, 4)),
                (K.FLASH_INFER_HND, K.FLASH_INFER_NHD, [(N, 2, S, S, HD)] * L,
                 (0, 1, 3, 2, 4)),
                (K.CROSS_LAYER_HND, K.CROSS_LAYER_NHD, [(N, L, 2, S, S, HD)],
                 (0, 1, 2, 4, 3, 5))):
            layout = mha(nhd, L, S, S, HD, DT.BFLOAT16)
            phys = random_np_caches(shapes, DT.BFLOAT16, seed=4)
            before = [p.copy() for p in phys]
            views = [torch.from_numpy(p.view(np.int16)).permute(*perm) for p in phys]
            objs = filled(2, layout.object_bytes, 0x77)
            for op in ("gather", "scatter"):
                with self.subTest(layout=nhd.name, op=op):
                    with self.assertRaisesRegex(
                            ValueError, r"^INVALID_ARGUMENT: caches\[0\] is a permuted view "
                            r"of shape .* in memory as \[.*H, T, D\]; layout "
                            + nhd.name + r" takes"):
                        getattr(self.shim, op)(layout, views, [0, 1], objs)
                    self.assertTrue(all((o == 0x77).all() for o in objs))
                    for p, b in zip(phys, before):
                        np.testing.assert_array_equal(p, b)
        # And an NHD view (a contiguous tensor permuted to HND order and
        # back is contiguous; permuted to the HND *physical* shape it is a
        # view of the wrong shape) under an HND layout.
        layout = mha(K.FLASH_ATTN_HND, L, T, H, HD, DT.BFLOAT16)
        nhd_view = [torch.zeros((2, N, T, H, HD), dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)
                    for _ in range(L)]
        with self.assertRaisesRegex(ValueError, r"caches\[0\] is a permuted view of shape "
                                    r"\[2, 7, 2, 4, 8\]"):
            self.shim.gather(layout, nhd_view, [0], filled(1, layout.object_bytes, 0))


class RegisterHostTest(ShimTestCase):
    def test_register_and_unregister(self):
        buf = np.zeros(1 << 16, np.uint8)
        self.shim.register_host(buf)
        try:
            with self.assertRaisesRegex(RuntimeError, "^ALREADY_EXISTS: "):
                self.shim.register_host(buf)
            # A registered buffer works as objects (and its views do).
            layout, shapes = layout_cases(DT.FLOAT32)[5]
            caches = random_np_caches(shapes, DT.FLOAT32, seed=2)
            size = layout.object_bytes
            self.shim.gather(layout, caches, [4], [buf[:size]])
            want = filled(1, size, 0)
            kvdepot.gather(layout, caches, [4], want)
            self.assertEqual(raw(buf[:size]), raw(want[0]))
        finally:
            self.shim.unregister_host(buf)
        with self.assertRaisesRegex(KeyError, "NOT_FOUND"):
            self.shim.unregister_host(buf)
        self.shim.register_host(buf)  # again, after unregistering
        self.shim.unregister_host(buf)

    def test_bad_buffers(self):
        with self.assertRaisesRegex(ValueError, "^INVALID_ARGUMENT: cannot register 0 bytes"):
            self.shim.register_host(np.zeros(0, np.uint8))
        with self.assertRaisesRegex(ValueError, "buffer is read-only"):
            self.shim.register_host(bytes(64))
        with self.assertRaisesRegex(ValueError, "buffer is a tensor on cuda"):
            self.shim.register_host(FakeTensor("cuda", 0, 64))


class StagingBufferTest(unittest.TestCase):
    """Objects in a live kvdepotd client's allocate_buffer memory (a numpy
    uint8 array of UCX-allocated memory), registered as the CUDA path needs
    them: gather into it, put and get it back, scatter from it."""

    def setUp(self):
        self.daemon = Daemon()
        self.client = kvdepot.Client(self.daemon.address, timeout_s=10)
        self.shim = KvShim.for_device("cpu")

    def tearDown(self):
        del self.client
        self.daemon.stop()

    def test_gather_put_get_scatter_through_allocated_memory(self):
        layout, shapes = layout_cases(DT.BFLOAT16)[0]
        caches = random_np_caches(shapes, DT.BFLOAT16, seed=12)
        size = layout.object_bytes
        try:
            pool = self.client.allocate_buffer(4 * size)
        except RuntimeError as e:  # pragma: no cover
            self.skipTest(f"no UCX memory here: {e}")
        self.assertIsInstance(pool, np.ndarray)
        self.shim.register_host(pool)
        try:
            objs = [pool[i * size:(i + 1) * size] for i in range(4)]
            self.shim.gather(layout, caches, [6, 1], objs[:2])
            want = filled(2, size, 0)
            kvdepot.gather(layout, caches, [6, 1], want)
            self.assertEqual([raw(o) for o in objs[:2]], [raw(w) for w in want])
            ns = layout.namespace_for("pytest-kvshim")
            self.assertEqual(self.client.put(ns, [b"a", b"b"], objs[:2]), [True, True])
            self.assertEqual(self.client.get_into(ns, [b"a", b"b"], objs[2:]), [True, True])
            dst = [np.zeros_like(c) for c in caches]
            self.shim.scatter(layout, dst, [0, 3], objs[2:])
            back = filled(2, size, 1)
            kvdepot.gather(layout, dst, [0, 3], back)
            self.assertEqual([raw(b) for b in back], [raw(w) for w in want])
        finally:
            self.shim.unregister_host(pool)


@unittest.skipUnless(os.path.exists(os.environ.get("KVDEPOT_KV_CUDA_LIB", "")),
                     "the CUDA library is not built (KVDEPOT_KV_CUDA_LIB)")
class CudaLibraryWithoutGpuTest(unittest.TestCase):
    """The CUDA library's checks that run before any device work. On a
    machine with a GPU, tests/gpu/test_cuda_kvshim.py covers the rest."""

    def setUp(self):
        self.path = os.environ["KVDEPOT_KV_CUDA_LIB"]

    def test_for_device_needs_a_usable_gpu(self):
        if os.path.exists("/dev/nvidiactl"):
            self.skipTest("this machine has an NVIDIA driver")
        with self.assertRaisesRegex(RuntimeError, "^FAILED_PRECONDITION: cudaGetDevice"):
            KvShim.for_device("cuda", library=self.path)

    def test_memory_checks_before_the_library_is_called(self):
        shim = KvShim(self.path)  # no device probe
        self.assertEqual(shim.backend, "cuda")
        layout, shapes = layout_cases(DT.FLOAT16)[0]
        host = random_np_caches(shapes, DT.FLOAT16, seed=1)
        objs = filled(1, layout.object_bytes, 0)
        with self.assertRaisesRegex(ValueError, r"caches\[0\] is host memory; the cuda "
                                    r"library \(libkvdepot_kv_cuda.so\) moves blocks of CUDA"):
            shim.gather(layout, host, [0], objs)
        on0 = [FakeTensor("cuda", 0, c.nbytes) for c in host]
        with self.assertRaisesRegex(ValueError, r"objects\[0\] is on cuda:1, the caches on "
                                    r"cuda:0"):
            shim.gather(layout, on0, [0], [FakeTensor("cuda", 1, layout.object_bytes)])
        with self.assertRaisesRegex(ValueError, r"objects\[0\] is a tensor on mps"):
            shim.scatter(layout, on0, [0], [FakeTensor("mps", 0, layout.object_bytes)])

    def test_a_streams_device_is_current_while_it_is_synchronized(self):
        # The default stream of cuda:1 is the handle 0: the legacy default
        # stream of whichever device is current. With cuda:0 current, the
        # library must still wait on cuda:1's.
        shim = KvShim(self.path)
        current = [0]
        seen = []

        class FakeCuda:
            @staticmethod
            @contextlib.contextmanager
            def device(d):
                before, current[0] = current[0], d
                try:
                    yield
                finally:
                    current[0] = before

        class Stream:
            device = 1
            cuda_stream = 0

        def synchronize(handle, err, cap):
            seen.append((handle, current[0]))
            return 0

        shim._lib = types.SimpleNamespace(kvdepot_kv_synchronize=synchronize)
        with mock.patch.dict(sys.modules, {"torch": types.SimpleNamespace(cuda=FakeCuda)}):
            shim.synchronize(Stream())
        self.assertEqual(seen, [(None, 1)])
        self.assertEqual(current[0], 0)


if __name__ == "__main__":
    unittest.main()
