"""dataflow.channel.codec: round trips, zero-copy decode, limits. No Ray."""

import msgpack
import numpy as np
import pytest
import torch

from dataflow.channel.codec import DEFAULT_OOB_THRESHOLD, DecodeError, Message, decode, encode

TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.bfloat16, torch.float32, torch.float64]
NUMPY_DTYPES = [np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint16, np.uint32,
                np.uint64, np.float16, np.float32, np.float64]
SHAPES = [(), (0,), (3, 0, 2), (7,), (2, 3, 4), (300, 300)]  # (300, 300) goes out of band


def roundtrip(data, meta=None, **kw):
    header, buffers = encode(Message(data, meta or {}), **kw)
    assert isinstance(header, bytes)
    return decode(header, buffers)


def _random_tensor(shape, dtype):
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(0, 100, shape).to(dtype)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_torch_roundtrip_bit_exact(dtype, shape):
    t = _random_tensor(shape, dtype)
    out = roundtrip({"t": t}).data["t"]
    assert isinstance(out, torch.Tensor)
    assert out.dtype == dtype and out.shape == t.shape
    # Compare bits, not values: bf16/fp16 NaN or -0.0 must survive too.
    if t.numel():
        assert torch.equal(out.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_bf16_special_values_bit_exact():
    bits = torch.tensor([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x3F80]).to(torch.int16)
    t = bits.view(torch.bfloat16)
    out = roundtrip(t).data
    assert torch.equal(out.view(torch.int16), bits)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_numpy_roundtrip(dtype, shape):
    a = np.asarray(np.random.default_rng(0).random(shape) * 100).astype(dtype)
    out = roundtrip([a]).data[0]
    assert isinstance(out, np.ndarray)
    assert out.dtype == a.dtype and out.shape == a.shape
    assert np.array_equal(out, a)


def test_non_contiguous_and_big_endian():
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2].T  # non-contiguous view
    a = np.arange(12, dtype=">i4").reshape(3, 4)[::2]
    out = roundtrip({"t": t, "a": a}).data
    assert torch.equal(out["t"], t)
    assert np.array_equal(out["a"], a) and out["a"].dtype == np.dtype(">i4")


def test_nested_structures_and_meta():
    data = {
        "none": None, "bools": [True, False], "int": -(2**62), "float": 1.5, "str": "héllo",
        "bytes": b"\x00\xff", "tuple": (1, (2, 3)), "empty": {}, "np_scalar": np.float32(2.5),
        "nested": {"list": [{"t": torch.ones(2, dtype=torch.bfloat16)}, np.arange(3)]},
    }
    meta = {"seq": 3, "producer": "gen[1]", "t_send_us": 123, "version": 7, "ok": True,
            "loss": 0.25, "tag": None}
    msg = roundtrip(data, meta)
    assert msg.meta == meta
    out = msg.data
    assert out["tuple"] == [1, [2, 3]]  # tuples come back as lists (documented)
    assert out["np_scalar"] == 2.5 and type(out["np_scalar"]) is float
    assert {k: out[k] for k in ("none", "bools", "int", "float", "str", "bytes", "empty")} == {
        k: data[k] for k in ("none", "bools", "int", "float", "str", "bytes", "empty")}
    assert torch.equal(out["nested"]["list"][0]["t"], torch.ones(2, dtype=torch.bfloat16))
    assert np.array_equal(out["nested"]["list"][1], np.arange(3))


def test_threshold_decides_inline_or_out_of_band():
    small = np.zeros(DEFAULT_OOB_THRESHOLD - 1, np.uint8)
    big = np.zeros(DEFAULT_OOB_THRESHOLD, np.uint8)
    header, buffers = encode(Message({"s": small, "b": big}))
    assert len(buffers) == 1 and buffers[0].nbytes == big.nbytes
    assert len(header) > small.nbytes
    assert all(isinstance(b, np.ndarray) and b.dtype == np.uint8 for b in buffers)


def test_encode_does_not_copy_out_of_band_data():
    t = torch.randn(1 << 16)
    _, buffers = encode(Message(t))
    assert buffers[0].__array_interface__["data"][0] == t.data_ptr()


def _address_range(buf):
    view = np.frombuffer(buf, np.uint8)
    start = view.__array_interface__["data"][0]
    return start, start + view.nbytes


def _inside(arr_ptr, nbytes, buf):
    lo, hi = _address_range(buf)
    return lo <= arr_ptr and arr_ptr + nbytes <= hi


def test_decode_is_zero_copy_inline_and_out_of_band():
    inline_np, inline_t = np.arange(100, dtype=np.float32), torch.arange(50, dtype=torch.int64)
    big_np = np.arange(1 << 15, dtype=np.float64)
    big_t = torch.randn(1 << 15).to(torch.bfloat16)
    header, buffers = encode(Message([inline_np, inline_t, big_np, big_t]))
    # What a receiver gets: fresh buffers it owns (as Ray hands them over).
    buffers = [np.array(b) for b in buffers]
    out = decode(header, buffers).data
    assert _inside(out[0].__array_interface__["data"][0], out[0].nbytes, header)
    assert _inside(out[1].data_ptr(), out[1].nbytes, header)
    assert _inside(out[2].__array_interface__["data"][0], out[2].nbytes, buffers[0])
    assert _inside(out[3].data_ptr(), out[3].nbytes, buffers[1])
    assert not out[0].flags.writeable  # read-only: callers copy before writing
    assert np.array_equal(out[2], big_np) and torch.equal(out[3], big_t)


def test_inline_arrays_are_aligned_within_header():
    header, _ = encode(Message([np.ones(3, np.int8), np.arange(5, dtype=np.float64)]))
    out = decode(header, []).data
    base = _address_range(header)[0]
    assert (out[1].__array_interface__["data"][0] - base) % 64 == 0


def test_unsupported_types_raise_type_error():
    with pytest.raises(TypeError):
        encode(Message(object()))
    with pytest.raises(TypeError):
        encode(Message(np.array([object()])))
    # Non-str dict keys pass encode (msgpack has no cheap check) but decode refuses them.
    with pytest.raises(DecodeError):
        decode(*encode(Message({1: "x"})))


def test_size_limits():
    header, buffers = encode(Message(np.zeros(1 << 20, np.uint8)))
    with pytest.raises(DecodeError, match="limit"):
        decode(header, buffers, max_bytes=1 << 19)
    header, buffers = encode(Message("x" * 5000))
    with pytest.raises(DecodeError, match="limit"):
        decode(header, buffers, max_bytes=1000)


@pytest.mark.parametrize("garbage", [
    b"", b"\x00", b"not a message at all", b"DFm1" + b"\xff" * 8,
    b"DFm1" + (5).to_bytes(8, "little") + b"\xc1\xc1\xc1\xc1\xc1",
])
def test_garbage_raises_decode_error(garbage):
    with pytest.raises(DecodeError):
        decode(garbage, [])


def test_tampered_messages_raise_decode_error():
    header, buffers = encode(Message(np.zeros(1 << 17, np.uint8)))
    with pytest.raises(DecodeError):
        decode(header, [])  # buffer missing
    with pytest.raises(DecodeError):
        decode(header, [np.zeros(10, np.uint8)])  # wrong size
    header, _ = encode(Message(np.arange(100, dtype=np.int64)))
    with pytest.raises(DecodeError):
        decode(header[:-8], [])  # inline region truncated
    header, _ = encode(Message({"a": [1, 2, 3]}))
    with pytest.raises(DecodeError):
        decode(header[:-2], [])  # msgpack body truncated
    body = msgpack.packb([1, 2])  # valid msgpack, wrong shape
    with pytest.raises(DecodeError, match="expected"):
        decode(b"DFm1" + len(body).to_bytes(8, "little") + body, [])
