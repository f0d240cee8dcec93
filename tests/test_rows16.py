"""q4_k, q5_k and q6_k weights interleaved 16 rows at a time (backends/llvm/kernels/rows16.py): where each byte goes,
which weights a program lays out so (those that only qmatmuls read), one copy per process, and the
file's pages left intact."""
import mmap
import textwrap

import numpy as np
import pytest

import zoo
from test_llvm_kernels import random_blocks
from ggraph.compiler import compile_graph
from ggraph.ir import dtypes
from ggraph.ir.text import parse
from ggraph.backends.llvm import program
from ggraph.backends.llvm.kernels import rows16
from ggraph.backends.llvm.target import missing_features, named_target

rng = np.random.default_rng(16)


def random_rows(dtype, n: int, k: int) -> np.ndarray:
    """n rows of random ``dtype`` blocks with small finite f16 fields (d, dmin)."""
    return random_blocks(dtype, n, k, rng)


def q4_k_rows(n: int, k: int) -> np.ndarray:
    return random_rows(dtypes.q4_k, n, k)


def q6_k_rows(n: int, k: int) -> np.ndarray:
    return random_rows(dtypes.q6_k, n, k)


def test_repack_puts_each_word_of_16_rows_side_by_side():
    N, K = 32, 512
    w = q4_k_rows(N, K)
    blocks = w.reshape(N, K // 256, 144)
    out = rows16.repack(w, dtypes.q4_k, N, K).reshape(N // 16, K // 256, 2304)
    for g, b, r in ((0, 0, 0), (1, 1, 15), (1, 0, 7)):
        block, group = blocks[16 * g + r, b], out[g, b]
        assert bytes(group[2 * r:2 * r + 2]) == bytes(block[0:2])                       # d
        assert bytes(group[32 + 2 * r:34 + 2 * r]) == bytes(block[2:4])                 # dmin
        for word in range(3):                                                           # scales and mins
            at = 64 + 64 * word + 4 * r
            assert bytes(group[at:at + 4]) == bytes(block[4 + 4 * word:8 + 4 * word])
        for word in (0, 9, 31):                                                         # nibbles
            at = 256 + 64 * word + 4 * r
            assert bytes(group[at:at + 4]) == bytes(block[16 + 4 * word:20 + 4 * word])
    np.testing.assert_array_equal(rows16.unpack(out, dtypes.q4_k, N, K), w.reshape(-1))


def test_repack_q6_k_puts_each_steps_words_together_in_aligned_blocks():
    """q6_k: per block of a group, its 4 scale words, then for each half h and j < 8 ql word 16h+j, ql
    word 16h+8+j and qh word 8h+j (what one gemv step reads), 16 rows' of each side by side; then
    the rows' d (16 x f16) and 32 bytes of zeros, so that every block starts 64-byte aligned."""
    N, K = 48, 768
    nb = K // 256
    w = q6_k_rows(N, K)
    blocks = w.reshape(N, nb, 210)
    laid = rows16.repack(w, dtypes.q6_k, N, K)
    assert laid.nbytes == rows16.nbytes(dtypes.q6_k, N, K) == N // 16 * nb * 3392
    out = laid.reshape(N // 16, nb, 3392)
    for g, b, r in ((0, 0, 0), (2, 2, 15), (1, 1, 9)):
        block, group = blocks[16 * g + r, b], out[g, b]
        for word in range(4):                                                           # int8 scales
            assert bytes(group[64 * word + 4 * r:][:4]) == bytes(block[192 + 4 * word:196 + 4 * word])
        for h, j in ((0, 0), (0, 7), (1, 3)):
            at = 256 + 64 * 3 * (8 * h + j) + 4 * r
            for n, word in enumerate((4 * (16 * h + j), 4 * (16 * h + 8 + j), 128 + 4 * (8 * h + j))):
                assert bytes(group[at + 64 * n:][:4]) == bytes(block[word:word + 4]), (h, j, n)
        assert bytes(group[3328 + 2 * r:3330 + 2 * r]) == bytes(block[208:210])         # d
    assert not out[..., 3360:].any()
    np.testing.assert_array_equal(rows16.unpack(laid, dtypes.q6_k, N, K), w.reshape(-1))


def test_repack_q5_k_puts_the_qh_words_beside_the_first_nibble_words():
    """q5_k: d, dmin and the scale words as q4_k's; then nibble word j and qh word j side by side for
    j < 8 (the first steps read both), then nibble words 8..31."""
    N, K = 32, 512
    raw = random_rows(dtypes.q5_k, N, K).reshape(N, K // 256, 176)
    out = rows16.repack(raw, dtypes.q5_k, N, K).reshape(N // 16, K // 256, 2816)
    for g, b, r in ((0, 0, 0), (1, 1, 15), (1, 0, 6)):
        block, group = raw[16 * g + r, b], out[g, b]
        assert bytes(group[2 * r:2 * r + 2]) == bytes(block[0:2])                       # d
        assert bytes(group[32 + 2 * r:34 + 2 * r]) == bytes(block[2:4])                 # dmin
        assert bytes(group[64 + 64 * 2 + 4 * r:][:4]) == bytes(block[12:16])            # scale word 2
        for j in (0, 5, 7):
            assert bytes(group[256 + 128 * j + 4 * r:][:4]) == bytes(block[48 + 4 * j:52 + 4 * j])   # nibbles
            assert bytes(group[320 + 128 * j + 4 * r:][:4]) == bytes(block[16 + 4 * j:20 + 4 * j])   # qh
        for w in (8, 31):
            assert bytes(group[1280 + 64 * (w - 8) + 4 * r:][:4]) == bytes(block[48 + 4 * w:52 + 4 * w])
    np.testing.assert_array_equal(rows16.unpack(out, dtypes.q5_k, N, K), raw.reshape(-1))


def test_repack_refuses_what_is_not_whole_groups():
    with pytest.raises(ValueError, match="a q4_k matrix of 24 x 512 has"):
        rows16.repack(q4_k_rows(24, 512), dtypes.q4_k, 24, 512)
    with pytest.raises(ValueError, match="a q4_k matrix of 32 x 512 has 9216 bytes .* got 4608"):
        rows16.repack(q4_k_rows(16, 512), dtypes.q4_k, 32, 512)
    with pytest.raises(ValueError, match="the output must be 9216 bytes"):
        rows16.repack(q4_k_rows(32, 512), dtypes.q4_k, 32, 512, out=np.empty(100, np.uint8))
    with pytest.raises(ValueError, match="a q6_k matrix of 32 x 512 has 13440 bytes .* got 9216"):
        rows16.repack(q4_k_rows(32, 512), dtypes.q6_k, 32, 512)
    with pytest.raises(ValueError, match="the output must be 13568 bytes"):
        rows16.repack(q6_k_rows(32, 512), dtypes.q6_k, 32, 512, out=np.empty(13440, np.uint8))
    with pytest.raises(ValueError, match="no layout for q3_k; it has q4_k, q5_k, q6_k"):
        rows16.repack(q4_k_rows(32, 512), dtypes.q3_k, 32, 512)


def _vnni():
    if missing_features("avx512_vnni"):
        pytest.skip("this host cannot run avx512_vnni")
    return named_target("avx512_vnni")


GRAPH = """
{ lambda ; x:f32[T,256] ids:i32[T]. let
    w:q4_k[64,256] = param "w"
    a:f32[T,64] = qmatmul x w
    u:q4_k[32,256] = param "u"
    b:f32[T,256] = take u ids
    c:f32[T,32] = qmatmul x u
    v:q4_k[48,256] = param "v"
    d:f32[T,48] = qmatmul x v
    s:q6_k[32,256] = param "s"
    e:f32[T,32] = qmatmul x s
    f:q5_k[32,256] = param "f"
    g:f32[T,32] = qmatmul x f
  in (a b c d e g) }
"""


@pytest.mark.parametrize("T", [1, 5])
def test_only_weights_that_only_qmatmuls_read_are_laid_out(T):
    """w, s (q6_k) and f (q5_k), read by qmatmuls, go to rows16; u (a take reads it too) and v (48 rows: not
    whole 32-row tiles) stay as in the file; every output equals the numpy backend's."""
    graph = parse(textwrap.dedent(GRAPH))
    weights = {"w": q4_k_rows(64, 256), "u": q4_k_rows(32, 256), "v": q4_k_rows(48, 256), "s": q6_k_rows(32, 256),
               "f": random_rows(dtypes.q5_k, 32, 256)}
    prog = compile_graph(graph, backend="llvm", passes=[], target=_vnni(), threads=2)
    layouts = {b.name: b.layout for b in prog.spec.buffers if b.kind == "param"}
    assert layouts == {"w": "rows16", "u": None, "v": None, "s": "rows16", "f": "rows16"}
    kernels = sorted({c.kernel for c in prog.spec.calls if c.kernel.startswith("qmatmul")})
    assert kernels == ["qmatmul_q4_k_k256_n32_avx512_vnni", "qmatmul_q4_k_k256_n48_avx512_vnni",
                       "qmatmul_q4_k_k256_n64_rows16_avx512_vnni", "qmatmul_q5_k_k256_n32_rows16_avx512_vnni",
                       "qmatmul_q6_k_k256_n32_rows16_avx512_vnni"]
    built = {n for u in prog.spec.units for n in u.names if n.startswith("qmatmul")}
    assert built == set(kernels)                          # u's rows16 kernel, asked for first, is not linked
    prog.bind_weights(weights)
    ref = compile_graph(graph, backend="numpy", passes=[])
    ref.bind_weights(weights)
    x = rng.standard_normal((T, 256)).astype(np.float32)
    ids = rng.integers(0, 32, T).astype(np.int32)
    for got, want in zip(prog(x, ids), ref(x, ids)):
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_programs_share_one_copy_and_the_file_keeps_its_bytes(tmp_path):
    """Two programs over one file's weight read one rows16 copy, made once; the file's pages the copy
    was made from are let go, and read back the same when something reads them again."""
    from ggraph.gguf.reader import GGUFFile
    from ggraph.gguf.writer import write
    raw = q4_k_rows(256, 1024)                             # 36 pages: whole pages to let go
    path = tmp_path / "w.gguf"
    write(path, {}, {"w": (raw, dtypes.q4_k, (256, 1024))})
    f = GGUFFile(path)
    graph = parse(textwrap.dedent("""
    { lambda ; x:f32[T,1024]. let
        w:q4_k[256,1024] = param "w"
        a:f32[T,256] = qmatmul x w
      in (a) }
    """))
    progs = [compile_graph(graph, backend="llvm", passes=[], target=_vnni(), threads=1, weights=f) for _ in range(2)]
    copies = [p._keep[p.spec.param_index[graph.params[0]]] for p in progs]
    assert copies[0] is copies[1] and isinstance(copies[0], program._Laid)
    assert copies[0].data.ctypes.data % mmap.PAGESIZE == 0
    np.testing.assert_array_equal(rows16.unpack(copies[0].data, dtypes.q4_k, 256, 1024), raw.reshape(-1))
    np.testing.assert_array_equal(f.tensors["w"].data.reshape(-1), raw.reshape(-1))
    x = rng.standard_normal((1, 1024)).astype(np.float32)
    np.testing.assert_array_equal(progs[0](x)[0], progs[1](x)[0])


def test_a_program_with_laid_out_weights_loads_back_from_the_cache(tmp_path, monkeypatch, capsys):
    """The program state keeps each buffer's layout: read back from the disk cache in a new process (here:
    with this process's loaded programs forgotten), it loads without a warning and keeps rows16."""
    monkeypatch.setenv("GGRAPH_CACHE", str(tmp_path))
    graph = parse(textwrap.dedent(GRAPH))
    first = compile_graph(graph, backend="llvm", passes=[], target=_vnni())
    monkeypatch.setattr(program, "_LOADED", {})
    again = compile_graph(graph, backend="llvm", passes=[], target=_vnni())
    assert "warning" not in capsys.readouterr().err
    assert [b.layout for b in again.spec.buffers] == [b.layout for b in first.spec.buffers]
    assert "rows16" in [b.layout for b in again.spec.buffers]
