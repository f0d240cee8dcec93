"""A hybrid file in LFM2's proportions and an all-recurrent one in Mamba-2's, and their decode and prefill
against llama.cpp's ``llama-bench``, side by side in one run; decode at depth.

    python benchmarks/hybrid.py --write /tmp/lfm2-bench.gguf                   # LFM2-1.2B's shape
    python benchmarks/hybrid.py --write /tmp/mamba2-bench.gguf --family mamba2  # mamba2-370m's shape
    python benchmarks/hybrid.py /tmp/lfm2-bench.gguf --threads 1,2 --rounds 3 --llama-bench auto
    python benchmarks/hybrid.py /tmp/mamba2-bench.gguf --depth 0,16384 --pp 0 --llama-bench PATH/llama-bench
    python benchmarks/hybrid.py /tmp/lfm2-bench.gguf --profile                  # where a step's time goes

The files are random weights written as f16 with gguf-py and quantised by llama.cpp's
``llama_model_quantize`` (Q4_K_M: its own per-tensor type choice), with tests/data/vocab's llama-spm
tokenizer (32000 tokens, tied output) as moe.py's. lfm2: 16 layers of width 2048, LFM2-1.2B's attention
layers (2, 5, 8, 10, 12, 14: 32 query heads of 64 over 8 KV heads) between gated short convolutions of 3
taps, a SwiGLU FFN of 8192 in every layer. mamba2: 48 Mamba-2 layers of width 1024 (inner 2048, 32 heads
of 64, one group, state 128, conv 4), no attention, no FFN. Matrices are N(0, 1/fan_in); the Mamba-2
layer's A = -U(1, 16), dt_bias = softplus⁻¹ of a dt in [0.001, 0.1] (log-uniform) and D = 1, as Mamba
initialises them, so that states neither blow up nor vanish. After writing, the file runs in llama.cpp
(llama-cpp-python) and in ggraph on a few tokens: both must give finite logits, and their cosine is
printed (needs llama-cpp-python).

Each round runs every engine in turn (benchmarks/side_by_side.py); each figure is the median of the
rounds, and the load average is printed beside them. ``--depth`` times decode after that many tokens
(llama-bench ``-d``; ggraph holds them in its caches and states untimed, a session per depth), every
depth in every round, and prints each engine's decode at depth against its own at depth 0.
``--profile`` times a decode step and a prefill step per kernel (ggraph.bench.profile_ggraph).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from side_by_side import load, side_by_side, table_head, table_rows

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"lfm2": dict(layers=16, width=2048, ffn=8192, heads=32, kv_heads=8, conv=3),
          "mamba2": dict(layers=48, width=1024, inner=2048, heads=32, groups=1, state=128, conv=4)}
LFM2_ATTENTION = (2, 5, 8, 10, 12, 14)     # LFM2-1.2B's attention layers; the others are convolutions
Q4_K_M = 15                                # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M
VOCAB = "llama-spm"
CHECK_TOKENS = 8                           # tokens the written file runs in llama.cpp and ggraph


def _mat(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(1 / np.sqrt(shape[-1]))


def _norm(rng, *shape):
    return np.float32(1) + np.float32(0.1) * rng.standard_normal(shape, dtype=np.float32)


def lfm2_tensors(s: dict, rng):
    """(name, f32 array) of an lfm2 model of shape ``s`` (numpy's shapes: (out, in))."""
    from zoo import n_vocab
    d, f, hd = s["width"], s["ffn"], s["width"] // s["heads"]
    yield "token_embd.weight", _mat(rng, n_vocab(VOCAB), d)
    yield "token_embd_norm.weight", _norm(rng, d)
    for i in range(s["layers"]):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", _norm(rng, d)
        if i in LFM2_ATTENTION:
            yield b + "attn_q.weight", _mat(rng, d, d)
            yield b + "attn_k.weight", _mat(rng, s["kv_heads"] * hd, d)
            yield b + "attn_v.weight", _mat(rng, s["kv_heads"] * hd, d)
            yield b + "attn_q_norm.weight", _norm(rng, hd)
            yield b + "attn_k_norm.weight", _norm(rng, hd)
            yield b + "attn_output.weight", _mat(rng, d, d)
        else:
            yield b + "shortconv.in_proj.weight", _mat(rng, 3 * d, d)          # b, c, x
            yield b + "shortconv.conv.weight", _mat(rng, d, s["conv"])        # (D, K): taps per channel
            yield b + "shortconv.out_proj.weight", _mat(rng, d, d)
        yield b + "ffn_norm.weight", _norm(rng, d)
        yield b + "ffn_gate.weight", _mat(rng, f, d)
        yield b + "ffn_up.weight", _mat(rng, f, d)
        yield b + "ffn_down.weight", _mat(rng, d, f)


def mamba2_tensors(s: dict, rng):
    """(name, f32 array) of a mamba2 model of shape ``s``, its SSM parameters in Mamba's init ranges."""
    from zoo import n_vocab
    d, di, h, g, n = s["width"], s["inner"], s["heads"], s["groups"], s["state"]
    conv = di + 2 * g * n
    yield "token_embd.weight", _mat(rng, n_vocab(VOCAB), d)
    yield "output_norm.weight", _norm(rng, d)
    for i in range(s["layers"]):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", _norm(rng, d)
        yield b + "ssm_in.weight", _mat(rng, 2 * di + 2 * g * n + h, d)       # z, x B C, dt
        yield b + "ssm_conv1d.weight", _mat(rng, conv, s["conv"])
        yield b + "ssm_conv1d.bias", np.float32(0.1) * rng.standard_normal(conv, dtype=np.float32)
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), h)).astype(np.float32)
        yield b + "ssm_dt.bias", (dt + np.log(-np.expm1(-dt))).astype(np.float32)    # softplus(bias) = dt
        yield b + "ssm_a", -rng.uniform(1, 16, (h, 1)).astype(np.float32)             # A = -exp(A_log)
        yield b + "ssm_d", np.ones((h, 1), np.float32)
        yield b + "ssm_norm.weight", _norm(rng, g, di // g)
        yield b + "ssm_out.weight", _mat(rng, d, di)


def metadata(family: str, s: dict) -> list[tuple[str, object, str]]:
    """(key under the architecture, value, gguf value type) of the family's hyperparameters."""
    common = [("context_length", 32768, "UINT32"), ("embedding_length", s["width"], "UINT32"),
              ("block_count", s["layers"], "UINT32"), ("attention.layer_norm_rms_epsilon", 1e-5, "FLOAT32")]
    if family == "lfm2":
        kv = [s["kv_heads"] if i in LFM2_ATTENTION else 0 for i in range(s["layers"])]
        return common + [("feed_forward_length", s["ffn"], "UINT32"), ("attention.head_count", s["heads"], "UINT32"),
                         ("attention.head_count_kv", kv, "UINT32[]"), ("rope.freq_base", 1e6, "FLOAT32"),
                         ("shortconv.l_cache", s["conv"], "UINT32")]
    return common + [("feed_forward_length", 0, "UINT32"), ("attention.head_count", 0, "UINT32"),
                     ("ssm.conv_kernel", s["conv"], "UINT32"), ("ssm.inner_size", s["inner"], "UINT32"),
                     ("ssm.state_size", s["state"], "UINT32"), ("ssm.time_step_rank", s["heads"], "UINT32"),
                     ("ssm.group_count", s["groups"], "UINT32")]


def stored_f16(name: str, x: np.ndarray) -> bool:
    """Matrices go to the f16 file llama.cpp quantises; convolution taps and the SSM's vectors stay f32."""
    return x.ndim >= 2 and not name.endswith(("conv.weight", "conv1d.weight", "ssm_a", "ssm_d", "_norm.weight"))


def write(path: Path, family: str, s: dict, seed: int = 0) -> Path:
    """The ``family`` file of shape ``s`` at ``path``, Q4_K_M by llama.cpp."""
    from gguf import GGUFValueType, GGUFWriter
    from zoo import llama_quantize, tokenizer_kv
    src = path.with_name(path.name + ".f16.gguf")
    w = GGUFWriter(str(src), family)
    w.add_name(f"ggraph {family} benchmark")
    w.add_file_type(1)
    for key, value, kind in metadata(family, s):
        if kind.endswith("[]"):
            w.add_key_value(f"{family}.{key}", value, GGUFValueType.ARRAY, GGUFValueType[kind[:-2]])
        else:
            w.add_key_value(f"{family}.{key}", value, GGUFValueType[kind])
    for key, value, kind, sub in tokenizer_kv(VOCAB):
        w.add_key_value(key, value, kind, sub)
    rng = np.random.default_rng(seed)
    for name, x in (lfm2_tensors if family == "lfm2" else mamba2_tensors)(s, rng):
        w.add_tensor(name, x.astype(np.float16) if stored_f16(name, x) else x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    try:
        llama_quantize(src, path, Q4_K_M, what=f"{family} benchmark Q4_K_M")
    finally:
        src.unlink(missing_ok=True)
    return path


def check(path: Path, tokens: int = CHECK_TOKENS) -> float:
    """The file's logits at every one of ``tokens`` positions in llama.cpp and in ggraph: both finite (else
    RuntimeError), their least cosine returned."""
    from llama_cpp import Llama

    from ggraph.bench.measure import prompt_tokens
    from ggraph.runtime.session import Session
    s = Session(path, backend="llvm", ctx=64)
    ids = prompt_tokens(tokens, s.config.n_vocab)
    ours = np.asarray(s.logits(ids), dtype=np.float64)
    llm = Llama(model_path=str(path), n_ctx=64, n_batch=64, n_ubatch=64, logits_all=True, n_threads=2,
                verbose=False)
    llm.eval(ids)
    theirs = np.array(llm.scores[:tokens], dtype=np.float64)
    llm.close()
    for who, x in (("llama.cpp", theirs), ("ggraph", ours)):
        if not np.isfinite(x).all():
            raise RuntimeError(f"{path}: {who}'s logits are not finite")
    return float(min(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b) for a, b in zip(ours, theirs)))


def profile(path: Path, threads: int, pp: int) -> str:
    """Per-kernel time of a decode step and of a prefill step of ``pp`` tokens."""
    from ggraph.bench.measure import profile_ggraph, profile_table
    prof = profile_ggraph(path, pp=pp, threads=threads)
    return "\n".join([profile_table(f"decode step, {threads} thread(s), {load()}", prof["decode"]["op"]),
                      profile_table(f"prefill step of {prof['prefill_step']['T']}, {threads} thread(s)",
                                    prof["prefill"]["op"])])


def built_llama_bench() -> str:
    """llama.cpp's llama-bench from the installed llama-cpp-python's source, built once with the flags of
    tests/llama_cpp_cmake_args.py (tests/llama_tools.py)."""
    import pytest
    from llama_tools import llama_tool
    try:
        return str(llama_tool("llama-bench"))
    except pytest.skip.Exception as e:
        raise SystemExit(f"--llama-bench auto: {e}") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", type=Path, help="the benchmark file (made by --write)")
    p.add_argument("--write", type=Path, help="write the benchmark file here (Q4_K_M), check it and stop")
    p.add_argument("--family", choices=sorted(SHAPES), default="lfm2", help="the file --write makes")
    p.add_argument("--shape", default="", help="override the shape, e.g. layers=3,width=256 (keys: lfm2 "
                   + ", ".join(SHAPES["lfm2"]) + "; mamba2 " + ", ".join(SHAPES["mamba2"]) + ")")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--pp", type=int, default=512, help="prefill tokens, timed at the first depth (0: decode only)")
    p.add_argument("--tg", type=int, default=128)
    p.add_argument("--depth", default="0", help="tokens in the context before the timed steps, e.g. 0,16384")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--llama-bench", help="llama.cpp's llama-bench binary (and options of its own, in one string); "
                   "'auto': the one tests/llama_tools.py builds from llama-cpp-python's llama.cpp source")
    p.add_argument("--profile", action="store_true", help="profile a decode and a prefill step instead")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    if args.write:
        shape = dict(SHAPES[args.family])
        for kv in filter(None, args.shape.split(",")):
            key, _, value = kv.partition("=")
            if key not in shape:
                p.error(f"--shape: {key!r} is not a {args.family} shape key (keys: {', '.join(shape)})")
            shape[key] = int(value)
        write(args.write, args.family, shape)
        print(f"wrote {args.write}: {args.family}, {args.write.stat().st_size / 1e6:.0f} MB, "
              + ", ".join(f"{k} {v}" for k, v in shape.items()))
        print(f"llama.cpp and ggraph on {CHECK_TOKENS} tokens: finite logits, least cosine {check(args.write):.6f}")
        return 0
    if args.model is None:
        p.error("name the benchmark file (or --write one)")
    threads = [int(t) for t in args.threads.split(",")]
    depths = tuple(int(d) for d in args.depth.split(","))
    if args.profile:
        for t in threads:
            print(profile(args.model, t, args.pp or 64))
        return 0
    engines = {"llama.cpp": built_llama_bench() if args.llama_bench == "auto" else args.llama_bench} \
        if args.llama_bench else {}
    print(f"{args.model.name}, {load()}")
    print(table_head(args.pp, args.tg, depth=True))
    flat: dict[tuple, float] = {}
    for t in threads:
        for depth, res in side_by_side(args.model, t, args.pp, args.tg, args.rounds, engines, depths).items():
            print(table_rows(res, t, depth), flush=True)
            flat.update({(t, depth, name): tg for name, (_, tg, _) in res.items()})
    print(f"({load()})")
    for (t, depth, name), tg in flat.items():
        if depth and (t, 0, name) in flat:
            print(f"{name}, {t} thread(s): decode at depth {depth} is {tg / flat[(t, 0, name)]:.3f}x its decode "
                  f"at depth 0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
