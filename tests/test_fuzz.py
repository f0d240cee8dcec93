"""Hostile input never crashes, hangs or eats the machine: each case runs in a subprocess with a timeout
and a memory cap, and must end in one clean error line (or a correct run), never a traceback or a signal.

The corpus is made here: lying metadata and tensors (written with ggraph's GGUF writer from a zoo
model), corrupt bytes, bad arguments to every verb, API misuse, damaged compile caches, and
templates that would run forever. ``CLASSES`` names the classes the note reports counts for.
"""
from __future__ import annotations

import os
import random
import resource
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import zoo
from gguf_edit import edited, read
from ggraph.gguf import Typed, write

MEMORY_CAP = 6 << 30                  # the address space a case may take: beyond it is a failure
TIMEOUT = 120


def _cap():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def run(args, env=None, stdin=None, timeout=TIMEOUT, python=False):
    """``ggraph ARGS`` (or ``python -c ARGS[0]``) in a capped subprocess: (exit code, stdout, stderr)."""
    cmd = [sys.executable, "-c", args[0]] if python else [sys.executable, "-m", "ggraph.cli", *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=_cap,
                          env={**os.environ, **(env or {})}, input=stdin)
    return done.returncode, done.stdout, done.stderr


def assert_clean_error(rc, out, err, *expect):
    """Exit 1 with one error line (warnings and progress aside) that says each of ``expect``."""
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("ggraph: warning:")
             and "\r" not in ln]
    assert rc == 1, (rc, out[-500:], err[-2000:])
    assert "Traceback" not in err and len(lines) == 1, err[-2000:]
    for e in expect:
        assert e in lines[0], (e, lines[0])


@pytest.fixture(scope="module")
def base():
    return zoo.cached_model("llama", "q8_0")


@pytest.fixture(scope="module")
def corpus(base, tmp_path_factory):
    """name -> lying file, each made from the base llama model."""
    d = tmp_path_factory.mktemp("fuzz")
    meta, tensors, _ = read(base)
    files = {}

    def lie(name, **kw):
        files[name] = edited(base, d / f"{name}.gguf", **kw)

    lie("block_count_short", keys={"llama.block_count": 1})
    lie("block_count_long", keys={"llama.block_count": 3})
    lie("block_count_huge", keys={"llama.block_count": 2 ** 32 - 1})
    lie("block_count_float", keys={"llama.block_count": Typed(2.0, "f32")})
    lie("embedding_narrow", keys={"llama.embedding_length": 32})
    lie("head_count_zero", keys={"llama.attention.head_count": 0})
    lie("head_count_odd", keys={"llama.attention.head_count": 3})
    lie("head_count_kv_huge", keys={"llama.attention.head_count_kv": 2 ** 20})
    lie("key_length_huge", keys={"llama.attention.key_length": 2 ** 20})
    lie("ffn_length_wrong", keys={"llama.feed_forward_length": 100})
    lie("rope_base_zero", keys={"llama.rope.freq_base": 0.0})
    lie("rope_base_nan", keys={"llama.rope.freq_base": float("nan")})
    lie("epsilon_negative", keys={"llama.attention.layer_norm_rms_epsilon": -1.0})
    lie("rope_dims_odd", keys={"llama.rope.dimension_count": 15})
    lie("rope_scaling_unknown", keys={"llama.rope.scaling.type": "dynamic"})
    lie("rope_factor_negative", keys={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": -4.0})
    lie("rope_attn_factor_nan", keys={"llama.rope.scaling.attn_factor": float("nan")})
    lie("rope_orig_ctx_negative", keys={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                                        "llama.rope.scaling.original_context_length": Typed(-1, "i32")})
    lie("rope_freqs_wrong_shape", tensors={"rope_freqs.weight": np.ones(5, np.float32)})
    tokens = list(meta["tokenizer.ggml.tokens"].value)
    lie("vocab_longer_than_embedding", keys={
        "tokenizer.ggml.tokens": tokens + ["<extra>"],
        "tokenizer.ggml.scores": list(meta["tokenizer.ggml.scores"].value) + [0.0],
        "tokenizer.ggml.token_type": list(meta["tokenizer.ggml.token_type"].value) + [1]})
    data, dtype, (_, width) = tensors["output.weight"]
    lie("output_rows_short", tensors={"output.weight": (data[:10 * dtype.row_bytes(width)], dtype, (10, width))})
    lie("norm_one_element", tensors={"blk.0.attn_norm.weight": np.ones(1, np.float32)})
    lie("missing_ffn_down", tensors={"blk.1.ffn_down.weight": None})
    lie("eos_out_of_range", keys={"tokenizer.ggml.eos_token_id": Typed(10 ** 6, "u32")})
    lie("eog_list_out_of_range", keys={"tokenizer.ggml.eog_token_ids": Typed([2, 10 ** 6], "i32")})
    lie("unknown_arch", rename_arch="mamba")
    lie("array_file_type", keys={"general.file_type": Typed([1, 2], "u32")})
    lie("nan_metadata", keys={"ggraph.fuzz.value": Typed(float("nan"), "f32")})
    raw = base.read_bytes()
    files["truncated_header"] = d / "truncated.gguf"
    files["truncated_header"].write_bytes(raw[:200])
    files["truncated_data"] = d / "truncated_data.gguf"
    files["truncated_data"].write_bytes(raw[:len(raw) // 2])
    flipped = bytearray(raw)
    for i in random.Random(0).sample(range(24, 4000), 40):
        flipped[i] ^= 0xFF
    files["flipped_header"] = d / "flipped.gguf"
    files["flipped_header"].write_bytes(bytes(flipped))
    files["empty"] = d / "empty.gguf"
    files["empty"].write_bytes(b"")
    files["zero_element_tensor"] = d / "zero.gguf"
    write(files["zero_element_tensor"], {"general.architecture": "llama"}, {"t": np.zeros((0,), np.float32)})
    files["fifo"] = d / "fifo.gguf"
    os.mkfifo(files["fifo"])
    return files


LYING = {  # file: what the one error line must say
    "block_count_short": "llama.block_count = 1 but the file has blk.0..blk.1",
    "block_count_long": "llama.block_count = 3 but the file has blk.0..blk.1",
    "block_count_huge": "llama.block_count = 4294967295 but the file has blk.0..blk.1",
    "block_count_float": "llama.block_count = 2.0: must be an integer",
    "embedding_narrow": "llama.embedding_length = 32",
    "head_count_zero": "llama.attention.head_count = 0: must be an integer of at least 1",
    "head_count_odd": "llama.attention.head_count = 3 is not a multiple of",
    "head_count_kv_huge": "llama.attention.head_count = 4 is not a multiple of llama.attention.head_count_kv",
    "key_length_huge": "llama.attention.head_count × key_length = 4 × 1048576",
    "ffn_length_wrong": "llama.feed_forward_length = 100",
    "rope_base_zero": "llama.rope.freq_base = 0.0: must be a finite number greater than 0",
    "rope_base_nan": "llama.rope.freq_base = nan: must be a finite number greater than 0",
    "epsilon_negative": "llama.attention.layer_norm_rms_epsilon = -1.0",
    "rope_dims_odd": "llama.rope.dimension_count = 15 must be even",
    "rope_scaling_unknown": "llama.rope.scaling.type 'dynamic' is not supported (none, linear, yarn, longrope)",
    "rope_factor_negative": "llama.rope.scaling.factor = -4.0",
    "rope_attn_factor_nan": "llama.rope.scaling.attn_factor = nan",
    "rope_orig_ctx_negative": "llama.rope.scaling.original_context_length = -1: must be an integer of at least 0",
    "rope_freqs_wrong_shape": "tensor rope_freqs.weight is [5], but llama.rope.dimension_count = 16 halved say [8]",
    "vocab_longer_than_embedding": "tokenizer.ggml.tokens has 32001 entries but token_embd.weight has 32000 rows",
    "output_rows_short": "tensor output.weight is [10,64], but the vocabulary of 32000",
    "norm_one_element": "tensor blk.0.attn_norm.weight is [1], but llama.embedding_length = 64 say [64]",
    "missing_ffn_down": "tensor blk.1.ffn_down.weight is missing",
    "eos_out_of_range": "tokenizer.ggml.eos_token_id = 1000000 is outside the vocabulary",
    "eog_list_out_of_range": "tokenizer.ggml.eog_token_ids holds 1000000, outside the vocabulary",
    "unknown_arch": "unsupported architecture 'mamba'",
    "truncated_header": "truncated.gguf",
    "truncated_data": "truncated_data.gguf",
    "flipped_header": "flipped.gguf",
    "empty": "the file is empty",
    "fifo": "not a regular file",
}


@pytest.mark.parametrize("name", sorted(LYING))
def test_lying_and_corrupt_files(corpus, name):
    for verb in (["run", "-p", "hi", "-n", 2, "--ctx", 32], ["dump", "--layer", 0, "--ctx", 32]):
        rc, out, err = run([verb[0], corpus[name], *verb[1:]], timeout=60)
        assert_clean_error(rc, out, err, LYING[name])


# Lies an independent hostile corpus found after the first fuzz suite: a block count that sized gemma's
# per-layer window flags (5 GB before any check), a local rope base of 0 and rope factors of 0 or NaN (NaN
# logits, exit 0), a string softcap read as a number, a scalar EOG list (a leaked TypeError), token types
# outside llama.cpp's enum (empty text, exit 0), a base so small its frequencies overflow, yarn over a base
# of 1, integer-typed weights and f16 rope factors (op errors that named no tensor: "dequant: i32[64,64] is not
# a weight type", "div: dtypes differ").
MORE_LIES = {  # name: (base arch or None for the q8_0 llama, edits, what the one error line must say)
    "gemma2_block_count_huge": ("gemma2", dict(keys={"gemma2.block_count": 2 ** 32 - 1}),
                                "gemma2.block_count = 4294967295 but the file has blk.0..blk.3"),
    "gemma3_block_count_huge": ("gemma3", dict(keys={"gemma3.block_count": Typed(2 ** 40, "u64")}),
                                "gemma3.block_count = 1099511627776 but the file has blk.0..blk.5"),
    "gemma2_local_base_zero": ("gemma2", dict(keys={"gemma2.rope.freq_base_swa": Typed(0.0, "f32")}),
                               "gemma2.rope.freq_base_swa = 0.0: must be a finite number greater than 0"),
    "gemma3_local_base_zero": ("gemma3", dict(keys={"gemma3.rope.freq_base_swa": Typed(0.0, "f32")}),
                               "gemma3.rope.freq_base_swa = 0.0: must be a finite number greater than 0"),
    "gemma2_softcap_string": ("gemma2", dict(keys={"gemma2.final_logit_softcapping": Typed("30", "str")}),
                              "gemma2.final_logit_softcapping = '30': must be a finite number greater than 0"),
    "eog_scalar": (None, dict(keys={"tokenizer.ggml.eog_token_ids": Typed(2, "u32")}),
                   "tokenizer.ggml.eog_token_ids = 2: must be an array of token ids"),
    "token_type_99": (None, dict(keys={"tokenizer.ggml.token_type": Typed([99] * 32000, "i32")}),
                      "tokenizer.ggml.token_type holds 99, which is not a token type"),
    "rope_freqs_zero": (None, dict(tensors={"rope_freqs.weight": np.zeros(8, np.float32)}),
                        "tensor rope_freqs.weight holds 0.0: rope frequency factors must be finite"),
    "rope_freqs_nan": (None, dict(tensors={"rope_freqs.weight": np.full(8, np.nan, np.float32)}),
                       "tensor rope_freqs.weight holds nan"),
    "rope_base_tiny": (None, dict(keys={"llama.rope.freq_base": 1e-45}),
                       "llama.rope.freq_base = 1.401298464324817e-45: too small, its rope frequencies overflow"),
    "yarn_over_base_one": (None, dict(keys={"llama.rope.freq_base": 1.0, "llama.rope.scaling.type": Typed("yarn", "str"),
                                            "llama.rope.scaling.factor": Typed(4.0, "f32"),
                                            "llama.rope.scaling.original_context_length": Typed(32, "u32")}),
                           "llama.rope.freq_base = 1.0: yarn scaling needs a rope base other than 1"),
    "integer_weight": (None, dict(tensors={"blk.0.attn_norm.weight": np.ones(64, np.int8)}),
                       "tensor blk.0.attn_norm.weight is i8: the llama decoder reads float or quantised weights"),
    "rope_freqs_f16": (None, dict(tensors={"rope_freqs.weight": np.ones(8, np.float16)}),
                       "tensor rope_freqs.weight is f16: rope frequency factors must be f32"),
}


@pytest.fixture(scope="module")
def more_lies(base, tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz-more")
    return {name: edited(zoo.cached_model(arch, "f32") if arch else base, d / f"{name}.gguf", **edits)
            for name, (arch, edits, _) in MORE_LIES.items()}


@pytest.mark.parametrize("name", sorted(MORE_LIES))
def test_more_lying_files(more_lies, name):
    for verb in (["run", "-p", "hi", "-n", 2, "--ctx", 32], ["dump", "--layer", 0, "--ctx", 32]):
        rc, out, err = run([verb[0], more_lies[name], *verb[1:]], timeout=60)
        assert_clean_error(rc, out, err, MORE_LIES[name][2])


def test_nan_logits_are_an_error_not_empty_text(base, tmp_path):
    """NaN weights (a damaged file, or a flipped bit in an f16 tensor) gave NaN logits, which sampled to
    token 0 and printed nothing with exit 0."""
    model = edited(base, tmp_path / "nan.gguf", tensors={"output_norm.weight": np.full(64, np.nan, np.float32)})
    rc, out, err = run(["run", model, "-p", "hi", "-n", 2, "--ctx", 32])
    assert_clean_error(rc, out, err, "the model's logits are not finite (NaN or infinite) at generated token 0")


def test_files_differing_in_an_unused_tensor_do_not_share_a_program(base, tmp_path):
    """The program cache was keyed by the graph's signature, which leaves tensor names out: a file with an
    extra tensor loaded the program cached for another file's names (KeyError, or 'Var#27:f32[4]')."""
    env = {"GGRAPH_CACHE": str(tmp_path / "cache")}
    files = [base, edited(base, tmp_path / "a.gguf", tensors={"extra.a": np.ones(4, np.float32)}),
             edited(base, tmp_path / "b.gguf", tensors={"extra.b": np.ones(4, np.float32)})]
    texts = []
    for f in files + files[::-1]:
        rc, out, err = run(["run", f, "-p", "Hello", "-n", 4, "--temp", 0, "--ctx", 32], env=env)
        assert rc == 0 and "Traceback" not in err, (f, err[-1000:])
        texts.append(out)
    assert len(set(texts)) == 1, texts


def test_quantize_refuses_a_lying_block_count(corpus, tmp_path):
    """quantize's mix counts layers (which attn_v and ffn_down get more bits): a block count that lies moved
    it silently, and the output lied the same way."""
    rc, out, err = run(["quantize", corpus["block_count_long"], tmp_path / "out.gguf", "Q8_0"])
    assert_clean_error(rc, out, err, "llama.block_count = 3 but the file has blk.0..blk.1")
    assert not (tmp_path / "out.gguf").exists()

def test_inspect_survives_odd_but_valid_files(corpus):
    for name in ("zero_element_tensor", "array_file_type", "nan_metadata"):
        rc, out, err = run(["inspect", corpus[name]])
        assert rc == 0 and "Traceback" not in err, (name, err)
        rc, out, err = run(["inspect", "--json", corpus[name]])
        assert rc == 0 and "NaN" not in out.replace('"nan"', "") and "Infinity" not in out, (name, out[-300:])


ARGS = {  # argv after the model: what the one error line must say
    "threads_1000": (["run", "-p", "hi", "-t", 1000], "threads must be a whole number in 1.."),
    "threads_zero": (["run", "-p", "hi", "-t", 0], "threads must be a whole number in 1.."),
    "temp_nan": (["run", "-p", "hi", "--temp", "nan"], "temperature must be a finite number"),
    "penalty_nan": (["run", "-p", "hi", "--repeat-penalty", "nan"], "repeat_penalty must be a finite number"),
    "top_p_two": (["run", "-p", "hi", "--top-p", 2], "top_p must be in (0, 1]"),
    "n_negative": (["run", "-p", "hi", "-n", -5], "--n-predict must be >= -1"),
    "ctx_zero": (["run", "-p", "hi", "--ctx", 0], "ctx must be a positive whole number"),
    "ctx_huge": (["run", "-p", "hi", "--ctx", 10 ** 9], "the KV cache (ctx 1000000000"),
    "max_memory_tiny": (["run", "-p", "hi", "--max-memory", "1K"], "more than the --max-memory limit of 1.00 KiB"),
    "max_memory_junk": (["run", "-p", "hi", "--max-memory", "lots"], "memory size 'lots'"),
    "no_pass_typo": (["run", "-p", "hi", "--no-pass", "fuse_everything"], "unknown pass(es) fuse_everything"),
    "passes_typo": (["run", "-p", "hi", "--passes", "dce,fuze"], "unknown pass(es) fuze"),
    "bench_repeats_zero": (["bench", "--repeats", 0], "--repeats must be at least 1"),
    "bench_pp_junk": (["bench", "-p", "x"], "--pp must be a comma-separated list of integers"),
    "bench_threads_huge": (["bench", "-t", "1,999"], "threads must be a whole number in 1.."),
    "dump_layer_999": (["dump", "--layer", 999], "--layer 999: the model has layers 0..1"),
    "dump_png_no_file": (["dump", "--format", "png"], "give -o FILE"),
    "diff_bad_tokens": (["diff", "--tokens", "1,x"], "--tokens must be comma-separated integers"),
    "diff_tokens_range": (["diff", "--tokens", "5,99999999"], "need token ids in [0, 32000)"),
    "max_memory_overflow": (["run", "-p", "hi", "--max-memory", "1e400"], "memory size '1e400'"),
    "max_memory_half_byte": (["run", "-p", "hi", "--max-memory", "0.5"], "that is less than one byte"),
    "bench_pp_empty_item": (["bench", "-p", "1,,2"], "--pp must be a comma-separated list of integers"),
    "bench_pp_empty": (["bench", "-p", ""], "--pp must be a comma-separated list of integers"),
    "diff_tokens_empty": (["diff", "--tokens", ""], "--tokens must be comma-separated integers"),
    "diff_tokens_empty_item": (["diff", "--tokens", "1,,2"], "--tokens must be comma-separated integers"),
    "diff_tokens_beyond_memory": (["diff", "--tokens", ",".join(["5"] * 8000)], "diff of 8000 tokens"),
}


@pytest.mark.parametrize("name", sorted(ARGS))
def test_bad_arguments(base, name):
    argv, expect = ARGS[name]
    rc, out, err = run([argv[0], base, *argv[1:]], timeout=60)
    assert_clean_error(rc, out, err, expect)
    assert out == "", "nothing is printed before the arguments are checked"


def test_missing_and_odd_paths(tmp_path):
    for path, expect in ((tmp_path / "nope.gguf", "No such file"), (tmp_path, "not a regular file")):
        rc, out, err = run(["run", path, "-p", "hi"])
        assert_clean_error(rc, out, err, expect)
    rc, out, err = run(["run", "--plugin", tmp_path / "nope.py", "--demo", "-p", "hi"])
    assert_clean_error(rc, out, err, "no such file")


def test_fifo_inputs_and_exiting_plugins_are_one_line(base, tmp_path):
    """--grammar, --json-schema or quantize --imatrix naming a FIFO blocked forever; a plugin calling
    sys.exit() ended ggraph silently with its code."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for flag in ("--grammar", "--json-schema"):
        rc, out, err = run(["run", base, "-p", "hi", flag, fifo], timeout=60)
        assert_clean_error(rc, out, err, "not a regular file")
    rc, out, err = run(["quantize", base, tmp_path / "q.gguf", "IQ4_XS", "--imatrix", fifo], timeout=60)
    assert_clean_error(rc, out, err, "not a regular file")
    plugin = tmp_path / "exits.py"
    plugin.write_text("import sys\nsys.exit(3)\n")
    rc, out, err = run(["run", base, "-p", "hi", "--plugin", plugin])
    assert_clean_error(rc, out, err, "failed to import: SystemExit: 3")


def test_dump_to_a_fifo_waits_for_no_one(base, tmp_path):
    """dump -o naming a FIFO that no process reads blocked forever; with a reader it still streams there."""
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    rc, out, err = run(["dump", base, "--layer", 0, "--ctx", 32, "-o", fifo], timeout=60)
    assert_clean_error(rc, out, err, "a FIFO that no process reads")
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    time.sleep(0.5)                                       # cat waits in open() for a writer
    rc, out, err = run(["dump", base, "--layer", 0, "--ctx", 32, "-o", fifo], timeout=60)
    text = reader.communicate(timeout=60)[0].decode()
    assert rc == 0 and "blk.0" in text, (rc, err[-500:], text[:200])

def test_an_unbudgeted_allocation_failure_is_one_line():
    snippet = textwrap.dedent("""
        import sys
        import ggraph.cli.inspect as verb
        verb.cmd_inspect = lambda args: (_ for _ in ()).throw(MemoryError("no room"))
        import ggraph.cli
        sys.exit(ggraph.cli.main(["inspect", "x.gguf"]))
    """)
    rc, out, err = run([snippet], python=True)
    assert_clean_error(rc, out, err, "ggraph inspect: error: out of memory: no room")


def test_the_memory_budget_sees_an_address_space_limit():
    """A process under ulimit -v (or a cgroup) has less than MemAvailable: the budget says so."""
    rc, out, err = run(["from ggraph import memory; print(memory.available() < 6 << 30)"], python=True)
    assert rc == 0 and out.strip() == "True", (out, err)


API = {  # python snippet (with `s`, a Session of the base model, and np): the exception it must raise
    "n_past_is_read_only": ("s.n_past = -1000", "AttributeError"),
    "negative_P": ("s.program(True).run_inputs([np.array([2], np.int32), -5, *s.k_cache, *s.v_cache])",
                   "ValueError: input P = -5: a dim cannot be negative"),
    "P_beyond_ctx": ("s.program(True).run_inputs([np.array([2, 3], np.int32), 31, *s.k_cache, *s.v_cache])",
                     "32 rows"),
    "P_wraps_i32": ("s.program(True).run_inputs([np.array([2], np.int32), 2**40, *s.k_cache, *s.v_cache])",
                    "does not fit i32"),
    "float_ids": ("s.step([1.7])", "TypeError: token ids must be integers"),
    "string_ids": ("s.step(['2'])", "TypeError: token ids must be integers"),
    "wrapping_ids": ("s.step([np.int64(2**32 + 1)])", "token id 4294967297 is outside the vocabulary"),
    "truncate_beyond": ("s.step([2, 3]); s.truncate(5)", "truncate: n must be a whole number in 0..2"),
    "context_full": ("s.step(list(range(2, 40)))", "ContextFullError: context full"),
    "cache_of_wrong_shape": ("s.program(True).run_inputs([np.array([2], np.int32), 0, "
                             "*[np.zeros((8, 2, 16), np.float32)] * 4])", "expected shape"),
    "read_only_cache": ("kc = [c.copy() for c in s.k_cache]; [c.setflags(write=False) for c in kc]; "
                        "s.program(True).run_inputs([np.array([2], np.int32), 0, *kc, *s.v_cache])",
                        "is updated in place, but the array given is read-only"),
    # a cache the last step took (and checked) is checked again once its flags or shape change
    "cache_turned_read_only": ("p = s.program(True); kc = [c.copy() for c in s.k_cache]; "
                               "p.run_inputs([np.array([2], np.int32), 0, *kc, *s.v_cache]); kc[0].setflags(write=False); "
                               "p.run_inputs([np.array([3], np.int32), 1, *kc, *s.v_cache])",
                               "is updated in place, but the array given is read-only"),
    "cache_reshaped_in_place": ("p = s.program(True); kc = [c.copy() for c in s.k_cache]; "
                                "p.run_inputs([np.array([2], np.int32), 0, *kc, *s.v_cache]); kc[0].shape = (-1,); "
                                "p.run_inputs([np.array([3], np.int32), 1, *kc, *s.v_cache])", "expected shape"),
    "converted_cache": ("s.program(True).run_inputs([np.array([2], np.int32), 0, "
                        "*[c.astype(np.float64) for c in s.k_cache], *s.v_cache])",
                        "is updated in place: give an array of float16"),
    "none_ids": ("s.step(None)", "TypeError: token ids must be an integer or a sequence of integers, got NoneType"),
    "none_prompt": ("s.generate(None)", "TypeError: token ids must be an integer or a sequence of integers"),
    "stop_of_ints": ("s.generate('hi', max_tokens=2, stop=[1])", "TypeError: stop must be a string or a list of strings"),
    "grammar_not_a_grammar": ("s.generate('hi', grammar='root ::= x')",
                              "TypeError: grammar must be a ggraph.runtime.grammar.Grammar, got str"),
    "embed_none": ("s.embed(None)", "TypeError: texts must be a string"),
    "decode_strings": ("s.tokenizer.decode(['a'])", "TypeError: token ids must be integers, got str 'a'"),
    "token_text_negative": ("s.tokenizer.token_text(-1)", "token id -1 is outside the vocabulary"),
    "message_not_a_dict": ("s.chat([None], max_tokens=2)", "TypeError: message 0 must be a dict with a string 'role'"),
    "zero_tokens": ("s.program(True).run_inputs([np.zeros(0, np.int32), 0, *s.k_cache, *s.v_cache])",
                    "input tokens: T = 0; a step takes at least one row"),
    "prompt_too_long_to_encode": ("s.generate('a' * 10 ** 7, max_tokens=2)",
                                  "ContextFullError: context full: the prompt is 10000000 characters"),
}


@pytest.mark.parametrize("backend", ["llvm", "numpy"])
@pytest.mark.parametrize("name", sorted(API))
def test_api_misuse(base, name, backend):
    code, expect = API[name]
    snippet = textwrap.dedent(f"""
        import numpy as np
        from ggraph.runtime import Session
        s = Session({str(base)!r}, backend={backend!r}, ctx=32)
        try:
            {code}
        except Exception as e:
            print(f"{{type(e).__name__}}: {{e}}")
        else:
            print("no error")
        s.reset(); print("still runs:", s.step([2, 3]).shape)
    """)
    rc, out, err = run([snippet], python=True, timeout=60)
    assert rc == 0 and "Traceback" not in err, (rc, err[-2000:])
    assert expect in out and "still runs: (1, 32000)" in out, out


def test_session_arguments_are_checked(base):
    """passes=123 leaked "'int' object is not iterable"; disabled=['nope'] (or the string 'dce', read as
    'd', 'c', 'e') was ignored; Session(None) gave open()'s message; stop='ab' meant 'a' or 'b'."""
    snippet = textwrap.dedent(f"""
        from ggraph.runtime import Session
        from ggraph.runtime.session import stop_strings
        print("stops:", stop_strings(None), stop_strings("ab"))
        for kw in (dict(passes=123), dict(passes="nope"), dict(disabled=["nope"]), dict(disabled="dce")):
            try:
                Session({str(base)!r}, ctx=32, **kw)
            except Exception as e:
                print(f"{{type(e).__name__}}: {{e}}")
        try:
            Session(None)
        except Exception as e:
            print(f"{{type(e).__name__}}: {{e}}")
    """)
    rc, out, err = run([snippet], python=True, timeout=60)
    assert rc == 0 and "Traceback" not in err, err[-2000:]
    for expect in ("stops: () ('ab',)", "PipelineError: passes must be a pipeline name",
                   "PipelineError: passes: unknown pipeline or pass 'nope'", "PipelineError: disabled: unknown pass(es) nope",
                   "PipelineError: disabled must be a list of pass names",
                   "TypeError: a model is a GGUF file's path (str or os.PathLike), got NoneType"):
        assert expect in out, (expect, out)


def _run_text(env):
    return run(["run", zoo.cached_model("llama", "q8_0"), "-p", "Hello", "-n", 6, "--temp", 0, "--ctx", 32], env=env)


def test_damaged_compile_caches_heal(tmp_path):
    env = {"GGRAPH_CACHE": str(tmp_path / "cache")}
    rc, want, err = _run_text(env)
    assert rc == 0, err
    entries = sorted((tmp_path / "cache").rglob("*.program")) + sorted((tmp_path / "cache").rglob("*.kernel"))
    assert len(entries) > 3
    rng = random.Random(1)
    damages = []
    for path in entries:
        data = bytearray(path.read_bytes())
        for how in ("flip", "zero", "truncate"):
            bad = bytearray(data)
            if how == "flip":
                for i in rng.sample(range(len(bad)), 8):
                    bad[i] ^= 1 << rng.randrange(8)
            elif how == "zero":
                bad[40:] = bytes(len(bad) - 40)
            else:
                bad = bad[:len(bad) // 3]
            damages.append((path, how, bytes(bad), bytes(data)))
    for path, how, bad, good in rng.sample(damages, 12):
        path.write_bytes(bad)
        rc, out, err = _run_text(env)
        assert rc == 0 and out == want and "Traceback" not in err, (path.name, how, err[-1500:])
        assert "is damaged" in err, (path.name, how, err)
        rc, out, err = _run_text(env)                      # healed: the next run is quiet
        assert rc == 0 and out == want and "warning" not in err, (path.name, how, err)


def test_odd_cache_entries_heal(tmp_path):
    """A FIFO at an entry's name blocked the run forever; a folder there, or a file where kernels/ belongs,
    warned on every run and never healed; another entry's intact bytes copied over a program's or a linked
    library's name passed the digest and ran the wrong code (wrong text; SIGABRT for a library)."""
    cache = tmp_path / "cache"
    env = {"GGRAPH_CACHE": str(cache)}
    rc, want, err = _run_text(env)
    assert rc == 0, err
    (prog,), libs = list(cache.glob("*.program")), list(cache.glob("libs/*.so"))
    rc, _, err = run(["run", zoo.cached_model("llama", "f32"), "-p", "Hello", "-n", 2, "--ctx", 32], env=env)
    assert rc == 0, err                                       # another program (and library) in the cache
    (other,) = [p for p in cache.glob("*.program") if p != prog]
    other_libs = [p for p in cache.glob("libs/*.so") if p not in libs]

    def swap(a, b):
        x, y = a.read_bytes(), b.read_bytes()
        a.write_bytes(y)
        b.write_bytes(x)
    damages = {"fifo": lambda: (prog.unlink(), os.mkfifo(prog)), "folder": lambda: (prog.unlink(), prog.mkdir()),
               "symlink loop": lambda: (prog.unlink(), prog.symlink_to(prog)),
               "kernels/ is a file": lambda: (shutil.rmtree(cache / "kernels"), (cache / "kernels").write_text("x")),
               "programs swapped": lambda: swap(prog, other)}
    if libs and other_libs:                                   # the system linker made them
        damages["libraries swapped"] = lambda: swap(libs[0], other_libs[0])
    for how, damage in damages.items():
        damage()
        rc, out, err = _run_text(env)
        assert rc == 0 and out == want and "Traceback" not in err, (how, rc, err[-1500:])
        rc, out, err = _run_text(env)                          # healed: the next run is quiet
        assert rc == 0 and out == want and "warning" not in err, (how, err)


BATCH_API = {  # python snippet (with `b`, a Batch of 2 slots of 32 rows, and np): what it must print
    "n_past_is_read_only_too": ("b.n_past[0] = -1000", "TypeError: 'tuple' object does not support item assignment"),
    "n_past_is_read_only": ("b.n_past = None", "AttributeError"),
    "slot_out_of_range": ("b.program().run_inputs([t, np.array([7], np.int32), np.array([0], np.int32), p, *kv])",
                          "holds sequence slots, 0..1, got 7"),
    "slot_negative": ("b.program().run_inputs([t, np.array([-1], np.int32), np.array([0], np.int32), p, *kv])",
                      "holds sequence slots, 0..1, got -1"),
    "position_negative": ("b.program().run_inputs([t, np.array([0], np.int32), np.array([-100000], np.int32), p, *kv])",
                          "holds positions in a slot of 32 rows, 0..31, got -100000"),
    "position_past_the_slot": ("b.program().run_inputs([t, np.array([0], np.int32), np.array([32], np.int32), p, *kv])",
                               "holds positions in a slot of 32 rows, 0..31, got 32"),
}


@pytest.mark.parametrize("name", sorted(BATCH_API))
def test_batch_misuse(base, name):
    """Batch.n_past was a public list: b.n_past[0] = -1000 wrote the cache out of bounds (SIGSEGV), as did a
    slot or position out of range given to the batch program (or, at the slot's end, wrote the next slot)."""
    code, expect = BATCH_API[name]
    snippet = textwrap.dedent(f"""
        import numpy as np
        from ggraph.runtime.batch import Batch
        b = Batch({str(base)!r}, slots=2, ctx=32, threads=1)
        t, p, kv = np.array([2], np.int32), np.array([0], np.int32), [*b.k_cache, *b.v_cache]
        try:
            {code}
        except Exception as e:
            print(f"{{type(e).__name__}}: {{e}}")
        print("still runs:", b.step({{0: [2, 3]}})[0].shape)
    """)
    rc, out, err = run([snippet], python=True, timeout=60)
    assert rc == 0 and "Traceback" not in err, (rc, err[-2000:])
    assert expect in out and "still runs: (32000,)" in out, out


def test_an_unwritable_cache_compiles_in_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    rc, out, err = _run_text({"GGRAPH_CACHE": str(blocker / "cache")})
    assert rc == 0 and "Hello" in out and "Traceback" not in err
    assert "cannot write the compile cache" in err and err.count("cannot write the compile cache") == 1


def test_a_cache_path_too_long_is_one_warning(tmp_path):
    """Past PATH_MAX every entry's read failed on its own: one warning per entry, then one for the write."""
    rc, out, err = _run_text({"GGRAPH_CACHE": str(tmp_path / "/".join(["d" * 200] * 25))})
    assert rc == 0 and "Hello" in out and "Traceback" not in err
    assert err.count("warning") == 1 and "File name too long" in err, err[-1000:]


def test_ctrl_c_in_a_compile_worker_is_no_traceback():
    """Ctrl-C signals the whole process group: a compile worker waiting for work printed a KeyboardInterrupt
    traceback (seen when a server compiling was stopped). Workers leave Ctrl-C to their parent."""
    import pickle
    import signal
    from ggraph.backends.llvm.target import host_target
    proc = subprocess.Popen([sys.executable, "-m", "ggraph.backends.llvm.compile_worker"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(pickle.dumps(host_target()))
    proc.stdin.flush()
    time.sleep(1.0)                                       # past the import, waiting for a job
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    _, err = proc.communicate(b"", timeout=60)            # then the parent closes its stdin
    assert proc.returncode == 0 and b"Traceback" not in err, err.decode()[-1000:]

def test_a_hostile_chat_template_is_stopped(base, tmp_path):
    model = edited(base, tmp_path / "chat.gguf", keys={
        "tokenizer.chat_template": Typed("{% for i in range(10**6) %}{% for j in range(10**6) %}x{% endfor %}"
                                         "{% endfor %}", "str")})
    rc, out, err = run(["run", model, "-p", "hi", "--chat", "-n", 2, "--ctx", 32], timeout=60)
    assert_clean_error(rc, out, err, "chat template")

