"""kvdepot adapters for inference engines, and the helpers they share.

* :mod:`kvdepot.integrations.vllm` -- ``KvDepotConnector``, a vLLM v1
  ``KVConnectorBase_V1`` (``--kv-transfer-config`` with
  ``"kv_connector_module_path": "kvdepot.integrations.vllm"``).
* :mod:`kvdepot.integrations.sglang` -- ``KvDepotHiCacheStorage``, an SGLang
  ``HiCacheStorage`` backend (``--hicache-storage-backend dynamic``).

Neither engine is imported here, and each adapter module imports without its
engine installed (it then subclasses a documented local stand-in of the
engine's base class, so that the tests can drive it). See README.md in this
folder for the configuration and for what was and was not run against the real
engines.

The helpers below are :class:`CircuitBreaker` (both adapters stop calling a
daemon that is unreachable or does not answer, for a back-off window), the
namespace labels (:func:`model_label`, :func:`model_variant`), and the keys
of a token sequence's blocks (also used by
``tools/multiturn``): as in vLLM's prefix caching (``hash_block_tokens``), a
full block's key hashes (parent block's key, the block's token ids, extra
keys), so it names the whole prefix up to it, and two requests share a key
exactly when they share that prefix. vLLM hashes with SHA-256 over pickle or
CBOR from a root drawn from ``PYTHONHASHSEED``; here the encoding and the root
are fixed, and written down as test vectors (``tests/test_block_keys.py``):

* ``ROOT_HASH = SHA-256(b"kvdepot/block-hash/v1/root")``;
* a block's key is ``SHA-256(b"KVB1" || u32 len(parent) || parent ||
  u32 n || n x u32 token id || u32 m || m x extra key)``, an extra key being a
  type byte (``b`` bytes, ``s`` UTF-8 str, ``i`` i64), its u32 length and its
  bytes, every integer little-endian.

Unlike vLLM's own block hashes (seeded from ``PYTHONHASHSEED`` unless
configured), these are the same in every process, so every engine instance
finds the blocks any other one stored.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import struct
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

ExtraKey = Union[bytes, str, int]

_FORMAT_TAG = b"KVB1"
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")

ROOT_HASH: bytes = hashlib.sha256(b"kvdepot/block-hash/v1/root").digest()

__all__ = [
    "CircuitBreaker",
    "DEFAULT_MAX_BATCH_KEYS",
    "ROOT_HASH",
    "UNAVAILABLE_CODES",
    "batch_ranges",
    "block_hashes",
    "config_digest",
    "encode_block",
    "hash_block",
    "model_label",
    "model_variant",
    "parents_of",
    "status_code",
]


def _encode_extra_key(key: ExtraKey) -> bytes:
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
    num_blocks: Optional[int] = None,
) -> List[bytes]:
    """Keys of the full blocks of ``token_ids`` (a trailing partial block gets
    none), from block ``start_block`` (whose parent key must then be given)
    up to ``num_blocks`` blocks in all (default: every full block)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, not {block_size}")
    if parent is None:
        if start_block:
            raise ValueError("extending a chain needs the parent key")
        parent = ROOT_HASH
    end = len(token_ids) // block_size
    if num_blocks is not None:
        end = min(end, num_blocks)
    keys: List[bytes] = []
    for b in range(start_block, end):
        parent = hash_block(
            parent, list(token_ids[b * block_size : (b + 1) * block_size]), extra_keys
        )
        keys.append(parent)
    return keys


def parents_of(keys: Sequence[bytes], first_parent: bytes = b"") -> List[bytes]:
    """The parent of each key of a chain as ``Client.put`` takes them."""
    return [first_parent, *keys[:-1]] if keys else []


_BAD_CHARS = re.compile(r"[^A-Za-z0-9._:/@+=-]+")


def model_label(*parts: object, max_len: int = 100) -> str:
    """A model name for :meth:`kvdepot.KvLayout.namespace_for` made of
    ``parts`` joined by ``/``. Parts a namespace can hold as they are
    (``A-Za-z0-9._:/@+=-``, no leading or trailing ``/``) are kept; if any
    part had to change (characters a namespace may not hold become ``-``,
    outer ``/`` go), or the result is longer than ``max_len``, it is
    suffixed (cut first, if need be) with a hash of the parts as given. So
    distinct inputs stay distinct: two models never share a namespace
    because their names read alike once cleaned ("llama 3", "llama#3")."""
    given = [str(p) for p in parts]
    clean = [_BAD_CHARS.sub("-", p).strip("/") or "-" for p in given]
    text = "/".join(clean)
    if clean != given or len(text) > max_len:
        digest = hashlib.sha256("\0".join(given).encode()).hexdigest()[:12]
        text = text[: max_len - 13] + "=" + digest
    return text


def _stable(value: Any) -> Any:
    """``value`` as JSON-able data that is the same in every process: dicts
    and sequences item by item, functions and classes by qualified name,
    config objects by their ``to_dict()``, other objects by their repr
    without memory addresses."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _stable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_stable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(json.dumps(_stable(v), sort_keys=True) for v in value)
    name = getattr(value, "__qualname__", None)
    if name is not None:
        return f"{getattr(value, '__module__', '')}.{name}"
    to_dict = getattr(value, "to_dict", None)  # transformers' config objects
    if callable(to_dict):
        try:
            return _stable(to_dict())
        except Exception:  # noqa: BLE001 - the repr below then
            pass
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def config_digest(value: Any) -> str:
    """12 hex digits naming a configuration value (a dict of RoPE scaling
    parameters, HF config overrides, ...) in a :func:`model_label` part: the
    SHA-256 of its canonical JSON (dict keys sorted, so their order does not
    matter; functions by qualified name), the same in every process."""
    text = json.dumps(_stable(value), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def model_variant(*, identity: Any = None, revision: Any = None,
                  quantization: Any = None, rope: Any = None,
                  overrides: Any = None) -> List[str]:
    """The :func:`model_label` parts that set apart deployments of one model
    computing other KV, each only where set (so a plain deployment's label
    has none): an engine's model identity (``id:<hash>``), the model
    ``revision`` (``rev:...``), the ``quantization`` method (``quant:...``;
    an enum by its value), and digests (:func:`config_digest`) of the RoPE
    scaling (``rope:<digest>``) and the HF config overrides
    (``hf:<digest>``)."""
    parts: List[str] = []
    if identity:
        parts.append(f"id:{identity}")
    if revision:
        parts.append(f"rev:{revision}")
    if quantization:
        parts.append(f"quant:{getattr(quantization, 'value', quantization)}")
    if rope:
        parts.append(f"rope:{config_digest(rope)}")
    if overrides:
        parts.append(f"hf:{config_digest(overrides)}")
    return parts


# The daemon's default max_batch_keys (README, "Configuration"): the most keys
# one Lookup, put or Read takes. The daemon reports its own value when a
# session opens (OpenSessionResponse.max_batch_keys), but the Python client
# does not expose it; the adapters take extra_config["max_batch_keys"].
DEFAULT_MAX_BATCH_KEYS = 1024


def batch_ranges(count: int, limit: int, unit: int = 1) -> List[Tuple[int, int]]:
    """[lo, hi) ranges splitting ``count`` keys, in order, into daemon calls
    of at most ``limit`` keys, each ending at a multiple of ``unit`` (the
    objects of one page stay in one call); a unit of more than ``limit``
    keys is split into pieces of ``limit``, the last ending at its
    boundary."""
    n = max(1, unit)
    if n <= limit:
        step = (limit // n) * n
        return [(lo, min(count, lo + step)) for lo in range(0, count, step)]
    return [(lo, min(page + n, lo + limit))
            for page in range(0, count, n) for lo in range(page, page + n, limit)]


# The outcomes that say kvdepotd is unreachable or did not answer in time:
# what opens a CircuitBreaker.
UNAVAILABLE_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED")
# Codes the module raises itself too, before any call (a buffer of the
# wrong size, a block id out of range): they do not show that the daemon
# answered, so they do not close the breaker.
_LOCAL_CODES = ("INVALID_ARGUMENT", "OUT_OF_RANGE")

_CODE = re.compile(r"([A-Z][A-Z_]+):")


def status_code(error: Any) -> Optional[str]:
    """The status code name of an outcome of the kvdepot binding: None for
    None; the code of a per-block error ``(code, message)``; for an
    exception, the code its message starts with (the binding's errors start
    with it, e.g. ``"UNAVAILABLE: ..."``; a KeyError's is its argument),
    ``DEADLINE_EXCEEDED`` for a TimeoutError, else None."""
    if error is None:
        return None
    if isinstance(error, tuple):
        return str(error[0]) if error else None
    if isinstance(error, TimeoutError):
        return "DEADLINE_EXCEEDED"
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    m = _CODE.match(text)
    return m.group(1) if m else None


class CircuitBreaker:
    """Stops an adapter calling kvdepotd for a while after a call found it
    unreachable or unanswering (an outcome in :data:`UNAVAILABLE_CODES`), so
    that an engine does not wait out a timeout (or a connection attempt) on
    every call while the daemon is down or hung.

    Closed (the normal state): every call goes through. A failure opens it
    for ``min_s`` seconds, during which :meth:`allow` is False (the caller
    answers a miss or skips its save without calling the daemon). Once the
    window is over, :meth:`allow` lets one call through (a probe) and holds
    the others off for another window: if the probe fails, the window
    doubles (up to ``max_s``); any call that reaches the daemon closes it
    (:meth:`succeeded`). Opening and closing each log one warning.
    ``min_s`` 0 disables it (always closed).

    ``clock`` gives the time in seconds (``time.monotonic``; tests pass a
    fake). Thread-safe (SGLang's prefetch and backup threads share one)."""

    def __init__(self, what: str, min_s: float = 1.0, max_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic,
                 log: Optional[logging.Logger] = None) -> None:
        self.what = what
        self.min_s = max(0.0, float(min_s))
        self.max_s = max(self.min_s, float(max_s))
        self.clock = clock
        self._log = log or logging.getLogger(__name__)
        self._lock = threading.Lock()
        # Guarded by _lock: the end of the window (None: closed), its
        # length, and whether a probe is out.
        self._until: Optional[float] = None
        self._window = self.min_s
        self._probing = False
        self.skipped = 0  # calls refused by allow() (guarded by _lock)

    @property
    def is_open(self) -> bool:
        """Whether the daemon was last found unavailable (the breaker has not
        closed since), whether or not its window is over."""
        with self._lock:
            return self._until is not None

    def allow(self) -> bool:
        """Whether to call the daemon now (see the class comment). A True
        past an open window is a probe: report its outcome."""
        with self._lock:
            if self._until is None:
                return True
            now = self.clock()
            if now < self._until:
                self.skipped += 1
                return False
            self._until = now + self._window  # the others wait for the probe
            self._probing = True
            return True

    def blocked(self) -> bool:
        """Whether a call that is not worth a probe (an unpin: its pin ends
        with the session lease anyway) should be skipped: open, within its
        window."""
        with self._lock:
            return self._until is not None and self.clock() < self._until

    def failed(self, error: Any) -> bool:
        """Reports a call's failure (an exception or a per-block error):
        opens the breaker, or doubles its window after a failed probe, if
        ``error`` says the daemon is unavailable, and returns True. Another
        status code means the daemon answered: closes it (as
        :meth:`succeeded`), except INVALID_ARGUMENT and OUT_OF_RANGE, which
        the module also raises before any call; an error without a code
        changes nothing."""
        code = status_code(error)
        if self.min_s <= 0:
            return False
        if code not in UNAVAILABLE_CODES:
            # Another status: kvdepotd answered (a probe that gets one closes
            # the breaker, or it would stay open); an error with no status,
            # or one the module also raises itself (_LOCAL_CODES), says
            # nothing about it.
            if code is not None and code not in _LOCAL_CODES:
                self.succeeded()
            return False
        with self._lock:
            now = self.clock()
            if self._until is None:
                self._window = self.min_s
                self._until = now + self._window
                self._probing = False
                self._log.warning(
                    "kvdepot: %s: kvdepotd unavailable (%s); not calling it for %g s, "
                    "then retrying with a back-off of up to %g s", self.what,
                    str(error[1] if isinstance(error, tuple) else error)[:200],
                    self._window, self.max_s)
            elif self._probing:
                self._probing = False
                self._window = min(2 * self._window, self.max_s)
                self._until = now + self._window
            else:  # a call that started before the breaker opened
                self._until = max(self._until, now + self._window)
        return True

    def succeeded(self) -> None:
        """Reports a call the daemon answered (a miss included): closes the
        breaker."""
        with self._lock:
            if self._until is None:
                return
            self._until = None
            self._probing = False
            self._window = self.min_s
            skipped, self.skipped = self.skipped, 0
        self._log.warning("kvdepot: %s: kvdepotd answers again; calls resume "
                          "(%d skipped while it was unavailable)", self.what, skipped)

    def record(self, error: Any) -> None:
        """Reports the outcome of a call that reached the daemon: a failure
        as :meth:`failed` if it says the daemon is unavailable, anything else
        (None, a miss, another error: the daemon answered) as
        :meth:`succeeded`."""
        if not self.failed(error):
            self.succeeded()
