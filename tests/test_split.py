"""``ggraph split`` / ``ggraph merge``: llama-gguf-split's files byte for byte, loadable by ggraph and llama.cpp.

The fast tests check the format (names, split keys and their types, which tensors go where, the layout)
and the errors; the slow ones compare every file with llama-gguf-split's and the logits with llama.cpp's.
"""
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import zoo
from ggraph.cli import main
from ggraph.gguf import GGUFError, GGUFFile, write
from ggraph.split import parse_size, split_path

SIZE_MODEL = dict(arch="llama", mix="f16", n_ff=4096)   # 12 MB: 4 MB embeddings and output, 0.5 MB FFN matrices


def ggraph(*args) -> int:
    return main([str(a) for a in args])


def files(prefix, count: int) -> list[Path]:
    return [Path(split_path(str(prefix), no, count)) for no in range(count)]


def header(path) -> tuple[dict, dict]:
    """One file's own metadata {key: (value, type name)} and tensors {name: (type id, ne)}, siblings not joined."""
    kv, tensors = zoo.read_gguf(path)
    types = {k: v[1].name.lower() + (f"[{v[2].name.lower()}]" if v[2] is not None else "") for k, v in kv.items()}
    return {k: (v[0], types[k]) for k, v in kv.items()}, tensors


def tensor_bytes(path) -> dict[str, bytes]:
    with GGUFFile(path) as f:
        return {n: bytes(t.data) for n, t in f.tensors.items()}


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".partial"))


@pytest.fixture(scope="module")
def model():
    return zoo.cached_model("llama", "f32")


@pytest.fixture(scope="module")
def size_model():
    return zoo.cached_model(SIZE_MODEL["arch"], SIZE_MODEL["mix"], n_ff=SIZE_MODEL["n_ff"])


@pytest.fixture(scope="module")
def quantized_model():
    return zoo.cached_model("llama", "q4_k_m", **zoo.K_QUANT_DIMS)


# -- the format ----------------------------------------------------------------------------------------

def test_split_by_count_names_keys_and_placement(model, tmp_path):
    """8 tensors a file: 21 tensors make 3 files; the first carries all the metadata, every file the split keys."""
    assert ggraph("split", model, tmp_path / "m", "--max-tensors", 8) == 0
    paths = files(tmp_path / "m", 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in paths]
    source, source_tensors = header(model)
    kv = [header(p)[0] for p in paths]
    split_keys = {"split.no": "uint16", "split.tensors.count": "int32", "split.count": "uint16"}
    assert list(kv[0]) == list(source) + list(split_keys)      # the input's order, then the three keys
    assert {k: v for k, v in kv[0].items() if k in source} == source
    for no, meta in enumerate(kv):
        assert {k: t for k, (_, t) in meta.items() if k in split_keys} == split_keys
        assert (meta["split.no"][0], meta["split.count"][0], meta["split.tensors.count"][0]) == (no, 3, 21)
        if no:
            assert list(meta) == list(split_keys)
    names = [list(header(p)[1]) for p in paths]
    assert [len(n) for n in names] == [8, 8, 5] and sum(names, []) == list(source_tensors)


def test_split_model_loads_whole_in_ggraph(model, tmp_path):
    assert ggraph("split", model, tmp_path / "m", "--max-tensors", 10) == 0
    with GGUFFile(files(tmp_path / "m", 3)[0]) as f, GGUFFile(model) as whole:
        assert len(f.paths) == 3 and list(f.tensors) == list(whole.tensors)
        assert list(f.metadata_types.items())[:-3] == list(whole.metadata_types.items())
    assert tensor_bytes(files(tmp_path / "m", 3)[0]) == tensor_bytes(model)


def test_split_by_size_fills_each_file_up_to_the_limit(size_model, tmp_path):
    """A new file starts when the tensors' bytes, each padded to 32, would pass 5 MB (= 5000000 bytes)."""
    assert ggraph("split", size_model, tmp_path / "s", "--max-size", "5M") == 0
    paths = files(tmp_path / "s", 3)
    with GGUFFile(size_model) as whole:
        sizes = {n: -(-t.nbytes // 32) * 32 for n, t in whole.tensors.items()}
    per_file = [[sizes[n] for n in header(p)[1]] for p in paths]
    assert [len(f) for f in per_file] == [2, 8, 11]
    for this, following in zip(per_file, per_file[1:]):
        assert sum(this) <= 5_000_000 < sum(this) + following[0]
    assert tensor_bytes(paths[0]) == tensor_bytes(size_model)


def test_merge_gives_the_split_metadata_and_every_tensor(model, tmp_path):
    """The merged file is the input plus split.no = 0, split.tensors.count and split.count = 0, as gguf-split's."""
    assert ggraph("split", model, tmp_path / "m", "--max-tensors", 8) == 0
    assert ggraph("merge", files(tmp_path / "m", 3)[0], tmp_path / "merged.gguf") == 0
    kv, tensors = header(tmp_path / "merged.gguf")
    source, source_tensors = header(model)
    assert list(kv) == list(source) + ["split.no", "split.tensors.count", "split.count"]
    assert (kv["split.no"], kv["split.tensors.count"], kv["split.count"]) == ((0, "uint16"), (21, "int32"),
                                                                             (0, "uint16"))
    assert tensors == source_tensors and tensor_bytes(tmp_path / "merged.gguf") == tensor_bytes(model)


def test_split_of_a_split_model_equals_split_of_its_merge(model, tmp_path):
    """An input that is itself split is read whole, so re-splitting it is splitting the merged model."""
    assert ggraph("split", model, tmp_path / "a", "--max-tensors", 8) == 0
    assert ggraph("merge", files(tmp_path / "a", 3)[0], tmp_path / "merged.gguf") == 0
    assert ggraph("split", files(tmp_path / "a", 3)[0], tmp_path / "b", "--max-tensors", 5) == 0
    assert ggraph("split", tmp_path / "merged.gguf", tmp_path / "c", "--max-tensors", 5) == 0
    for b, c in zip(files(tmp_path / "b", 5), files(tmp_path / "c", 5)):
        assert b.read_bytes() == c.read_bytes()
    assert ggraph("merge", files(tmp_path / "c", 5)[0], tmp_path / "again.gguf") == 0
    assert (tmp_path / "again.gguf").read_bytes() == (tmp_path / "merged.gguf").read_bytes()


def test_no_tensor_first_split_puts_only_metadata_first(model, tmp_path):
    assert ggraph("split", model, tmp_path / "m", "--max-tensors", 16, "--no-tensor-first-split") == 0
    paths = files(tmp_path / "m", 3)
    assert [len(header(p)[1]) for p in paths] == [0, 16, 5]
    assert tensor_bytes(paths[0]) == tensor_bytes(model)


def tiny_file(path, sizes, alignment=32, shapes=None) -> Path:
    """A GGUF file of f32 tensors t0, t1, ... of the given element counts (or numpy shapes)."""
    shapes = shapes or [(n,) for n in sizes]
    rng = np.random.default_rng(0)
    write(path, {"general.architecture": "llama", "general.name": "tiny"},
          {f"t{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}, alignment=alignment)
    return path


def test_a_tensor_larger_than_the_limit_gets_a_file_of_its_own(tmp_path, capsys):
    """As gguf-split does; ggraph also does so for the first tensor, where gguf-split stops with an error."""
    src = tiny_file(tmp_path / "t.gguf", [16, 300_000, 16, 16, 400_000])
    assert ggraph("split", src, tmp_path / "a", "--max-size", "1M") == 0
    assert [list(header(p)[1]) for p in files(tmp_path / "a", 4)] == [["t0"], ["t1"], ["t2", "t3"], ["t4"]]
    assert "2 tensor(s) are larger than the maximum size of 1000000 bytes: t1 (1.14 MiB), t4" in capsys.readouterr().err
    first_big = tiny_file(tmp_path / "u.gguf", [300_000, 16])
    assert ggraph("split", first_big, tmp_path / "b", "--max-size", "1M") == 0
    assert [list(header(p)[1]) for p in files(tmp_path / "b", 2)] == [["t0"], ["t1"]]


def test_tensor_infos_keep_dims_up_to_the_last_that_is_not_1(tmp_path):
    """ggml's writer stores ggml_n_dims dims: a [1, 64] tensor becomes [64], a [4, 1, 8] one stays."""
    src = tiny_file(tmp_path / "t.gguf", None, shapes=[(1, 64), (1, 1, 8, 32), (4, 1, 8), (1,)])
    assert ggraph("split", src, tmp_path / "d", "--max-tensors", 2) == 0
    dims = {**header(files(tmp_path / "d", 2)[0])[1], **header(files(tmp_path / "d", 2)[1])[1]}
    assert {n: ne for n, (_, ne) in dims.items()} == {"t0": (64,), "t1": (32, 8), "t2": (8, 1, 4), "t3": (1,)}
    assert tensor_bytes(files(tmp_path / "d", 2)[0]) == tensor_bytes(src)


def test_an_alignment_other_than_32_is_kept_where_it_is_declared(tmp_path):
    """The first file declares the input's general.alignment and is laid out at it; the others at 32."""
    src = tiny_file(tmp_path / "t.gguf", [40, 24, 40, 8], alignment=64)
    assert ggraph("split", src, tmp_path / "a", "--max-tensors", 2) == 0
    paths = files(tmp_path / "a", 2)
    with GGUFFile(paths[0]) as f:
        assert f.alignment == 64 and [t.offset % 64 for t in f.tensors.values()][:2] == [0, 0]
    assert "general.alignment" not in header(paths[1])[0]
    assert tensor_bytes(paths[0]) == tensor_bytes(src)
    assert ggraph("merge", paths[0], tmp_path / "merged.gguf") == 0
    with GGUFFile(tmp_path / "merged.gguf") as f:
        assert f.alignment == 64
    assert tensor_bytes(tmp_path / "merged.gguf") == tensor_bytes(src)


def test_dry_run_prints_the_plan_and_writes_nothing(model, tmp_path, capsys):
    assert ggraph("split", model, tmp_path / "m", "--max-tensors", 8, "--dry-run") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{model}: 21 tensors into 3 files"
    assert [line.split()[:3] for line in out[1:]] == [[str(p), str(n), "tensors"]
                                                      for p, n in zip(files(tmp_path / "m", 3), (8, 8, 5))]
    assert list(tmp_path.iterdir()) == []
    assert ggraph("split", model, tmp_path / "m", "--max-tensors", 8) == 0
    assert [int(line.split()[3].replace(",", "")) for line in out[1:]] == \
        [os.path.getsize(p) for p in files(tmp_path / "m", 3)]
    assert ggraph("merge", files(tmp_path / "m", 3)[0], tmp_path / "x.gguf", "--dry-run") == 0
    assert "x.gguf" in capsys.readouterr().out and not (tmp_path / "x.gguf").exists()


def test_run_on_the_first_split_gives_the_unsplit_models_text(model, tmp_path, capsys):
    assert ggraph("split", model, tmp_path / "m", "--max-tensors", 8) == 0
    capsys.readouterr()
    texts = []
    for path in (model, files(tmp_path / "m", 3)[0]):
        assert ggraph("run", path, "-p", "Hello world", "-n", 6, "--temp", 0, "--ctx", 32, "--backend", "numpy") == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("Hello world")


# -- sizes and errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, n", [("200M", 200_000_000), ("4G", 4_000_000_000), ("512K", 512_000),
                                     ("1.5G", 1_500_000_000), ("2m", 2_000_000)])
def test_sizes_are_decimal_k_m_g(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("args, message", [
    (["--max-size", "0"], "--max-size '0': expected a positive number and a unit K, M or G"),
    (["--max-size", "0M"], "--max-size '0M' is 0 bytes"),
    (["--max-size=-5M"], "--max-size '-5M': expected a positive number"),
    (["--max-size", "12X"], "--max-size '12X': expected a positive number and a unit K, M or G"),
    (["--max-tensors", "0"], "max_tensors (--max-tensors) must be at least 1, got 0"),
])
def test_bad_limits_are_one_line_errors(model, tmp_path, capsys, args, message):
    assert ggraph("split", model, tmp_path / "m", *args) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ggraph split: error: {message}") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_existing_outputs_are_refused_unless_forced(model, tmp_path, capsys):
    assert ggraph("split", model, tmp_path / "m", "--max-tensors", 8) == 0
    first = files(tmp_path / "m", 3)[0]
    first.write_bytes(b"old")
    assert ggraph("split", model, tmp_path / "m", "--max-tensors", 8) == 1
    assert f"ggraph split: error: {first} already exists: remove it or give --force" in capsys.readouterr().err
    assert first.read_bytes() == b"old" and leftovers(tmp_path) == []
    assert ggraph("split", model, tmp_path / "m", "--max-tensors", 8, "--force") == 0
    assert tensor_bytes(first) == tensor_bytes(model)
    assert ggraph("split", first, tmp_path / "m", "--max-tensors", 8, "--force") == 1   # never over the input
    assert f"ggraph split: error: {first} is one of the input files" in capsys.readouterr().err


def test_bad_merges_are_one_line_errors(model, tmp_path, capsys):
    assert ggraph("split", model, tmp_path / "m", "--max-tensors", 8) == 0
    paths = files(tmp_path / "m", 3)
    out = tmp_path / "out.gguf"
    cases = [(paths[1], "split.no at byte 24: this is split 2 of 3; open the first split instead"),
             (model, "is not a split model: it has no split.count key")]
    paths[2].rename(tmp_path / "elsewhere.gguf")
    cases.append((paths[0], f"split file {paths[2]} is missing (split 3 of 3)"))
    for given, message in cases:
        assert ggraph("merge", given, out) == 1
        err = capsys.readouterr().err
        assert err.startswith("ggraph merge: error: ") and message in err and err.count("\n") == 1
    assert not out.exists() and leftovers(tmp_path) == []


def test_bad_prefixes_and_folders(model, tmp_path, capsys):
    assert ggraph("split", model, tmp_path / "m.gguf") == 1
    assert "ends in .gguf: the files would be named" in capsys.readouterr().err
    assert ggraph("split", model, tmp_path / "nowhere" / "m") == 1
    assert f"no such directory {tmp_path / 'nowhere'}" in capsys.readouterr().err        # as every verb says it
    assert list(tmp_path.iterdir()) == []


def test_a_failure_while_writing_leaves_no_file(model, tmp_path, monkeypatch, capsys):
    """Every file goes to NAME.partial first; a failure in the second file removes the first one too."""
    import ggraph.split as split
    real, calls = split._write_part, []

    def failing(part, path, bar):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", path)
        real(part, path, bar)

    monkeypatch.setattr(split, "_write_part", failing)
    assert ggraph("split", model, tmp_path / "m", "--max-tensors", 8) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# -- llama.cpp: byte-identical files, same logits ----------------------------------------------------------

def gguf_split(*args):
    from llama_tools import run_tool
    return run_tool("llama-gguf-split", *args, timeout=300)


def assert_same_files(ours: list[Path], theirs: list[Path]) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert a.read_bytes() == b.read_bytes(), f"{a.name} differs from llama-gguf-split's {b.name}"


SPLITS = {"tensors": (["--max-tensors", "8"], ["--split-max-tensors", "8"], "model", 3),
          "size": (["--max-size", "5M"], ["--split-max-size", "5M"], "size_model", 3),
          "no-tensor-first": (["--max-tensors", "16", "--no-tensor-first-split"],
                              ["--split-max-tensors", "16", "--no-tensor-first-split"], "model", 3),
          "q4_k_m": (["--max-size", "7M"], ["--split-max-size", "7M"], "quantized_model", 2)}


@pytest.mark.slow
@pytest.mark.parametrize("case", SPLITS)
def test_split_files_equal_llama_gguf_split_files(case, tmp_path, request):
    ours, theirs, fixture, count = SPLITS[case]
    src = request.getfixturevalue(fixture)
    assert ggraph("split", src, tmp_path / "ours", *ours) == 0
    gguf_split("--split", *theirs, src, tmp_path / "theirs")
    assert_same_files(files(tmp_path / "ours", count), files(tmp_path / "theirs", count))


@pytest.mark.slow
def test_oversized_tensors_and_short_dims_match_llama_gguf_split(tmp_path):
    """A tensor past the limit alone in its file, and dims stored up to the last that is not 1."""
    src = tiny_file(tmp_path / "t.gguf", None, shapes=[(16,), (1, 300_000), (16,), (4, 1, 8), (400_000,)])
    assert ggraph("split", src, tmp_path / "ours", "--max-size", "1M") == 0
    gguf_split("--split", "--split-max-size", "1M", src, tmp_path / "theirs")
    assert_same_files(files(tmp_path / "ours", 4), files(tmp_path / "theirs", 4))


@pytest.mark.slow
def test_merge_equals_llama_gguf_split_merge_of_either_tools_splits(size_model, tmp_path):
    gguf_split("--split", "--split-max-size", "5M", size_model, tmp_path / "theirs")
    assert ggraph("split", size_model, tmp_path / "ours", "--max-size", "5M") == 0
    gguf_split("--merge", files(tmp_path / "theirs", 3)[0], tmp_path / "theirs.gguf")
    assert ggraph("merge", files(tmp_path / "theirs", 3)[0], tmp_path / "a.gguf") == 0
    assert ggraph("merge", files(tmp_path / "ours", 3)[0], tmp_path / "b.gguf") == 0
    want = (tmp_path / "theirs.gguf").read_bytes()
    assert (tmp_path / "a.gguf").read_bytes() == want and (tmp_path / "b.gguf").read_bytes() == want


@pytest.mark.slow
def test_llama_cpp_and_ggraph_load_the_split_model(size_model, tmp_path):
    """The first split gives the unsplit file's logits, in llama.cpp and in ggraph, bit for bit."""
    import oracle
    from ggraph.runtime.session import Session
    from test_models import EXACT, agreement, prompt_ids
    assert ggraph("split", size_model, tmp_path / "s", "--max-size", "5M") == 0
    first = files(tmp_path / "s", 3)[0]
    ids = prompt_ids(16)
    want = oracle.llama_logits(size_model, ids, n_ctx=64)
    np.testing.assert_array_equal(oracle.llama_logits(first, ids, n_ctx=64), want)
    got = Session(first, backend="numpy", ctx=64, **EXACT).logits(ids)
    np.testing.assert_array_equal(got, Session(size_model, backend="numpy", ctx=64, **EXACT).logits(ids))
    cos, top1 = agreement(got, want)
    assert cos > 0.999 and top1 >= 0.9, (cos, top1)


@pytest.mark.slow
def test_where_llama_gguf_split_fails_ggraph_writes_loadable_files(tmp_path):
    """gguf-split stops when the first tensor passes the limit, and lays out a 64-aligned model's first file
    at 32 while declaring 64; ggraph gives that tensor its own file and keeps the declared alignment."""
    from llama_tools import llama_tool
    exe = str(llama_tool("llama-gguf-split"))
    big_first = tiny_file(tmp_path / "u.gguf", [300_000, 16])
    proc = subprocess.run([exe, "--split", "--split-max-size", "1M", big_first, tmp_path / "u"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "0 tensors" in proc.stderr
    aligned = tiny_file(tmp_path / "t.gguf", [40, 24, 40, 8], alignment=64)
    gguf_split("--split", "--split-max-tensors", "2", aligned, tmp_path / "theirs")
    with pytest.raises(GGUFError, match="is not a multiple of the alignment 64"):
        GGUFFile(files(tmp_path / "theirs", 2)[0])
    assert ggraph("split", aligned, tmp_path / "ours", "--max-tensors", 2) == 0
    assert tensor_bytes(files(tmp_path / "ours", 2)[0]) == tensor_bytes(aligned)
