"""``ggraph imatrix``: an importance matrix from calibration text, in llama.cpp's imatrix GGUF format."""
from __future__ import annotations

import sys

from ggraph.cli.common import add_force_arg, add_model_arg, check_output, model_path
from ggraph.cli.perplexity import add_chunk_args, read_text


def cmd_imatrix(args) -> int:
    """Compute an importance matrix for quantising a model: per weight of the model's blocks, the mean
    square of each input column's activations over a calibration text, as llama.cpp's llama-imatrix
    does. The text runs in the chunks ggraph perplexity uses (so the running perplexity prints too),
    through a program whose instrument_imatrix pass makes every weight matmul report its input's
    squares. The output is llama.cpp's imatrix GGUF: 'ggraph quantize --imatrix' and
    'llama-quantize --imatrix' both read it (and ggraph reads llama-imatrix's files, GGUF or .dat).
    """
    from ggraph import imatrix
    check_output(args.output, args.force, "-o")
    text = read_text(args.file)
    imx, _ = imatrix.collect(model_path(args), text, n_ctx=args.ctx, n_chunks=args.chunks, threads=args.threads,
                             batch=args.batch, process_output=args.process_output, ppl=not args.no_ppl,
                             dataset=args.file, cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v,
                             max_memory=args.max_memory)
    imatrix.write(args.output, imx)
    chunks = f"{imx.chunk_count} chunk{'s' if imx.chunk_count != 1 else ''}"
    print(f"ggraph imatrix: {len(imx.sums)} tensors from {chunks} of {imx.chunk_size} tokens -> {args.output}",
          file=sys.stderr)
    return 0


def add_parser(sub, parents) -> None:
    p = sub.add_parser("imatrix", help="an importance matrix from calibration text, as llama-imatrix",
                       description=cmd_imatrix.__doc__, parents=parents,
                       epilog="example: ggraph imatrix --demo -f calibration.txt -o imatrix.gguf -c 512")
    add_model_arg(p)
    add_chunk_args(p)
    p.add_argument("-o", "--output", default="imatrix.gguf", help="the imatrix file to write (default imatrix.gguf)")
    p.add_argument("--process-output", action="store_true",
                   help="record output.weight too (skipped by default, as llama-imatrix does; a model whose "
                        "output head is its token embedding has no output.weight)")
    p.add_argument("--no-ppl", action="store_true", help="do not compute the running perplexity")
    add_force_arg(p)
    p.set_defaults(fn=cmd_imatrix)
