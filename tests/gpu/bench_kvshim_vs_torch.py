#!/usr/bin/env python3
"""GPU benchmark: the Python package's CUDA path for paged KV caches
(kvdepot.kvshim: the CUDA gather/scatter kernels between the GPU caches and
page-locked staging memory, as KvCacheStore uses them) against what the
vLLM connector did before it, and still does where the CUDA library is
missing: torch ``index_select`` + ``stack`` + ``.to("cpu")`` to save, and
``.to(device)`` + ``index_copy_`` per layer to load.

One Llama-3-8B-shaped cache (vLLM FlashAttention NHD, 32 layers x [2,
blocks, 16, 8, 128] bf16: 2 MiB per block's object), 64 random blocks per
round; rounds alternate A B A B, each timed with torch.cuda.synchronize()
around it; best and median of each, and their ratio (kvshim / torch, as
GB/s of object bytes: above 1 means kvshim is faster). The bytes both ways
produce are compared once before timing (they must be equal).

For a machine with an NVIDIA GPU and torch with CUDA, like
test_cuda_kvshim.py (no daemon, no _kvdepot: kvshim.py is loaded by path).

  python3 tests/gpu/bench_kvshim_vs_torch.py [--cuda-lib PATH] [--rounds N]
      [--blocks N] [--cache-blocks N] [--json PATH]

Exit: 0 ran (the ratios are reported, never asserted), 1 the two ways gave
different bytes or the library is missing, 77 no torch or no CUDA device.
"""

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import numpy as np
    import torch
except ImportError as e:
    print(f"bench_kvshim_vs_torch: {e}; skipping", file=sys.stderr)
    sys.exit(77)
if not torch.cuda.is_available():
    print("bench_kvshim_vs_torch: torch sees no CUDA device; skipping", file=sys.stderr)
    sys.exit(77)

LAYERS, TOKENS, HEADS, HEAD = 32, 16, 8, 128


def torch_gather(caches, block_ids):
    """The vLLM connector's torch staging save (FlashAttention layout):
    objects [layers, 2, tokens, heads, head] per block, on the host."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=caches[0].device)
    stacked = torch.stack([c.index_select(1, idx) for c in caches], dim=0)
    return stacked.permute(2, 0, 1, 3, 4, 5).contiguous().to("cpu")


def torch_scatter(caches, block_ids, host):
    """The connector's torch staging load: host objects into the caches."""
    dev = caches[0].device
    idx = torch.tensor(block_ids, dtype=torch.long, device=dev)
    data = host.to(dev)
    for layer, cache in enumerate(caches):
        cache.index_copy_(1, idx, data[:, layer].transpose(0, 1))


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuda-lib", default=os.environ.get("KVDEPOT_KV_CUDA_LIB") or
                        os.path.join(REPO, "build", "python", "kvdepot", "libkvdepot_kv_cuda.so"))
    parser.add_argument("--kvshim", default=os.path.join(
        REPO, "client", "python", "kvdepot", "kvshim.py"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--cache-blocks", type=int, default=256)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.blocks > args.cache_blocks:
        parser.error("--blocks must not exceed --cache-blocks")

    spec_ = importlib.util.spec_from_file_location("kvshim", args.kvshim)
    kvshim = importlib.util.module_from_spec(spec_)
    sys.modules["kvshim"] = kvshim
    spec_.loader.exec_module(kvshim)
    if not os.path.exists(args.cuda_lib):
        print(f"bench_kvshim_vs_torch: {args.cuda_lib} not found", file=sys.stderr)
        return 1
    cuda = kvshim.KvShim.for_device("cuda", library=args.cuda_lib)
    spec = kvshim.LayoutSpec.mha(kvshim.CacheLayout.FLASH_ATTN_NHD, LAYERS, TOKENS,
                                 HEADS, HEAD, kvshim.Dtype.BFLOAT16)
    info = cuda.layout_info(spec)
    dev = torch.device("cuda", 0)
    n, nb = args.cache_blocks, args.blocks
    gen = torch.Generator(device=dev).manual_seed(1)
    caches = [torch.randn((2, n, TOKENS, HEADS, HEAD), generator=gen, device=dev)
              .to(torch.bfloat16) for _ in range(LAYERS)]
    ids = torch.randperm(n, generator=torch.Generator().manual_seed(2))[:nb].tolist()

    # The store's staging: one pageable pool, registered once.
    pool = np.zeros(nb * info.object_bytes, np.uint8)
    cuda.register_host(pool)
    objects = [pool[i * info.object_bytes:(i + 1) * info.object_bytes] for i in range(nb)]
    stream = torch.cuda.current_stream(dev)

    def shim_save():
        cuda.gather(spec, caches, ids, objects, stream=stream)
        cuda.synchronize(stream)

    def shim_load():
        cuda.scatter(spec, caches, ids, objects, stream=stream)
        cuda.synchronize(stream)

    host = {}

    def torch_save():
        host["objects"] = torch_gather(caches, ids)

    def torch_load():
        torch_scatter(caches, ids, host["objects"])

    # Same bytes both ways, before anything is timed.
    shim_save()
    torch_save()
    torch.cuda.synchronize()
    same = host["objects"].view(torch.uint8).numpy().reshape(-1).tobytes() == pool.tobytes()
    if not same:
        print("bench_kvshim_vs_torch: kvshim's objects differ from the torch path's",
              file=sys.stderr)
        cuda.unregister_host(pool)
        return 1
    for warm in (shim_save, torch_save, shim_load, torch_load):
        warm()

    nbytes = nb * info.object_bytes
    rates = {k: [] for k in ("kvshim_save", "torch_save", "kvshim_load", "torch_load")}
    for _ in range(args.rounds):  # A B A B
        rates["kvshim_save"].append(nbytes / timed(shim_save) / 1e9)
        rates["torch_save"].append(nbytes / timed(torch_save) / 1e9)
        rates["kvshim_load"].append(nbytes / timed(shim_load) / 1e9)
        rates["torch_load"].append(nbytes / timed(torch_load) / 1e9)
    cuda.unregister_host(pool)

    result = {"tool": "bench_kvshim_vs_torch", "gpu": torch.cuda.get_device_name(dev),
              "torch": torch.__version__, "layout": "FLASH_ATTN_NHD bf16 32x[2,N,16,8,128]",
              "object_bytes": info.object_bytes, "blocks": nb, "rounds": args.rounds}
    print(f"kvshim (CUDA kernels, registered pageable staging) vs the torch staging path, "
          f"{nb} blocks x {info.object_bytes >> 20} MiB, {args.rounds} rounds A B A B "
          f"(GB/s of object bytes)")
    print(f"{'op':6} {'kvshim best':>12} {'torch best':>11} {'ratio':>6} "
          f"{'kvshim med':>11} {'torch med':>10} {'ratio':>6}")
    for op in ("save", "load"):
        a, b = rates[f"kvshim_{op}"], rates[f"torch_{op}"]
        best, med = max(a) / max(b), statistics.median(a) / statistics.median(b)
        print(f"{op:6} {max(a):12.2f} {max(b):11.2f} {best:6.2f} "
              f"{statistics.median(a):11.2f} {statistics.median(b):10.2f} {med:6.2f}")
        result[op] = {"kvshim_best_gb_per_s": max(a), "torch_best_gb_per_s": max(b),
                      "ratio_best": best, "ratio_median": med,
                      "kvshim_gb_per_s": a, "torch_gb_per_s": b}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
