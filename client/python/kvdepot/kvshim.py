"""Gather/scatter of paged KV caches through the C ABI of ``gpu/kv_capi.h``,
loaded with ctypes: the CUDA kernels for CUDA torch caches, the CPU twin for
host caches.

The native module ``_kvdepot`` carries the CPU implementation of gather and
scatter only (a pybind module cannot hold both: they define the same
symbols), and it is built for one Python version. The C ABI libraries are
plain shared libraries, built next to it by CMake:

* ``libkvdepot_kv_cpu.so`` -- the CPU twin (host memory; done when the call
  returns);
* ``libkvdepot_kv_cuda.so`` -- the CUDA kernels (built where nvcc was found;
  the static CUDA runtime, so it needs only the driver). Calls enqueue on a
  CUDA stream and return.

Each exports only the ``kvdepot_kv_`` functions, so both can be loaded
into one process beside ``_kvdepot``, and they work with any Python 3
version. ctypes releases the GIL during every call.

This module imports nothing from the rest of the package (only the standard
library; numpy and torch lazily, when given their objects), so it also works
where ``_kvdepot`` does not load -- e.g. a GPU machine with another Python.
Load it by path there::

    import importlib.util
    spec = importlib.util.spec_from_file_location("kvshim", "<...>/kvdepot/kvshim.py")
    kvshim = importlib.util.module_from_spec(spec); spec.loader.exec_module(kvshim)
    shim = kvshim.KvShim.for_device("cuda", library="<build>/gpu/libkvdepot_kv_cuda.so")

Example (inside the package)::

    from kvdepot.kvshim import KvShim
    shim = KvShim.for_device("cuda")            # libkvdepot_kv_cuda.so beside this file
    shim.register_host(staging)                 # once: e.g. client.allocate_buffer memory
    stream = torch.cuda.current_stream(kv_caches[0].device)
    shim.gather(layout, kv_caches, block_ids, objects, stream=stream)
    shim.synchronize(stream)                    # before the objects are read

Errors raise like the rest of the package, the message starting with the
status code name: ``ValueError`` (INVALID_ARGUMENT, OUT_OF_RANGE),
``KeyError`` (NOT_FOUND), ``RuntimeError`` (everything else, e.g.
``FAILED_PRECONDITION`` without a usable CUDA device). A library that is not
built or does not load raises ``ImportError`` naming it.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import operator
import os
import sys
import threading
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

__all__ = [
    "ABI_VERSION",
    "CacheLayout",
    "Dtype",
    "KvShim",
    "LayoutInfo",
    "LayoutSpec",
    "library_path",
]

#: The KVDEPOT_KV_ABI_VERSION this module speaks.
ABI_VERSION = 1

_INVALID_ARGUMENT = 3
_NOT_FOUND = 5
_OUT_OF_RANGE = 11
_ERR_CAP = 1024
# ctypes passes an int as an int32_t or a pointer modulo 2**32 or 2**64,
# without a word: every such argument is checked against these first.
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
_POINTER_LIMIT = 1 << (8 * ctypes.sizeof(ctypes.c_void_p))


class CacheLayout(enum.IntEnum):
    """``KVDEPOT_KV_LAYOUT_*`` (the values of ``kvdepot.KvCacheLayout``; see
    gpu/README.md for the shapes)."""

    FLASH_ATTN_NHD = 1
    FLASH_ATTN_HND = 2
    FLASH_INFER_NHD = 3
    FLASH_INFER_HND = 4
    MLA = 5
    CROSS_LAYER_NHD = 6
    CROSS_LAYER_HND = 7


class Dtype(enum.IntEnum):
    """``KVDEPOT_KV_DTYPE_*`` (the values of ``kvdepot.KvDtype``)."""

    FLOAT16 = 1
    BFLOAT16 = 2
    FLOAT8_E4M3 = 3
    FLOAT32 = 4


class LayoutSpec(NamedTuple):
    """A cache layout without the native module: the fields of
    ``kvdepot.KvLayout`` (which the methods below accept as well).
    Validated by the library on use."""

    layout: Union[CacheLayout, int]
    num_layers: int
    num_components: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: Union[Dtype, int]

    @classmethod
    def mha(cls, layout: Union[CacheLayout, int], num_layers: int, block_size: int,
            num_kv_heads: int, head_size: int, dtype: Union[Dtype, int]) -> "LayoutSpec":
        """A K/V layout (2 components), as ``kvdepot.KvLayout.mha``."""
        return cls(layout, num_layers, 2, block_size, num_kv_heads, head_size, dtype)

    @classmethod
    def mla(cls, layout: Union[CacheLayout, int], num_layers: int, block_size: int,
            latent_size: int, dtype: Union[Dtype, int]) -> "LayoutSpec":
        """A one-latent layout (1 component, 1 head), as ``kvdepot.KvLayout.mla``."""
        return cls(layout, num_layers, 1, block_size, 1, latent_size, dtype)


class LayoutInfo(NamedTuple):
    """Sizes of a layout (``kvdepot_kv_layout_info``)."""

    num_tensors: int  #: cache tensors: num_layers, or 1 for cross-layer
    element_bytes: int
    layer_bytes: int  #: one layer of one block's object
    object_bytes: int  #: one block's whole object
    tensor_bytes_per_block: int  #: a cache tensor of N blocks has N x this


class _Spec(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in (
        "layout", "dtype", "num_layers", "num_components", "block_size",
        "num_kv_heads", "head_size")]


class _Info(ctypes.Structure):
    _fields_ = [
        ("num_tensors", ctypes.c_int32),
        ("element_bytes", ctypes.c_int32),
        ("layer_bytes", ctypes.c_uint64),
        ("object_bytes", ctypes.c_uint64),
        ("tensor_bytes_per_block", ctypes.c_uint64),
    ]


def library_path(backend: str) -> str:
    """Where :meth:`KvShim.for_device` looks for the library of ``backend``
    ("cpu" or "cuda") by default: beside this file, as the CMake build and
    the wheel put it."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        f"libkvdepot_kv_{backend}.so")


def _spec_key(layout: Any) -> Tuple[int, ...]:
    """The seven fields of a LayoutSpec, a kvdepot.KvLayout or anything with
    those attributes, as ints (enums by value; layout and dtype also by
    name), in the order of ``_Spec``. ValueError for a field outside int32
    (ctypes would pass it modulo 2**32: 2**32 + 3 layers as 3)."""
    def enum_value(value: Any, kind: Any, what: str) -> int:
        if isinstance(value, str):
            try:
                return int(kind[value.upper()])
            except KeyError:
                raise ValueError(f"INVALID_ARGUMENT: unknown {what} {value!r}") from None
        return int(value)

    try:
        key = (
            enum_value(layout.layout, CacheLayout, "layout"),
            enum_value(layout.dtype, Dtype, "dtype"),
            int(layout.num_layers),
            int(layout.num_components),
            int(layout.block_size),
            int(layout.num_kv_heads),
            int(layout.head_size),
        )
    except AttributeError as e:
        raise TypeError(
            "layout must be a kvshim.LayoutSpec or a kvdepot.KvLayout "
            f"(attributes layout, num_layers, num_components, block_size, "
            f"num_kv_heads, head_size, dtype): {e}") from None
    for (name, _), value in zip(_Spec._fields_, key):
        _check_int32(value, f"layout field {name}")
    return key


def _check_int32(value: int, what: str) -> None:
    """ValueError unless ``value`` fits the int32_t ctypes passes it as."""
    if not _INT32_MIN <= value <= _INT32_MAX:
        raise ValueError(f"INVALID_ARGUMENT: {what} = {value} is not a 32-bit integer")


# The physical shape of a cache tensor of each layout (gpu/kv_layout.h), of
# N blocks, from a _spec_key: (shape, the same in letters).
def _physical_shape(key: Tuple[int, ...], n: int) -> Tuple[Tuple[int, ...], str]:
    layout, _, num_layers, c, t, h, d = key
    shapes = {
        CacheLayout.FLASH_ATTN_NHD: ((c, n, t, h, d), "[2, N, T, H, D]"),
        CacheLayout.FLASH_ATTN_HND: ((c, n, h, t, d), "[2, N, H, T, D]"),
        CacheLayout.FLASH_INFER_NHD: ((n, c, t, h, d), "[N, 2, T, H, D]"),
        CacheLayout.FLASH_INFER_HND: ((n, c, h, t, d), "[N, 2, H, T, D]"),
        CacheLayout.MLA: ((n, t, d), "[N, T, D]"),
        CacheLayout.CROSS_LAYER_NHD: ((n, num_layers, c, t, h, d), "[N, L, C, T, H, D]"),
        CacheLayout.CROSS_LAYER_HND: ((n, num_layers, c, h, t, d), "[N, L, C, H, T, D]"),
    }
    return shapes[CacheLayout(layout)]


# Where each dimension of a layout's tensor is in the engine's (logical)
# shape: physical dimension i is logical dimension order[i]. The logical
# shape is the physical one in NHD order; an HND cache keeps its H and T
# dimensions swapped in memory. That is how vLLM builds its HND caches
# (get_kv_cache_shape() is NHD, get_kv_cache_stride_order() the physical
# order): the physical tensor, permute()d to the logical shape.
_HND_ORDER = {
    CacheLayout.FLASH_ATTN_HND: (0, 1, 3, 2, 4),
    CacheLayout.FLASH_INFER_HND: (0, 1, 3, 2, 4),
    CacheLayout.CROSS_LAYER_HND: (0, 1, 2, 4, 3, 5),
}


def _logical_order(key: Tuple[int, ...], n: int) -> Tuple[Tuple[int, ...], List[str],
                                                         Tuple[int, ...]]:
    """(logical shape, its dimensions' letters, physical order) of the
    tensors of a layout of N blocks: physical dimension i is logical
    dimension order[i]."""
    physical, letters = _physical_shape(key, n)
    names = letters.strip("[]").split(", ")
    order = _HND_ORDER.get(CacheLayout(key[0]), tuple(range(len(physical))))
    logical = [0] * len(physical)
    logical_names = [""] * len(physical)
    for i, dim in enumerate(order):
        logical[dim] = physical[i]
        logical_names[dim] = names[i]
    return tuple(logical), logical_names, order


def _dense_strides(t: Any) -> Optional[Tuple[int, ...]]:
    """The element strides of torch tensor ``t`` if it is a permutation of a
    C-contiguous tensor's dimensions (every element once, no gaps, as
    ``x.permute(...)`` of a contiguous ``x``), else None."""
    try:
        strides = tuple(int(x) for x in t.stride())
        shape = tuple(int(x) for x in t.shape)
    except Exception:  # noqa: BLE001 - not a torch tensor after all
        return None
    if len(strides) != len(shape):
        return None
    expected = 1
    for stride, extent in sorted((st, e) for e, st in zip(shape, strides) if e > 1):
        if stride != expected:
            return None
        expected *= extent
    return strides


def _byte_shape(shape: Sequence[int], itemsize: int) -> Tuple[int, ...]:
    """A shape with its last dimension in bytes and without the dimensions
    of extent 1 (which order no bytes): two C-contiguous tensors of equal
    byte shapes lay out the same index in the same bytes, whatever integer
    type views them."""
    dims = [int(x) for x in shape]
    dims[-1] *= itemsize
    return tuple(x for x in dims if x != 1)


class _Memory(NamedTuple):
    ptr: int
    nbytes: int
    device: str  # "cpu" for host memory, else the torch device type
    index: Optional[int]  # the CUDA device index of a CUDA tensor
    keep: Any  # what must stay referenced while the pointer is used
    shape: Tuple[int, ...]  # in elements (a buffer's of its format's items)
    itemsize: int  # bytes per element
    # Element strides of a torch tensor that is a permuted view of a
    # contiguous one (only where _memory was allowed to take one); None
    # for C-contiguous memory.
    strides: Optional[Tuple[int, ...]] = None


def _torch_storage(t: Any) -> Any:
    """The storage of torch tensor ``t`` (None where it has none): what owns
    its memory. Holding the tensor alone does not keep the memory: t.set_()
    gives the tensor another storage, freeing the old one if nothing else
    holds it. (A resize_() that grows the tensor reallocates even a held
    storage: that stays the caller's to avoid.)"""
    for name in ("untyped_storage", "storage"):  # torch >= 2.0, older
        get = getattr(t, name, None)
        if get is not None:
            try:
                return get()
            except Exception:  # noqa: BLE001 - e.g. a tensor without storage
                return None
    return None


def _check_byte_order(order: str, itemsize: int, what: str, shown: str) -> None:
    """ValueError for big-endian elements wider than a byte: element bytes
    are copied verbatim and are little-endian by contract (gpu/kv_layout.h),
    so they would be stored byte-swapped into a namespace other engines
    load. ``order``: a struct/typestr byte-order character ('<', '>', '!',
    '=', '@' or '|')."""
    big = order in ">!" or (order in "=@" and sys.byteorder == "big")
    if big and itemsize > 1:
        raise ValueError(
            f"INVALID_ARGUMENT: {what} holds big-endian elements ({shown}); kvdepot "
            f"copies element bytes verbatim and they must be little-endian: convert "
            f"first (e.g. numpy's .astype('<f2'))")


# What the native module takes (client/python/_kvdepot.cc, PlainElements):
# buffers of plain numbers or bytes. As struct format characters (after the
# byte-order mark and a repeat count; complex is "Z" and one of these):
_PLAIN_FORMATS = "bBhHiIlLqQnNefdg?cs"
# As numpy typestr kinds: bool, signed and unsigned integers, floats,
# complex, byte strings. Not objects ('O': Python object pointers, which a
# read would overwrite), records and void ('V'), unicode ('U'), datetimes
# ('M', 'm').
_PLAIN_KINDS = "biufcS"


def _plain_format(fmt: str) -> bool:
    """Whether a buffer's struct format is plain numbers or bytes, as the
    native module decides it."""
    element = fmt.lstrip("@=<>!").lstrip("0123456789")
    if len(element) == 2 and element[0] == "Z":
        element = element[1:]
    return len(element) == 1 and element in _PLAIN_FORMATS


def _not_plain(what: str, shown: str) -> TypeError:
    return TypeError(
        f"{what} holds elements of {shown}; kvdepot moves buffers of plain numbers "
        f"or bytes only (numpy numeric dtypes, bytes, bytearray), never Python "
        f"objects, records or unicode")


def _is_torch_tensor(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("data_ptr", "element_size", "numel",
                                         "is_contiguous", "device"))


def _check_storage_holds(ptr: int, nbytes: int, storage: Any, what: str) -> None:
    """ValueError when a tensor's storage does not hold the ``nbytes`` at
    ``ptr`` the tensor names: ``storage.resize_(0)`` (how FSDP frees
    parameters) leaves its numel() as it was and its data_ptr() null, and
    a kernel reading or writing it would fault or hit freed memory (the
    native module checks the same)."""
    if nbytes == 0 or storage is None:  # a tensor-like object: nothing to check
        return
    held = ptr != 0
    if held:
        try:
            base, size = int(storage.data_ptr()), int(storage.nbytes())
        except Exception:  # noqa: BLE001 - an old torch: taken as it is
            return
        held = base <= ptr and ptr - base + nbytes <= size
    if not held:
        raise ValueError(f"INVALID_ARGUMENT: {what}'s storage does not hold its "
                         f"{nbytes} bytes (freed with resize_(0), or resized under it)")


def _memory(obj: Any, writable: bool, what: str, permuted: bool = False) -> _Memory:
    """The memory of a torch tensor, a numpy array (or anything with
    ``__array_interface__``) or a buffer-protocol object. Raises ValueError
    for a non-contiguous (or, with ``writable``, read-only) one and
    TypeError for other objects and for elements other than plain numbers
    or bytes (objects, records, unicode, datetimes: what the native module
    refuses). With ``permuted``, a torch tensor may also
    be a permuted view of a contiguous one (its strides are returned; its
    data_ptr is then still where its bytes start)."""
    if _is_torch_tensor(obj):
        strides = None
        if not obj.is_contiguous():
            strides = _dense_strides(obj) if permuted else None
            if strides is None:
                raise ValueError(
                    f"INVALID_ARGUMENT: {what} is not contiguous"
                    + (" (nor a permuted view of a contiguous tensor)" if permuted else ""))
        device = obj.device
        itemsize = int(obj.element_size())
        _check_byte_order("=", itemsize, what, "a torch tensor on a big-endian host")
        numel = int(obj.numel())
        shape = tuple(int(x) for x in getattr(obj, "shape", (numel,)))
        storage = _torch_storage(obj)
        if device.type in ("cpu", "cuda"):  # others are refused by the shim
            _check_storage_holds(int(obj.data_ptr()), numel * itemsize, storage, what)
        return _Memory(int(obj.data_ptr()), numel * itemsize, str(device.type),
                       device.index, (obj, storage), shape, itemsize,
                       strides)
    interface = getattr(obj, "__array_interface__", None)
    buffer_shape = None  # a buffer's own shape and item size (its bytes: uint8)
    if interface is None:
        try:
            view = memoryview(obj)
        except TypeError:
            raise TypeError(
                f"{what} must be a torch tensor, a numpy array or a buffer "
                f"(bytearray, memoryview, ...), not {type(obj).__name__}") from None
        if not view.c_contiguous:
            raise ValueError(f"INVALID_ARGUMENT: {what} is not a C-contiguous buffer")
        fmt = view.format or "B"
        if not _plain_format(fmt):
            raise _not_plain(what, f"buffer format {fmt!r}")
        _check_byte_order(fmt[0], view.itemsize, what, f"buffer format {fmt!r}")
        import numpy as np  # for the address of any buffer, read-only ones too

        # frombuffer's array is read-only exactly when the buffer is. Its
        # shape is the buffer's, not the flat bytes': a memoryview of a
        # 5-D array is checked against the layout as that array would be.
        buffer_shape = (tuple(int(x) for x in view.shape) or (1,), int(view.itemsize))
        obj = np.frombuffer(view, dtype=np.uint8) if view.nbytes else np.empty(0, np.uint8)
        interface = obj.__array_interface__
    ptr, readonly = interface["data"]
    strides = interface.get("strides")
    shape = tuple(interface["shape"])
    typestr = interface["typestr"]
    try:
        itemsize = int(typestr[2:])
    except ValueError:
        itemsize = 0
    if typestr[1:2] not in _PLAIN_KINDS or itemsize <= 0:
        raise _not_plain(what, f"type {typestr!r}")
    _check_byte_order(typestr[0], itemsize, what, f"type {typestr!r}")
    nbytes = itemsize
    for extent in shape:
        nbytes *= int(extent)
    if strides is not None:
        expected = itemsize
        for extent, stride in reversed(list(zip(shape, strides))):
            if extent > 1 and stride != expected:
                raise ValueError(f"INVALID_ARGUMENT: {what} is not C-contiguous")
            expected *= extent
    if writable and readonly:
        raise ValueError(f"INVALID_ARGUMENT: {what} is read-only")
    if buffer_shape is not None:
        shape, itemsize = buffer_shape
    return _Memory(int(ptr or 0), nbytes, "cpu", None, obj, shape, itemsize)


# The floating-point element type a cache of each dtype must have when it
# has one (integer elements are taken as raw bits: a uint8 view, or numpy's
# uint16 for bf16, which numpy lacks).
_CACHE_ELEMENTS = {
    Dtype.FLOAT16: {"float16"},
    Dtype.BFLOAT16: {"bfloat16"},
    Dtype.FLOAT8_E4M3: {"float8_e4m3fn"},
    Dtype.FLOAT32: {"float32"},
}


# Buffer-protocol formats of floating-point elements (struct module
# letters; "Z..." is complex), by the name numpy gives them.
_FLOAT_FORMATS = {"e": "float16", "f": "float32", "d": "float64", "g": "float128"}


def _element_name(obj: Any) -> str:
    """A torch tensor's or numpy array's dtype name ("bfloat16", "uint8");
    for other buffers, their format's ("float32" for array.array('f'),
    "complex" for "Zf"), or "uint8" for bytes and integers."""
    dtype = getattr(obj, "dtype", None)
    if dtype is None:
        try:
            fmt = (memoryview(obj).format or "B").lstrip("@=<>!")
        except TypeError:
            return "uint8"
        if fmt.startswith("Z"):
            return "complex"
        return _FLOAT_FORMATS.get(fmt, "uint8")
    name = getattr(dtype, "name", None)  # numpy's; torch's dtypes have none
    return str(name) if name is not None else str(dtype).replace("torch.", "")


def _check_cache_elements(caches: Sequence[Any], dtype: int) -> None:
    """ValueError for a cache tensor of floating-point elements other than
    the layout's dtype (the fingerprint names it): fp16 caches under a bf16
    layout would be stored as, or loaded from, bf16 blocks."""
    allowed = _CACHE_ELEMENTS.get(Dtype(dtype), set())
    for i, t in enumerate(caches):
        name = _element_name(t)
        if name.startswith(("float", "bfloat", "complex")) and name not in allowed:
            raise ValueError(
                f"INVALID_ARGUMENT: caches[{i}] holds {name} elements but the layout's "
                f"dtype is {Dtype(dtype).name} (give tensors of that dtype, or an "
                f"integer view of their bits)")


def _integer(value: Any, what: str) -> int:
    """``value`` as an int, if it is an integer (Python, numpy or a
    one-element integer tensor); TypeError for others: a float block id
    2.9 is no block, and truncating it would pick block 2."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, not {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, not {value!r}") from None


def _as_block_ids(block_ids: Sequence[Any]) -> Any:
    ids = [_integer(b, f"block_ids[{i}]") for i, b in enumerate(block_ids)]
    for i, b in enumerate(ids):
        if not -(1 << 63) <= b < (1 << 63):
            raise ValueError(f"INVALID_ARGUMENT: block_ids[{i}] = {b} is not a 64-bit integer")
    return (ctypes.c_int64 * len(ids))(*ids)


def _check_no_overlap(memories: Sequence[_Memory], what: str) -> None:
    """ValueError naming two of ``memories`` that share bytes (adjacent ones
    are fine), as the native module refuses them."""
    spans = sorted((m.ptr, m.ptr + m.nbytes, i) for i, m in enumerate(memories) if m.nbytes)
    for (_, end, i), (start, _, j) in zip(spans, spans[1:]):
        if start < end:
            first, second = sorted((i, j))
            raise ValueError(f"INVALID_ARGUMENT: {what}[{second}] overlaps {what}[{first}]")


def _check_objects_apart(objects: Sequence[_Memory], caches: Sequence[_Memory]) -> None:
    """ValueError naming an object that shares bytes with a cache tensor
    (see _kvdepot's CheckObjectsApartFromCaches): a gather would write it
    over the cache it reads, a scatter read it from a cache it writes.
    Caches may share bytes with each other (layers that share one KV
    cache). Device and host pointers share one address space (UVA)."""
    for i, o in enumerate(objects):
        for c, m in enumerate(caches):
            if o.nbytes and o.ptr < m.ptr + m.nbytes and m.ptr < o.ptr + o.nbytes:
                raise ValueError(f"INVALID_ARGUMENT: objects[{i}] overlaps caches[{c}]; "
                                 "a block's object needs memory apart from the caches")


class KvShim:
    """One loaded C ABI library (``libkvdepot_kv_cpu.so`` or
    ``libkvdepot_kv_cuda.so``).

    Thread-safe: the library keeps no state; concurrent calls must not write
    the same bytes. The registrations of :meth:`register_host` are tracked
    under a lock. Get instances from :meth:`for_device` (one per library
    file) or construct one from a path.
    """

    _instances: Dict[str, "KvShim"] = {}
    _instances_lock = threading.Lock()

    def __init__(self, library: str) -> None:
        """Loads the library at ``library``. Raises ImportError, naming it,
        when it is missing, does not load, or speaks another ABI version."""
        self.library = os.path.abspath(library)
        if not os.path.exists(self.library):
            raise ImportError(
                f"kvdepot: {self.library} is not built. CMake builds "
                f"libkvdepot_kv_cpu.so always and libkvdepot_kv_cuda.so where nvcc "
                f"is found (targets kvdepot_kv_cpu, kvdepot_kv_cuda); see "
                f"client/python/README.md.")
        try:
            lib = ctypes.CDLL(self.library)  # CDLL: the GIL is released per call
        except OSError as e:
            raise ImportError(f"kvdepot: {self.library} does not load: {e}") from e
        self._lib = lib
        try:
            self._declare(lib)
        except AttributeError as e:  # a library of another kind or version
            raise ImportError(f"kvdepot: {self.library} lacks a kvdepot_kv_ function: "
                              f"{e}") from e
        version = lib.kvdepot_kv_abi_version()
        if version != ABI_VERSION:
            raise ImportError(f"kvdepot: {self.library} has ABI version {version}; "
                              f"this kvshim.py speaks {ABI_VERSION}")
        self.backend: str = lib.kvdepot_kv_backend().decode()
        self._info_cache: Dict[Tuple[int, ...], LayoutInfo] = {}
        self._registered: Dict[int, Tuple[Any, int]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _declare(lib: Any) -> None:
        """Sets the signatures of kv_capi.h's functions on ``lib``."""
        c = ctypes
        err = [c.c_char_p, c.c_size_t]
        lib.kvdepot_kv_abi_version.argtypes = []
        lib.kvdepot_kv_abi_version.restype = c.c_int
        lib.kvdepot_kv_backend.argtypes = []
        lib.kvdepot_kv_backend.restype = c.c_char_p
        lib.kvdepot_kv_status_name.argtypes = [c.c_int]
        lib.kvdepot_kv_status_name.restype = c.c_char_p
        lib.kvdepot_kv_layout_describe.argtypes = [c.POINTER(_Spec), c.POINTER(_Info)] + err
        transfer = [c.POINTER(_Spec), c.POINTER(c.c_void_p), c.c_size_t, c.c_int64,
                    c.POINTER(c.c_int64), c.c_size_t, c.c_int32, c.c_int32,
                    c.POINTER(c.c_void_p), c.c_void_p] + err
        lib.kvdepot_kv_gather.argtypes = transfer
        lib.kvdepot_kv_scatter.argtypes = transfer
        lib.kvdepot_kv_synchronize.argtypes = [c.c_void_p] + err
        lib.kvdepot_kv_current_device.argtypes = [c.POINTER(c.c_int32)] + err
        lib.kvdepot_kv_register_host.argtypes = [c.c_void_p, c.c_size_t] + err
        lib.kvdepot_kv_unregister_host.argtypes = [c.c_void_p] + err
        for f in ("layout_describe", "gather", "scatter", "synchronize",
                  "current_device", "register_host", "unregister_host"):
            getattr(lib, "kvdepot_kv_" + f).restype = c.c_int

    @classmethod
    def for_device(cls, device: Any = "cpu", library: Optional[str] = None) -> "KvShim":
        """The shim for ``device``: "cpu" or "cuda" (also "cuda:1", a
        ``torch.device``), from ``library`` or else :func:`library_path`.
        One instance per library file.

        For "cuda", also checks that a CUDA device is usable (RuntimeError
        ``FAILED_PRECONDITION: ...`` if not: no GPU, no or too old a driver
        for the CUDA runtime the library was built with). ImportError when
        the library is not built."""
        kind = str(getattr(device, "type", device)).split(":")[0]
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"INVALID_ARGUMENT: no kvdepot gather/scatter library for "
                             f"device {device!r}; use 'cpu' or 'cuda'")
        path = os.path.abspath(library or library_path(kind))
        with cls._instances_lock:
            shim = cls._instances.get(path)
            if shim is None:
                shim = cls(path)
                if shim.backend == "cuda":
                    shim.current_device()  # raises without a usable device
                cls._instances[path] = shim
        if shim.backend != kind:
            raise ImportError(f"kvdepot: {path} is the {shim.backend} library, "
                              f"not the {kind} one")
        return shim

    def __repr__(self) -> str:
        return f"KvShim(backend={self.backend!r}, library={self.library!r})"

    # -- errors ---------------------------------------------------------

    def _raise(self, code: int, err: Any) -> None:
        name = self._lib.kvdepot_kv_status_name(code).decode() or f"CODE_{code}"
        message = f"{name}: {err.value.decode(errors='replace')}"
        if self.backend == "cuda" and code == _INVALID_ARGUMENT and "pageable" in message:
            message += (" (from Python: KvShim.register_host(buffer) once, or a "
                        "torch tensor from pin_memory())")
        if code == _NOT_FOUND:
            raise KeyError(message)
        if code in (_INVALID_ARGUMENT, _OUT_OF_RANGE):
            raise ValueError(message)
        raise RuntimeError(message)

    def _call(self, fn: Any, *args: Any) -> None:
        err = ctypes.create_string_buffer(_ERR_CAP)
        code = fn(*args, err, _ERR_CAP)
        if code != 0:
            self._raise(code, err)

    # -- layouts --------------------------------------------------------

    def layout_info(self, layout: Any) -> LayoutInfo:
        """The sizes of ``layout`` (a :class:`LayoutSpec` or
        ``kvdepot.KvLayout``). ValueError for a layout the library rejects."""
        return self._key_and_info(layout)[1]

    def _key_and_info(self, layout: Any) -> Tuple[Tuple[int, ...], LayoutInfo]:
        """``layout``'s _spec_key and its :meth:`layout_info`."""
        key = _spec_key(layout)
        info = self._info_cache.get(key)
        if info is None:
            out = _Info()
            self._call(self._lib.kvdepot_kv_layout_describe, ctypes.byref(_Spec(*key)),
                       ctypes.byref(out))
            info = LayoutInfo(out.num_tensors, out.element_bytes, out.layer_bytes,
                              out.object_bytes, out.tensor_bytes_per_block)
            self._info_cache[key] = info
        return key, info

    # -- gather / scatter -----------------------------------------------

    def gather(self, layout: Any, caches: Sequence[Any], block_ids: Sequence[int],
               objects: Sequence[Any], layers: Optional[Tuple[int, int]] = None,
               stream: Any = None) -> None:
        """Copies layers ``layers`` (default: all) of the blocks
        ``block_ids`` (repeats allowed) out of ``caches`` into ``objects``,
        one per id, each ``(end - begin) x layer_bytes`` bytes, in the
        canonical object format (gpu/README.md).

        ``caches``: the cache tensors of ``layout`` (num_layers per-layer
        tensors, or one cross-layer tensor), contiguous and of equal size,
        N blocks each, little-endian. A tensor of more than one dimension
        must have the layout's physical shape (gpu/kv_layout.h, e.g. [2, N,
        T, H, D] for FLASH_ATTN_NHD; dimensions of extent 1 aside, and an
        integer view of the bits may count other elements in the last
        dimension); 1-D buffers are taken by their size. A torch cache may
        instead be a permuted view of a contiguous tensor, as vLLM's HND
        caches are: then of the layout's shape in NHD order (e.g. [2, N, T,
        H, D] for FLASH_ATTN_HND), its strides in the physical order
        (:meth:`_check_shapes` says what these checks can and cannot
        tell). ``objects``:
        writable torch tensors, numpy arrays or buffers. The cpu library
        takes host memory only; the cuda library takes CUDA torch caches,
        and objects on the same device or in page-locked host memory
        (pin_memory tensors, or buffers registered with
        :meth:`register_host`).

        cuda: enqueued on ``stream`` (a ``torch.cuda.Stream``, a raw
        ``cudaStream_t`` int; default: torch's current stream of the caches'
        device) and returns; the objects are complete once that stream has
        reached this point (:meth:`synchronize`), and every object must stay
        alive until then. cpu: done when it returns; ``stream`` is ignored.

        Raises ValueError, before anything is written, for bad input: counts,
        sizes or shapes that do not match the layout, big-endian elements,
        ids outside the caches, a bad layer range, a layout field or layer
        outside int32, memory the library cannot reach."""
        self._transfer(False, layout, caches, block_ids, objects, layers, stream)

    def scatter(self, layout: Any, caches: Sequence[Any], block_ids: Sequence[int],
                objects: Sequence[Any], layers: Optional[Tuple[int, int]] = None,
                stream: Any = None) -> None:
        """The reverse of :meth:`gather`: ``objects[i]`` (readable; any
        buffer) is written into block ``block_ids[i]`` of ``caches``;
        nothing else in the caches changes. Block ids must not repeat.
        Same memory, stream and error rules as :meth:`gather`."""
        self._transfer(True, layout, caches, block_ids, objects, layers, stream)

    def _transfer(self, to_cache: bool, layout: Any, caches: Sequence[Any],
                  block_ids: Sequence[int], objects: Sequence[Any],
                  layers: Optional[Tuple[int, int]], stream: Any) -> None:
        key, info = self._key_and_info(layout)
        caches = list(caches)
        objects = list(objects)
        if len(caches) != info.num_tensors:
            raise ValueError(
                f"INVALID_ARGUMENT: layout {CacheLayout(key[0]).name} with {key[2]} "
                f"layers takes {info.num_tensors} cache tensors, got {len(caches)}")
        _check_cache_elements(caches, key[1])
        cache_mem = [_memory(t, to_cache, f"caches[{i}]", permuted=True)
                     for i, t in enumerate(caches)]
        obj_mem = [_memory(o, not to_cache, f"objects[{i}]") for i, o in enumerate(objects)]
        per_block = info.tensor_bytes_per_block
        size = cache_mem[0].nbytes
        for i, m in enumerate(cache_mem):
            if m.nbytes != size or m.nbytes == 0 or m.nbytes % per_block != 0:
                raise ValueError(
                    f"INVALID_ARGUMENT: caches[{i}] has {m.nbytes} bytes; every cache "
                    f"tensor must have the same size, a positive multiple of "
                    f"{per_block} bytes (one block)")
        num_blocks = size // per_block
        self._check_shapes(key, info, cache_mem, num_blocks)
        begin, end = (0, key[2]) if layers is None else (
            _integer(layers[0], "layers[0]"), _integer(layers[1], "layers[1]"))
        # Here, not (only) in the library: ctypes would pass the range modulo
        # 2**32, (0, 2**32 + 1) as (0, 1), past the size check below.
        if not 0 <= begin < end <= key[2]:
            raise ValueError(f"INVALID_ARGUMENT: layer range [{begin}, {end}) is not a "
                             f"non-empty part of [0, {key[2]})")
        want = (end - begin) * info.layer_bytes
        for i, m in enumerate(obj_mem):
            if m.nbytes != want:
                raise ValueError(f"INVALID_ARGUMENT: objects[{i}] has {m.nbytes} "
                                 f"bytes, expected {want}")
        if not to_cache:  # the objects are written: one must not clobber another
            _check_no_overlap(obj_mem, "objects")
        ids = _as_block_ids(block_ids)
        if len(obj_mem) != len(ids):
            raise ValueError(f"INVALID_ARGUMENT: {len(ids)} block ids but {len(obj_mem)} "
                             f"objects; there must be one per block")
        device_index = self._check_devices(cache_mem, obj_mem)
        _check_objects_apart(obj_mem, cache_mem)
        tensors = (ctypes.c_void_p * len(cache_mem))(*[m.ptr for m in cache_mem])
        ptrs = (ctypes.c_void_p * len(obj_mem))(*[m.ptr for m in obj_mem])
        fn = self._lib.kvdepot_kv_scatter if to_cache else self._lib.kvdepot_kv_gather
        args = (ctypes.byref(_Spec(*key)), tensors, len(cache_mem), num_blocks, ids,
                len(ids), begin, end, ptrs)
        if self.backend == "cpu":
            self._call(fn, *args, None)
            return
        import torch  # CUDA caches are torch tensors (checked above)

        with torch.cuda.device(device_index):
            self._call(fn, *args, self._stream_handle(stream, device_index))

    @staticmethod
    def _check_shapes(key: Tuple[int, ...], info: LayoutInfo, caches: List[_Memory],
                      num_blocks: int) -> None:
        """ValueError for a cache whose dimensions do not fit the layout
        (gpu/kv_layout.h); layouts share namespaces, so another layout's
        tensor would store or load wrong blocks. What is checked:

        * A C-contiguous tensor or array of more than one dimension: its
          shape must be the layout's physical shape (dimensions of extent 1
          aside; an integer view of the bits may count other elements in
          the last dimension). Only the shape: a tensor of another layout
          with the same shape passes -- NHD as HND or the reverse when
          block_size == num_kv_heads, FlashAttention's [2, N, ...] as
          FlashInfer's [N, 2, ...] when num_blocks == 2.
        * A torch tensor that is a permuted view of a contiguous one (how
          vLLM builds HND caches): its shape must be the layout's logical
          shape (the physical one in NHD order, e.g. [2, N, T, H, D] for
          FLASH_ATTN_HND), and its strides must lay those dimensions out in
          the layout's physical order. Its dimensions are taken to be in
          that logical order, so the strides tell NHD from HND whatever the
          sizes; FlashAttention and FlashInfer still only by shape.
        * 1-D buffers: their size only (checked by the caller)."""
        expected, letters = _physical_shape(key, num_blocks)
        want = _byte_shape(expected, info.element_bytes)
        name = CacheLayout(key[0]).name
        for i, m in enumerate(caches):
            if m.strides is not None:
                KvShim._check_permuted(key, info, m, num_blocks, f"caches[{i}]")
            elif len(m.shape) > 1 and _byte_shape(m.shape, m.itemsize) != want:
                raise ValueError(
                    f"INVALID_ARGUMENT: caches[{i}] has shape {list(m.shape)}; layout "
                    f"{name} takes tensors of shape {list(expected)} "
                    f"(physically {letters}; an integer view of other width may differ "
                    f"in the last dimension, a 1-D buffer in shape)")

    @staticmethod
    def _check_permuted(key: Tuple[int, ...], info: LayoutInfo, m: _Memory,
                        num_blocks: int, what: str) -> None:
        """_check_shapes for a permuted view ``m``: the layout's logical
        shape, strides of its physical order."""
        logical, names, order = _logical_order(key, num_blocks)
        physical, letters = _physical_shape(key, num_blocks)
        shape = list(m.shape)
        strides = list(m.strides or ())
        # The head-size dimension is innermost in every layout: an integer
        # view of other width counts other elements in it.
        want_shape = list(logical)
        last_bytes = want_shape[-1] * info.element_bytes
        want_shape[-1] = last_bytes // m.itemsize if last_bytes % m.itemsize == 0 else -1
        want_strides = [0] * len(want_shape)
        step = 1
        for dim in reversed(order):
            want_strides[dim] = step
            step *= want_shape[dim]
        if shape == want_shape and all(
                e <= 1 or st == w for e, st, w in zip(shape, strides, want_strides)):
            return
        # The order its strides give, in the letters of the logical shape
        # where that shape is the layout's.
        by_stride = sorted(range(len(shape)), key=lambda d: -strides[d])
        if len(shape) == len(names) and shape[:-1] == want_shape[:-1]:
            seen = "[" + ", ".join(names[d] for d in by_stride) + "]"
        else:
            seen = f"dimensions {by_stride}"
        raise ValueError(
            f"INVALID_ARGUMENT: {what} is a permuted view of shape {shape} with "
            f"strides {strides}, in memory as {seen}; layout {CacheLayout(key[0]).name} "
            f"takes contiguous tensors of shape {list(physical)} "
            f"(physically {letters}), or views of them of shape {list(logical)} "
            f"([{', '.join(names)}])")

    def _check_devices(self, caches: List[_Memory], objects: List[_Memory]) -> Optional[int]:
        """Checks the memory against the backend; returns the CUDA device
        index of the cuda backend's tensors."""
        named = [(f"caches[{i}]", m) for i, m in enumerate(caches)]
        named += [(f"objects[{i}]", m) for i, m in enumerate(objects)]
        if self.backend == "cpu":
            for what, m in named:
                if m.device != "cpu":
                    raise ValueError(
                        f"INVALID_ARGUMENT: {what} is a torch tensor on {m.device}; the cpu "
                        f"library ({os.path.basename(self.library)}) moves host memory "
                        f"only: use KvShim.for_device('cuda') for CUDA tensors")
            return None
        index: Optional[int] = None
        for what, m in named:
            if what.startswith("caches") and m.device != "cuda":
                raise ValueError(
                    f"INVALID_ARGUMENT: {what} is {'host memory' if m.device == 'cpu' else 'on ' + m.device}; "
                    f"the cuda library ({os.path.basename(self.library)}) moves blocks of "
                    f"CUDA torch caches: use KvShim.for_device('cpu') for host caches")
            if m.device not in ("cuda", "cpu"):
                raise ValueError(f"INVALID_ARGUMENT: {what} is a tensor on {m.device}; the "
                                 f"cuda library takes CUDA tensors and host memory")
            if m.device == "cuda":
                dev = 0 if m.index is None else int(m.index)
                if index is None:
                    index = dev
                elif dev != index:
                    raise ValueError(f"INVALID_ARGUMENT: {what} is on cuda:{dev}, the "
                                     f"caches on cuda:{index}: one device per call")
        return index

    @staticmethod
    def _stream_handle(stream: Any, device_index: Optional[int]) -> Optional[int]:
        """A cudaStream_t as an int (None: the legacy default stream)."""
        if stream is None:
            import torch

            return torch.cuda.current_stream(device_index).cuda_stream or None
        handle = getattr(stream, "cuda_stream", stream)
        if not isinstance(handle, int):
            raise TypeError("stream must be a torch.cuda.Stream, a cudaStream_t as an "
                            f"int, or None, not {type(stream).__name__}")
        if not 0 <= handle < _POINTER_LIMIT:  # ctypes would wrap it
            raise ValueError(f"INVALID_ARGUMENT: stream handle {handle} is not a pointer")
        return handle or None

    # -- streams, devices, host memory ----------------------------------

    def synchronize(self, stream: Any = None) -> None:
        """Waits for the work on ``stream`` (default: torch's current
        stream of the *current* device where torch is loaded, else the
        legacy default stream; a ``torch.cuda.Stream`` is waited for on its
        own device); raises the device's error if any of it failed. Returns
        at once in the cpu library. A gather or scatter without a stream
        runs on the current stream of the *caches'* device: for caches on
        another device than the current one, the default waits on another
        stream, so pass the stream (as the module's example does)."""
        handle = None
        device = None
        if self.backend == "cuda":
            if stream is None and "torch" in sys.modules:
                stream = sys.modules["torch"].cuda.current_stream()
            handle = None if stream is None else self._stream_handle(stream, None)
            # A torch.cuda.Stream knows its GPU. Its default stream is the
            # handle 0, the legacy default stream of whichever GPU is
            # current: make it the stream's, or this would wait on another.
            device = getattr(stream, "device", None)
        current: Any = contextlib.nullcontext()
        if device is not None:
            import torch

            current = torch.cuda.device(device)
        with current:
            self._call(self._lib.kvdepot_kv_synchronize, handle)

    def current_device(self) -> int:
        """The calling thread's CUDA device as the library sees it (0 for
        cpu). RuntimeError ``FAILED_PRECONDITION`` without a usable device."""
        device = ctypes.c_int32(-1)
        self._call(self._lib.kvdepot_kv_current_device, ctypes.byref(device))
        return device.value

    def register_host(self, buffer: Any) -> None:
        """Page-locks the host memory of ``buffer`` (a writable numpy array,
        buffer, e.g. the array ``Client.allocate_buffer`` returns, or a CPU
        tensor) so that the cuda library's kernels reach it; a no-op beyond
        the checks in the cpu library. Register once, not per transfer
        (pinning is slow). The buffer is kept alive until
        :meth:`unregister_host`.

        Raises ValueError for device or read-only memory, RuntimeError
        ``ALREADY_EXISTS`` if this shim registered it already (the cuda
        library says so too for memory registered elsewhere, e.g. a
        pin_memory tensor)."""
        m = _memory(buffer, True, "buffer")
        if m.device != "cpu":
            raise ValueError(f"INVALID_ARGUMENT: buffer is a tensor on {m.device}; only "
                             f"host memory is registered")
        with self._lock:
            if m.ptr in self._registered:
                raise RuntimeError(f"ALREADY_EXISTS: host memory at {m.ptr:#x} is "
                                   f"registered already")
            self._call(self._lib.kvdepot_kv_register_host, m.ptr, m.nbytes)
            self._registered[m.ptr] = (m.keep, m.nbytes)

    def unregister_host(self, buffer: Any) -> None:
        """Undoes :meth:`register_host` of the same buffer (or one starting
        at the same address). KeyError ``NOT_FOUND`` if this shim did not
        register it."""
        m = _memory(buffer, False, "buffer")
        with self._lock:
            if m.ptr not in self._registered:
                raise KeyError(f"NOT_FOUND: host memory at {m.ptr:#x} was not "
                               f"registered through this shim")
            self._call(self._lib.kvdepot_kv_unregister_host, m.ptr)
            del self._registered[m.ptr]
