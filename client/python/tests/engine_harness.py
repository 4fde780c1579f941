"""Test harness for the engine adapters (kvdepot.integrations): small
stand-ins of vLLM's scheduler/model runner and SGLang's HiCache controller
that call the adapters' methods in the order, and with the arguments, the
engines use (the daemon comes from live_daemon.py).

The call orders follow vLLM's v1 engine (vllm/v1/core/sched/scheduler.py,
vllm/v1/worker/kv_connector_model_runner_mixin.py,
vllm/attention/layer.py) and SGLang's HiCacheController
(python/sglang/srt/managers/cache_controller.py). These stand-ins are not the
engines: they exercise the adapters' contracts, nothing more.
"""

from __future__ import annotations

import enum
import hashlib
import zlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional

import torch


# ----------------------------------------------------------------------
# vLLM stand-ins (the attributes the connector reads, as vLLM 0.11 names them)


class FakeClock:
    """A clock for a CircuitBreaker (``breaker.clock``) that moves only when
    told to (``advance``)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


class FakeModelConfig:
    def __init__(self, model: str, num_layers: int, num_kv_heads: int,
                 head_size: int, dtype: Any) -> None:
        self.model = model
        self.dtype = dtype
        self.use_mla = False
        self._layers, self._heads, self._head_size = num_layers, num_kv_heads, head_size

    def get_num_layers(self, parallel_config: Any) -> int:
        return self._layers

    def get_num_kv_heads(self, parallel_config: Any) -> int:
        return self._heads

    def get_head_size(self) -> int:
        return self._head_size


class FakeCUDAGraphMode(enum.Enum):
    """vllm.config.compilation.CUDAGraphMode (vLLM 0.11): same members,
    values and has_full_cudagraphs()."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (2, 0)
    FULL_AND_PIECEWISE = (2, 1)

    def has_full_cudagraphs(self) -> bool:
        value = max(self.value) if isinstance(self.value, tuple) else self.value
        return value == FakeCUDAGraphMode.FULL.value


def make_vllm_config(server: str, *, num_layers: int, block_size: int,
                     num_kv_heads: int, head_size: int, dtype: Any,
                     kv_role: str = "kv_both", extra: Optional[dict] = None,
                     cudagraph_mode: Any = FakeCUDAGraphMode.PIECEWISE,
                     executor: Optional[str] = None) -> Any:
    """The parts of a VllmConfig the connector reads, built from
    --kv-transfer-config's fields. ``cudagraph_mode``: PIECEWISE by default
    (what vLLM picks for a connector that requires it); vLLM 0.11's own
    default is FULL_AND_PIECEWISE. ``executor``: parallel_config.
    distributed_executor_backend (None: unset, as vLLM resolves it, "uni"
    for one rank, "mp" for more; see VllmEngine.execute)."""
    cfg = {"server": server, "timeout_s": 2.0}
    cfg.update(extra or {})
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector="KvDepotConnector",
            kv_connector_module_path="kvdepot.integrations.vllm",
            kv_role=kv_role, kv_connector_extra_config=cfg),
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto"),
        model_config=FakeModelConfig("test/tiny-llama", num_layers, num_kv_heads,
                                     head_size, dtype),
        parallel_config=SimpleNamespace(tensor_parallel_size=1,
                                        pipeline_parallel_size=1, rank=0,
                                        distributed_executor_backend=executor),
        compilation_config=SimpleNamespace(cudagraph_mode=cudagraph_mode),
    )


@dataclass
class FakeRequest:
    """vllm.v1.request.Request: the fields the connector reads. A prompt
    sent as embeddings has ``prompt_token_ids=None`` and ``prompt_embeds``
    set; vLLM then fills its token ids with zeros."""

    request_id: str
    prompt_token_ids: Optional[List[int]]
    output_token_ids: List[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    lora_request: Any = None
    cache_salt: Optional[str] = None
    mm_features: List[Any] = field(default_factory=list)
    prompt_embeds: Any = None
    sampling_params: Any = None  # e.g. SimpleNamespace(prompt_logprobs=...)

    @property
    def all_token_ids(self) -> List[int]:
        if self.prompt_token_ids is None:  # as vllm.v1.request.Request
            return [0] * len(self.prompt_embeds) + self.output_token_ids
        return self.prompt_token_ids + self.output_token_ids


class FakeKVCacheBlocks:
    """vllm.v1.core.kv_cache_manager.KVCacheBlocks: get_block_ids() returns
    one list per KV cache group."""

    def __init__(self, block_ids: List[int]) -> None:
        self._ids = list(block_ids)

    def get_block_ids(self) -> tuple:
        return (list(self._ids),)


def kv_for(tokens: List[int], pos: int, layer: int, heads: int, head_size: int,
           dtype: Any) -> torch.Tensor:
    """The stand-in model: K and V of token ``pos`` in ``layer``, a function
    of the tokens up to and including it (as real attention K/V are)."""
    seed = zlib.crc32(bytes(str((layer, tokens[:pos + 1])), "ascii"))
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, heads, head_size), generator=g).to(dtype)


class VllmEngine:
    """One vLLM engine instance: a scheduler-side and a worker-side
    connector, a block allocator and per-layer paged caches in vLLM's
    FlashAttention layout [2, num_blocks, block_size, num_kv_heads,
    head_size], driven in the engine's order:

      scheduler.schedule(): get_num_new_matched_tokens(request,
        num_local_computed) -> allocate -> update_state_after_alloc(request,
        blocks, num_external) -> build_connector_meta(scheduler_output)
      model runner: bind_connector_metadata(meta) -> start_load_kv(
        forward_context) -> per layer: wait_for_layer_load(name), attention
        writes the layer's new K/V, save_kv_layer(name, kv_cache, attn_md) ->
        wait_for_save() -> get_finished(finished_ids) ->
        get_block_ids_with_load_errors() -> clear_connector_metadata()
      scheduler.update_from_output(): request_finished(request, block_ids)
        for the requests that end in this step, then update_connector_output(
        output), whose finished_sending frees the blocks of requests that
        request_finished held; on load errors the request's computed tokens
        are cut back to the first failed block (recompute).
      A step without tokens runs only bind_connector_metadata ->
        start_load_kv -> get_finished -> get_block_ids_with_load_errors ->
        clear_connector_metadata (vLLM's kv_connector_no_forward: no forward
        pass, no wait_for_save), and its output reaches
        update_connector_output only where it reports something (finished
        sending, load errors) or the executor aggregates the workers'
        outputs (KVOutputAggregator: the "mp" and "ray" executors, and an
        unset executor with more than one rank), as in vLLM.
    """

    def __init__(self, connector_cls: Any, vllm_config: Any, num_blocks: int,
                 role_enum: Any, physical: str = "NHD") -> None:
        """``physical``: how the caches lie in memory and what the worker is
        given: "NHD", [2, N, block_size, heads, head_size] tensors; "HND",
        FlashAttention's HND stride order, views of that shape over
        [2, N, heads, block_size, head_size] memory; "CPU_ATTN", vLLM's CPU
        backend, [2, N, heads, block_size, head_size] tensors as they are."""
        mc = vllm_config.model_config
        self.cfg = vllm_config
        self.block_size = vllm_config.cache_config.block_size
        self.layers = mc.get_num_layers(None)
        self.heads = mc.get_num_kv_heads(None)
        self.head_size = mc.get_head_size()
        self.dtype = mc.dtype
        self.scheduler = connector_cls(vllm_config, role_enum.SCHEDULER)
        self.worker = connector_cls(vllm_config, role_enum.WORKER)
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(self.layers)]
        # kv_caches: the [2, N, block_size, heads, head_size] views this
        # harness writes and reads; registered: what vLLM hands the worker.
        self.kv_caches: Dict[str, torch.Tensor] = {}
        self.registered: Dict[str, torch.Tensor] = {}
        for name in self.layer_names:
            if physical == "NHD":
                t = torch.zeros((2, num_blocks, self.block_size, self.heads,
                                 self.head_size), dtype=self.dtype)
                self.kv_caches[name] = self.registered[name] = t
            else:
                t = torch.zeros((2, num_blocks, self.heads, self.block_size,
                                 self.head_size), dtype=self.dtype)
                self.kv_caches[name] = t.transpose(2, 3)
                self.registered[name] = t if physical == "CPU_ATTN" else t.transpose(2, 3)
        self.worker.register_kv_caches(self.registered)
        self.free = list(range(1, num_blocks))  # block 0 is vLLM's null block
        self.blocks: Dict[str, List[int]] = {}
        self.computed: Dict[str, int] = {}  # tokens with K/V in the cache
        self.external: Dict[str, int] = {}
        self.load_errors: List[int] = []
        self.finished: set = set()
        self.sending: set = set()  # finished, blocks held (request_finished True)
        self.sent: set = set()  # reported finished_sending, blocks freed

    # --- scheduler.schedule()
    def admit(self, req: FakeRequest, num_local_computed: int = 0,
              local_blocks: Optional[List[int]] = None) -> int:
        """A waiting request's first schedule: returns the external tokens."""
        ext, is_async = self.scheduler.get_num_new_matched_tokens(req, num_local_computed)
        assert ext is not None and is_async is False, (ext, is_async)
        total = len(req.all_token_ids)
        need = -(-total // self.block_size)
        blocks = list(local_blocks or [])
        while len(blocks) < need:
            blocks.append(self.free.pop(0))
        self.blocks[req.request_id] = blocks
        self.scheduler.update_state_after_alloc(req, FakeKVCacheBlocks(blocks), ext)
        req.num_computed_tokens = num_local_computed + ext
        self.external[req.request_id] = ext
        return ext

    def step(self, new_reqs: List[FakeRequest], cached: List[FakeRequest],
             num_scheduled: Dict[str, int],
             hook: Optional[Callable[[str, int], None]] = None,
             graph_replay: bool = False,
             finishing: Optional[List[FakeRequest]] = None) -> Any:
        """One scheduler step and forward pass. ``finishing``: requests that
        end with this step (request_finished runs in its update_from_output,
        before update_connector_output, as in vLLM). ``hook(event, layer)``, when
        given, is called at points a test may inspect: ("before_load", -1)
        after the metadata is bound, ("after_start_load", -1) once
        start_load_kv returned, ("layer_loaded", l) once
        wait_for_layer_load returned for layer l, and ("before_attention",
        l) just before layer l's attention. ``graph_replay``: the forward
        pass is a FULL CUDA graph replay, which runs the layers without the
        per-layer hooks (no wait_for_layer_load, no save_kv_layer)."""
        return self.execute(self.schedule(new_reqs, cached, num_scheduled), hook,
                            graph_replay, finishing)

    def schedule(self, new_reqs: List[FakeRequest], cached: List[FakeRequest],
                 num_scheduled: Dict[str, int]) -> Any:
        """The scheduler half of :meth:`step` (up to build_connector_meta);
        :meth:`execute` runs it. With async scheduling vLLM schedules the
        next step before the output of the one running comes back: call
        schedule twice, then execute each in order."""
        new_block_ids: List[Any] = []
        for r in cached:  # running requests get blocks as they grow
            blocks = self.blocks[r.request_id]
            added = []
            while len(blocks) * self.block_size < len(r.all_token_ids):
                added.append(self.free.pop(0))
                blocks.append(added[-1])
            new_block_ids.append((added,) if added else None)
        so = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(
                req_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                block_ids=(list(self.blocks[r.request_id]),),
                num_computed_tokens=r.num_computed_tokens) for r in new_reqs],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[r.request_id for r in cached],
                resumed_from_preemption=[False] * len(cached),
                new_token_ids=[[] for _ in cached],
                new_block_ids=new_block_ids,
                num_computed_tokens=[r.num_computed_tokens for r in cached]),
            num_scheduled_tokens=dict(num_scheduled),
            finished_req_ids=set(self.finished))
        meta = self.scheduler.build_connector_meta(so)
        # vLLM serializes the metadata to the worker processes.
        import pickle
        meta = pickle.loads(pickle.dumps(meta))
        self.finished = set()
        return SimpleNamespace(so=so, meta=meta, new_reqs=list(new_reqs),
                               cached=list(cached), num_scheduled=dict(num_scheduled))

    def execute(self, scheduled: Any,
                hook: Optional[Callable[[str, int], None]] = None,
                graph_replay: bool = False,
                finishing: Optional[List[FakeRequest]] = None) -> Any:
        """The forward pass and update_from_output of a :meth:`schedule`d
        step (see :meth:`step`); returns its metadata."""
        hook = hook or (lambda event, layer: None)
        so, meta = scheduled.so, scheduled.meta
        new_reqs, cached = scheduled.new_reqs, scheduled.cached
        num_scheduled = scheduled.num_scheduled
        # --- model runner
        self.worker.bind_connector_metadata(meta)
        fc = SimpleNamespace(no_compile_layers={}, attn_metadata={}, virtual_engine=0)
        hook("before_load", -1)
        self.worker.start_load_kv(fc)
        hook("after_start_load", -1)
        reqs = {r.request_id: r for r in new_reqs + cached}
        forward = any(n > 0 for n in num_scheduled.values())
        for layer, name in enumerate(self.layer_names if forward else []):
            if not graph_replay:
                self.worker.wait_for_layer_load(name)
                hook("layer_loaded", layer)
            hook("before_attention", layer)
            for rid, n in num_scheduled.items():
                self._attention_writes(reqs[rid], layer, name, n)
            if not graph_replay:
                self.worker.save_kv_layer(name, self.registered[name], fc.attn_metadata)
        if forward:
            self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(so.finished_req_ids)
        assert recving is None, recving
        errors = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        # --- scheduler.update_from_output()
        for rid, n in num_scheduled.items():
            r = reqs[rid]
            r.num_computed_tokens += n
        for r in finishing or ():
            self.finish(r)
        if forward or sending or errors or self.aggregates_outputs():
            self.scheduler.update_connector_output(SimpleNamespace(
                finished_sending=sending, finished_recving=None,
                invalid_block_ids=set(errors)))
        for rid in sending or ():
            # vLLM frees the blocks of a request it holds them for (and
            # fails on any other id).
            assert rid in self.sending, (rid, self.sending)
            self.sending.remove(rid)
            self.sent.add(rid)
        if errors:
            self.load_errors.extend(sorted(errors))
        return meta

    def aggregates_outputs(self) -> bool:
        """Whether vLLM's executor for this config builds a KVConnectorOutput
        for every step (KVOutputAggregator): "mp" and "ray" do, "uni" does
        not; unset, vLLM picks "uni" for one rank and "mp" for more."""
        pc = self.cfg.parallel_config
        backend = getattr(pc, "distributed_executor_backend", None)
        if backend is None:
            return int(pc.tensor_parallel_size) > 1
        return backend in ("mp", "ray")

    def _attention_writes(self, req: FakeRequest, layer: int, name: str, n: int) -> None:
        """The stand-in forward pass: K/V of the scheduled tokens."""
        tokens = req.all_token_ids
        cache = self.kv_caches[name]
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
            b = self.blocks[req.request_id][pos // self.block_size]
            cache[:, b, pos % self.block_size] = kv_for(
                tokens, pos, layer, self.heads, self.head_size, self.dtype)

    def recompute_failed(self, req: FakeRequest, errors: List[int]) -> None:
        """vLLM's recompute policy: computed tokens cut back to the first
        block that failed to load."""
        blocks = self.blocks[req.request_id]
        first = min(blocks.index(b) for b in errors if b in blocks)
        req.num_computed_tokens = min(req.num_computed_tokens, first * self.block_size)

    def finish(self, req: FakeRequest) -> Any:
        out = self.scheduler.request_finished(req, list(self.blocks[req.request_id]))
        self.finished.add(req.request_id)
        if out[0]:
            self.sending.add(req.request_id)
        return out

    def block_kv(self, req: FakeRequest, index: int) -> List[torch.Tensor]:
        """Every layer's [2, block_size, heads, head_size] of the request's
        ``index``-th block."""
        b = self.blocks[req.request_id][index]
        return [self.kv_caches[n][:, b].clone() for n in self.layer_names]

    def expected_block_kv(self, tokens: List[int], index: int) -> List[torch.Tensor]:
        out = []
        for layer in range(self.layers):
            t = torch.stack([kv_for(tokens, p, layer, self.heads, self.head_size, self.dtype)
                             for p in range(index * self.block_size,
                                            (index + 1) * self.block_size)], dim=1)
            out.append(t)
        return out


# ----------------------------------------------------------------------
# SGLang stand-ins


@dataclass
class FakeStorageConfig:
    """sglang.srt.mem_cache.hicache_storage.HiCacheStorageConfig's fields
    (SGLang requires enable_storage_metrics; True here)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    enable_storage_metrics: bool = True
    is_page_first_layout: bool = True
    model_name: Optional[str] = "test/tiny-llama"
    extra_config: Optional[dict] = None


class FakeMHAHostPool:
    """SGLang's MHATokenToKVPoolHost, page_first or layer_first layout: its
    kv_buffer and get_page_buffer_meta (pointer and size of each page's K and
    V, computed as SGLang does)."""

    def __init__(self, size: int, page_size: int, layer_num: int, head_num: int,
                 head_dim: int, dtype: Any, layout: str = "page_first") -> None:
        self.size, self.page_size, self.layer_num = size, page_size, layer_num
        self.head_num, self.head_dim, self.dtype, self.layout = head_num, head_dim, dtype, layout
        if layout == "layer_first":
            dims = (2, layer_num, size, head_num, head_dim)
        else:
            dims = (2, size, layer_num, head_num, head_dim)
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def get_size_per_token(self) -> int:
        return (self.head_dim * self.head_num * self.layer_num
                * torch.tensor([], dtype=self.dtype).element_size() * 2)

    def get_ksize_per_token(self) -> int:
        return self.get_size_per_token() // 2

    def get_page_buffer_meta(self, indices: torch.Tensor):
        assert len(indices) % self.page_size == 0
        ptrs: List[int] = []
        base = self.kv_buffer.data_ptr()
        idx = indices.tolist()
        item = torch.tensor([], dtype=self.dtype).element_size()
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * item
        if self.layout == "layer_first":
            for i in range(0, len(idx), self.page_size):
                for layer in range(self.layer_num):
                    k = (base + idx[i] * self.head_num * self.head_dim * item
                         + layer * self.size * self.head_num * self.head_dim * item)
                    ptrs += [k, k + v_offset]
            element = item * self.page_size * self.head_num * self.head_dim
        else:
            for i in range(0, len(idx), self.page_size):
                k = base + idx[i] * self.layer_num * self.head_num * self.head_dim * item
                ptrs += [k, k + v_offset]
            element = self.layer_num * item * self.page_size * self.head_num * self.head_dim
        return ptrs, [element] * len(ptrs)

    def page(self, start: int) -> torch.Tensor:
        """A copy of the page starting at token index ``start`` (K and V)."""
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, start:start + self.page_size].clone()
        return self.kv_buffer[:, start:start + self.page_size].clone()


def sglang_page_hashes(token_ids: List[int], page_size: int) -> List[str]:
    """HiCacheController.get_hash_str chained over pages: SHA-256 hex of the
    prior hash and the page's token ids."""
    out: List[str] = []
    prior: Optional[str] = None
    for i in range(0, len(token_ids) - len(token_ids) % page_size, page_size):
        h = hashlib.sha256()
        if prior is not None:
            h.update(bytes.fromhex(prior))
        for t in token_ids[i:i + page_size]:
            h.update(t.to_bytes(4, byteorder="little", signed=False))
        prior = h.hexdigest()
        out.append(prior)
    return out


def create_dynamic_backend(storage_config: FakeStorageConfig, base_cls: Any) -> Any:
    """StorageBackendFactory._create_dynamic_backend: import module_path,
    getattr class_name, check the base class, cls(storage_config, kwargs)."""
    import importlib

    extra = storage_config.extra_config
    for name in ("backend_name", "module_path", "class_name"):
        if name not in extra:
            raise ValueError(f"Missing required field '{name}'")
    module = importlib.import_module(extra["module_path"])
    cls = getattr(module, extra["class_name"])
    if not issubclass(cls, base_cls):
        raise TypeError("Backend class must inherit from HiCacheStorage")
    return cls(storage_config, {})
