"""GGRAPH_DEBUG_NANS=1 names the first op whose output is not finite, on both backends, every feature set
and through the CLI; unset, programs have no checks in them."""
import os
import subprocess
import sys

import numpy as np
import pytest

import ggraph
from ggraph import f32, ops
from ggraph.backends.debug_nans import NonFiniteError
from ggraph.backends.llvm.target import named_target, runnable_targets
from ggraph.ir import param

TARGETS = [t.name for t in runnable_targets()]
rng = np.random.default_rng(0)
X = rng.standard_normal((3, 64)).astype(np.float32)
W = rng.standard_normal((32, 64)).astype(np.float32)


def model(x, w):
    with ggraph.scope("blk.3.ffn"):
        h = ops.linear(x, w)
        y = ops.log(h) * 2.0                        # log of a negative: nan
    return ops.exp(y) + 1.0


GRAPH = ggraph.trace(model, f32[3, 64], param("w", f32[32, 64]))


def programs(target="avx2"):
    for backend, options in (("numpy", {}), ("llvm", {"target": named_target(target)})):
        yield backend, ggraph.compile(GRAPH, backend=backend, passes="none", weights={"w": W}, **options)


@pytest.mark.parametrize("target", TARGETS)
def test_the_first_non_finite_op_is_named_with_its_scope_and_eqn(monkeypatch, target):
    monkeypatch.setenv("GGRAPH_DEBUG_NANS", "1")
    for backend, program in programs(target):
        with pytest.raises(NonFiniteError, match=r"GGRAPH_DEBUG_NANS: output 0 of log at blk\.3\.ffn is not finite "
                                                 r"\(.*element 0\); its operands are finite: the op made it: "
                                                 r"a:f32\[3,32\] = log b with b:f32\[3,32\]$"):
            program(X)


def test_a_fused_op_is_named_and_the_way_to_see_inside_it_is_said(monkeypatch):
    monkeypatch.setenv("GGRAPH_DEBUG_NANS", "1")
    for backend in ("numpy", "llvm"):
        with pytest.raises(NonFiniteError, match=r"of fused at .* = fused\{log,mul,exp,add\} b with b:f32\[3,32\] "
                                                 r"\(a fused op: --passes none shows its ops one by one\)"):
            ggraph.compile(GRAPH, backend=backend, weights={"w": W})(X)


@pytest.mark.parametrize("target", TARGETS)
def test_a_weight_holding_infinities_is_named_as_the_cause(monkeypatch, target):
    monkeypatch.setenv("GGRAPH_DEBUG_NANS", "1")
    bad = W.copy()
    bad[5, 7] = np.inf
    g = ggraph.trace(lambda x, w: ops.linear(x, w) + 1.0, f32[3, 64], param("w", f32[32, 64]))
    for backend, options in (("numpy", {}), ("llvm", {"target": named_target(target)})):
        program = ggraph.compile(g, backend=backend, passes="none", weights={"w": bad}, **options)
        with pytest.raises(NonFiniteError, match=r"output 0 of (matmul|qmatmul) at top level is not finite .*; its "
                                                 r"weight 'w' already holds \+inf \(element 327\)"):
            program(np.abs(X) + 1)


def test_unset_the_programs_check_nothing(monkeypatch):
    monkeypatch.delenv("GGRAPH_DEBUG_NANS", raising=False)
    for backend, program in programs():
        assert np.isnan(program(X)).any()
        if backend == "llvm":
            assert program.spec.checks == [] and not any("check_finite" in c.kernel for c in program.spec.calls)
    monkeypatch.setenv("GGRAPH_DEBUG_NANS", "1")
    llvm = dict(programs())["llvm"]
    assert sum("check_finite" in c.kernel for c in llvm.spec.calls) == len(llvm.spec.checks) > 0


def test_finite_results_pass_through_with_checks_on(monkeypatch):
    monkeypatch.setenv("GGRAPH_DEBUG_NANS", "1")
    g = ggraph.trace(lambda x, w: ops.exp(ops.linear(x, w) * 0.01), f32[3, 64], param("w", f32[32, 64]))
    want = np.exp((X @ W.T) * np.float32(0.01))
    for backend in ("numpy", "llvm"):
        np.testing.assert_allclose(ggraph.compile(g, backend=backend, weights={"w": W})(X), want, rtol=1e-5)


def test_the_cli_names_the_op_where_generation_only_says_the_logits(tmp_path):
    """A model file whose one weight holds a NaN: `ggraph run` says the logits are not finite and how to
    find out more; with GGRAPH_DEBUG_NANS=1 it names the op and the weight."""
    import gguf_edit
    import zoo
    model = zoo.write_model(tmp_path / "tiny.gguf", "llama", mix="f32")
    up = gguf_edit.read(model)[1]["blk.1.ffn_up.weight"]
    up[3, 5] = np.nan
    gguf_edit.edited(model, tmp_path / "poisoned.gguf", tensors={"blk.1.ffn_up.weight": up})
    cmd = [sys.executable, "-m", "ggraph.cli", "run", str(tmp_path / "poisoned.gguf"), "-p", "hello", "-n", "2",
           "--temp", "0"]
    plain = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert plain.returncode == 1 and "GGRAPH_DEBUG_NANS=1" in plain.stderr and "weights" not in plain.stderr
    for backend in ("numpy", "llvm"):
        r = subprocess.run(cmd + ["--backend", backend], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "GGRAPH_DEBUG_NANS": "1"})
        assert r.returncode == 1, r.stderr
        assert r.stderr.count("\n") == 1 and "at blk.1" in r.stderr
        assert "its weight 'blk.1.ffn_up.weight' already holds nan" in r.stderr
