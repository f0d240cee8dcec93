"""A researcher's edits always run: kernels and programs are cached under the code that makes them
(the user's emitter, numpy rule and lowering, and the constants they capture), not under their names;
and defining an op, composite, pass or architecture again where it was defined replaces it."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import ggraph
from ggraph import f32, ops
from ggraph.backends.llvm.target import named_target, runnable_targets
from ggraph.ir.primitive import get_primitive

TARGETS = [t.name for t in runnable_targets()]

# One op, `scaled`, whose llvm emitter and numpy rule both read the module global K; a lowering of the
# user's own for a second op, `shifted`, whose kernel adds the module global S.
SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    import ggraph
    from ggraph import f32, ops
    from ggraph.backends.llvm.kernels.builder import Kernel, f32 as F32
    from ggraph.backends.llvm.lowering import lowering, rows
    from ggraph.backends.llvm.target import named_target
    from ggraph.ir.primitive import register
    from ggraph.ir.prims import cost_per_output

    K, S, OP = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    target = named_target(sys.argv[4])

    def emit(ev, x):
        return ev.b.fmul(x, ev.const(x, K)) if OP == "mul" else ev.b.fadd(x, ev.const(x, K))

    scaled_p = ops.elementwise("scaled", lambda x: x * np.float32(K) if OP == "mul" else x + np.float32(K),
                               emit=emit)
    shifted_p = register("shifted", shape=lambda x: x, impl=lambda x: x + np.float32(S), kind="other")

    def shift_kernel(module, n):
        k = Kernel(module, f"shift_{n}", ("x", "y"))
        with k.loop(0, k.mul(k.arg["T"], n)) as i:
            off = k.mul(i, 4)
            k.store(k.b.fadd(k.load(F32, k.arg["x"], off), F32(S)), k.arg["y"], off)
        return k.finish()

    @lowering(shifted_p)
    def _shifted(lw, e):
        out = lw.output(e.outputs[0])
        lw.call(lw.kernel(shift_kernel, e.inputs[0].aval.shape[-1]), lw.ref(e.inputs[0]), out,
                rows(e.inputs[0].aval), writes=(out,))

    g = ggraph.trace(lambda x: ggraph.ir.bind(shifted_p, scaled_p(x)), f32[4, 16])
    x = np.arange(64, dtype=np.float32).reshape(4, 16) / 8
    for backend, options in (("numpy", {}), ("llvm", {"target": target})):
        print(backend, " ".join(str(v) for v in ggraph.compile(g, backend=backend, **options)(x)[1, :3]))
''')


def _run(tmp_path, cache, *args):
    script = tmp_path / "user_ops.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, GGRAPH_CACHE=str(cache))
    r = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    return lines["numpy"], lines["llvm"]


@pytest.mark.parametrize("target", TARGETS)
def test_edited_emitter_and_lowering_run_in_a_new_process_with_the_same_cache(tmp_path, target):
    cache = tmp_path / "cache"
    x = np.arange(16, 32, dtype=np.float32)[:3] / 8
    for k, s, op in ((2, 0.5, "mul"), (3, 0.5, "mul"), (3, 0.25, "mul"), (3, 0.25, "add"), (2, 0.5, "mul")):
        numpy_out, llvm_out = _run(tmp_path, cache, k, s, op, target)
        want = (x * k if op == "mul" else x + k) + s
        assert numpy_out == llvm_out == " ".join(str(v) for v in want.astype(np.float32)), (k, s, op)


@pytest.mark.parametrize("target", TARGETS)
def test_an_op_defined_again_in_one_process_runs_its_new_code(target):
    g_of = {}
    for k in (2.0, 3.0, 5.0):
        def emit(ev, x, k=k):
            return ev.b.fmul(x, ev.const(x, k))
        p = ops.elementwise("times_k", lambda x, k=k: x * np.float32(k), emit=emit)
        assert get_primitive("times_k") is p                       # the latest definition wins
        g_of[k] = ggraph.trace(lambda x: p(x) + 1.0, f32[2, 16])
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(2, 16)
    for k, g in g_of.items():
        out = ggraph.compile(g, backend="llvm", target=named_target(target))(x)
        np.testing.assert_array_equal(out, x * np.float32(k) + np.float32(1))


def test_a_composite_defined_again_replaces_the_old_one():
    for c in (1.0, 4.0):
        @ops.composite("plus_c", lambda x, c=c: x + np.float32(c))
        def plus_c(x, c=c):
            return x + c
    g = ggraph.trace(lambda x: plus_c(x), f32[16])
    assert get_primitive("plus_c") is plus_c.prim
    for backend in ("numpy", "llvm"):
        np.testing.assert_array_equal(ggraph.compile(g, backend=backend)(np.zeros(16, np.float32)), 4.0)


def test_a_name_defined_elsewhere_is_still_a_clash_naming_both(tmp_path):
    other = tmp_path / "other_plugin.py"
    other.write_text("import numpy as np\nfrom ggraph import ops\nops.elementwise('clashing', np.negative)\n")
    mine = tmp_path / "my_plugin.py"
    mine.write_text("import numpy as np\nfrom ggraph import ops\nops.elementwise('clashing', np.abs)\n")
    from ggraph import plugins
    plugins.load_file(other)
    with pytest.raises(plugins.PluginError, match=f"'clashing' is already registered by {other}; {mine} registers"):
        plugins.load_file(mine)
    with pytest.raises(ValueError, match="'add' is already registered by ggraph.ir.prims"):
        ops.elementwise("add", np.add, arity=2)


def test_an_architecture_registered_again_from_the_same_place_replaces_it():
    from ggraph.models.registry import ARCHITECTURES, register_architecture
    for extra in ({}, {"rope_style": "neox"}):
        register_architecture("retried_lm", lambda key, names, n_layer, extra=extra: dict(extra))
    assert ARCHITECTURES["retried_lm"].flags(None, set(), 1) == {"rope_style": "neox"}
    with pytest.raises(ValueError, match="'llama' is already registered by ggraph.models.llama"):
        register_architecture("llama", lambda key, names, n_layer: {})


def test_a_primitive_is_called_like_an_op():
    square_p = ops.elementwise("square_it", np.square, emit=lambda ev, x: ev.b.fmul(x, x))
    g = ggraph.trace(lambda x: square_p(x) * 2.0, f32[8])
    assert "square_it" in str(g)
    x = np.arange(8, dtype=np.float32)
    np.testing.assert_array_equal(ggraph.compile(g, backend="llvm")(x), x * x * 2)


def test_where_of_two_float_constants_is_f32():
    g = ggraph.trace(lambda x: ops.where(ops.less(x, 0.0), 0.0, 1.0) * x, f32[8])
    assert str(g.eqns[1].outputs[0].aval) == "f32[8]"
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    for backend in ("numpy", "llvm"):
        np.testing.assert_array_equal(ggraph.compile(g, backend=backend)(x), np.where(x < 0, 0, x))


def test_a_notebook_cell_run_twice_defines_its_op_and_architecture_again():
    cell = textwrap.dedent('''
        import numpy as np
        from ggraph import ops
        from ggraph.models import register_architecture
        cell_op_p = ops.elementwise("cell_op", lambda x: x * np.float32(GAIN), emit=lambda ev, x: ev.b.fmul(x, ev.const(x, GAIN)))
        register_architecture("cell_lm", lambda key, names, n_layer: {})
    ''')
    for gain in (2.0, 3.0):                     # a notebook's cells run in the namespace of __main__
        namespace = {"__name__": "__main__", "GAIN": gain}
        exec(compile(cell, "<ipython-input-1>", "exec"), namespace)
    g = ggraph.trace(lambda x: namespace["cell_op_p"](x), f32[4])
    np.testing.assert_array_equal(ggraph.compile(g, backend="llvm")(np.ones(4, np.float32)), 3.0)
