"""A mixture-of-experts file in Qwen3-MoE's proportions, and its decode and prefill against llama.cpp's
``llama-bench`` (and ik_llama.cpp's), side by side in one run.

    python benchmarks/moe.py --write /tmp/qwen3moe-bench.gguf     # 16 layers, width 1024, 64 experts of 512, top 8
    python benchmarks/moe.py /tmp/qwen3moe-bench.gguf --threads 1,2 --rounds 3 \\
        --llama-bench PATH/llama-bench --ik-bench PATH/llama-bench \\
        --ik-bench "PATH/llama-bench -rtr 1"                         # each optional; options after a binary
    python benchmarks/moe.py /tmp/qwen3moe-bench.gguf --profile         # where a decode step's time goes

The file is random weights (N(0, 1/fan_in); the router's rows too, so routing spreads over the experts
as a trained router's does, roughly), written as f16 with gguf-py and quantised by llama.cpp's
``llama_model_quantize`` (Q4_K_M: its own per-tensor type choice); the tokenizer is tests/data/vocab's
llama-spm one (32000 tokens, tied output), so that the experts, not a 151k-token output matrix, are
what a decode step reads. Needs llama-cpp-python for --write.

Each round runs every engine in turn (ggraph in this process: one prefill of ``--pp`` tokens at an empty
cache and ``--tg`` decode steps from it, as ``llama-bench -p PP -n TG`` does; each llama-bench a process
of one repetition), so that the noise of a shared machine falls on all alike; each figure is the median
of the rounds. ``--profile`` times one decode step per kernel call (ggraph.bench.profile_ggraph) and
says how many bytes the experts' kernels read a token against the active experts' bytes.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from side_by_side import side_by_side, table_head, table_rows

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(layers=16, width=1024, experts=64, top_k=8, expert_width=512, heads=16, kv_heads=2, head_dim=128)
Q4_K_M = 15                      # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M


def tensors(s: dict, rng):
    """(name, f32 array) of every tensor of a qwen3moe model of shape ``s`` (numpy's shapes: (out, in)), one
    at a time (the experts are 6 GB as f32)."""
    from zoo import n_vocab
    d, f, e, hd = s["width"], s["expert_width"], s["experts"], s["head_dim"]
    nq, nkv = s["heads"] * hd, s["kv_heads"] * hd

    def mat(*shape):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(1 / np.sqrt(shape[-1]))

    def norm(n):
        return np.float32(1) + np.float32(0.1) * rng.standard_normal(n, dtype=np.float32)

    yield "token_embd.weight", mat(n_vocab("llama-spm"), d)
    yield "output_norm.weight", norm(d)
    for i in range(s["layers"]):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", norm(d)
        yield b + "attn_q.weight", mat(nq, d)                       # (heads * head_dim, width)
        yield b + "attn_k.weight", mat(nkv, d)
        yield b + "attn_v.weight", mat(nkv, d)
        yield b + "attn_q_norm.weight", norm(hd)
        yield b + "attn_k_norm.weight", norm(hd)
        yield b + "attn_output.weight", mat(d, nq)
        yield b + "ffn_norm.weight", norm(d)
        yield b + "ffn_gate_inp.weight", mat(e, d)                  # the router: (experts, width)
        yield b + "ffn_gate_exps.weight", mat(e, f, d)              # (experts, expert width, width)
        yield b + "ffn_up_exps.weight", mat(e, f, d)
        yield b + "ffn_down_exps.weight", mat(e, d, f)


def write(path: Path, s: dict, seed: int = 0) -> Path:
    """The qwen3moe file of shape ``s`` at ``path``, Q4_K_M by llama.cpp."""
    from gguf import GGUFValueType, GGUFWriter
    from zoo import llama_quantize, tokenizer_kv
    src = path.with_name(path.name + ".f16.gguf")
    w = GGUFWriter(str(src), "qwen3moe")
    w.add_name("ggraph moe benchmark")
    w.add_file_type(1)
    a = "qwen3moe"
    for key, value, kind in [("context_length", 4096, "UINT32"), ("embedding_length", s["width"], "UINT32"),
                             ("block_count", s["layers"], "UINT32"), ("feed_forward_length", 4 * s["width"], "UINT32"),
                             ("expert_feed_forward_length", s["expert_width"], "UINT32"),
                             ("expert_count", s["experts"], "UINT32"), ("expert_used_count", s["top_k"], "UINT32"),
                             ("attention.head_count", s["heads"], "UINT32"),
                             ("attention.head_count_kv", s["kv_heads"], "UINT32"),
                             ("attention.key_length", s["head_dim"], "UINT32"),
                             ("attention.value_length", s["head_dim"], "UINT32"),
                             ("attention.layer_norm_rms_epsilon", 1e-6, "FLOAT32"),
                             ("rope.freq_base", 1e6, "FLOAT32")]:
        w.add_key_value(f"{a}.{key}", value, GGUFValueType[kind])
    for key, value, kind, sub in tokenizer_kv("llama-spm"):
        w.add_key_value(key, value, kind, sub)
    for name, x in tensors(s, np.random.default_rng(seed)):
        w.add_tensor(name, x.astype(np.float16) if x.ndim >= 2 and "gate_inp" not in name else x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    try:
        llama_quantize(src, path, Q4_K_M, what="moe benchmark Q4_K_M")
    finally:
        src.unlink(missing_ok=True)
    return path


def active_bytes(path: Path) -> tuple[int, int]:
    """(bytes of the k experts a token uses, summed over layers; bytes of every expert) of the file."""
    from ggraph.gguf.reader import GGUFFile
    f = GGUFFile(path)
    every = sum(t.nbytes for name, t in f.tensors.items() if "_exps." in name)
    return every * f.metadata["qwen3moe.expert_used_count"] // f.metadata["qwen3moe.expert_count"], every


def profile(path: Path, threads: int) -> str:
    """One decode step's experts: time, bytes read (the active experts') and GB/s against a stream read."""
    from ggraph.bench.measure import EXPERTS, profile_ggraph, stream_bandwidth
    prof = profile_ggraph(path, pp=1, threads=threads)
    rows = prof["decode"]["op"]
    seconds = sum(r["seconds"] for r in rows if r["name"].startswith(EXPERTS))
    counted = sum(r["bytes"] for r in rows if r["name"].startswith(EXPERTS))
    active, every = active_bytes(path)
    stream = stream_bandwidth(threads)
    total = sum(r["seconds"] for r in rows)
    return (f"decode step, {threads} thread(s): experts' kernels {seconds * 1e3:.2f} ms of {total * 1e3:.2f} ms, "
            f"{counted / 1e6:.1f} MB counted (active experts {active / 1e6:.1f} MB of {every / 1e6:.1f} MB), "
            f"{counted / seconds / 1e9:.1f} GB/s against a stream read of {stream:.1f} GB/s: the experts take "
            f"{seconds * stream * 1e9 / active:.2f}x the time of reading the active experts once")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", type=Path, help="the benchmark file (made by --write)")
    p.add_argument("--write", type=Path, help="write the benchmark file here (Q4_K_M) and stop")
    p.add_argument("--shape", default="", help="override the shape, e.g. layers=2,experts=8 (keys: "
                   + ", ".join(SHAPE) + ")")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--pp", type=int, default=512)
    p.add_argument("--tg", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--llama-bench", help="llama.cpp's llama-bench binary (and options of its own, in one string)")
    p.add_argument("--ik-bench", action="append", default=[],
                   help="ik_llama.cpp's llama-bench binary (and options of its own, in one string); repeatable")
    p.add_argument("--profile", action="store_true", help="profile a decode step's experts instead")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    shape = dict(SHAPE, **{k: int(v) for k, v in (kv.split("=") for kv in args.shape.split(",") if kv)})
    if args.write:
        write(args.write, shape)
        active, every = active_bytes(args.write)
        print(f"wrote {args.write}: {args.write.stat().st_size / 1e6:.0f} MB, experts {every / 1e6:.0f} MB, "
              f"{active / 1e6:.1f} MB of them active per token")
        return 0
    if args.model is None:
        p.error("name the benchmark file (or --write one)")
    threads = [int(t) for t in args.threads.split(",")]
    if args.profile:
        for t in threads:
            print(profile(args.model, t))
        return 0
    engines = {"llama.cpp": args.llama_bench} if args.llama_bench else {}
    for exe in args.ik_bench:
        extra = " ".join(exe.split()[1:])
        engines[f"ik_llama.cpp {extra}".strip()] = exe
    print(table_head(args.pp, args.tg))
    for t in threads:
        print(table_rows(side_by_side(args.model, t, args.pp, args.tg, args.rounds, engines)[0], t))
    return 0


if __name__ == "__main__":
    sys.exit(main())
