"""A small decoder-only transformer that computes attention from a paged KV cache.

The architecture is Llama's: token embedding, then per layer RMSNorm ->
grouped-query attention with rotary position embeddings (RoPE, rotate-half)
-> residual -> RMSNorm -> SwiGLU MLP -> residual; a final RMSNorm and an
untied LM head. The weights are random, drawn from a seeded generator, so the
model needs no download and is the same in every process.

The KV cache is paged the way vLLM's FlashAttention backend keeps it: one
tensor per layer of shape ``[2, num_blocks, block_size, num_kv_heads,
head_size]`` (K then V, NHD), keys stored after RoPE. A forward pass takes a
flattened batch of sequence chunks (prefills of new tokens and single-token
decodes mixed, as in vLLM V1); each chunk writes its new K/V into the slots
its block table names and then attends to everything its block table holds
up to and including its own tokens -- blocks computed earlier, blocks loaded
from elsewhere, and itself. Nothing in attention reads K/V from anywhere but
the cache, so a loaded block is really used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence

import torch
from torch import nn

# Rows of queries per attention matmul: bounds the score matrix of a long
# prefill to [heads, QUERY_CHUNK, context].
QUERY_CHUNK = 256


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the model; ``seed`` picks its random weights."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # K/V heads, shared by num_heads / num_kv_heads queries each
    head_size: int
    intermediate_size: int  # SwiGLU width
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_model_len: int = 8192  # longest context (size of the RoPE tables)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if self.head_size % 2:
            raise ValueError(f"head_size {self.head_size} must be even (RoPE)")

    def model_id(self) -> str:
        """A name for the weights and sizes, usable in a kvdepot namespace.

        Two configs with the same id produce the same K/V for the same
        tokens, so blocks stored under it are interchangeable.
        """
        return (
            f"randllama-v{self.vocab_size}-h{self.hidden_size}"
            f"-l{self.num_layers}-q{self.num_heads}-kv{self.num_kv_heads}"
            f"-d{self.head_size}-i{self.intermediate_size}"
            f"-rope{self.rope_theta:g}-eps{self.rms_norm_eps:g}-seed{self.seed}"
        )


@dataclass(frozen=True)
class SequenceChunk:
    """New tokens of one sequence for one forward pass.

    ``token_ids`` sit at positions ``num_cached .. num_cached + len - 1``;
    positions ``0 .. num_cached - 1`` are already in the cache.
    ``block_table[i]`` is the cache block holding positions ``16 i .. 16 i +
    15`` (for 16-token blocks) and must cover every position of the chunk.
    """

    token_ids: Sequence[int]
    num_cached: int
    block_table: Sequence[int]


class PagedKvCache:
    """The engine's paged KV cache and its block allocator.

    ``tensors[layer]`` has shape ``[2, num_blocks, block_size, num_kv_heads,
    head_size]`` and is C-contiguous (vLLM FlashAttention, NHD). Not
    thread-safe.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        fill_value: float = 0.0,
    ) -> None:
        """``fill_value`` initialises every slot, and :meth:`free` resets
        every freed block to it; with NaN, any read of a slot that was not
        written since its block was allocated shows up in the logits."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.fill_value = fill_value
        shape = (2, num_blocks, block_size, config.num_kv_heads, config.head_size)
        self.tensors: List[torch.Tensor] = [
            torch.full(shape, fill_value, dtype=dtype, device=device)
            for _ in range(config.num_layers)
        ]
        # Lowest ids first, so that a run's block placement is reproducible.
        self._free: List[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        """Blocks not allocated."""
        return len(self._free)

    def allocate(self, n: int) -> List[int]:
        """Returns ``n`` free block ids. Raises RuntimeError when fewer are
        free (the caller sized the cache too small)."""
        if n > len(self._free):
            raise RuntimeError(
                f"KV cache exhausted: {n} blocks wanted, {len(self._free)} free"
            )
        return [self._free.pop() for _ in range(n)]

    def free(self, block_ids: Sequence[int]) -> None:
        """Resets ``block_ids`` to ``fill_value`` and returns them to the
        free list.

        The reset matters: the free list is LIFO, so a conversation's next
        turn often gets back the very blocks its previous turn used. Left as
        they were, they would still hold that turn's K/V, and a load that
        wrote nothing would go unnoticed. Every run (recompute or kvdepot)
        frees the same blocks at the same steps, so the reset costs both
        sides the same.
        """
        if block_ids:
            index = torch.tensor(list(block_ids), dtype=torch.long,
                                 device=self.tensors[0].device)
            for tensor in self.tensors:
                tensor.index_fill_(1, index, self.fill_value)
        self._free.extend(reversed(block_ids))


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale (no bias)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.to(x.dtype) * self.weight


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with cos/sin tables precomputed for every position."""

    def __init__(self, head_size: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
        )
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotates ``x`` of shape ``[tokens, heads, head_size]``."""
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@dataclass
class ChunkMeta:
    """Where one chunk's rows are in the flattened batch and what it reads."""

    offset: int
    num_new: int
    num_cached: int
    context_blocks: torch.Tensor  # block ids covering positions [0, context)


@dataclass
class AttentionMetadata:
    """What every layer needs to write and read the paged cache in one pass."""

    positions: torch.Tensor  # [tokens], position of each new token
    slots: torch.Tensor  # [tokens], block_id * block_size + offset
    chunks: List[ChunkMeta]


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    chunk: ChunkMeta,
    scale: float,
) -> torch.Tensor:
    """Causal grouped-query attention of one chunk's queries over its cache.

    ``q`` is ``[num_new, num_heads, head_size]`` for positions ``num_cached
    ..``; keys and values are read from ``kv_cache`` (one layer, already
    holding this chunk's own K/V). Returns ``[num_new, num_heads,
    head_size]``.
    """
    num_new, num_heads, head_size = q.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    context = chunk.num_cached + num_new
    # [2, blocks, block_size, kv_heads, head] -> [2, kv_heads, context, head]
    kv = kv_cache[:, chunk.context_blocks].flatten(1, 2)[:, :context]
    keys = kv[0].transpose(0, 1)
    values = kv[1].transpose(0, 1)
    # [num_new, heads, head] -> [kv_heads, group, num_new, head]
    qg = q.view(num_new, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
    out = torch.empty_like(qg)
    for start in range(0, num_new, QUERY_CHUNK):
        stop = min(start + QUERY_CHUNK, num_new)
        rows = stop - start
        visible = chunk.num_cached + stop  # keys any of these rows may see
        scores = torch.matmul(
            qg[:, :, start:stop].reshape(num_kv_heads, group * rows, head_size),
            keys[:, :visible].transpose(1, 2),
        ).view(num_kv_heads, group, rows, visible)
        if rows > 1:
            query_pos = torch.arange(chunk.num_cached + start, chunk.num_cached + stop)
            key_pos = torch.arange(visible)
            future = (key_pos[None, :] > query_pos[:, None]).to(q.device)
            scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores.float() * scale, dim=-1).to(q.dtype)
        out[:, :, start:stop] = torch.matmul(
            probs.view(num_kv_heads, group * rows, visible), values[:, :visible]
        ).view(num_kv_heads, group, rows, head_size)
    return out.permute(2, 0, 1, 3).reshape(num_new, num_heads, head_size)


class Attention(nn.Module):
    """Grouped-query self-attention reading and writing one layer's paged cache."""

    def __init__(self, config: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_size = config.head_size
        self.scale = 1.0 / math.sqrt(config.head_size)
        q_size = config.num_heads * config.head_size
        kv_size = config.num_kv_heads * config.head_size
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.rope = rope

    def forward(
        self, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(
            [
                self.num_heads * self.head_size,
                self.num_kv_heads * self.head_size,
                self.num_kv_heads * self.head_size,
            ],
            dim=-1,
        )
        q = self.rope(q.view(tokens, self.num_heads, self.head_size), meta.positions)
        k = self.rope(k.view(tokens, self.num_kv_heads, self.head_size), meta.positions)
        v = v.view(tokens, self.num_kv_heads, self.head_size)
        # Write the new K/V into their slots, then attend from the cache only.
        slots = kv_cache.view(2, -1, self.num_kv_heads, self.head_size)
        slots[0].index_copy_(0, meta.slots, k)
        slots[1].index_copy_(0, meta.slots, v)
        out = torch.empty_like(q)
        for chunk in meta.chunks:
            rows = slice(chunk.offset, chunk.offset + chunk.num_new)
            out[rows] = paged_attention(q[rows], kv_cache, chunk, self.scale)
        return self.o_proj(out.view(tokens, self.num_heads * self.head_size))


class SwiGLU(nn.Module):
    """The MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residual connections."""

    def __init__(self, config: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, rope)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(
        self, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), kv_cache, meta)
        return x + self.mlp(self.post_attn_norm(x))


class DecoderModel(nn.Module):
    """The whole model. Use under ``torch.inference_mode()``. A forward pass
    writes the cache it is given, so one thread at a time per cache."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        rope = RotaryEmbedding(config.head_size, config.max_model_len, config.rope_theta)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, rope) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._init_weights()

    @classmethod
    def create(
        cls, config: ModelConfig, dtype: torch.dtype, device: torch.device
    ) -> "DecoderModel":
        """The model with its seeded weights, cast to ``dtype`` on ``device``
        (drawn in float32 on the CPU first, so every dtype rounds the same
        weights)."""
        return cls(config).to(dtype=dtype, device=device).eval()

    def _init_weights(self) -> None:
        """Draws every weight from one generator seeded with ``config.seed``:
        embeddings N(0, 1), linear layers N(0, 1/fan_in), norms 1."""
        generator = torch.Generator().manual_seed(self.config.seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif param.dim() == 2 and name.startswith("embed"):
                    param.normal_(0.0, 1.0, generator=generator)
                else:
                    param.normal_(0.0, param.shape[1] ** -0.5, generator=generator)

    def forward(
        self, chunks: Sequence[SequenceChunk], cache: PagedKvCache
    ) -> torch.Tensor:
        """Runs ``chunks`` as one flattened batch, writing their K/V into
        ``cache``. Returns float32 logits ``[len(chunks), vocab]``, one row
        per chunk: those of its last token."""
        meta = self._metadata(chunks, cache.block_size)
        token_ids = torch.tensor(
            [t for c in chunks for t in c.token_ids], dtype=torch.long
        ).to(meta.positions.device)
        x = self.embed(token_ids)
        for layer, kv_cache in zip(self.layers, cache.tensors):
            x = layer(x, kv_cache, meta)
        last_rows = torch.tensor(
            [m.offset + m.num_new - 1 for m in meta.chunks], device=x.device
        )
        return self.lm_head(self.norm(x[last_rows])).float()

    def _metadata(
        self, chunks: Sequence[SequenceChunk], block_size: int
    ) -> AttentionMetadata:
        """Positions and cache slots of every new token, and each chunk's rows
        and context blocks. Raises ValueError for an empty chunk, a context
        beyond max_model_len or a block table too short for it."""
        device = self.embed.weight.device
        positions: List[int] = []
        slots: List[int] = []
        metas: List[ChunkMeta] = []
        for chunk in chunks:
            if not chunk.token_ids:
                raise ValueError("a chunk needs at least one new token")
            context = chunk.num_cached + len(chunk.token_ids)
            if context > self.config.max_model_len:
                raise ValueError(
                    f"context {context} exceeds max_model_len "
                    f"{self.config.max_model_len}"
                )
            num_blocks = -(-context // block_size)
            if num_blocks > len(chunk.block_table):
                raise ValueError(
                    f"block table of {len(chunk.block_table)} blocks cannot "
                    f"hold {context} tokens"
                )
            metas.append(
                ChunkMeta(
                    offset=len(positions),
                    num_new=len(chunk.token_ids),
                    num_cached=chunk.num_cached,
                    context_blocks=torch.tensor(
                        chunk.block_table[:num_blocks], dtype=torch.long, device=device
                    ),
                )
            )
            for pos in range(chunk.num_cached, context):
                positions.append(pos)
                slots.append(
                    chunk.block_table[pos // block_size] * block_size + pos % block_size
                )
        return AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            slots=torch.tensor(slots, dtype=torch.long, device=device),
            chunks=metas,
        )
