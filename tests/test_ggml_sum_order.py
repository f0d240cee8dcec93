"""A one-token matmul sums in ggml's order, bit for bit, where llama.cpp's x86 decode is deterministic.

A decode step in llama.cpp (one token) takes ggml's vec_dot kernels, not llamafile's tinyBLAS (which
needs two tokens): ggml_vec_dot_f32 for f32 weights, ggml_vec_dot_<type>_q8_0 for the 32-weight block
types. Each rounds its f32 sum in a fixed order that depends on the vector width it was built for. A
router's near tie between two experts can hang on that last bit: qwen3moe's Q4_K_M file sent token 21
to other experts on AVX-512 targets than llama.cpp's AVX-512 build did (logits cosine 0.955), because
the q8_0 K and V projections summed two blocks per 16-lane accumulator (and, with VNNI, took the
weights' +128 offset out in f32), and the router's f32 gemv kept one accumulator.

The oracles: numpy float64 rules of ggml's sums written from ggml's x86 sources (every FMA rounded once
to f32, exactly, by ``fma32``), over gguf-py's dequantisation and ggml's activation quantiser
(test_llvm_kernels.ref_act); and llama.cpp's own router logits, read through its eval callback while
it decodes a real converted model token by token.
"""
from __future__ import annotations

import ctypes
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from llvmlite import ir

import test_llvm_kernels as tk
from ggraph.backends.llvm import jit, kernels
from ggraph.backends.llvm.target import host_target, named_target, runnable_targets
from ggraph.ir import dtypes

X86_VECTOR = ("avx2", "avx512", "avx512_vnni")
# 32-weight types whose x86 vec_dot keeps even and odd blocks apart (accum1, accum2), and the others
TWO_ACCUMULATORS = (dtypes.iq4_nl, dtypes.mxfp4)
SMALL_TYPES = (dtypes.q8_0, dtypes.q4_0, dtypes.q5_0, *TWO_ACCUMULATORS)
N = 16
RULE_TOKENS = 2            # tokens whose router logits the (slow, exact) numpy rule also computes


def runnable(name: str) -> None:
    if name not in [t.name for t in runnable_targets()]:
        pytest.skip(f"host cannot run {name}")


def fma32(a, b, c) -> np.float32:
    """a*b + c rounded once to f32 (ties to even), from the exact rational value."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    near = np.float32(float(exact))
    cands = (near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, np.float32(-np.inf)))
    return min(cands, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.array(v).view(np.uint32)) & 1))


def add32(a, b) -> np.float32:
    return np.float32(np.float32(a) + np.float32(b))


def halving(lanes) -> np.float32:
    """Lanes summed by halving: _mm512_reduce_add_ps, tinyBLAS's hsum, and quants.c's hsum_float_8."""
    v = [np.float32(x) for x in lanes]
    while len(v) > 1:
        h = len(v) // 2
        v = [add32(a, b) for a, b in zip(v[:h], v[h:])]
    return v[0]


# -- 32-weight blocks against q8_0 activations -------------------------------------------------------
def levels(raw: np.ndarray, dt, rows: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    """(signed levels int [rows, K/32, 32], block scales f32 [rows, K/32]) from gguf-py's dequantisation."""
    blocks = raw.reshape(rows, K // 32, dt.type_size)
    if dt is dtypes.mxfp4:                              # e8m0, halved: ggml's GGML_E8M0_TO_FP32_HALF
        d = 2.0 ** (blocks[:, :, 0].astype(np.float64) - 128)
    else:
        d = blocks[:, :, :2].copy().view(np.float16).astype(np.float64)[..., 0]
    w = tk.dequant(raw, dt, rows, K).astype(np.float64).reshape(rows, K // 32, 32)
    q = np.rint(w / d[..., None])
    assert np.array_equal(q * d[..., None], w), "levels times scale must give gguf-py's weights back"
    return q.astype(np.int64), d.astype(np.float32)


def ggml_vec_dot_q8_0(q: np.ndarray, d: np.ndarray, xq: np.ndarray, xd: np.ndarray, two: bool) -> np.float32:
    """ggml_vec_dot_<type>_q8_0 on x86 (AVX2 and AVX-512 builds alike) for one row: per block, 8 i32 lanes
    (4 products each, exact), acc = fma(d_w * d_x, float(lanes), acc); ``two``: even and odd blocks in two
    accumulators, added before the final hsum_float_8 (an odd last block is left to the caller)."""
    accs = [[np.float32(0)] * 8, [np.float32(0)] * 8]
    for blk in range(q.shape[0]):
        acc = accs[blk % 2 if two else 0]
        dd = np.float32(d[blk]) * np.float32(xd[blk])
        lanes = (q[blk] * xq[blk]).reshape(8, 4).sum(1)
        acc[:] = [fma32(dd, np.float32(int(s)), a) for a, s in zip(acc, lanes)]
    return halving([add32(a, b) for a, b in zip(*accs)] if two else accs[0])


@pytest.mark.parametrize("K", [512, 288])                 # two groups of 8 blocks; 9 blocks (a partial group)
@pytest.mark.parametrize("dt", SMALL_TYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("target", X86_VECTOR)
def test_small_block_gemv_sums_as_ggml_vec_dot(target, dt, K):
    """One token through qmatmul: the bits of ggml's vec_dot of the same quants, row by row."""
    runnable(target)
    if dt in TWO_ACCUMULATORS and K // 32 % 2:
        pytest.skip("ggml adds an odd last block of these types after its hsum, in an order not modelled here")
    t = named_target(target)
    m = ir.Module()
    kernels.act_quant(m, "q8_0", K, t)
    kernels.qmatmul(m, dt, K, N, t)
    lib = jit.compile(m, t)
    rng = np.random.default_rng(41)
    w = tk.random_blocks(dt, N, K, rng)
    x = rng.standard_normal((1, K)).astype(np.float32)
    buf = tk.quantize_acts(target, x, "q8_0", lib)
    y = np.full((1, N), np.nan, np.float32)
    tk.run(lib.function(f"qmatmul_{dt.name}_k{K}_n{N}_{target}", None, tk.MATMUL_ABI),
           (w.ctypes.data, buf.ctypes.data, y.ctypes.data, np.zeros(16, np.int32).ctypes.data), 1, 2)
    xq, xd = tk.ref_act(x, "q8_0")
    q, d = levels(w, dt, N, K)
    want = np.array([ggml_vec_dot_q8_0(q[n], d[n], xq[0].reshape(-1, 32), xd[0], dt in TWO_ACCUMULATORS)
                     for n in range(N)], np.float32)
    np.testing.assert_array_equal(y[0], want, err_msg=f"{dt.name} K={K} on {target}")


# -- f32 weights ------------------------------------------------------------------------------------
def ggml_vec_dot_f32(w: np.ndarray, x: np.ndarray, lanes: int) -> np.float32:
    """ggml_vec_dot_f32 (x86, GGML_F32_STEP = 4 vectors of ``lanes``): four accumulators over steps of
    4 vectors; acc0 + acc2, acc1 + acc3, their sum; its lanes by halving (AVX-512) or, on AVX (8 lanes),
    as the two halves added and then hadd twice; the elements past the last whole step one FMA each."""
    step = 4 * lanes
    main = len(x) - len(x) % step
    acc = [[np.float32(0)] * lanes for _ in range(4)]
    for i in range(0, main, step):
        for j in range(4):
            at = i + j * lanes
            acc[j] = [fma32(w[at + l], x[at + l], a) for l, a in enumerate(acc[j])]
    a0 = [add32(add32(p, r), add32(q, s)) for p, q, r, s in zip(*acc)]
    if lanes == 8:
        h = [add32(a0[i], a0[i + 4]) for i in range(4)]
        total = add32(add32(h[0], h[1]), add32(h[2], h[3]))
    else:
        total = halving(a0)
    for i in range(main, len(x)):
        total = fma32(w[i], x[i], total)
    return total


def f32_lanes(target: str) -> int:
    t = named_target(target)
    return t.vector_bits // 32 if t.name != "generic" else 16


def fmatmul_lib(target: str, K: int, n: int, rows_only: bool = False):
    t = named_target(target)
    m = ir.Module()
    name = kernels.fmatmul(m, dtypes.f32, K, n, t, rows_only)
    return jit.compile(m, t).function(name, None, tk.MATMUL_ABI)


def fmatmul_run(f, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    w, x = np.ascontiguousarray(w, np.float32), np.ascontiguousarray(x, np.float32)
    y = np.full((len(x), len(w)), np.nan, np.float32)
    tk.run(f, (w.ctypes.data, x.ctypes.data, y.ctypes.data, np.zeros(16, np.int32).ctypes.data), len(x), 2)
    return y


@pytest.mark.parametrize("K", [256, 300])                 # whole steps; a tail past the last one
@pytest.mark.parametrize("target", ("generic",) + X86_VECTOR)
def test_f32_gemv_sums_as_ggml_vec_dot_f32(target, K):
    """One token through fmatmul on f32 weights: ggml_vec_dot_f32's bits at the target's width (the
    generic twin: AVX-512's)."""
    runnable(target)
    rng = np.random.default_rng(7)
    w = rng.standard_normal((N, K)).astype(np.float32)
    x = rng.standard_normal((1, K)).astype(np.float32)
    y = fmatmul_run(fmatmul_lib(target, K, N), w, x)
    want = np.array([ggml_vec_dot_f32(w[n], x[0], f32_lanes(target)) for n in range(N)], np.float32)
    np.testing.assert_array_equal(y[0], want, err_msg=f"K={K} on {target}")


@pytest.mark.parametrize("target", ("generic",) + X86_VECTOR)
def test_f32_batch_kernel_computes_every_token_as_alone(target):
    """rows_only (a batch's step): each of T tokens gets the bits of a one-token call, ggml_vec_dot_f32's;
    the regular kernel at T > 1 sums as tinyBLAS does (one accumulator per output), which differs."""
    runnable(target)
    rng = np.random.default_rng(8)
    K, T = 256, 5
    w = rng.standard_normal((N, K)).astype(np.float32)
    x = rng.standard_normal((T, K)).astype(np.float32)
    one = fmatmul_lib(target, K, N)
    alone = np.concatenate([fmatmul_run(one, w, x[t:t + 1]) for t in range(T)])
    np.testing.assert_array_equal(fmatmul_run(fmatmul_lib(target, K, N, rows_only=True), w, x), alone)
    assert (fmatmul_run(one, w, x) != alone).any(), "the prefill order should differ from the decode order"


# -- llama.cpp's own router logits -----------------------------------------------------------------
def llama_router_steps(path, tokens, n_ctx: int = 64) -> list[dict[str, np.ndarray]]:
    """Per decoded token (one llama_decode each, f32 KV cache), llama.cpp's "ffn_norm-<l>" (the router's
    input) and "ffn_moe_logits-<l>" (its output), read through its eval callback."""
    import oracle
    llama_cpp = oracle._llama_cpp()
    step: dict[str, np.ndarray] = {}

    @llama_cpp.ggml_backend_sched_eval_callback
    def record(tensor, ask, _user):
        t = oracle._Tensor.from_address(tensor)
        name = t.name.decode()
        if ask or t.type != 0 or not name.startswith(("ffn_norm-", "ffn_moe_logits-")) or name in step:
            return True
        ne, nb = list(t.ne), list(t.nb)
        span = sum((n - 1) * b for n, b in zip(ne, nb)) + 4
        flat = np.frombuffer((ctypes.c_char * span).from_address(t.data), np.float32)
        step[name] = np.lib.stride_tricks.as_strided(flat, shape=ne[::-1], strides=nb[::-1]).reshape(-1).copy()
        return True

    mdl = llama_cpp.llama_model_load_from_file(str(Path(path).resolve()).encode(),
                                               llama_cpp.llama_model_default_params())
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = n_ctx
    cp.n_threads = cp.n_threads_batch = 2
    cp.type_k = cp.type_v = oracle.GGML_TYPES["f32"]
    cp.flash_attn_type = 0
    cp.cb_eval = record
    ctx = llama_cpp.llama_init_from_model(mdl, cp)
    out = []
    try:
        for tok in tokens:
            step.clear()
            ids = (llama_cpp.llama_token * 1)(int(tok))
            assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(ids, 1)) == 0
            out.append(dict(step))
    finally:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(mdl)
    return out


@pytest.mark.slow
def test_router_logits_are_llama_cpps_bits():
    """qwen3moe's f32 routers (Q4_K_M file) on llama.cpp's own inputs, token by token: the decode kernel
    of every target of llama.cpp's build width gives llama.cpp's logits bit for bit (the numpy rule agrees
    on the first RULE_TOKENS); the other width's kernel gives its own width's ggml order, which differs
    from llama.cpp's in some bits: llama.cpp's AVX2 and AVX-512 builds round these sums differently."""
    import hf_models
    from ggraph.models import load
    from test_hf_families import IDS
    path = hf_models.converted("qwen3moe", "q4_k_m")
    model = load(path)
    steps = llama_router_steps(path, IDS)
    layers = sorted({int(k.split("-")[1]) for k in steps[0] if k.startswith("ffn_moe_logits-")})
    assert layers == list(range(model.config.n_layer)), steps[0].keys()
    built = host_target().vector_bits          # llama-cpp-python is built for this host's widest vectors
    same = [t for t in ("generic",) + X86_VECTOR if f32_lanes(t) * 32 == built] if built in (256, 512) else []
    if not same:
        pytest.skip(f"llama.cpp's x86 f32 dot at {built} bits is not modelled here")
    for target in [t.name for t in runnable_targets() if t.name in ("generic",) + X86_VECTOR]:
        differ = 0
        for layer in layers:
            w = np.asarray(model.file.tensors[f"blk.{layer}.ffn_gate_inp.weight"].data).view(np.float32)
            w = w.reshape(-1, steps[0][f"ffn_norm-{layer}"].size)
            f = fmatmul_lib(target, w.shape[1], w.shape[0])
            for p, step in enumerate(steps):
                x, want = step[f"ffn_norm-{layer}"], step[f"ffn_moe_logits-{layer}"]
                got = fmatmul_run(f, w, x[None])[0]
                if p < RULE_TOKENS:
                    rule = np.array([ggml_vec_dot_f32(r, x, f32_lanes(target)) for r in w], np.float32)
                    np.testing.assert_array_equal(got, rule, err_msg=f"{target} layer {layer} token {p}: not the rule")
                if target in same:
                    np.testing.assert_array_equal(got, want, err_msg=f"{target} layer {layer} token {p}")
                differ += int((got != want).sum())
        if target not in same:                  # the test's premise: the two widths' orders do differ here
            assert differ > 0, f"{target}: its ggml order gave llama.cpp's {built}-bit bits everywhere"
