"""Wire format of channel items: msgpack with numpy arrays and torch tensors as ext types.

    encode(Message) -> (header: bytes, buffers: list[np.ndarray])
    decode(header, buffers) -> Message

Header layout (all offsets relative to the start of `header`):

    MAGIC (4 bytes) | body length (u64 LE) | msgpack body | pad to 64 | raw region

The msgpack body is `{"d": data, "m": meta}`. An array or tensor is an ext type whose payload is
the msgpack list `[dtype_name, shape, where, offset]`:
  - `where == -1`: its bytes are in the header's raw region at `offset` (arrays below the
    out-of-band threshold). They live outside the msgpack body because msgpack hands ext payloads
    to the hook as fresh `bytes`; keeping them in a region we index ourselves lets decode return a
    view over the received header instead of a copy.
  - `where >= 0`: its bytes are all of `buffers[where]` (arrays at or above the threshold). Buffers
    are flat uint8 numpy views of the caller's memory: Ray's pickle5 sends numpy arrays out of
    band, so neither encode nor the transport copies them here (Ray copies once into its store).

Decode is zero-copy: arrays and tensors are views over `header` / `buffers` and are READ-ONLY
(numpy: `flags.writeable` is False; torch: writing is undefined behaviour). Callers that write
must copy first (`arr.copy()`, `t.clone()`).

Plain values: None, bool, int, float, str, bytes, lists, dicts with str keys (other keys are
refused by decode), nested. Tuples are sent as msgpack arrays and come back as LISTS. numpy
scalars (np.float32(1.0)) come back as plain Python scalars. Non-contiguous arrays/tensors are
made contiguous (one copy at encode); CUDA tensors are moved to the CPU.
"""

from __future__ import annotations

import functools
import struct
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

# torch is imported only when a tensor is decoded: a node whose items hold no tensors (a reward
# function, a toy graph's node) then starts its actor process without torch's ~2 s import.

DEFAULT_OOB_THRESHOLD = 64 * 1024
"""Arrays of at least this many bytes travel as separate buffers instead of in the header."""

DEFAULT_MAX_BYTES = 1 << 30
"""decode() refuses a header or a buffer larger than this (1 GiB)."""

_MAGIC = b"DFm1"
_PREFIX = struct.Struct("<4sQ")  # magic, msgpack body length
_ALIGN = 64  # raw-region entries start at multiples of this (vector loads, cache lines)

_EXT_NUMPY = 1
_EXT_TORCH = 2

_NUMPY_KINDS = frozenset("biufc")


@functools.cache
def torch_dtypes() -> dict:
    """The torch dtypes we carry, by the name used on the wire. numpy dtypes travel as `dtype.str`
    (e.g. "<f4", "|b1"), restricted to plain numeric kinds so decode never builds object arrays."""
    import torch

    return {
        str(d).removeprefix("torch."): d
        for d in (
            torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
            torch.float16, torch.bfloat16, torch.float32, torch.float64,
            torch.uint16, torch.uint32, torch.uint64, torch.complex64, torch.complex128,
        )
    }


class DecodeError(ValueError):
    """The bytes are not a valid encoded Message (garbage, truncated, or over a size limit)."""


@dataclass(slots=True)
class Message:
    """One channel item: the payload and its metadata.

    `meta` maps str -> int | float | str | bool | None. The engine adds `seq` (per producer),
    `producer` (its name) and `t_send_us` (wall clock when it entered the outbox, microseconds);
    nodes add their own keys (e.g. `version`).
    """

    data: Any
    meta: dict = field(default_factory=dict)


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


class _Encoder:
    """Collects raw bytes and out-of-band buffers while msgpack walks the message."""

    __slots__ = ("threshold", "raw", "raw_len", "buffers")

    def __init__(self, threshold: int):
        self.threshold = threshold
        self.raw: list = []      # chunks of the raw region, padding included
        self.raw_len = 0
        self.buffers: list = []

    def _place(self, flat_u8: np.ndarray) -> tuple[int, int]:
        """Put a flat uint8 view inline or out of band; returns (where, offset)."""
        if flat_u8.nbytes >= self.threshold:
            self.buffers.append(flat_u8)
            return len(self.buffers) - 1, 0
        offset = _round_up(self.raw_len, _ALIGN)
        if offset > self.raw_len:
            self.raw.append(bytes(offset - self.raw_len))
        self.raw.append(flat_u8.data)
        self.raw_len = offset + flat_u8.nbytes
        return -1, offset

    def default(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")  # not imported: obj cannot be a tensor
        if torch is not None and isinstance(obj, torch.Tensor):
            t = obj.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            name = str(t.dtype).removeprefix("torch.")
            if name not in torch_dtypes():
                raise TypeError(f"cannot encode torch dtype {t.dtype}")
            # reshape(-1) makes 0-d tensors 1-d so the uint8 view is allowed; .numpy() shares
            # memory (its base keeps the tensor alive while the buffer is in flight).
            flat = t.contiguous().reshape(-1).view(torch.uint8).numpy()
            where, offset = self._place(flat)
            return msgpack.ExtType(_EXT_TORCH, msgpack.packb([name, list(t.shape), where, offset]))
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind not in _NUMPY_KINDS:
                raise TypeError(f"cannot encode numpy dtype {obj.dtype} (numeric kinds only)")
            flat = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
            where, offset = self._place(flat)
            return msgpack.ExtType(
                _EXT_NUMPY, msgpack.packb([obj.dtype.str, list(obj.shape), where, offset])
            )
        if isinstance(obj, np.generic):
            return obj.item()
        raise TypeError(f"cannot encode {type(obj).__name__}")


def encode(msg: Message, *, oob_threshold: int = DEFAULT_OOB_THRESHOLD) -> tuple[bytes, list]:
    """Serialize `msg`. Returns (header, buffers); buffers are flat uint8 numpy views that share
    memory with the message's arrays/tensors, so the caller must not modify those until the
    buffers have been sent. Raises TypeError for values the format does not carry."""
    enc = _Encoder(oob_threshold)
    body = msgpack.packb({"d": msg.data, "m": msg.meta}, default=enc.default, use_bin_type=True,
                         datetime=False)
    if not enc.raw:
        return _PREFIX.pack(_MAGIC, len(body)) + body, enc.buffers
    head_len = _PREFIX.size + len(body)
    pad = bytes(_round_up(head_len, _ALIGN) - head_len)
    return b"".join([_PREFIX.pack(_MAGIC, len(body)), body, pad, *enc.raw]), enc.buffers


class _Decoder:
    __slots__ = ("header", "header_len", "raw_start", "buffers")

    def __init__(self, header, header_len: int, raw_start: int, buffers: list):
        self.header = header
        self.header_len = header_len
        self.raw_start = raw_start
        self.buffers = buffers

    def _locate(self, where: int, offset: int, nbytes: int) -> tuple[Any, int]:
        """(buffer object, byte offset) holding `nbytes` bytes of one array, checked."""
        if where == -1:
            start = self.raw_start + offset
            if offset < 0 or start + nbytes > self.header_len:
                raise DecodeError("array runs past the end of the header")
            return self.header, start
        if not 0 <= where < len(self.buffers):
            raise DecodeError(f"buffer index {where} out of range ({len(self.buffers)} buffers)")
        buf = self.buffers[where]
        if memoryview(buf).nbytes != nbytes:
            raise DecodeError(f"buffer {where} has {memoryview(buf).nbytes} bytes, "
                              f"expected {nbytes}")
        return buf, 0

    def ext_hook(self, code: int, payload: bytes) -> Any:
        dtype_name, shape, where, offset = msgpack.unpackb(payload)
        if not all(isinstance(s, int) and s >= 0 for s in shape):
            raise DecodeError(f"bad shape {shape!r}")
        count = 1
        for s in shape:
            count *= s
        if code == _EXT_NUMPY:
            dtype = np.dtype(dtype_name)
            if dtype.kind not in _NUMPY_KINDS:
                raise DecodeError(f"numpy dtype {dtype_name!r} not allowed")
            buf, start = self._locate(where, offset, count * dtype.itemsize)
            return np.frombuffer(buf, dtype, count, start).reshape(shape)
        if code == _EXT_TORCH:
            import torch

            dtype = torch_dtypes().get(dtype_name)
            if dtype is None:
                raise DecodeError(f"torch dtype {dtype_name!r} not allowed")
            buf, start = self._locate(where, offset, count * dtype.itemsize)
            if count == 0:  # torch.frombuffer refuses empty buffers
                return torch.empty(shape, dtype=dtype)
            with warnings.catch_warnings():
                # The buffer is read-only by design (see module docstring); torch warns about it.
                warnings.simplefilter("ignore", UserWarning)
                return torch.frombuffer(buf, dtype=dtype, count=count, offset=start).view(shape)
        raise DecodeError(f"unknown ext type {code}")


def decode(header, buffers: list, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Message:
    """Inverse of encode(). Arrays/tensors in the result are read-only views over `header` and
    `buffers` (no copy); they keep those objects alive. Raises DecodeError for malformed input
    or when the header or any buffer exceeds `max_bytes`."""
    header_len = memoryview(header).nbytes
    if header_len > max_bytes:
        raise DecodeError(f"header of {header_len} bytes exceeds the {max_bytes}-byte limit")
    for i, buf in enumerate(buffers):
        if memoryview(buf).nbytes > max_bytes:
            raise DecodeError(f"buffer {i} exceeds the {max_bytes}-byte limit")
    if header_len < _PREFIX.size:
        raise DecodeError("header too short")
    magic, body_len = _PREFIX.unpack_from(header)
    if magic != _MAGIC:
        raise DecodeError("not a dataflow message (bad magic)")
    if _PREFIX.size + body_len > header_len:
        raise DecodeError("header truncated")
    dec = _Decoder(header, header_len, _round_up(_PREFIX.size + body_len, _ALIGN), buffers)
    body = memoryview(header)[_PREFIX.size:_PREFIX.size + body_len]
    try:
        # Length limits default to the body size already; set them explicitly so a change in
        # msgpack's defaults cannot let a small header claim a huge container.
        obj = msgpack.unpackb(
            body, ext_hook=dec.ext_hook, raw=False, strict_map_key=True, use_list=True,
            max_str_len=body_len, max_bin_len=body_len,
            max_array_len=body_len, max_map_len=body_len, max_ext_len=body_len,
        )
    except DecodeError:
        raise
    except Exception as e:  # msgpack raises several unrelated types for malformed input
        raise DecodeError(f"malformed message: {type(e).__name__}: {e}") from e
    if not isinstance(obj, dict) or obj.keys() != {"d", "m"} or not isinstance(obj["m"], dict):
        raise DecodeError("malformed message: expected {'d': data, 'm': meta}")
    return Message(obj["d"], obj["m"])
