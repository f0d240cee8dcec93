"""The command line: inspect, target, help, and one-line errors instead of tracebacks."""
import json

import numpy as np
import pytest

from ggraph.cli import main
from ggraph.gguf import write
from ggraph.gguf.quants import quantize


@pytest.fixture
def small_file(tmp_path):
    path = tmp_path / "small.gguf"
    rng = np.random.default_rng(0)
    write(path, {"general.architecture": "llama", "general.name": "tiny", "general.file_type": 7,
                 "tokenizer.ggml.tokens": [f"t{i}" for i in range(100)]},
          {"token_embd.weight": (quantize(rng.standard_normal((100, 64)).astype(np.float32), "q8_0"), "q8_0", (100, 64)),
           "output_norm.weight": np.ones(64, np.float32)})
    return path


def test_inspect_text(small_file, capsys):
    assert main(["inspect", str(small_file)]) == 0
    out = capsys.readouterr().out
    assert "GGUF v3, 4 keys, 2 tensors" in out and "architecture llama · tiny" in out and "file type Q8_0" in out
    assert "tokenizer.ggml.tokens = [100 items] 't0', 't1', 't2', 't3', ..." in out
    assert "token_embd.weight" in out and "100x64" in out
    assert "q8_0       1 tensors" in out and "8.50 bits/weight" in out


def test_inspect_json(small_file, capsys):
    assert main(["inspect", str(small_file), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["metadata"]["general.name"] == "tiny"
    assert doc["metadata"]["tokenizer.ggml.tokens"] == {"array_length": 100, "head": [f"t{i}" for i in range(8)]}
    assert doc["tensors"][0] == {"name": "token_embd.weight", "shape": [100, 64], "type": "q8_0",
                                 "offset": doc["tensors"][0]["offset"], "nbytes": 100 * 2 * 34}


@pytest.mark.parametrize("content,message", [
    (None, "No such file or directory"),
    (b"GGUF\x03\x00\x00\x00" + b"\xff" * 16, "tensor_count at byte 8"),
    (b"not a gguf file at all, sorry", "not a GGUF file"),
])
def test_inspect_errors_are_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "bad.gguf"
    if content is not None:
        path.write_bytes(content)
    assert main(["inspect", str(path)]) == 1
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1 and "Traceback" not in captured.err


def test_help_teaches(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("inspect", "run", "target"):
        assert cmd in out
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "example: ggraph run --demo" in capsys.readouterr().out


def test_bench_says_llama_cpp_is_missing_before_measuring(small_file, capsys, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    assert main(["bench", str(small_file), "--vs-llama-cpp"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "--vs-llama-cpp needs llama-cpp-python" in err and "Traceback" not in err


def test_target_says_how_programs_load(capsys, monkeypatch):
    """With ``ld`` programs load as shared objects it links; without, through LLVM's JIT linker."""
    import shutil
    import sys
    which = shutil.which
    assert main(["target"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("programs load:")]
    ld = which("ld") if sys.platform.startswith("linux") else None
    why = "no system linker 'ld' found" if sys.platform.startswith("linux") else "ggraph links with 'ld' on Linux only"
    assert line == ([f"programs load: as one shared object each, linked by {ld} and cached"] if ld else
                    [f"programs load: through LLVM's JIT linker (JITLink) in the process: {why}"])
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "ld" else which(name, *a, **k))
    assert main(["target", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["linker"] is None
    from ggraph.backends.llvm import jit, target
    for module in (jit, target):                  # a Mac has an ld (Apple's), which ggraph does not use
        monkeypatch.setattr(module, "host_os", lambda: "darwin")
    assert main(["target"]) == 0
    assert "programs load: through LLVM's JIT linker (JITLink) in the process: ggraph links with 'ld' on Linux " \
           "only" in capsys.readouterr().out.splitlines()
