"""A new architecture, registered by a plugin, runs from the CLI: through --plugin FILE.py on every
verb, $GGRAPH_PLUGINS and the ggraph.architectures entry-point group; plugins that fail name themselves."""
import textwrap

import numpy as np
import pytest
import zoo
from gguf_edit import edited
from test_models import prompt_ids

from ggraph import models, plugins
from ggraph.cli import main
from ggraph.runtime import Session


def renamed_arch(src, dst, arch: str):
    """A copy of GGUF ``src`` whose general.architecture (and key prefix) is ``arch``: the same weights."""
    return edited(src, dst, rename_arch=arch)


@pytest.fixture
def fresh(monkeypatch):
    """Plugin state as in a new process; architectures registered by a test are removed after it."""
    monkeypatch.setattr(plugins, "_defaults_done", False)
    monkeypatch.setattr(plugins, "_loaded", {})
    monkeypatch.delenv(plugins.ENV, raising=False)
    before = dict(models.ARCHITECTURES)
    yield
    models.ARCHITECTURES.clear()
    models.ARCHITECTURES.update(before)


@pytest.fixture(scope="module")
def llama():
    return zoo.cached_model("llama", "q8_0")


PLUGIN = '''
from ggraph.models import register_architecture

def flags(key, names, n_layer):
    return dict(rope_style="interleaved", act="silu")

register_architecture("{name}", flags)
'''


def plugin(tmp_path, name, body=PLUGIN):
    p = tmp_path / f"{name}_plugin.py"
    p.write_text(textwrap.dedent(body.format(name=name)))
    return p


def run_text(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_run_dump_bench_diff_with_a_plugin_file(tmp_path, fresh, llama, capsys):
    model = renamed_arch(llama, tmp_path / "my.gguf", "mylm")
    code, _, err = run_text(capsys, "run", model, "-p", "Hello", "-n", 4, "--temp", 0)
    assert code == 1 and "unsupported architecture 'mylm'" in err and "--plugin" in err
    p = plugin(tmp_path, "mylm")
    code, want, _ = run_text(capsys, "run", llama, "-p", "Hello", "-n", 6, "--temp", 0, "--ctx", 64)
    code, got, _ = run_text(capsys, "run", "--plugin", p, model, "-p", "Hello", "-n", 6, "--temp", 0, "--ctx", 64)
    assert code == 0 and got == want                              # the same weights: the same text
    code, out, _ = run_text(capsys, "dump", "--plugin", p, model, "--layer", 0, "--ctx", 32)
    assert code == 0 and "rope_attention" in out and "qmatmul" in out
    code, out, _ = run_text(capsys, "bench", "--plugin", p, model, "-p", 8, "-n", 2, "--repeats", 1, "--json")
    assert code == 0 and '"pp_tok_s"' in out
    code, out, _ = run_text(capsys, "diff", "--plugin", p, model, "--tokens", "5,6,7")
    assert code == 0 and "top-1 token agrees at 100%" in out
    code, out, _ = run_text(capsys, "inspect", "--plugin", p, model)
    assert code == 0 and "architecture mylm" in out


def test_plugins_from_the_environment(tmp_path, fresh, llama, monkeypatch):
    model = renamed_arch(llama, tmp_path / "env.gguf", "envlm")
    monkeypatch.setenv(plugins.ENV, f"{plugin(tmp_path, 'envlm')}:{plugin(tmp_path, 'otherlm')}")
    ids = prompt_ids(8)
    got = Session(model, backend="numpy", ctx=16).logits(ids)           # the Python API loads them too
    np.testing.assert_array_equal(got, Session(llama, backend="numpy", ctx=16).logits(ids))
    assert {"envlm", "otherlm"} <= set(models.ARCHITECTURES)


def test_plugins_from_an_entry_point(tmp_path, fresh, llama, monkeypatch):
    site = tmp_path / "site"
    (site / "entlm_plugin-1.0.dist-info").mkdir(parents=True)
    (site / "entlm_plugin-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: entlm-plugin\nVersion: 1.0\n")
    (site / "entlm_plugin-1.0.dist-info" / "entry_points.txt").write_text(
        "[ggraph.architectures]\nentlm = entlm_plugin:register\n")
    (site / "entlm_plugin.py").write_text(textwrap.dedent('''
        from ggraph.models import register_architecture

        def register():
            register_architecture("entlm", lambda key, names, n_layer: dict(rope_style="interleaved", act="silu"))
    '''))
    monkeypatch.syspath_prepend(str(site))
    model = renamed_arch(llama, tmp_path / "ent.gguf", "entlm")
    ids = prompt_ids(8)
    got = Session(model, backend="llvm", threads=1, ctx=16).logits(ids)
    np.testing.assert_allclose(got, Session(llama, backend="llvm", threads=1, ctx=16).logits(ids), rtol=0, atol=0)


def test_a_plugin_with_a_forward_of_its_own(tmp_path, fresh, llama):
    """``forward`` replaces the shared decoder; flags that are not ModelConfig fields reach it as cfg.extra."""
    model = renamed_arch(llama, tmp_path / "fwd.gguf", "twicelm")
    p = plugin(tmp_path, "twicelm", '''
        from ggraph.models import register_architecture
        from ggraph.models.transformer import forward as shared

        def flags(key, names, n_layer):
            return dict(rope_style="interleaved", act="silu", logit_gain=2.0)

        def forward(cfg, w, tokens, P, k, v, **kw):
            logits, k, v = shared(cfg, w, tokens, P, k, v, **kw)
            return logits * cfg.extra["logit_gain"], k, v

        register_architecture("{name}", flags, forward=forward)
    ''')
    plugins.load_file(p)
    ids = prompt_ids(8)
    got = Session(model, backend="numpy", ctx=16).logits(ids)
    np.testing.assert_allclose(got, 2 * Session(llama, backend="numpy", ctx=16).logits(ids), rtol=1e-6)


def test_bad_plugins_name_themselves(tmp_path, fresh, llama, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("import ggraph\n1 / 0\n")
    code, _, err = run_text(capsys, "run", "--plugin", broken, llama, "-p", "x", "-n", 1)
    assert code == 1 and f"plugin {broken} failed to import: ZeroDivisionError: division by zero" in err
    code, _, err = run_text(capsys, "target", "--plugin", tmp_path / "missing.py")
    assert code == 1 and "missing.py: no such file" in err
    twice = plugin(tmp_path, "llama")                             # a shipped name, without replace=True
    code, _, err = run_text(capsys, "inspect", "--plugin", twice, llama)
    assert code == 1 and "architecture 'llama' is already registered" in err
    p = plugin(tmp_path, "typolm", '''
        from ggraph.models import register_architecture
        register_architecture("{name}", lambda key, names, n_layer: dict(rope_stlye="neox"))
    ''')
    plugins.load_file(p)
    model = renamed_arch(llama, tmp_path / "typo.gguf", "typolm")
    with pytest.raises(ValueError, match="flags rope_stlye are not ModelConfig fields"):
        models.load(model)
