"""GGUF files and their block formats.

    reader.py       GGUFFile: a strict zero-copy reader over mmap (split models too)
    writer.py       write(path, metadata, tensors), Typed values, Deferred tensors, typed_metadata(f)
    format.py       the constants and value types both share, and GGUFError
    quants.py       numpy dequantise and quantise for every block type: the reference for kernels
    quantize_k.py   the searched quantisers: k-quants, IQ4_*, imatrix-weighted Q4_0..Q5_1
    block_bits.py   bit layouts quants.py and quantize_k.py share: IQ4 levels, k-quant scales, nibbles
"""
from ggraph.gguf.format import GGUFError
from ggraph.gguf.reader import GGUFFile, StringArray, TensorInfo
from ggraph.gguf.writer import Deferred, Typed, typed_metadata, write

__all__ = ["GGUFError", "GGUFFile", "StringArray", "TensorInfo", "Typed", "Deferred", "typed_metadata", "write"]
