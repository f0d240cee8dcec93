"""``ggraph convert`` on the newer families (qwen3, olmo2, qwen3moe, olmoe, qwen2moe, Mixtral) against
llama.cpp's own converter.

The tiny random models of hf_models.py (2 layers, width 256; the MoE ones 8 experts, top-2) are saved
by transformers and converted by llama.cpp's convert_hf_to_gguf.py. ``ggraph convert`` on the same
folders must give:

- every tensor llama.cpp writes, with its name, shape, type and bytes (f32; and f16, bf16 and q8_0
  against the converter run with that ``--outtype``), and no other;
- every ``<arch>.*`` and ``tokenizer.*`` key llama.cpp writes, with its value (general.* naming
  keys aside: the converter names the model from its folder);
- ggraph's logits on its own file equal to llama.cpp's on llama.cpp's file;
- fused experts (transformers 5's ``experts.gate_up_proj`` [E, 2F, D] and ``experts.down_proj``)
  give the same bytes as one matrix per expert.

Bad configs and checkpoints (an expert key or an expert's matrix missing, too many experts, dense
layers among MoE ones, a top-k renormalisation llama.cpp would not do) fail with one line naming it.
Tests that need transformers or llama.cpp are marked slow.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

import hf_models
import oracle
from ggraph.cli import main
from ggraph.convert import convert
from ggraph.convert.families import FAMILIES, HFConfig
from ggraph.gguf import GGUFFile
from ggraph.runtime.session import Session
from test_models import EXACT

NEW = ["qwen3", "olmo2", "qwen3moe", "olmoe", "qwen2moe", "mixtral"]
MOE = ["qwen3moe", "olmoe", "qwen2moe", "mixtral"]
# keys llama.cpp writes that say where the model came from, not what it is (the converter names it from its
# folder, "hf"); every other key must be equal
NAMING = {"general.name", "general.basename", "general.size_label", "general.finetune", "general.version"}
IDS = [int(t) for t in np.random.default_rng(0).integers(3, 400, 24)]     # ids both vocabularies hold

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def ggraph_convert(family: str, outtype: str, out: Path) -> Path:
    """``ggraph convert`` of hf_models' folder of ``family``, through the command line."""
    assert main(["convert", str(hf_models.hf_folder(family)), str(out), "--outtype", outtype]) == 0
    return out


def llama_cpp_convert(family: str, outtype: str, out: Path) -> Path:
    """llama.cpp's converter run on the same folder with ``--outtype`` (hf_models keeps only its f32)."""
    if outtype == "f32":
        return hf_models.converted(family, "f32")
    import llama_tools
    src, folder = llama_tools.llama_cpp_source(), hf_models.hf_folder(family)
    path = os.pathsep.join(filter(None, [str(src / "gguf-py"), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(folder), "--outfile", str(out), "--outtype", outtype]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and out.is_file(), proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """``made(tool, family, outtype)``: the file ``ggraph`` or ``llama.cpp`` converts, each made once per module."""
    root = tmp_path_factory.mktemp("families")

    @lru_cache(maxsize=None)
    def made(tool: str, family: str, outtype: str = "f32") -> Path:
        how = ggraph_convert if tool == "ggraph" else llama_cpp_convert
        return how(family, outtype, root / f"{tool}-{family}-{outtype}.gguf")
    return made


def tensors(path: Path) -> dict[str, tuple]:
    """name -> (numpy shape, type name, bytes) of every tensor of a GGUF file."""
    with GGUFFile(str(path)) as f:
        return {n: (tuple(t.shape), str(t.dtype), np.asarray(t.data).tobytes()) for n, t in f.tensors.items()}


def metadata(path: Path) -> dict:
    with GGUFFile(str(path)) as f:
        return {k: (list(v) if not isinstance(v, (str, int, float, bool)) else v) for k, v in f.metadata.items()}


def assert_same_tensors(got: Path, want: Path) -> None:
    a, b = tensors(got), tensors(want)
    assert sorted(a) == sorted(b), (sorted(set(a) - set(b)), sorted(set(b) - set(a)))
    for name in b:
        assert a[name][:2] == b[name][:2], (name, a[name][:2], b[name][:2])
        assert a[name][2] == b[name][2], f"{name}: the bytes differ"


# ---------------------------------------------------------------- against llama.cpp's converter

@pytest.mark.slow
@pytest.mark.parametrize("family", NEW)
def test_every_tensor_equals_llama_cpps(made, family):
    """f32: names, shapes, types and bytes, expert stacks and routers included."""
    assert_same_tensors(made("ggraph", family), made("llama.cpp", family, "f32"))


@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
@pytest.mark.parametrize("family", MOE)
def test_every_tensor_equals_llama_cpps_in_each_outtype(made, family, outtype):
    """The routers stay f32, the expert stacks take the type, as llama.cpp's converter chooses."""
    assert_same_tensors(made("ggraph", family, outtype), made("llama.cpp", family, outtype))


@pytest.mark.slow
@pytest.mark.parametrize("family", NEW)
def test_every_key_equals_llama_cpps(made, family):
    """Every key llama.cpp writes (the architecture's, the experts', the tokenizer's, general.file_type), the
    naming keys aside; ggraph writes no other."""
    got, want = metadata(made("ggraph", family)), metadata(made("llama.cpp", family, "f32"))
    assert sorted(set(got) - NAMING) == sorted(set(want) - NAMING), (set(got) ^ set(want)) - NAMING
    for key in sorted(set(want) - NAMING):
        assert got[key] == want[key], (key, got[key] if not isinstance(got[key], list) else len(got[key]),
                                       want[key] if not isinstance(want[key], list) else len(want[key]))


@pytest.mark.slow
@pytest.mark.parametrize("family", NEW)
def test_logits_on_ggraphs_file_equal_llama_cpps_on_its_own(made, family):
    """ggraph runs its converted file as llama.cpp runs the file llama.cpp converted (f32 bars of test_hf_families)."""
    want = oracle.llama_logits(made("llama.cpp", family, "f32"), IDS, n_ctx=64)
    for backend in ("numpy", "llvm"):
        got = Session(made("ggraph", family), backend=backend, threads=2, ctx=64, **EXACT).logits(IDS)
        cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        assert cos.min() > 0.99999 and (got.argmax(1) == want.argmax(1)).mean() >= 0.9, (family, backend, cos.min())


def _fuse_experts(src: Path, dst: Path) -> Path:
    """A copy of an MoE folder whose experts are stored as transformers 5 holds them in memory:
    ``mlp.experts.gate_up_proj`` [E, 2F, D] (gate rows first) and ``mlp.experts.down_proj`` [E, D, F]."""
    from safetensors.numpy import load_file, save_file
    dst.mkdir()
    for p in src.iterdir():
        if p.name != "model.safetensors":
            (dst / p.name).write_bytes(p.read_bytes())
    weights, fused = load_file(str(src / "model.safetensors")), {}
    experts = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight")
    for name in sorted(weights, key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)]):
        m = experts.fullmatch(name)
        if m:
            fused.setdefault(m[1], {}).setdefault(m[3], []).append(weights.pop(name))
    for stem, w in fused.items():
        weights[f"{stem}.gate_up_proj"] = np.concatenate([np.stack(w["gate_proj"]), np.stack(w["up_proj"])], axis=1)
        weights[f"{stem}.down_proj"] = np.stack(w["down_proj"])
    save_file(weights, str(dst / "model.safetensors"))
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3moe", "olmoe", "qwen2moe"])
def test_fused_experts_convert_to_the_same_bytes(family, tmp_path):
    folder = _fuse_experts(hf_models.hf_folder(family), tmp_path / "fused")
    a = convert(hf_models.hf_folder(family), tmp_path / "one.gguf", "q8_0", name="tiny")
    b = convert(folder, tmp_path / "fused.gguf", "q8_0", name="tiny")
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.slow
def test_what_the_decoder_reads(made):
    """The flags ggraph's models take from the converted files: experts, widths, the shared expert."""
    from ggraph.models import load
    for family, want in [("qwen3moe", (8, 2, 128, 0)), ("olmoe", (8, 2, 256, 0)), ("qwen2moe", (8, 2, 128, 256)),
                         ("mixtral", (8, 2, 256, 0))]:
        cfg = load(made("ggraph", family)).config
        assert (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.n_ff_shexp) == want, family
    assert load(made("ggraph", "mixtral")).config.arch == "llama"


# ---------------------------------------------------------------- bad input

MOE_CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                  max_position_embeddings=512, rms_norm_eps=1e-6, vocab_size=416, num_experts=4,
                  num_experts_per_tok=2, tie_word_embeddings=False)
ARCHS = {"qwen3moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
         "mixtral": "MixtralForCausalLM", "qwen3": "Qwen3ForCausalLM", "olmo2": "Olmo2ForCausalLM"}
RENORMALISED = {"qwen3moe": True, "olmoe": False, "qwen2moe": False}


def moe_config(family: str, **changes) -> dict:
    cfg = MOE_CONFIG | {"architectures": [ARCHS[family]]} | changes
    if family in RENORMALISED:
        cfg.setdefault("norm_topk_prob", RENORMALISED[family])
    return {k: v for k, v in cfg.items() if v is not None}


def write_checkpoint(folder: Path, config: dict, drop: str | None = None, edit=None) -> Path:
    """config.json and random weights of every tensor it implies, named as transformers saves them (one
    matrix per expert); ``drop`` leaves one out, ``edit(name, array)`` changes one."""
    save_file = pytest.importorskip("safetensors.numpy").save_file
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    cfg = HFConfig(config, folder / "config.json")
    fam = FAMILIES[config["architectures"][0]]
    rng, weights = np.random.default_rng(0), {}
    for gguf, shape in fam.expected(cfg).items():
        names = [fam.hf_name(gguf, x) for x in range(shape[0])] if len(shape) == 3 else [fam.hf_name(gguf)]
        for hf in names:
            weights[hf] = rng.standard_normal(shape[1:] if len(shape) == 3 else shape).astype(np.float32)
    weights.pop(drop, None)
    if edit is not None:
        weights = {n: w for n, w in ((n, edit(n, w)) for n, w in weights.items()) if w is not None}
    save_file(weights, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("family", NEW)
def test_tensor_names_round_trip(family, tmp_path):
    """Every checkpoint tensor of a family goes to one GGUF tensor (an expert to its place in a stack)."""
    from ggraph.convert import source_shape, tensor_sources
    from ggraph.convert.checkpoint import Checkpoint
    folder = write_checkpoint(tmp_path / "hf", moe_config(family))
    cfg = HFConfig(json.loads((folder / "config.json").read_text()), folder / "config.json")
    fam = FAMILIES[ARCHS[family]]
    expected = fam.expected(cfg)
    with Checkpoint(folder) as ck:
        sources = tensor_sources(fam, cfg, ck)
        assert sorted(sources) == sorted(expected)
        assert {n: source_shape(ck, s) for n, s in sources.items()} == expected


@pytest.mark.parametrize("family, changes, message", [
    ("qwen3moe", dict(num_experts_per_tok=None), "config.json: num_experts_per_tok is missing"),
    ("olmoe", dict(num_experts=None), "config.json: num_local_experts (or num_experts) is missing"),
    ("qwen3moe", dict(moe_intermediate_size=None), "config.json: moe_intermediate_size is missing"),
    ("qwen2moe", dict(shared_expert_intermediate_size=None), "config.json: shared_expert_intermediate_size is missing"),
    ("mixtral", dict(num_experts_per_tok=5), "num_experts_per_tok = 5 is more than the 4 experts"),
    ("qwen3moe", dict(norm_topk_prob=False), "norm_topk_prob = false is not supported: llama.cpp's qwen3moe always "
                                             "renormalises the chosen experts' weights"),
    ("olmoe", dict(norm_topk_prob=True), "norm_topk_prob = true is not supported: llama.cpp's olmoe does not "
                                         "renormalise"),
    ("qwen2moe", dict(mlp_only_layers=[1]), "mlp_only_layers = [1] makes dense layers among the experts' ones, which "
                                            "llama.cpp's qwen2moe does not have"),
    ("qwen3moe", dict(decoder_sparse_step=2), "decoder_sparse_step = 2 makes dense layers"),
    ("mixtral", dict(sliding_window=4096), "sliding_window = 4096 is not supported: llama.cpp's llama attends"),
    ("olmo2", dict(sliding_window=4096), "sliding_window = 4096 (OLMo 3's sliding-window layers) is not supported"),
    ("qwen3", dict(attention_bias=True), "attention_bias = true is not supported"),
])
def test_bad_configs_fail_with_one_line(tmp_path, capsys, family, changes, message):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(moe_config(family, **changes)))
    out = tmp_path / "out.gguf"
    assert main(["convert", str(folder), str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ggraph convert: error: ") and message in err and err.count("\n") == 1, err
    assert not out.exists() and not out.with_name("out.gguf.partial").exists()


@pytest.mark.parametrize("family, drop, edit, message", [
    ("qwen3moe", "model.layers.1.mlp.experts.3.up_proj.weight", None,
     "the checkpoint has no model.layers.1.mlp.experts.3.up_proj.weight (expert 3 of blk.1.ffn_up_exps.weight) "
     "(1 missing; config.json implies them)"),
    ("mixtral", "model.layers.0.block_sparse_moe.experts.0.w2.weight", None,
     "the checkpoint has no model.layers.0.block_sparse_moe.experts.0.w2.weight (expert 0 of "
     "blk.0.ffn_down_exps.weight) (1 missing"),
    ("qwen2moe", "model.layers.0.mlp.shared_expert_gate.weight", None,
     "the checkpoint has no model.layers.0.mlp.shared_expert_gate.weight (blk.0.ffn_gate_inp_shexp.weight)"),
    ("olmoe", "model.layers.1.mlp.gate.weight", None,
     "the checkpoint has no model.layers.1.mlp.gate.weight (blk.1.ffn_gate_inp.weight)"),
    ("olmoe", None, lambda n, w: w[:, :16] if n == "model.layers.0.mlp.experts.2.down_proj.weight" else w,
     "tensor model.layers.0.mlp.experts.2.down_proj.weight has shape [64, 16], but config.json (experts, "
     "hidden_size, the experts' intermediate size) implies [64, 128]"),
])
def test_bad_checkpoints_fail_with_one_line(tmp_path, capsys, family, drop, edit, message):
    folder = write_checkpoint(tmp_path / "hf", moe_config(family), drop, edit)
    out = tmp_path / "out.gguf"
    assert main(["convert", str(folder), str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ggraph convert: error: ") and message in err and err.count("\n") == 1, err
    assert not list(tmp_path.glob("out.gguf*"))


def test_an_expert_past_the_configs_count_is_refused(tmp_path):
    folder = write_checkpoint(tmp_path / "hf", moe_config("qwen3moe", num_experts=5),
                              edit=lambda n, w: w[:4] if n.endswith("mlp.gate.weight") else w)
    (folder / "config.json").write_text(json.dumps(moe_config("qwen3moe")))          # 4 experts, 5 stored
    with pytest.raises(ValueError, match=re.escape("tensor model.layers.0.mlp.experts.4.gate_proj.weight is expert 4 "
                                                   "of blk.0.ffn_gate_exps.weight, but config.json has 4 experts")):
        convert(folder, tmp_path / "o.gguf")
