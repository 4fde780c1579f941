"""Chained block hashes: the kvdepot keys of a token sequence's KV blocks.

As in vLLM's prefix caching (``vllm/v1/core/kv_cache_utils.py``,
``hash_block_tokens``), the key of a full block is a hash of the tuple
(parent block's hash, the block's token ids, extra keys), so a block's key
names the whole prefix up to and including it, and two requests share a key
exactly when they share that prefix. The first block's parent is a fixed
root, vLLM's ``NONE_HASH``.

vLLM hashes the tuple with SHA-256 over pickle or CBOR, and draws its root
from ``PYTHONHASHSEED`` (random when unset). Here both are pinned down so
that the keys are the same in every process, on every platform and in every
Python version, and can be written down as test vectors:

* ``ROOT_HASH = SHA-256(b"kvdepot/block-hash/v1/root")``.
* A block's hash is ``SHA-256(encode(parent, token_ids, extra_keys))``,
  where ``encode`` is the concatenation of

  - ``b"KVB1"``, a format tag;
  - the parent hash: its length as u32, then its bytes (32 for SHA-256);
  - the token count as u32, then each token id as u32;
  - the extra-key count as u32, then each extra key as a type byte
    (``b"b"`` bytes, ``b"s"`` str as UTF-8, ``b"i"`` int as i64) followed by
    its length as u32 (8 for an int) and its bytes,

  every integer little-endian. Every field is length-prefixed, so two
  different inputs never encode to the same bytes.

Extra keys carry what makes equal tokens produce different K/V and that the
namespace does not already name (vLLM: LoRA adapter, multimodal input
hashes, a per-tenant cache salt). The model, its sizes and the cache layout
are in the kvdepot namespace (``KvLayout.namespace_for``), not in the key.
"""

from __future__ import annotations

import hashlib
import struct
from typing import List, Optional, Sequence, Union

ExtraKey = Union[bytes, str, int]

_FORMAT_TAG = b"KVB1"
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")

ROOT_HASH: bytes = hashlib.sha256(b"kvdepot/block-hash/v1/root").digest()


def _encode_extra_key(key: ExtraKey) -> bytes:
    """Type byte, u32 length, value bytes."""
    if isinstance(key, bool):
        raise TypeError("extra keys are bytes, str or int, not bool")
    if isinstance(key, bytes):
        tag, data = b"b", key
    elif isinstance(key, str):
        tag, data = b"s", key.encode("utf-8")
    elif isinstance(key, int):
        tag, data = b"i", _I64.pack(key)
    else:
        raise TypeError(f"extra keys are bytes, str or int, not {type(key).__name__}")
    return tag + _U32.pack(len(data)) + data


def encode_block(
    parent: bytes, token_ids: Sequence[int], extra_keys: Sequence[ExtraKey] = ()
) -> bytes:
    """The canonical encoding of (parent, token_ids, extra_keys) that
    :func:`hash_block` hashes (see the module docstring). Token ids must fit
    in u32."""
    parts = [
        _FORMAT_TAG,
        _U32.pack(len(parent)),
        parent,
        _U32.pack(len(token_ids)),
        struct.pack(f"<{len(token_ids)}I", *token_ids),
        _U32.pack(len(extra_keys)),
    ]
    parts.extend(_encode_extra_key(k) for k in extra_keys)
    return b"".join(parts)


def hash_block(
    parent: bytes, token_ids: Sequence[int], extra_keys: Sequence[ExtraKey] = ()
) -> bytes:
    """The 32-byte SHA-256 key of one block given its parent's key."""
    return hashlib.sha256(encode_block(parent, token_ids, extra_keys)).digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[ExtraKey] = (),
    *,
    start_block: int = 0,
    parent: Optional[bytes] = None,
) -> List[bytes]:
    """Keys of the full blocks of ``token_ids``, in order.

    A trailing partial block gets no key (only full blocks are stored, as in
    vLLM). To extend a chain already hashed, pass ``start_block`` (the number
    of blocks hashed before) and ``parent`` (the key of block ``start_block -
    1``); ``parent`` defaults to :data:`ROOT_HASH` and must be given when
    ``start_block > 0``. ``extra_keys`` apply to every block.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, not {block_size}")
    if parent is None:
        if start_block:
            raise ValueError("extending a chain needs the parent key")
        parent = ROOT_HASH
    keys: List[bytes] = []
    for b in range(start_block, len(token_ids) // block_size):
        parent = hash_block(
            parent, token_ids[b * block_size : (b + 1) * block_size], extra_keys
        )
        keys.append(parent)
    return keys


def parents_of(keys: Sequence[bytes], first_parent: bytes = b"") -> List[bytes]:
    """The parent of each key in a chain, as kvdepot's ``put`` takes them:
    ``first_parent`` (``b""`` for a chain's first block) then each key's
    predecessor."""
    return [first_parent, *keys[:-1]] if keys else []

