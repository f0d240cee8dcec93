"""The command line as a newcomer meets it: every mistake is one line on stderr naming the flag, found
before any slow work, and nothing is done silently (an existing output overwritten, an option dropped,
a default prompt run in place of an empty one, a warning about a context nobody asked for)."""
import os
import subprocess
import sys
import tempfile

import pytest

import zoo
from cli_run import cli
from ggraph.cli import build_parser

VERBS_WITH_CTX = ("run", "chat", "serve", "bench", "dump", "perplexity", "imatrix")


@pytest.fixture(scope="module")
def model():
    """A tiny llama trained (so its metadata says) on a context of 512 tokens."""
    return str(zoo.cached_model("llama", "f32", n_ctx_train=512))


def one_line(err: str, *words: str) -> None:
    """``err`` is one error line (no traceback, no warning before it) with every one of ``words``."""
    assert err.count("\n") == 1 and "Traceback" not in err and ": error: " in err, err
    for w in words:
        assert w in err, (w, err)


def unwritable_dir(tmp_path) -> str:
    """A folder no file can be created in, even by root (where chmod does not stop writes)."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    for d in (str(folder), "/sys"):
        try:
            tempfile.NamedTemporaryFile(dir=d).close()
        except OSError:
            return d
    pytest.skip("no folder here refuses writes")


def required(verb: str) -> list[str]:
    return {"run": ["-p", "x"], "perplexity": ["-f", "x"], "imatrix": ["-f", "x"]}.get(verb, [])


# 1. -c is the context everywhere ------------------------------------------------------------------

@pytest.mark.parametrize("verb", VERBS_WITH_CTX)
def test_c_is_the_context_on_every_verb_with_ctx(verb):
    args = build_parser().parse_args([verb, "m.gguf", "-c", "512", *required(verb)])
    assert str(args.ctx) == "512"


# 2. seeds ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("verb", ["run", "chat"])
def test_a_negative_seed_is_refused_before_loading(verb, tmp_path, capsys):
    code, _, err = cli(capsys, verb, tmp_path / "missing.gguf", "--seed", "-2", *required(verb))
    assert code == 2
    one_line(err, "--seed", "-1")                   # not the missing file: the seed is checked first


def test_seed_minus_one_is_a_random_seed(model, capsys):
    assert build_parser().parse_args(["run", "-p", "x", "--seed", "-1"]).seed is None
    _, out, _ = cli(capsys, "run", "--help")
    assert "-1: a random seed" in " ".join(out.split("--seed SEED")[-1].split()[:20])      # --help says so
    code, out, err = cli(capsys, "run", model, "-p", "hello", "-n", "2", "--seed", "-1", "--backend", "numpy")
    assert code == 0 and out.startswith("hello")


# 3. a prompt longer than the context, in the command line's words -----------------------------------

@pytest.mark.parametrize("words,says", [(20, "the prompt is 42 tokens but the context is 16 (--ctx/-c)"),
                                        (2000, "the prompt is 24000 characters, more than a context of 16 tokens")])
def test_a_prompt_longer_than_the_context_says_give_a_larger_c(model, capsys, words, says):
    code, _, err = cli(capsys, "run", model, "-p", "hello world " * words, "-c", "16", "--backend", "numpy")
    assert code == 1
    one_line(err, says, "give a larger -c")
    assert "Session" not in err


def test_the_python_api_keeps_its_words(model):
    from ggraph import Session
    from ggraph.runtime.session import ContextFullError
    with pytest.raises(ContextFullError, match="start a new Session with a larger ctx"):
        Session(model, backend="numpy", ctx=8).generate("hello world " * 20)


# 4. diff ------------------------------------------------------------------------------------------

def test_diff_refuses_an_empty_prompt(tmp_path, capsys):
    code, _, err = cli(capsys, "diff", tmp_path / "missing.gguf", "--prompt", "")
    assert code == 2
    one_line(err, "--prompt")


def test_diff_takes_threads(model, capsys):
    assert build_parser().parse_args(["diff", "m.gguf", "-t", "2"]).threads == 2
    code, out, _ = cli(capsys, "diff", model, "--tokens", "1,2,3", "-t", "1")
    assert code == 0 and "logits" in out


# 5. one policy for outputs: --force, and checked before any work -------------------------------------

def text_file(tmp_path) -> str:
    path = tmp_path / "cal.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    return str(path)


@pytest.fixture(scope="module")
def split_model(model, tmp_path_factory):
    """The tiny model as split files: the first one's path."""
    from ggraph.gguf import GGUFFile
    from ggraph.split import plan_split, write_parts
    prefix = tmp_path_factory.mktemp("split") / "m"
    with GGUFFile(model) as f:
        parts = plan_split(f, str(prefix), max_tensors=8)
        write_parts(parts, inputs=f.paths)
    return parts[0].path


def writers(model, tmp_path, out, split_model=None):
    """Each verb that writes a file, with ``out`` as its output."""
    return {"quantize": ["quantize", model, out, "Q8_0"],
            "convert": ["convert", tmp_path, out],
            "imatrix": ["imatrix", model, "-f", text_file(tmp_path), "-c", "32", "--chunks", "1", "-o", out],
            "dump": ["dump", model, "--layer", "0", "-o", out],
            "bench": ["bench", model, "-p", "4", "-n", "1", "--repeats", "1", "--backend", "numpy", "--plot", out],
            "merge": ["merge", split_model, out]}


@pytest.mark.parametrize("verb", ["quantize", "convert", "imatrix", "dump", "bench", "merge"])
def test_an_existing_output_is_refused_without_force(verb, model, split_model, tmp_path, capsys):
    out = tmp_path / ("out.png" if verb == "bench" else "out.gguf")
    out.write_bytes(b"keep me")
    code, _, err = cli(capsys, *writers(model, tmp_path, out, split_model)[verb])
    assert code != 0 and out.read_bytes() == b"keep me"
    one_line(err, str(out), "--force")


@pytest.mark.parametrize("verb", ["quantize", "imatrix", "dump"])
def test_force_overwrites(verb, model, tmp_path, capsys):
    out = tmp_path / "out.gguf"
    out.write_bytes(b"old")
    code, _, err = cli(capsys, *writers(model, tmp_path, out)[verb], "--force")
    assert code == 0 and out.read_bytes() != b"old", err


@pytest.mark.parametrize("verb", ["quantize", "convert", "imatrix", "dump", "bench", "merge"])
def test_an_output_in_a_folder_that_cannot_be_written_is_refused_first(verb, model, split_model, tmp_path, capsys):
    out = os.path.join(unwritable_dir(tmp_path), "out.png" if verb == "bench" else "out.gguf")
    code, stdout, err = cli(capsys, *writers(model, tmp_path, out, split_model)[verb])
    assert code != 0 and ".partial" not in err and "[1]" not in stdout       # no chunk of imatrix ran
    one_line(err, out, "cannot")


def test_a_plot_under_a_regular_file_says_it_is_not_a_directory(model, tmp_path, capsys):
    afile = tmp_path / "FILE"
    afile.write_text("")
    code, _, err = cli(capsys, "bench", model, "--plot", afile / "x.png")
    assert code == 2
    one_line(err, "--plot", "is not a directory")


# 6. contexts: the error alone; no warning about a default nobody asked for -----------------------------

def test_an_impossible_context_is_one_error_line(model, capsys):
    code, _, err = cli(capsys, "run", model, "-p", "hi", "-c", "1000000000", "--backend", "numpy")
    assert code == 1
    one_line(err, "ctx 1000000000")


@pytest.mark.parametrize("verb", ["run", "dump"])
def test_the_default_context_is_capped_at_the_trained_one(verb, model, capsys):
    argv = ["run", model, "-p", "hi", "-n", "1", "--backend", "numpy"] if verb == "run" else ["dump", model, "--layer", "0"]
    code, out, err = cli(capsys, *argv)
    assert code == 0 and "warning" not in err, err
    code, _, err = cli(capsys, *argv, "-c", "1024")                # asked for: warned
    assert code == 0 and ("beyond the 512 tokens" in err) == (verb == "run")


# 7. quantize's type flags ------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--output-tensor-type", "--token-embedding-type"])
def test_a_bad_tensor_type_names_the_flag_and_the_valid_types(flag, model, tmp_path, capsys):
    code, _, err = cli(capsys, "quantize", model, tmp_path / "o.gguf", "Q8_0", flag, "bogus")
    assert code == 2
    one_line(err, flag, "'bogus'", "q8_0", "q6_k", "iq4_xs", "f16")
    for invalid in ("q8_1", "q8_k", "i32", "i8"):
        assert invalid not in err


# 8. options that cannot go together ------------------------------------------------------------------

@pytest.mark.parametrize("argv,flags", [
    (["dump", "m.gguf", "--explain", "--show-buffers"], ("--explain", "--show-buffers")),
    (["bench", "m.gguf", "--json", "--csv"], ("--json", "--csv")),
    (["bench", "m.gguf", "--passes", "none", "--compare", "fused,unfused"], ("--passes", "--compare")),
    (["quantize", "a.gguf", "b.gguf", "Q8_0", "--leave-output-tensor", "--output-tensor-type", "q8_0"],
     ("--leave-output-tensor", "--output-tensor-type")),
])
def test_conflicting_options_are_refused(argv, flags, capsys):
    code, _, err = cli(capsys, *argv)
    assert code == 2
    one_line(err, *flags)


# 9. an empty stop text -------------------------------------------------------------------------------

@pytest.mark.parametrize("verb", ["run", "chat"])
def test_an_empty_stop_is_refused(verb, tmp_path, capsys):
    code, _, err = cli(capsys, verb, tmp_path / "missing.gguf", "--stop", "", *required(verb))
    assert code == 2
    one_line(err, "--stop")


# as a user runs it ------------------------------------------------------------------------------------

def test_a_usage_error_is_one_line_from_the_real_command(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ggraph.cli", "run", str(tmp_path / "m.gguf"), "-p", "x",
                           "--seed", "-5"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    one_line(done.stderr, "ggraph run: error: argument --seed")


def test_serve_whose_slots_do_not_fit_says_only_that(capsys, model):
    """The session's cache fits (with a warning: ctx beyond the trained 512), the slots' do not: the error
    stands alone."""
    code, _, err = cli(capsys, "serve", model, "-c", 1024, "--parallel", 8, "--max-memory", "1M")
    assert code == 1
    one_line(err, "the KV cache", "--max-memory limit of 1.00 MiB")
