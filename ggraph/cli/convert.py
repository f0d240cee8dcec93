"""``ggraph convert``: a Hugging Face model folder (safetensors, config.json, tokenizer) as a GGUF file."""
from __future__ import annotations

import sys

from ggraph.cli.common import add_force_arg, check_output


def cmd_convert(args) -> int:
    """Convert a Hugging Face model folder to a GGUF file that llama.cpp and ggraph both run, as
    llama.cpp's convert_hf_to_gguf.py does: llama, qwen2, phi3, gemma2, gemma3 (text), qwen3 and
    olmo2 models, and the mixtures of experts qwen3moe, olmoe, qwen2moe and Mixtral (as llama with
    experts); their safetensors weights (one file or shards), the tokenizer (tokenizer.json or
    tokenizer.model) and the chat template. Matrices take --outtype; norms, routers and other 1-D
    tensors stay f32."""
    from ggraph.convert import convert
    from ggraph.units import fmt_bytes
    check_output(args.out, args.force, "output")
    path = convert(args.folder, args.out, args.outtype, name=args.name, tokenizer_pre=args.tokenizer_pre)
    print(f"ggraph convert: wrote {path} ({fmt_bytes(path.stat().st_size)}, {args.outtype})", file=sys.stderr)
    return 0


def add_parser(sub, parents) -> None:
    from ggraph.convert import FAMILIES, OUTTYPES
    p = sub.add_parser("convert", help="a Hugging Face model folder as a GGUF file", description=cmd_convert.__doc__,
                       parents=parents,
                       epilog="example: ggraph convert ./Qwen2.5-0.5B qwen2.5-0.5b-f16.gguf --outtype f16 && "
                              "ggraph quantize qwen2.5-0.5b-f16.gguf qwen2.5-0.5b-q4_k_m.gguf Q4_K_M. "
                              f"Architectures: {', '.join(FAMILIES)}.")
    p.add_argument("folder", metavar="HF_DIR", help="the model folder: config.json, *.safetensors, tokenizer files")
    p.add_argument("out", metavar="OUT.gguf", help="the GGUF file to write (written as OUT.gguf.partial, renamed "
                                                   "when complete)")
    p.add_argument("--outtype", default="f16", choices=list(OUTTYPES),
                   help="the type of the matrices (default f16; q8_0 falls back to f16 for rows that are not a "
                        "multiple of 32); norms and biases stay f32")
    p.add_argument("--name", default=None, help="general.name (default: the folder's name)")
    p.add_argument("--tokenizer-pre", default=None, metavar="NAME",
                   help="llama.cpp's BPE pre-tokenizer name (e.g. llama-bpe, qwen2, gpt-2), for a tokenizer.json "
                        "whose pre-tokenizer convert does not recognise")
    add_force_arg(p)
    p.set_defaults(fn=cmd_convert)
