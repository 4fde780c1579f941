#!/usr/bin/env python3
"""GPU check of the CUDA C ABI library (libkvdepot_kv_cuda.so) through the
ctypes shim (client/python/kvdepot/kvshim.py), against the CPU library
(libkvdepot_kv_cpu.so) as the reference. For a machine with an NVIDIA GPU
and torch with CUDA; needs no daemon, no pytest and not the native module
_kvdepot (which is built for another Python): kvshim.py is loaded by path,
alone.

Checks, for every layout and dtype (fp8 where torch has float8_e4m3fn) on
two geometries (16-byte rows, and odd 3-element rows):
  * CUDA gather (random block ids with repeats) into page-locked host memory
    (pin_memory tensors) and into device memory, whole objects and a layer
    range, equals the CPU library's gather of the same cache copied to the
    host, byte for byte; one case large enough for several kernel launches;
  * CUDA scatter from registered pageable buffers (numpy; /dev/shm shared
    memory, as UCX allocates staging buffers) and from pinned tensors into a
    zeroed GPU cache restores exactly those blocks and nothing else;
  * an unregistered pageable buffer is a clear ValueError and nothing is
    written (unless the device reads pageable memory, HMM/ATS: then it must
    work);
  * out-of-range and (scatter) repeated ids write nothing;
  * torch's current stream is honoured (and an explicit stream): the copy
    is ordered after earlier work on a non-default stream and is
    asynchronous;
  * kvdepot/_device_load.py (KvCacheStore.load_async's path for CUDA
    caches), with a stand-in of the client (no daemon there): each
    wait_for_layer scatters the layers up to it, on the current stream,
    from registered staging; the rest follows in wait(); a miss is untouched;
    a wait_for_layer from another stream (also after a polling thread
    queued every layer with ready_layers) orders that stream after the
    scatters: a copy queued on it right after sees every layer.

Usage:
  python3 tests/gpu/test_cuda_kvshim.py [--cuda-lib PATH] [--cpu-lib PATH]
                                        [--kvshim PATH] [unittest args, e.g. -v]
Defaults: $KVDEPOT_KV_CUDA_LIB / $KVDEPOT_KV_CPU_LIB / $KVDEPOT_KVSHIM, else
the first of <repo>/{build-gpu,build}/{python/kvdepot,gpu}/libkvdepot_kv_*.so
that exists, and <repo>/client/python/kvdepot/kvshim.py. Build the
libraries with e.g.
  cmake -S . -B build-gpu -G Ninja && ninja -C build-gpu kvdepot_kv_cuda kvdepot_kv_cpu

Exit: 0 all passed, 1 a failure (or a library missing), 77 no numpy, no
torch, or no CUDA device visible to torch.
"""

import argparse
import contextlib
import ctypes
import importlib.util
import mmap
import os
import random
import sys
import tempfile
import threading
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import numpy as np
    import torch
except ImportError as e:
    print(f"test_cuda_kvshim: {e}; skipping", file=sys.stderr)
    sys.exit(77)
if not torch.cuda.is_available():
    print("test_cuda_kvshim: torch sees no CUDA device; skipping", file=sys.stderr)
    sys.exit(77)

kvshim = None  # the module, loaded by path in main()
CPU = None  # KvShim of the CPU library
CUDA = None  # KvShim of the CUDA library
DEV = torch.device("cuda", 0)

GEOMETRIES = [  # (layers, blocks, tokens, heads, head size, latent size)
    (4, 24, 16, 4, 64, 576),
    (3, 11, 5, 3, 3, 7),
]


def torch_dtypes():
    """kvshim.Dtype -> torch dtype (None: this torch has no such dtype)."""
    D = kvshim.Dtype
    return {D.FLOAT16: torch.float16, D.BFLOAT16: torch.bfloat16,
            D.FLOAT32: torch.float32,
            D.FLOAT8_E4M3: getattr(torch, "float8_e4m3fn", None)}


def cases(dtype, geometry):
    """(LayoutSpec, cache tensor shapes) for every layout, plus the
    one-latent cross-layer layout."""
    L, N, T, H, HD, LAT = geometry
    C, S = kvshim.CacheLayout, kvshim.LayoutSpec
    return [
        (S.mha(C.FLASH_ATTN_NHD, L, T, H, HD, dtype), [(2, N, T, H, HD)] * L),
        (S.mha(C.FLASH_ATTN_HND, L, T, H, HD, dtype), [(2, N, H, T, HD)] * L),
        (S.mha(C.FLASH_INFER_NHD, L, T, H, HD, dtype), [(N, 2, T, H, HD)] * L),
        (S.mha(C.FLASH_INFER_HND, L, T, H, HD, dtype), [(N, 2, H, T, HD)] * L),
        (S.mla(C.MLA, L, T, LAT, dtype), [(N, T, LAT)] * L),
        (S.mha(C.CROSS_LAYER_NHD, L, T, H, HD, dtype), [(N, L, 2, T, H, HD)]),
        (S.mha(C.CROSS_LAYER_HND, L, T, H, HD, dtype), [(N, L, 2, H, T, HD)]),
        (S.mla(C.CROSS_LAYER_NHD, L, T, LAT, dtype), [(N, L, 1, T, 1, LAT)]),
    ]


def every_case():
    """(name, LayoutSpec, shapes, torch dtype or None) over dtypes, layouts
    and geometries."""
    for dtype, tdtype in torch_dtypes().items():
        for g, geometry in enumerate(GEOMETRIES):
            for spec, shapes in cases(dtype, geometry):
                name = f"{kvshim.CacheLayout(spec.layout).name}/{dtype.name}/geometry{g}"
                yield name, spec, shapes, tdtype


def num_blocks(spec, shapes):
    """N of a cache: the second dimension of the FlashAttention layouts
    ([2, N, ...]), the first of the others."""
    C = kvshim.CacheLayout
    per_layer_kv = spec.layout in (C.FLASH_ATTN_NHD, C.FLASH_ATTN_HND)
    return shapes[0][1] if per_layer_kv else shapes[0][0]


def random_gpu_caches(shapes, tdtype, gen):
    out = []
    esize = torch.tensor([], dtype=tdtype).element_size()
    for shape in shapes:
        count = int(np.prod(shape)) * esize
        bits = torch.randint(0, 256, (count,), dtype=torch.uint8, device=DEV, generator=gen)
        out.append(bits.view(tdtype).reshape(shape))
    return out


def host_copies(caches):
    torch.cuda.synchronize()
    return [c.cpu() for c in caches]


def raw(t):
    """The bytes of a tensor (any device) or numpy array."""
    if isinstance(t, torch.Tensor):
        return t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
    return np.ascontiguousarray(t).view(np.uint8).tobytes()


def cpu_objects(spec, host_caches, ids, layers=None):
    """The CPU library's gather: the reference bytes."""
    info = CPU.layout_info(spec)
    begin, end = layers or (0, spec.num_layers)
    objs = [np.zeros((end - begin) * info.layer_bytes, np.uint8) for _ in ids]
    CPU.gather(spec, host_caches, ids, objs, layers=layers)
    return [o.tobytes() for o in objs]


def pageable_access():
    """CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS of device 0 (driver API):
    whether kernels may read pageable host memory (HMM/ATS)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    if cuda.cuInit(0) != 0:
        raise RuntimeError("cuInit failed")
    dev = ctypes.c_int()
    value = ctypes.c_int()
    if cuda.cuDeviceGet(ctypes.byref(dev), 0) != 0 or cuda.cuDeviceGetAttribute(
            ctypes.byref(value), 88, dev) != 0:  # 88: PAGEABLE_MEMORY_ACCESS
        raise RuntimeError("cuDeviceGetAttribute failed")
    return value.value != 0


class CudaKvShimTest(unittest.TestCase):
    def assertSameBytes(self, got, want, what="object"):
        """Lists of byte strings equal; on failure names the first differing
        one and its first differing byte (no difflib: it would take minutes
        over megabytes)."""
        if len(got) != len(want):
            self.fail(f"{len(got)} {what}s, expected {len(want)}")
        for i, (g, w) in enumerate(zip(got, want)):
            if g == w:
                continue
            if len(g) != len(w):
                self.fail(f"{what} {i}: {len(g)} bytes, expected {len(w)}")
            at = next(k for k in range(len(g)) if g[k] != w[k])
            name = what if len(got) == 1 else f"{what} {i} of {len(got)}"
            self.fail(f"{name} differs first at byte {at} of {len(g)}: "
                      f"{g[at]:#04x}, expected {w[at]:#04x}")

    def setUp(self):
        torch.cuda.set_device(DEV)
        self.gen = torch.Generator(device=DEV).manual_seed(1234)
        self.rng = random.Random(99)

    def test_library_and_torch_agree_on_the_device(self):
        self.assertEqual(CUDA.backend, "cuda")
        self.assertEqual(CPU.backend, "cpu")
        self.assertEqual(CUDA.current_device(), torch.cuda.current_device())

    def test_gather_into_pinned_and_device_memory_equals_the_cpu_library(self):
        for name, spec, shapes, tdtype in every_case():
            with self.subTest(case=name):
                if tdtype is None:
                    self.skipTest("this torch has no float8_e4m3fn")
                N = num_blocks(spec, shapes)
                caches = random_gpu_caches(shapes, tdtype, self.gen)
                host = host_copies(caches)
                info = CUDA.layout_info(spec)
                ids = [self.rng.randrange(N) for _ in range(2 * N)]  # repeats
                want = cpu_objects(spec, host, ids)

                pinned = [torch.full((info.object_bytes,), 0xA5, dtype=torch.uint8).pin_memory()
                          for _ in ids]
                CUDA.gather(spec, caches, ids, pinned)
                CUDA.synchronize()
                self.assertSameBytes([raw(p) for p in pinned], want)

                # Device objects: views of one pool, as an engine would hold them.
                pool = torch.full((len(ids) * info.object_bytes,), 0x5A, dtype=torch.uint8,
                                  device=DEV)
                objs = list(pool.split(info.object_bytes))
                CUDA.gather(spec, caches, ids, objs)
                self.assertSameBytes([raw(o) for o in objs], want)  # .cpu() orders after it

                layers = (1, spec.num_layers)
                part = [torch.zeros(((layers[1] - layers[0]) * info.layer_bytes,),
                                    dtype=torch.uint8).pin_memory() for _ in ids[:5]]
                CUDA.gather(spec, caches, ids[:5], part, layers=layers)
                CUDA.synchronize()
                self.assertSameBytes([raw(p) for p in part],
                                     cpu_objects(spec, host, ids[:5], layers))

    def test_gather_of_many_blocks_and_layers_takes_several_launches(self):
        # More than 192 blocks and 64 layers per launch (gpu/README.md).
        spec = kvshim.LayoutSpec.mha(kvshim.CacheLayout.CROSS_LAYER_HND, 70, 2, 2, 8,
                                     kvshim.Dtype.BFLOAT16)
        N = 50
        caches = random_gpu_caches([(N, 70, 2, 2, 2, 8)], torch.bfloat16, self.gen)
        host = host_copies(caches)
        ids = [self.rng.randrange(N) for _ in range(450)]
        size = CUDA.layout_info(spec).object_bytes
        objs = list(torch.zeros((len(ids) * size,), dtype=torch.uint8, device=DEV).split(size))
        CUDA.gather(spec, caches, ids, objs)
        self.assertSameBytes([raw(o) for o in objs], cpu_objects(spec, host, ids))

    def check_scatter(self, spec, shapes, tdtype, sources_of):
        """Scatters the CPU library's objects of 3 random blocks into other
        blocks of a zeroed GPU cache, from the buffers sources_of(objects)
        returns (registering and unregistering them around the scatter);
        exactly those blocks change."""
        N = num_blocks(spec, shapes)
        host = host_copies(random_gpu_caches(shapes, tdtype, self.gen))
        src_ids = self.rng.sample(range(N), 3)
        to_ids = self.rng.sample(range(N), 3)
        objects = cpu_objects(spec, host, src_ids)
        dst = [torch.zeros(s, dtype=tdtype, device=DEV) for s in shapes]
        with sources_of(objects) as buffers:
            CUDA.scatter(spec, dst, to_ids, buffers)
            CUDA.synchronize()  # before the sources go
            del buffers
        back = cpu_objects(spec, host_copies(dst), list(range(N)))
        size = CUDA.layout_info(spec).object_bytes
        for b in range(N):
            if b in to_ids:
                self.assertSameBytes([back[b]], [objects[to_ids.index(b)]], f"block {b}")
            else:
                self.assertSameBytes([back[b]], [bytes(size)], f"(zeroed) block {b}")

    @staticmethod
    @contextlib.contextmanager
    def registered_pool(pool, objects):
        """The objects copied into the pageable uint8 array `pool`, which
        is registered while the views of them are in use."""
        size = len(objects[0])
        for i, o in enumerate(objects):
            pool[i * size:(i + 1) * size] = np.frombuffer(o, np.uint8)
        CUDA.register_host(pool)
        try:
            yield [pool[i * size:(i + 1) * size] for i in range(len(objects))]
        finally:
            CUDA.unregister_host(pool)

    @classmethod
    def registered_numpy(cls, objects):
        """The objects in one pageable numpy array, registered."""
        return cls.registered_pool(np.empty(len(objects) * len(objects[0]), np.uint8),
                                   objects)

    @staticmethod
    @contextlib.contextmanager
    def registered_shm(objects):
        """The objects in a MAP_SHARED mapping of a /dev/shm file, as UCX's
        posix shared memory allocates staging buffers, registered."""
        size = len(objects[0])
        total = -(-len(objects) * size // mmap.PAGESIZE) * mmap.PAGESIZE
        with tempfile.TemporaryFile(dir="/dev/shm") as f:
            f.truncate(total)
            # Not closed here: the views handed out keep it exported; it is
            # unmapped when the last of them goes.
            mapping = mmap.mmap(f.fileno(), total, mmap.MAP_SHARED)
        with CudaKvShimTest.registered_pool(np.frombuffer(mapping, np.uint8),
                                            objects) as views:
            yield views

    @staticmethod
    @contextlib.contextmanager
    def pinned_tensors(objects):
        """The objects in page-locked torch tensors."""
        yield [torch.frombuffer(bytearray(o), dtype=torch.uint8).pin_memory()
               for o in objects]

    def test_scatter_from_registered_and_pinned_buffers_restores_those_blocks(self):
        sources = {"registered numpy": self.registered_numpy,
                   "registered /dev/shm": self.registered_shm,
                   "pinned tensors": self.pinned_tensors}
        for name, spec, shapes, tdtype in every_case():
            for source, sources_of in sources.items():
                with self.subTest(case=name, source=source):
                    if tdtype is None:
                        self.skipTest("this torch has no float8_e4m3fn")
                    if source == "registered /dev/shm" and not os.path.isdir("/dev/shm"):
                        self.skipTest("no /dev/shm")
                    self.check_scatter(spec, shapes, tdtype, sources_of)

    def test_unregistered_pageable_buffers(self):
        spec, shapes = cases(kvshim.Dtype.BFLOAT16, GEOMETRIES[0])[0]
        caches = random_gpu_caches(shapes, torch.bfloat16, self.gen)
        host = host_copies(caches)
        size = CUDA.layout_info(spec).object_bytes
        objs = [np.full(size, 0x33, np.uint8) for _ in range(2)]
        if pageable_access():
            # HMM/ATS: the library lets the kernels read pageable memory.
            CUDA.gather(spec, caches, [1, 2], objs)
            CUDA.synchronize()
            self.assertSameBytes([o.tobytes() for o in objs], cpu_objects(spec, host, [1, 2]))
            self.skipTest("this device reads pageable memory (HMM/ATS): no error to see")
        with self.assertRaisesRegex(ValueError, r"^INVALID_ARGUMENT: object buffer 0 is "
                                    r"pageable host memory.*register_host"):
            CUDA.gather(spec, caches, [1, 2], objs)
        CUDA.synchronize()
        self.assertTrue(all((o == 0x33).all() for o in objs))
        with self.assertRaisesRegex(ValueError, "pageable host memory"):
            CUDA.scatter(spec, caches, [1, 2], objs)
        self.assertSameBytes([raw(c) for c in host_copies(caches)], [raw(h) for h in host],
                             "cache tensor")

    def test_bad_ids_write_nothing(self):
        spec, shapes = cases(kvshim.Dtype.FLOAT16, GEOMETRIES[0])[1]  # HND
        N = num_blocks(spec, shapes)
        caches = random_gpu_caches(shapes, torch.float16, self.gen)
        host = host_copies(caches)
        size = CUDA.layout_info(spec).object_bytes
        objs = [torch.full((size,), 0x44, dtype=torch.uint8).pin_memory() for _ in range(3)]
        for bad in (N, -1):
            with self.assertRaisesRegex(ValueError, "INVALID_ARGUMENT: block id .* outside"):
                CUDA.gather(spec, caches, [0, 1, bad], objs)
            with self.assertRaisesRegex(ValueError, "INVALID_ARGUMENT: block id .* outside"):
                CUDA.scatter(spec, caches, [bad, 0, 1], objs)
        with self.assertRaisesRegex(ValueError, "appears more than once"):
            CUDA.scatter(spec, caches, [2, 5, 2], objs)
        CUDA.synchronize()
        self.assertSameBytes([raw(o) for o in objs], [b"\x44" * size] * len(objs))
        self.assertSameBytes([raw(c) for c in host_copies(caches)], [raw(h) for h in host],
                             "cache tensor")

    def test_host_caches_are_rejected(self):
        spec, shapes = cases(kvshim.Dtype.FLOAT32, GEOMETRIES[1])[0]
        host = [torch.zeros(s) for s in shapes]
        with self.assertRaisesRegex(ValueError, r"caches\[0\] is host memory"):
            CUDA.gather(spec, host, [0], [torch.zeros(CUDA.layout_info(spec).object_bytes,
                                                      dtype=torch.uint8)])

    def check_stream_order(self, explicit):
        """Work queued before the gather on a non-default stream (a long
        sleep, then a rewrite of the cache) must come first: the gather sees
        the rewritten cache. On the legacy default stream it would not wait
        for that (torch's pool streams do not synchronize with it)."""
        spec, shapes = cases(kvshim.Dtype.BFLOAT16, GEOMETRIES[0])[5]  # cross-layer NHD
        caches = random_gpu_caches(shapes, torch.bfloat16, self.gen)
        new = random_gpu_caches(shapes, torch.bfloat16, self.gen)
        torch.cuda.synchronize()
        ids = [3, 0, 7]
        want = cpu_objects(spec, host_copies(new), ids)
        self.assertTrue(want != cpu_objects(spec, host_copies(caches), ids),
                        "the rewrite must change the gathered blocks")
        size = CUDA.layout_info(spec).object_bytes
        objs = [torch.zeros((size,), dtype=torch.uint8).pin_memory() for _ in ids]
        if not hasattr(torch.cuda, "_sleep"):
            self.skipTest("this torch has no torch.cuda._sleep to hold the stream")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(500_000_000)  # ~0.25 s on the stream
            caches[0].copy_(new[0])
            if explicit:
                with torch.cuda.stream(torch.cuda.default_stream()):
                    CUDA.gather(spec, caches, ids, objs, stream=stream)
            else:
                CUDA.gather(spec, caches, ids, objs)
        self.assertFalse(stream.query(), "the gather waited for the stream")
        CUDA.synchronize(stream)
        self.assertTrue(stream.query())
        self.assertSameBytes([raw(o) for o in objs], want)

    def test_the_current_stream_is_honoured(self):
        self.check_stream_order(explicit=False)

    def test_an_explicit_stream_is_honoured(self):
        self.check_stream_order(explicit=True)


class _ArrivedGet:
    """A stand-in of a finished Client.get_into_async batch (there is no
    kvdepotd on the GPU machine): copies the stored objects into the
    staging buffers; a key not stored is a NOT_FOUND block."""

    def __init__(self, stored, keys, buffers):
        self._errors = []
        for k, b in zip(keys, buffers):
            if k in stored:
                b[:] = np.frombuffer(stored[k], np.uint8)
                self._errors.append(None)
            else:
                self._errors.append(("NOT_FOUND", "not stored"))

    def wait(self, timeout=None):
        return True

    def ready(self):
        return True

    def errors(self):
        return list(self._errors)


class _StandInClient:
    def __init__(self, stored):
        self.stored = stored

    def get_into_async(self, ns, keys, buffers):
        return _ArrivedGet(self.stored, keys, buffers)


class DeviceLoadTest(unittest.TestCase):
    """kvdepot/_device_load.py (what KvCacheStore.load_async runs for CUDA
    caches) with the CUDA library: each wait_for_layer enqueues the
    scatter of the layers up to it on the current stream, from registered
    staging memory; wait() finishes and synchronizes; a miss is untouched."""

    @staticmethod
    def device_load_module():
        path = os.path.join(REPO, "client", "python", "kvdepot", "_device_load.py")
        spec_ = importlib.util.spec_from_file_location("kvdepot_device_load", path)
        mod = importlib.util.module_from_spec(spec_)
        spec_.loader.exec_module(mod)
        return mod

    def test_layers_are_scattered_on_the_current_stream_as_asked(self):
        mod = self.device_load_module()
        gen = torch.Generator(device=DEV).manual_seed(5)
        for spec, shapes in cases(kvshim.Dtype.BFLOAT16, GEOMETRIES[0]):
            with self.subTest(layout=kvshim.CacheLayout(spec.layout).name):
                L, N = spec.num_layers, num_blocks(spec, shapes)
                info = CUDA.layout_info(spec)
                host = host_copies(random_gpu_caches(shapes, torch.bfloat16, gen))
                objects = cpu_objects(spec, host, [0, 1, 2])
                stored = {b"k0": objects[0], b"k1": objects[1], b"k2": objects[2]}
                pool = np.zeros(4 * info.object_bytes, np.uint8)
                CUDA.register_host(pool)
                try:
                    staging = [pool[i * info.object_bytes:(i + 1) * info.object_bytes]
                               for i in range(4)]
                    dst = [torch.zeros(s, dtype=torch.bfloat16, device=DEV) for s in shapes]
                    ids = [N - 1, N - 2, N - 3, N - 4]
                    side = torch.cuda.Stream(DEV)
                    # The zero fill ran on the current stream: the scatters
                    # on `side` must come after it.
                    side.wait_stream(torch.cuda.current_stream(DEV))
                    load = mod.DeviceLoad(
                        _StandInClient(stored), "ns", [b"k2", b"missing", b"k0", b"k1"],
                        staging, spec, CUDA, dst, ids, [2, 2],
                        lambda: torch.cuda.current_stream(DEV))
                    with torch.cuda.stream(side):
                        self.assertTrue(load.wait_for_layer(0))
                    side.synchronize()
                    got0 = cpu_objects(spec, host_copies(dst), ids, layers=(0, 1))
                    rest = cpu_objects(spec, host_copies(dst), ids, layers=(1, L))
                    for i, src in ((0, 2), (2, 0), (3, 1)):
                        self.assertEqual(got0[i], objects[src][:info.layer_bytes])
                        self.assertEqual(rest[i], bytes(len(rest[i])))  # not yet
                    with torch.cuda.stream(side):
                        self.assertTrue(load.wait())
                    self.assertEqual([e is None for e in load.errors()],
                                     [True, False, True, True])
                    got = cpu_objects(spec, host_copies(dst), list(range(N)))
                    for b in range(N):
                        want = {ids[0]: objects[2], ids[2]: objects[0],
                                ids[3]: objects[1]}.get(b, bytes(info.object_bytes))
                        self.assertEqual(got[b], want, f"block {b}")
                    del load
                finally:
                    CUDA.unregister_host(pool)

    def check_another_stream_sees_the_layers(self, poll):
        """The load's scatters go on stream `held` (its first enqueueing
        caller's), queued behind ~0.25 s of sleep; a wait_for_layer from
        another stream, `reader`, must order that stream after them: a
        copy of the caches queued on `reader` right after it returns sees
        every layer. With `poll`, another thread (current stream `held`)
        queues every layer through ready_layers first, as an engine's
        polling thread would; else the first wait_for_layer, on `held`,
        queues layer 0 and the reader's queues the rest."""
        if not hasattr(torch.cuda, "_sleep"):
            self.skipTest("this torch has no torch.cuda._sleep to hold the stream")
        mod = self.device_load_module()
        gen = torch.Generator(device=DEV).manual_seed(6)
        spec, shapes = cases(kvshim.Dtype.BFLOAT16, GEOMETRIES[0])[0]  # FlashAttention NHD
        L = spec.num_layers
        info = CUDA.layout_info(spec)
        host = host_copies(random_gpu_caches(shapes, torch.bfloat16, gen))
        objects = cpu_objects(spec, host, [0, 1])
        stored = {b"k0": objects[0], b"k1": objects[1]}
        pool = np.zeros(2 * info.object_bytes, np.uint8)
        CUDA.register_host(pool)
        try:
            staging = [pool[i * info.object_bytes:(i + 1) * info.object_bytes]
                       for i in range(2)]
            dst = [torch.zeros(s, dtype=torch.bfloat16, device=DEV) for s in shapes]
            held, reader = torch.cuda.Stream(DEV), torch.cuda.Stream(DEV)
            held.wait_stream(torch.cuda.current_stream(DEV))  # after the zero fill
            reader.wait_stream(torch.cuda.current_stream(DEV))
            ids = [3, 5]
            load = mod.DeviceLoad(_StandInClient(stored), "ns", [b"k0", b"k1"], staging,
                                  spec, CUDA, dst, ids, [2],
                                  lambda: torch.cuda.current_stream(DEV))
            with torch.cuda.stream(held):
                torch.cuda._sleep(500_000_000)  # ~0.25 s before any scatter runs
            if poll:
                seen = []

                def poller():
                    with torch.cuda.stream(held):
                        seen.append(load.ready_layers())

                t = threading.Thread(target=poller)
                t.start()
                t.join()
                self.assertEqual(seen, [L])
            else:
                with torch.cuda.stream(held):
                    self.assertTrue(load.wait_for_layer(0))
            self.assertFalse(held.query(), "the scatters ran before the test could look")
            with torch.cuda.stream(reader):
                self.assertTrue(load.wait_for_layer(L - 1))
                snapshot = [d.clone() for d in dst]  # on reader, after the wait
                done = torch.cuda.Event()
                done.record(reader)
            done.synchronize()
            got = cpu_objects(spec, [s.cpu() for s in snapshot], ids)
            CudaKvShimTest.assertSameBytes(self, got, objects,
                                           "block seen from the reader's stream")
            self.assertTrue(load.wait())  # synchronized: the staging is free again
        finally:
            CUDA.unregister_host(pool)

    def test_a_wait_from_another_stream_sees_the_layers(self):
        self.check_another_stream_sees_the_layers(poll=False)

    def test_a_wait_after_a_polling_thread_queued_the_layers_sees_them(self):
        self.check_another_stream_sees_the_layers(poll=True)


def find_library(backend, given):
    candidates = [given] if given else [
        os.path.join(REPO, build, where, f"libkvdepot_kv_{backend}.so")
        for build in ("build-gpu", "build") for where in ("python/kvdepot", "gpu")]
    for path in candidates:
        if path and os.path.exists(path):
            return path
    print(f"test_cuda_kvshim: libkvdepot_kv_{backend}.so not found (tried "
          f"{', '.join(candidates)}); build it (ninja kvdepot_kv_{backend}) or pass "
          f"--{backend}-lib", file=sys.stderr)
    sys.exit(1)


def main():
    global kvshim, CPU, CUDA
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuda-lib", default=os.environ.get("KVDEPOT_KV_CUDA_LIB"))
    parser.add_argument("--cpu-lib", default=os.environ.get("KVDEPOT_KV_CPU_LIB"))
    parser.add_argument("--kvshim", default=os.environ.get("KVDEPOT_KVSHIM") or os.path.join(
        REPO, "client", "python", "kvdepot", "kvshim.py"))
    args, rest = parser.parse_known_args()
    spec = importlib.util.spec_from_file_location("kvshim", args.kvshim)
    kvshim = importlib.util.module_from_spec(spec)
    sys.modules["kvshim"] = kvshim
    spec.loader.exec_module(kvshim)
    CPU = kvshim.KvShim.for_device("cpu", library=find_library("cpu", args.cpu_lib))
    try:
        CUDA = kvshim.KvShim.for_device("cuda", library=find_library("cuda", args.cuda_lib))
    except RuntimeError as e:  # torch sees a device, the library does not
        print(f"test_cuda_kvshim: the CUDA library cannot use the device torch sees: {e}",
              file=sys.stderr)
        return 1
    print(f"test_cuda_kvshim: {torch.cuda.get_device_name(DEV)}, torch {torch.__version__}, "
          f"{CUDA.library}, {CPU.library}", file=sys.stderr)
    result = unittest.main(argv=[sys.argv[0]] + rest, exit=False).result
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
