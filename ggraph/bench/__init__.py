"""Benchmarks: ``measure.py`` times prefill and decode (ggraph and llama.cpp side by side),
rooflines and per-op profiles; ``plot.py`` draws them."""
from ggraph.bench.measure import (Result, bench_ggraph, bench_llama_cpp, op_kind, machine_peaks,
                                  profile_ggraph, profile_table, prompt_tokens, stream_bandwidth)

__all__ = ["Result", "bench_ggraph", "bench_llama_cpp", "op_kind", "machine_peaks", "profile_ggraph",
           "profile_table", "prompt_tokens", "stream_bandwidth"]
