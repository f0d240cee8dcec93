"""Importance matrices: collected from calibration text, and read and written in llama.cpp's formats.

    imx, est = collect("model.gguf", text, n_ctx=512, dataset="calibration.txt")
    write("imatrix.gguf", imx)
    vectors = load("imatrix.gguf")          # {weight name: f32 per-column importance}, for a quantiser

A weight [N, K]'s importance is, per input column k, the mean of x[:, k]² over the tokens
that reached it: quantisers weigh each column's rounding error by it. ``collect`` runs the
model on the same chunks as ``ggraph perplexity`` (and prints the same running perplexity),
through the program that the ``instrument_imatrix`` pass gives extra outputs: each step's
Σ x² per column and row count, per weight. As llama.cpp's ``llama-imatrix`` does, it records
the weights of the blocks (``blk.*``; ``output.weight`` too with ``process_output``), every
token of every chunk, and no step of fewer than ``MIN_ROWS`` tokens. Stacked experts [E, N, K]
are recorded per expert, from the rows routed to each (every step, as llama.cpp records every
``ggml_mul_mat_id``); an expert no token chose keeps a count of 0, and ``load`` gives it ones.

The GGUF format (``general.type = imatrix``) keeps the raw sums: per weight ``NAME``,
``NAME.in_sum2`` f32 [n_mat, K] and ``NAME.counts`` f32 [n_mat, 1] (n_mat = 1 for a dense
weight, the experts of a stacked MoE weight), with ``imatrix.datasets`` (the text files),
``imatrix.chunk_count`` and ``imatrix.chunk_size`` (u32). The legacy ``.dat`` format holds
``(Σ x² / count) · ncall`` per column and ``ncall``, the chunks seen. ``load`` divides as
``llama-quantize`` does, giving the very vector it hands the quantiser.
"""
from __future__ import annotations

import dataclasses
import os
import struct

import numpy as np

MIN_ROWS = 16                 # llama.cpp's collector skips matmuls of fewer rows (small decode batches)
GGUF_MAGIC = b"GGUF"


@dataclasses.dataclass
class Imatrix:
    """Per weight name: ``sums`` f32 [n_mat, K] of Σ x² per column and ``counts`` f32 [n_mat] of the
    rows each matrix saw; the datasets, and the chunks and chunk size they were computed with. (Read
    from a legacy .dat file, the sums are the means times ncall and the counts ncall: the same ratio.)"""
    sums: dict[str, np.ndarray]
    counts: dict[str, np.ndarray]
    datasets: list[str]
    chunk_count: int
    chunk_size: int

    def vectors(self) -> dict[str, np.ndarray]:
        """Each weight's f32 vector (n_mat·K,) as llama-quantize gives the quantiser: a matrix's sums over
        its count rounded to a whole number, or ones for a matrix that saw no rows."""
        out = {}
        for name, sums in self.sums.items():
            counts = _round_half_away(self.counts[name]).astype(np.float32)[:, None]    # (n_mat, 1)
            seen = counts > 0
            means = sums / np.where(seen, counts, np.float32(1))                        # f32 / f32, as in C
            out[name] = np.where(seen, means, np.float32(1)).astype(np.float32).reshape(-1)
        return out


def _round_half_away(x: np.ndarray) -> np.ndarray:
    """C's lround: halves away from zero."""
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def load(path) -> dict[str, np.ndarray]:
    """The per-column importance vector of every weight in an imatrix file (GGUF or legacy .dat), exactly
    as llama-quantize computes it from the file."""
    return read(path).vectors()


# -- reading -----------------------------------------------------------------------------------

def read(path) -> Imatrix:
    """An imatrix file: llama.cpp's GGUF format, or (any other file) its legacy .dat format."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    return _read_gguf(path) if magic == GGUF_MAGIC else _read_dat(path)


def _read_gguf(path: str) -> Imatrix:
    from ggraph.gguf import GGUFFile
    from ggraph.ir import dtypes
    with GGUFFile(path) as f:
        metadata = f.metadata
        missing = [k for k in ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size") if k not in metadata]
        if missing:
            raise ValueError(f"{path}: not an imatrix file: no {', '.join(missing)} (llama-quantize needs them)")
        datasets = list(metadata["imatrix.datasets"]) if f.metadata_types["imatrix.datasets"] == "arr[str]" else []
        pairs: dict[str, dict[str, np.ndarray]] = {}
        for name, t in f.tensors.items():
            base, _, kind = name.rpartition(".")
            if kind not in ("in_sum2", "counts"):
                continue
            if t.dtype is not dtypes.f32:
                raise ValueError(f"{path}: tensor {name} is {t.dtype}; imatrix sums and counts must be f32")
            pairs.setdefault(base, {})[kind] = t.data.view(np.float32).reshape(t.shape).copy()
    if not pairs:
        raise ValueError(f"{path}: the imatrix holds no <name>.in_sum2 / <name>.counts tensors")
    sums, counts = {}, {}
    for name, pair in sorted(pairs.items()):
        if len(pair) != 2:
            raise ValueError(f"{path}: {name} has {'.in_sum2' if 'in_sum2' in pair else '.counts'} "
                             f"but no {'.counts' if 'in_sum2' in pair else '.in_sum2'}")
        n_mat = pair["counts"].size
        if pair["in_sum2"].size % n_mat:
            raise ValueError(f"{path}: {name}.in_sum2 has {pair['in_sum2'].size} values, not a multiple of its "
                             f"{n_mat} counts")
        sums[name], counts[name] = pair["in_sum2"].reshape(n_mat, -1), pair["counts"].reshape(n_mat)
    return Imatrix(sums, counts, datasets, int(metadata["imatrix.chunk_count"]), int(metadata["imatrix.chunk_size"]))


def _read_dat(path: str) -> Imatrix:
    """The legacy format: i32 entries; per entry i32 name length, the name, i32 ncall, i32 nval, nval f32;
    then, optionally, i32 chunk count, i32 length and the dataset's name."""
    with open(path, "rb") as f:
        data = f.read()
    at = 0

    def take(fmt: str, what: str):
        nonlocal at
        size = struct.calcsize(fmt)
        if at + size > len(data):
            raise ValueError(f"{path}: not an imatrix file (GGUF or legacy .dat): it ends inside {what} "
                             f"at byte {at}")
        at += size
        return struct.unpack_from(fmt, data, at - size)

    (n,) = take("<i", "the entry count")
    if n < 1:
        raise ValueError(f"{path}: not an imatrix file (GGUF or legacy .dat): {n} entries")
    sums, counts = {}, {}
    for i in range(n):
        (length,) = take("<i", f"entry {i}'s name length")
        if length < 0:
            raise ValueError(f"{path}: entry {i}: negative name length {length}")
        name = take(f"<{length}s", f"entry {i}'s name")[0].decode("utf-8", errors="replace")
        ncall, nval = take("<ii", f"entry {name}'s counts")
        if nval < 1:
            raise ValueError(f"{path}: entry {name}: {nval} values")
        take(f"<{4 * nval}x", f"entry {name}'s {nval} values")
        sums[name] = np.frombuffer(data, "<f4", nval, at - 4 * nval).astype(np.float32).reshape(1, nval)
        counts[name] = np.array([max(ncall, 1)], np.float32)  # the values are (Σ x² / count) · ncall
    chunk_count, datasets = 0, []
    if len(data) - at >= 4:
        (chunk_count,) = take("<i", "the chunk count")
    if len(data) - at >= 4:
        (length,) = take("<i", "the dataset name length")
        if 0 < length <= len(data) - at:
            datasets.append(take(f"<{length}s", "the dataset name")[0].decode("utf-8", errors="replace"))
    return Imatrix(sums, counts, datasets, chunk_count, 0)


# -- writing -----------------------------------------------------------------------------------

def write(path, imx: Imatrix) -> None:
    """Write ``imx`` in llama.cpp's GGUF imatrix format, tensors in name order, as llama-imatrix does;
    through ``PATH.partial``, renamed into place once complete."""
    from ggraph.gguf.writer import Typed, write as write_gguf
    metadata = {"general.type": "imatrix",
                "imatrix.datasets": Typed(list(imx.datasets), "str"),
                "imatrix.chunk_count": Typed(int(imx.chunk_count), "u32"),
                "imatrix.chunk_size": Typed(int(imx.chunk_size), "u32")}
    tensors = {}
    for name in sorted(imx.sums):
        sums = np.asarray(imx.sums[name], np.float32)
        tensors[f"{name}.in_sum2"] = sums.reshape(sums.shape[0], -1)                 # (n_mat, K)
        tensors[f"{name}.counts"] = np.asarray(imx.counts[name], np.float32).reshape(-1, 1)   # (n_mat, 1)
    write_gguf(path, metadata, tensors)


# -- collecting --------------------------------------------------------------------------------

class Sums:
    """Σ x² per column (f64) and rows counted, per weight name, added up over steps: [1, K] and [1] for a
    matrix, [E, K] and [E] for stacked experts (per expert)."""

    def __init__(self, process_output: bool = False):
        self.process_output = process_output
        self.sums: dict[str, np.ndarray] = {}
        self.rows: dict[str, np.ndarray] = {}

    def records(self, name: str) -> bool:
        """llama-imatrix's choice: the blocks' weights, and the output head's with --process-output."""
        return name.startswith("blk.") or (self.process_output and name == "output.weight")

    def add(self, recorded: dict, small: bool = False) -> None:
        """Add one step's ``{weight name: (Σ x² f32[K], rows f32[1])}`` (stacked experts: f32[E, K], f32[E]),
        the instrumented outputs. ``small``: the step has fewer than MIN_ROWS tokens, which llama.cpp records
        for expert matmuls only."""
        for name, (sq, rows) in recorded.items():
            experts = np.ndim(sq) == 2
            if not experts and (small or not self.records(name)):
                continue
            sq = np.asarray(sq).reshape(np.size(rows), -1)
            if not np.all(np.isfinite(sq)):
                raise ValueError(f"imatrix: non-finite activations reached {name}")
            rows = np.rint(np.asarray(rows, np.float64)).astype(np.int64).reshape(-1)
            if name in self.sums:
                if self.sums[name].shape != sq.shape:
                    raise ValueError(f"imatrix: {name} gave sums of shape {sq.shape}, earlier {self.sums[name].shape}")
                self.sums[name] += sq
                self.rows[name] += rows
            else:
                self.sums[name] = sq.astype(np.float64)
                self.rows[name] = rows

    def imatrix(self, datasets: list[str], chunk_size: int) -> Imatrix:
        """The GGUF form; the chunk count is llama.cpp's: the most rows any weight saw, in whole chunks."""
        if not self.sums:
            raise ValueError("imatrix: no weight matmul was recorded (the model has no blk.* weights in matmuls)")
        return Imatrix({n: s.astype(np.float32) for n, s in sorted(self.sums.items())},
                       {n: r.astype(np.float32) for n, r in sorted(self.rows.items())},
                       list(datasets), int(max(r.max() for r in self.rows.values())) // chunk_size, chunk_size)


def steps(chunk: np.ndarray, batch: int) -> list[tuple[int, np.ndarray]]:
    """(position, tokens) of the native steps a chunk runs in: as few as ``batch`` allows, of equal size
    (so that no step is a sliver that llama.cpp's rule of ``MIN_ROWS`` would drop)."""
    n = chunk.size
    k = -(-n // batch)
    bounds = [n * i // k for i in range(k + 1)]
    return [(a, chunk[a:b]) for a, b in zip(bounds, bounds[1:])]


def collect(path, text: str, n_ctx: int = 512, n_chunks: int | None = None, threads: int | None = None,
            batch: int = 512, process_output: bool = False, ppl: bool = True, dataset: str = "",
            cache_type_k: str = "f16", cache_type_v: str = "f16", max_memory=None, backend: str = "llvm",
            out=None):
    """The importance matrix of the model at ``path`` over ``text`` in chunks of ``n_ctx`` tokens (at most
    ``n_chunks``), ``batch`` tokens per native step, and the running perplexity (unless ``ppl=False``);
    returns (Imatrix, perplexity Estimate or None). ``dataset`` names the text in the file."""
    from ggraph.ir.trace import tree_unflatten
    from ggraph.perplexity import bos_of, chunks, evaluate, text_tokens
    from ggraph.runtime.session import Session
    if isinstance(n_ctx, int) and not isinstance(n_ctx, bool) and n_ctx < MIN_ROWS:
        raise ValueError(f"the chunk size (--ctx) must be at least {MIN_ROWS} tokens: llama.cpp records no "
                         f"matmul of fewer rows, got {n_ctx}")
    session = Session(path, backend=backend, threads=threads, passes="imatrix", ctx=n_ctx, ubatch=batch,
                      max_memory=max_memory, cache_type_k=cache_type_k, cache_type_v=cache_type_v)
    rows = chunks(text_tokens(session.tokenizer, text), n_ctx, n_chunks, bos_of(session.tokenizer))
    prog = session.program(last_only=False)
    sums = Sums(process_output)

    def run_chunk(chunk):
        logits = []
        session.reset()                                    # each chunk starts from zeroed recurrent states
        for at, part in steps(chunk, session.ubatch):
            outs = prog.run_inputs([part, np.int32(at), *session.k_cache, *session.v_cache, *session.states])
            (step_logits, *_), recorded = tree_unflatten(prog.graph.out_tree, outs)
            sums.add(recorded, small=part.size < MIN_ROWS)
            if ppl:
                logits.append(step_logits)
        if not ppl:
            return None
        return logits[0] if len(logits) == 1 else np.concatenate(logits)

    est = evaluate(rows, run_chunk, "imatrix", out)
    return sums.imatrix([dataset] if dataset else [], n_ctx), est
