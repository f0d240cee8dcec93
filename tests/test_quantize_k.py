"""The searched quantisers (ggraph/gguf/quantize_k.py) against ggml's own ``ggml_quantize_chunk``, byte for byte.

The oracle is the C function llama-quantize calls, from llama-cpp-python's
libggml-base.so, run through ctypes on the same float32 rows and the same imatrix.
Rare rounding ties and NaN-producing overflows only show up in volume, so every
type sees tens of thousands of groups drawn from many distributions.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from ggraph import dtypes
from ggraph.gguf import block_bits, quantize_k, quants

K_TYPES = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"]
LEGACY = ["q4_0", "q4_1", "q5_0", "q5_1"]


# ---------------------------------------------------------------- ggml_quantize_chunk through ctypes

def ggml_quantize_chunk():
    """ggml's ``size_t ggml_quantize_chunk(type, src, dst, start, nrows, n_per_row, imatrix)``."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="ggml's C quantisers come with llama-cpp-python")
    fn = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so")).ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_void_p]
    return fn


def ggml_quantize(x: np.ndarray, dt: dtypes.DType, imatrix: np.ndarray | None) -> np.ndarray:
    """llama.cpp's bytes for float32 ``x`` (any shape; rows are the last axis), shaped as quants.quantize's."""
    rows = np.ascontiguousarray(x, np.float32).reshape(-1, x.shape[-1])
    out = np.zeros((rows.shape[0], dt.row_bytes(rows.shape[1])), np.uint8)
    im = None if imatrix is None else np.ascontiguousarray(imatrix, np.float32)
    size = ggml_quantize_chunk()(dt.ggml_id, rows.ctypes.data, out.ctypes.data, 0, rows.shape[0], rows.shape[1],
                                 None if im is None else im.ctypes.data)
    assert size == out.nbytes
    return out.reshape(*x.shape[:-1], -1)


# ---------------------------------------------------------------- inputs

def rows_of_every_kind(rows: int, n: int, rng) -> np.ndarray:
    """(rows, n) float32: each row from one of many distributions, plus the degenerate rows."""
    kinds = [
        lambda: rng.standard_normal(n),
        lambda: rng.uniform(-1, 1, n),
        lambda: rng.uniform(0, 1, n),                                  # all positive: the min clamps to 0
        lambda: -rng.exponential(1, n),                                # all negative
        lambda: rng.standard_normal(n) * np.where(rng.random(n) < 0.02, 100, 1),   # outliers
        lambda: rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 6),   # a random overall scale
        lambda: rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n // 16).repeat(16),  # per-group scales
        lambda: rng.integers(-8, 8, n) * 0.5,                          # halves: rounding ties
        lambda: rng.standard_normal(n).astype(np.float16),             # few mantissa bits, as real weights
        lambda: rng.standard_normal(n) * (rng.random(n) < 0.3),        # mostly zeros
    ]
    x = np.stack([kinds[i % len(kinds)]() for i in rng.permutation(rows)]).astype(np.float32)
    special = [0.0, -0.0, 0.25, -3.0, 1e-30, -1e-38]                    # all-zero, constant rows, tiny values
    for i, v in enumerate(special):
        x[i] = v
    x[len(special)] *= np.float32(1e6)                                 # fp16 scales overflow
    x[len(special) + 1] *= np.float32(1e25)                            # x*x overflows: C's sums turn NaN
    x[len(special) + 2, ::3] = 0
    return x


def imatrix_of(kind: str | None, n: int, rng) -> np.ndarray | None:
    """None, random positive weights (squared, as llama-imatrix's are), or the same with 30% zeros."""
    if kind is None:
        return None
    w = (rng.exponential(1, n) ** 2).astype(np.float32)
    if kind == "with zeros":
        w[rng.random(n) < 0.3] = 0
    return w


# ---------------------------------------------------------------- byte for byte against ggml

@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("imatrix", [None, "random", "with zeros"])
@pytest.mark.parametrize("name", K_TYPES + LEGACY)
def test_matches_ggml_quantize_chunk(name, imatrix):
    dt = dtypes.from_name(name)
    rng = np.random.default_rng(sum(map(ord, name + str(imatrix))))
    x = rows_of_every_kind(384, 1024, rng)                             # 98304 groups of 16, 12288 blocks of 32
    w = imatrix_of(imatrix, 1024, rng)
    ours, ref = quants.quantize(x, dt, imatrix=w), ggml_quantize(x, dt, w)
    bad = np.flatnonzero((ours.reshape(-1, dt.type_size) != ref.reshape(-1, dt.type_size)).any(axis=1))
    assert not bad.size, f"{name}: {bad.size} of {ref.size // dt.type_size} blocks differ, first {bad[:5]}"


SHAPES = [(1, 256), (3, 512), (2, 3, 768), (5, 2816), (2, 4096)]


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", K_TYPES + LEGACY + ["q8_0"])
def test_shapes_match_ggml(name, shape):
    """Rows of several lengths and leading dims: the imatrix is indexed by column, sigma2 taken per row."""
    dt = dtypes.from_name(name)
    rng = np.random.default_rng(len(shape) * 1000 + shape[-1])
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 3, shape[:-1] + (1,))).astype(np.float32)
    for w in (None, imatrix_of("random", shape[-1], rng)):
        ours = quants.quantize(x, dt, imatrix=w)
        assert ours.shape == shape[:-1] + (dt.row_bytes(shape[-1]),)
        assert np.array_equal(ours, ggml_quantize(x, dt, w)), f"{name}{list(shape)} imatrix={w is not None}"


# ---------------------------------------------------------------- round trips through gguf-py's dequantiser

# relative RMS error on standard normal rows, about 1.25x what llama.cpp's own bytes give
RMS_BOUND = {"q2_k": 0.38, "q3_k": 0.2, "q4_k": 0.1, "q5_k": 0.05, "q6_k": 0.025, "iq4_nl": 0.1,
             "iq4_xs": 0.1, "q4_0": 0.11, "q4_1": 0.1, "q5_0": 0.055, "q5_1": 0.05}


@pytest.mark.parametrize("name", K_TYPES + LEGACY)
def test_round_trip_through_gguf_py(name):
    """gguf-py reads our bytes as ggraph does; the error is the format's; the imatrix lowers the weighted error."""
    gq = pytest.importorskip("gguf.quants")
    from gguf.constants import GGMLQuantizationType as GT
    rng = np.random.default_rng(11)
    x = rng.standard_normal((32, 1024)).astype(np.float32)
    w = imatrix_of("random", 1024, rng)
    werr = {}
    for imatrix in (None, w):
        b = quants.quantize(x, name, imatrix=imatrix)
        y = gq.dequantize(b, GT[name.upper()]).reshape(x.shape)
        assert np.array_equal(y, quants.dequantize(b.reshape(-1), name, x.shape))
        assert np.sqrt(np.mean((x - y) ** 2)) < RMS_BOUND[name]
        werr[imatrix is None] = float(np.sum(w * (x - y) ** 2))
    assert werr[False] < werr[True]                                    # weighting what matters pays off


def test_zero_and_constant_rows_round_trip():
    for name in K_TYPES + LEGACY:
        x = np.zeros((3, 512), np.float32)
        x[1], x[2] = 0.5, -2.0
        for w in (None, np.ones(512, np.float32)):
            y = quants.dequantize(quants.quantize(x, name, imatrix=w).reshape(-1), name, x.shape)
            assert not y[0].any(), name                                # zeros stay exactly zero
            assert np.allclose(y[1:], x[1:], rtol=0.02), name          # a constant needs one level


# ---------------------------------------------------------------- pieces of C arithmetic

def test_nearest_int_is_ggml_bit_trick():
    v = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 2.4999998, 3.7, -3.7, 4194303.0, 0.0, -0.0], np.float32)
    assert quantize_k._nearest_int(v).tolist() == [0, 2, 2, 0, -2, 2, 4, -4, 4194303, 0, 0]
    with np.errstate(invalid="ignore"):                                # out of range: C's garbage, kept
        assert quantize_k._nearest_int(np.array([np.nan, np.inf, 2.0 ** 24], np.float32)).tolist() == \
            [0, -4194304, 2097152]


def best_index_int8(x: np.float32) -> int:
    """ggml's ``best_index_int8`` over the IQ4 levels, transcribed line by line."""
    v = quants.IQ4_VALUES
    if x <= v[0]:
        return 0
    if x >= v[15]:
        return 15
    lo, hi = 0, 15
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if x < v[mid] else (mid, hi)
    return hi - 1 if np.float32(x - v[hi - 1]) < np.float32(v[hi] - x) else hi


def test_iq4_nearest_level_matches_binary_search():
    """The table lookup agrees with C's search, at and one ulp around every midpoint and level."""
    v = quants.IQ4_VALUES
    points = np.concatenate([(v[:-1] + v[1:]) / 2, v]).astype(np.float32)
    x = np.concatenate([points, np.nextafter(points, np.float32(-1e9)), np.nextafter(points, np.float32(1e9)),
                        np.random.default_rng(0).uniform(-140, 130, 3000).astype(np.float32),
                        np.array([np.inf, -np.inf, np.nan, 1e30, -1e30, 0.0], np.float32)])
    with np.errstate(invalid="ignore"):
        got = quantize_k._best_iq4(x)
    assert got.tolist() == [best_index_int8(e) for e in x]


def test_seq_sum_is_sequential():
    t = np.array([[1e8], [1.0], [-1e8], [1.0]], np.float32)          # ((1e8 + 1) - 1e8) + 1 = 1 in float32
    assert quantize_k._seq_sum(t).tolist() == [1.0]
    assert np.signbit(quantize_k._seq_sum(np.full((2, 1), -0.0, np.float32)))[0] == np.False_


# ---------------------------------------------------------------- by hand: small cases that teach the formats

def test_q6_k_all_zero_block_is_zero_bytes():
    assert not quants.quantize(np.zeros(256, np.float32), "q6_k").any()


def test_iq4_nl_zero_block_points_at_level_one():
    b = quants.quantize(np.zeros(32, np.float32), "iq4_nl")           # d = 0; 0 rounds to level 8 (value 1)
    assert b[:2].tolist() == [0, 0] and (b[2:] == 0x88).all()


def test_q4_k_scale_is_six_bits_under_fp16_d():
    x = np.tile(np.arange(32, dtype=np.float32) / 31, 8)              # every group spans [0, 1] evenly
    b = quants.quantize(x, "q4_k")
    sc, m = block_bits.k_scale_min(b[None, 4:16])
    assert sc.tolist() == [[63] * 8] and m.tolist() == [[0] * 8]     # the largest scale maps to 63, no min
    assert np.isclose(float(b[0:2].view(np.float16)[0]) * 63, 1 / 15, rtol=0.02)   # about one level step


def test_imatrix_is_ignored_by_types_without_a_weighted_path():
    x = np.random.default_rng(3).standard_normal((4, 256)).astype(np.float32)
    w = np.random.default_rng(4).exponential(1, 256).astype(np.float32)
    for name in ("f32", "f16", "bf16", "q8_0", "q8_1", "q8_k", "mxfp4"):
        assert np.array_equal(quants.quantize(x, name, imatrix=w), quants.quantize(x, name)), name


def test_quantizable_lists_every_type():
    names = {d.name for d in quants.QUANTIZABLE}
    assert names == {"f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q8_1", "q8_k", "mxfp4", *K_TYPES}
    assert set(quantize_k.SEARCHED) == set(quants._SEARCHED)


# ---------------------------------------------------------------- errors name the thing

@pytest.mark.parametrize("imatrix, message", [
    (np.ones(255, np.float32), r"quantize: q4_k imatrix has shape \[255\], expected \[256\]"),
    (np.ones((2, 128), np.float32), r"quantize: q4_k imatrix has shape \[2, 128\], expected \[256\]"),
    (np.r_[np.ones(3), -1.0, np.ones(252)], r"quantize: q4_k imatrix\[3\] is -1.0; weights must be finite"),
    (np.r_[np.ones(7), np.nan, np.ones(248)], r"quantize: q4_k imatrix\[7\] is nan; weights must be finite"),
    (np.r_[np.inf, np.ones(255)], r"quantize: q4_k imatrix\[0\] is inf; weights must be finite"),
    (["a"] * 256, r"quantize: q4_k imatrix is not an array of numbers"),
])
def test_bad_imatrix(imatrix, message):
    with pytest.raises(ValueError, match=message):
        quants.quantize(np.ones((2, 256), np.float32), "q4_k", imatrix=imatrix)


def test_bad_imatrix_is_caught_for_types_that_ignore_it():
    with pytest.raises(ValueError, match=r"quantize: q8_0 imatrix has shape \[3\], expected \[64\]"):
        quants.quantize(np.ones(64, np.float32), "q8_0", imatrix=np.ones(3))


def test_rows_must_be_whole_super_blocks():
    with pytest.raises(ValueError, match="quantize: iq4_xs innermost dim 288 is not a multiple of its block size 256"):
        quants.quantize(np.ones((2, 288), np.float32), "iq4_xs")


def test_unsupported_dtype():
    with pytest.raises(ValueError, match="quantize: unsupported dtype i8; supported: f32, .*, iq4_xs"):
        quants.quantize(np.ones(32, np.float32), "i8")
