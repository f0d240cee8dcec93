"""MXFP4 (ggml type 39, gpt-oss's expert blocks): 32 weights, an e8m0 exponent byte e, 16 bytes of e2m1
nibbles; w = kvalues_mxfp4[q] * 2^(e-127) / 2. Oracles: hand-made blocks, gguf-py, a transcription of
ggml's dequantize_row_mxfp4 and ggml_vec_dot_mxfp4_q8_0, and ggml's own C code where llama-cpp-python
ships it; then the llvm kernels (qmatmul against q8_0 activations, get_rows) on every feature set this
host runs, and a tiny graph through ggraph.compile on both backends."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from llvm_targets import runnable_target
from llvmlite import ir

import ggraph
from ggraph import f32, i32, ops
from ggraph.backends.llvm import jit, kernels
from ggraph.backends.llvm.kernels.plan import act_rows, block_format, qmatmul_plan
from ggraph.backends.llvm.target import X86_NAMES, named_target, runnable_targets
from ggraph.compiler import optimize
from ggraph.gguf import GGUFFile, quants
from ggraph.gguf.block_bits import e8m0_half
from ggraph.ir import dtypes, param
from test_llvm_kernels import ACT_ABI, MATMUL_ABI, ROWS_ABI, fn, quantize_acts, random_blocks, ref_act, run

gq = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType as GT  # noqa: E402

MX = dtypes.mxfp4
KVALUES = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]     # ggml-common.h kvalues_mxfp4


# -- transcriptions of ggml's C, one block at a time --------------------------------------------
def e8m0_half_c(e: int) -> np.float32:
    """GGML_E8M0_TO_FP32_HALF: the float32 whose bits are 0x00200000 << e (e < 2) or (e - 1) << 23."""
    bits = (0x00200000 << e) if e < 2 else (e - 1) << 23
    return np.array([bits], np.uint32).view(np.float32)[0]


def dequantize_row_c(blocks: np.ndarray) -> np.ndarray:
    """ggml's dequantize_row_mxfp4: y[j] = kvalues[qs[j] & 15] * d, y[j + 16] = kvalues[qs[j] >> 4] * d."""
    y = np.zeros((len(blocks), 32), np.float32)
    with np.errstate(over="ignore"):                  # e >= 253: 12 * d overflows to inf, as in C
        for i, blk in enumerate(blocks):
            d = e8m0_half_c(int(blk[0]))
            for j in range(16):
                y[i, j] = np.float32(KVALUES[blk[1 + j] & 0x0F]) * d
                y[i, j + 16] = np.float32(KVALUES[blk[1 + j] >> 4]) * d
    return y


def vec_dot_ref(w: np.ndarray, q: np.ndarray, d8: np.ndarray) -> np.ndarray:
    """ggml_vec_dot_mxfp4_q8_0 for every (token, row), in f64: sum over blocks of (d8 * e8m0_half(e)) times
    the integer dot of the q8 bytes with the levels. w (N, K/32*17) blocks, q (T, K) ints, d8 (T, K/32)."""
    N, nb = w.shape[0], q.shape[1] // 32
    blocks = w.reshape(N, nb, 17)
    levels = np.array(KVALUES)[np.concatenate([blocks[..., 1:] & 15, blocks[..., 1:] >> 4], axis=-1)]  # (N, nb, 32)
    sumi = np.einsum("tbj,nbj->tnb", q.reshape(-1, nb, 32).astype(np.int64), levels)                  # (T, N, nb)
    scale = d8[:, None, :].astype(np.float64) * e8m0_half(blocks[..., 0])[None].astype(np.float64)
    return (scale * sumi).sum(-1)


def ggml_fn(lib: str, symbol: str, argtypes, restype=None):
    """A function of the ggml libraries llama-cpp-python ships (skip without them)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="ggml's C code comes with llama-cpp-python")
    f = getattr(ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / f"lib{lib}.so")), symbol)
    f.restype, f.argtypes = restype, argtypes
    return f


ROW_FN = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]


def random_raw(n_blocks: int, rng) -> np.ndarray:
    """(n_blocks, 17) random bytes: every exponent (0 and 1 give subnormal scales, 253.. overflow to inf)."""
    return rng.integers(0, 256, (n_blocks, 17), dtype=np.uint8)


# -- the type -------------------------------------------------------------------------------------
def test_the_dtype_is_ggml_type_39_of_32_weights_in_17_bytes():
    assert (MX.name, MX.ggml_id, MX.block_size, MX.type_size) == ("mxfp4", 39, 32, 17)
    assert dtypes.from_ggml_id(39) is MX and dtypes.from_name("MXFP4") is MX and MX.is_quantized
    assert GT.MXFP4 == 39 and tuple(gq.GGML_QUANT_SIZES[GT.MXFP4]) == (32, 17)
    assert MX.row_bytes(2880) == 90 * 17


# -- dequantize -------------------------------------------------------------------------------------
def test_dequantize_hand_made_blocks():
    """e = 127: d = 1/2, so the levels are e2m1's own values; nibble j low is weight j, high weight j + 16."""
    blk = np.zeros(17, np.uint8)
    blk[0] = 127
    blk[1:] = np.arange(16, dtype=np.uint8) | (np.arange(15, -1, -1, dtype=np.uint8) << 4)
    e2m1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert quants.dequantize(blk, MX, (32,)).tolist() == e2m1 + e2m1[::-1]
    for e, d in ((128, 1.0), (130, 4.0), (120, 2.0 ** -8), (1, 2.0 ** -127), (0, 2.0 ** -128), (252, 2.0 ** 124)):
        blk[0] = e
        assert quants.dequantize(blk, MX, (32,))[[1, 7, 31]].tolist() == [d, 12 * d, 0.0], f"e={e}"
    blk[0], blk[1] = 255, 0x07                                                 # 12 * 2^127 overflows, as in C
    assert quants.dequantize(blk, MX, (32,))[0] == np.inf


def test_dequantize_matches_gguf_py_and_the_c_transcription():
    raw = random_raw(300, np.random.default_rng(0))
    ours = quants.dequantize(raw.reshape(-1), MX, (3, 100 * 32))
    with np.errstate(over="ignore"):
        ref = gq.dequantize(raw, GT.MXFP4).reshape(ours.shape)
    assert np.array_equal(ours, ref)
    assert np.array_equal(ours.reshape(-1, 32), dequantize_row_c(raw))


def test_dequantize_matches_ggml_c():
    f = ggml_fn("ggml-base", "dequantize_row_mxfp4", ROW_FN)
    raw = random_raw(256, np.random.default_rng(1))
    out = np.zeros(256 * 32, np.float32)
    f(raw.ctypes.data, out.ctypes.data, out.size)
    assert np.array_equal(quants.dequantize(raw.reshape(-1), MX, (256 * 32,)), out)


# -- quantize ---------------------------------------------------------------------------------------
def weights_to_quantize(rng) -> np.ndarray:
    """(64, 64): blocks of scales 1e-4 .. 1e4, an all-zero block, exact grid points and exact ties."""
    x = rng.standard_normal((64, 64)) * np.logspace(-4, 4, 64)[:, None]
    x[0] = 0
    x[1, :32] = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6] * 4) * rng.choice([-1, 1], 32)   # on the grid at e = 127
    x[1, 32:] = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6] * 4)                 # halfway: the first wins
    return x.astype(np.float32)


def test_quantize_matches_gguf_py():
    x = weights_to_quantize(np.random.default_rng(2))
    ours = quants.quantize(x, MX)
    assert ours.shape == (64, MX.row_bytes(64))
    assert np.array_equal(ours, np.ascontiguousarray(gq.quantize(x, GT.MXFP4)).view(np.uint8).reshape(ours.shape))


def test_quantize_matches_ggml_quantize_row_mxfp4_ref():
    f = ggml_fn("ggml-base", "quantize_row_mxfp4_ref", ROW_FN)
    x = weights_to_quantize(np.random.default_rng(3))
    out = np.zeros(MX.nbytes(x.shape), np.uint8)
    f(x.ctypes.data, out.ctypes.data, x.size)
    assert np.array_equal(quants.quantize(x, MX).reshape(-1), out)


def test_quantize_by_hand():
    x = np.zeros(32, np.float32)
    x[:4] = [6.0, -0.75, 1.25, 0.1]                  # amax 6: e = floor(log2 6) - 2 + 127 = 127, d = 1/2
    b = quants.quantize(x, MX)
    assert b[0] == 127
    # 6 -> level 7 (12); -0.75 ties -0.5 (index 9) and -1 (10): the first; 1.25 ties 1 (2) and 1.5 (3); 0.1 -> 0
    assert [b[1] & 15, b[2] & 15, b[3] & 15, b[4] & 15] == [7, 9, 2, 0]
    assert not quants.quantize(np.zeros(32, np.float32), MX).any()        # e = 0, every nibble level 0 (+0)


# -- a GGUF file holding it ----------------------------------------------------------------------
def test_a_gguf_file_with_an_mxfp4_tensor_loads(tmp_path):
    gguf = pytest.importorskip("gguf")
    raw = quants.quantize(np.random.default_rng(4).standard_normal((6, 64)).astype(np.float32), MX)   # (6, 34)
    w = gguf.GGUFWriter(tmp_path / "m.gguf", "llama")
    w.add_tensor("blk.0.ffn_down_exps.weight", raw.reshape(2, 3, 34), raw_dtype=GT.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = GGUFFile(tmp_path / "m.gguf").tensors["blk.0.ffn_down_exps.weight"]
    assert t.dtype is MX and t.shape == (2, 3, 64) and np.array_equal(t.data, raw.reshape(-1))


# -- the llvm kernels -----------------------------------------------------------------------------
N, V = 37, 20
KS = (96, 608)                         # 3 blocks; 19 blocks (gemv's groups of blocks and an odd last one)
_LIBS: dict = {}


def _build(target_name: str) -> jit.Library:
    t = named_target(target_name)
    m = ir.Module()
    for K in KS:
        kernels.act_quant(m, "q8_0", K, t)
        kernels.act_quant(m, "q8_0", K, t, rows_only=True)
        kernels.qmatmul(m, MX, K, N, t)
        kernels.qmatmul(m, MX, K, N, t, rows_only=True)
        kernels.get_rows(m, MX, K, V, t)
    return jit.compile(m, t)


@pytest.fixture(params=X86_NAMES)
def target(request):
    return runnable_target(request.param, _LIBS, _build)


def test_the_plan_meets_q8_0_activations_without_a_gathered_run():
    assert block_format(MX).act == "q8_0" and kernels.act_format(MX) == "q8_0"
    assert not any(qmatmul_plan(MX, N, t).gathers for t in runnable_targets())   # qs at odd offset 1


def test_the_c_transcriptions_are_ggml():
    """vec_dot_ref (the qmatmul oracle below) against ggml's own x86 ggml_vec_dot_mxfp4_q8_0 on bytes from
    ggml's quantize_row_q8_0."""
    argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    ggml_fn("ggml-cpu", "ggml_cpu_init", [])()                     # fills the fp16 table the dot reads d from
    dot = ggml_fn("ggml-cpu", "ggml_vec_dot_mxfp4_q8_0", argtypes)
    q8 = ggml_fn("ggml-cpu", "quantize_row_q8_0", ROW_FN)
    rng = np.random.default_rng(5)
    K = 608
    w, x = random_blocks(MX, 4, K, rng), rng.standard_normal((3, K)).astype(np.float32)
    xq = np.zeros((3, K // 32 * 34), np.uint8)
    for t in range(3):
        q8(x[t].ctypes.data, xq[t].ctypes.data, K)
    q, d = ref_act(x, "q8_0")
    assert np.array_equal(xq.reshape(3, -1, 34)[..., 2:].view(np.int8).reshape(3, K), q)
    want = vec_dot_ref(w, q, d)
    got = np.zeros((3, 4), np.float32)
    for t in range(3):
        for n in range(4):
            s = ctypes.c_float()
            dot(K, ctypes.byref(s), 0, w[n].ctypes.data, 0, xq[t].ctypes.data, 0, 1)
            got[t, n] = s.value
    assert np.allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("K", KS)
def test_qmatmul_is_ggmls_vec_dot(target, K):
    """Every token count (gemv, the gemm, its tail group) and 1..3 threads, then the rows_only kernels
    (each token's bits as alone) against ggml_vec_dot_mxfp4_q8_0 on the activations act_quant makes."""
    rng = np.random.default_rng(6)
    w = random_blocks(MX, N, K, rng)
    W = quants.dequantize(w.reshape(-1), MX, (N, K)).astype(np.float64)
    f = fn(target, f"qmatmul_mxfp4_k{K}_n{N}", MATMUL_ABI, _LIBS[target])
    counter = np.zeros(16, np.int32)
    for T in (1, 3, 17, 40):
        x = rng.standard_normal((T, K)).astype(np.float32)
        buf = quantize_acts(target, x, "q8_0", _LIBS[target])
        want = vec_dot_ref(w, *ref_act(x, "q8_0"))
        norms = np.linalg.norm(x, axis=1)[:, None] * np.linalg.norm(W, axis=1)[None, :]
        for nth, threads in ((1, False), (3, False), (2, True)):
            y = np.full((T, N), np.nan, np.float32)
            counter[:] = 0
            run(f, (w.ctypes.data, buf.ctypes.data, y.ctypes.data, counter.ctypes.data), T, nth, threads)
            assert (np.abs(y - want) / norms).max() < 1e-5, f"T={T} nth={nth}"
        assert (np.abs(y - x.astype(np.float64) @ W.T) / norms).max() < 2e-2, f"T={T}: far from the f32 product"
    rows = fn(target, f"qmatmul_mxfp4_k{K}_n{N}_rows", MATMUL_ABI, _LIBS[target])
    one = rows if act_rows(named_target(target)) else f
    act = fn(target, f"act_quant_q8_0_k{K}_rows", ACT_ABI, _LIBS[target])
    x = rng.standard_normal((9, K)).astype(np.float32)
    buf = np.zeros(kernels.act_bytes("q8_0", 9, K, rows_only=True), np.uint8)
    run(act, (x.ctypes.data, buf.ctypes.data), 9, 2)
    y = np.full((9, N), np.nan, np.float32)
    counter[:] = 0
    run(rows, (w.ctypes.data, buf.ctypes.data, y.ctypes.data, counter.ctypes.data), 9, 2, threads=True)
    for t in range(9):
        alone = np.zeros((1, N), np.float32)
        counter[:] = 0
        xq = quantize_acts(target, x[t:t + 1], "q8_0", _LIBS[target])
        run(one, (w.ctypes.data, xq.ctypes.data, alone.ctypes.data, counter.ctypes.data), 1, 1)
        np.testing.assert_array_equal(y[t], alone[0], err_msg=f"token {t}")


@pytest.mark.parametrize("K", KS)
def test_get_rows_is_the_dequantisation(target, K):
    rng = np.random.default_rng(7)
    tab = random_raw(V * K // 32, rng).reshape(V, -1)
    tab[:, ::17] = rng.integers(100, 150, (V, K // 32))        # finite scales (inf * 0 would be a NaN to compare)
    ids = np.array([3, 0, V - 1, 7, 3, V, -1], np.int32)       # the last two are out of range
    out = np.full((len(ids), K), np.nan, np.float32)
    status = np.zeros(2, np.int64)
    run(fn(target, f"get_rows_mxfp4_k{K}_v{V}", ROWS_ABI, _LIBS[target]),
        (tab.ctypes.data, ids.ctypes.data, out.ctypes.data, status.ctypes.data), len(ids), 2)
    ref = quants.dequantize(tab.reshape(-1), MX, (V, K))
    np.testing.assert_array_equal(out[:-2], ref[ids[:-2]])
    assert (out[-2:] == 0).all() and status[0] == 1


# -- a graph with mxfp4 weights -------------------------------------------------------------------
def tiny(x, ids, emb, w_up, w_down):
    h = ops.take(emb, ids) + x                       # (T, 64): an mxfp4 embedding table
    return ops.linear(ops.linear(h, w_up), w_down)   # (T, 96) -> (T, 64)


@pytest.mark.parametrize("target", [t.name for t in runnable_targets()])
def test_a_graph_with_mxfp4_weights_on_both_backends(target):
    rng = np.random.default_rng(8)
    T = 5
    g = ggraph.trace(tiny, f32[T, 64], i32[T], param("token_embd.weight", MX[V, 64]),
                     param("ffn_up.weight", MX[96, 64]), param("ffn_down.weight", MX[64, 96]))
    weights = {name: quants.quantize(rng.standard_normal(shape).astype(np.float32), MX)
               for name, shape in (("token_embd.weight", (V, 64)), ("ffn_up.weight", (96, 64)),
                                   ("ffn_down.weight", (64, 96)))}
    args = (rng.standard_normal((T, 64)).astype(np.float32), rng.integers(0, V, T).astype(np.int32))
    emb, up, down = (quants.dequantize(weights[n].reshape(-1), MX, s) for n, s in
                     (("token_embd.weight", (V, 64)), ("ffn_up.weight", (96, 64)), ("ffn_down.weight", (64, 96))))
    exact = ((emb[args[1]] + args[0]).astype(np.float64) @ up.T) @ down.T
    want = ggraph.compile(g, backend="numpy", passes="none", weights=weights)(*args)
    assert np.abs(want - exact).max() < 1e-4 * np.abs(exact).max()
    fused = str(optimize(g))
    assert fused.count("qmatmul") == 2 and "dequant" not in fused and "take emb" in fused
    t = named_target(target)
    got = ggraph.compile(g, backend="llvm", weights=weights, target=t)(*args)    # qmatmul on q8_0 activations
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1.5e-2
    plain = ggraph.compile(g, backend="llvm", passes="none", weights=weights, target=t)(*args)
    assert np.linalg.norm(plain - want) / np.linalg.norm(want) < 1e-5
