"""ggraph explore and ggraph.view.explore: Model Explorer's graph JSON and node data checked as data (layers
from scopes, a scan as a layer holding its body, edges with dtype[shape] and bytes, each node's eqn, weights,
kernel and fusion log, the graph after every pass, costs worked out by hand here), the command line's
files and errors, and the served page in a real headless Chromium driven by Playwright (it loads, lists
every pass, a layer expands, an overlay colours the nodes, a node's details show its eqn); screenshots are
saved (in $GGRAPH_SCREENSHOTS, else pytest's temporary folder) to be looked at."""
import json
import os
import shutil
import textwrap
import urllib.parse

import pytest
import zoo
from cli_run import cli
from gguf_edit import edited

from ggraph import f32, ops
from ggraph.ir.trace import scope
from ggraph.passes import PIPELINES
from ggraph.view.adapter import kernel_table, namespace
from ggraph.view.explore import Exploration, explore


def user_fn(x, w, g, c0):
    """A researcher's own function: a norm, a matmul and a gated activation, then a scan over the tokens."""
    with scope("blk.0"), scope("ffn"):
        h = ops.rms_norm(x, g, eps=1e-6)
        y = ops.silu(ops.linear(h, w)) * h                         # (T, 64)
    with scope("blk.1"), scope("mix"):
        def body(c, xt):
            c = ops.tanh(c * 0.9 + xt)
            return c, c * xt + 1.0
        c, ys = ops.scan(body, c0, y)                              # (64,), (T, 64)
    return c, ys


AVALS = (f32["T", 64], f32[64, 64], f32[64], f32[64])


@pytest.fixture(scope="module")
def ex():
    return explore(user_fn, *AVALS, compare="none", serve=False)


def nodes_by_label(g, label):
    return [n for n in g["nodes"] if n["label"] == label]


def attr(node, key):
    return [a["value"] for a in node["attrs"] if a["key"] == key]


def node(g, nid):
    return next(n for n in g["nodes"] if n["id"] == nid)


# -- the adapter's JSON ---------------------------------------------------------------------------

def test_every_pass_is_a_graph_of_the_collection(ex):
    (fused, graphs), (unfused, others) = ex.collections
    assert fused == "fused (default)" and unfused == "unfused (none)"
    assert [g.json["id"] for g in graphs] == ["00 traced"] + [f"{i + 1:02d} {p}" for i, p in
                                                              enumerate(PIPELINES["default"])]
    assert [g.json["id"] for g in others] == ["none 00 traced"] + [f"none {i + 1:02d} {p}" for i, p in
                                                                   enumerate(PIPELINES["none"])]
    state = ex.ui_state()["paneStates"]                         # the two last graphs side by side
    assert [p["selectedGraphId"] for p in state] == ["09 plan_memory", "none 04 fold"]
    assert [p["widthFraction"] for p in state] == [0.5, 0.5]


def test_scopes_are_layers_and_edges_carry_dtype_shape_bytes(ex):
    g = ex.collections[0][1][-1].json
    assert namespace("blk.12.attn") == "blk.12/attn" and namespace("") == ""
    (mm,) = nodes_by_label(g, "matmul")
    assert mm["namespace"] == "blk.0/ffn"
    (norm,) = nodes_by_label(g, "fused{rms_norm}")
    src = {e["targetNodeInputId"]: e["sourceNodeId"] for e in mm["incomingEdges"]}
    assert src["0"] == norm["id"]                              # matmul(h, w): h from the fused norm
    assert node(g, src["1"])["label"] == "input"                # w, a graph input
    meta = {a["key"]: a["value"] for a in norm["outputsMetadata"][0]["attrs"]}
    assert meta["tensor_shape"] == "f32[T,64]"
    assert meta["bytes"] == "256 B at T=1, P=0"                 # 64 f32 at T=1
    w_name = {a["key"]: a["value"] for a in node(g, src["1"])["outputsMetadata"][0]["attrs"]}["tensor_name"]
    out = {a["key"]: a["value"] for a in mm["outputsMetadata"][0]["attrs"]}
    assert attr(mm, "eqn") == [f"{out['tensor_name']}:f32[T,64] = matmul {meta['tensor_name']} {w_name}"]


def test_a_scan_is_a_layer_holding_its_body(ex):
    g = ex.collections[0][1][-1].json
    layer = "blk.1/mix/scan_1"
    inside = [n for n in g["nodes"] if n["namespace"] == layer]
    labels = sorted(n["label"] for n in inside)
    assert labels == sorted(["carry in", "x_t in", "fused{mul,add,tanh,mul,add}", "carry out", "y_t",
                             "output", "output"])
    (carry_in,) = [n for n in inside if n["label"] == "carry in"]
    (x_in,) = [n for n in inside if n["label"] == "x_t in"]
    assert node(g, carry_in["incomingEdges"][0]["sourceNodeId"])["label"] == "input"        # c0
    assert node(g, x_in["incomingEdges"][0]["sourceNodeId"])["label"] == "fused{silu,mul}"  # y, from blk.0
    info = g["groupNodeAttributes"][layer]
    assert info["param length"] == "T" and info["param carry"] == "1" and "scan[" in info["eqn"]
    traced = ex.collections[0][1][0].json                      # as traced: the body's own primitives
    assert {"tanh", "mul", "add"} <= {n["label"] for n in traced["nodes"] if n["namespace"] == layer}


def test_nodes_say_what_fused_into_them_or_why_not(ex):
    g = ex.collections[0][1][-1].json
    (act,) = nodes_by_label(g, "fused{silu,mul}")
    (made,) = attr(act, "fused [fuse_elementwise]")
    assert made.startswith("fused{silu,mul}: 2 ops")
    (norm,) = nodes_by_label(g, "fused{rms_norm}")
    (why,) = attr(norm, "not fused [fuse_elementwise]")
    assert "not fused with {rms_norm}" in why
    assert "+ [fuse_elementwise] blk.0.ffn: fused{silu,mul}" in g["groupNodeAttributes"]["blk.0/ffn"]["rewrite log"]
    before = ex.collections[0][1][7].json                      # after fuse_dequant_matmul: nothing fused yet
    assert not any(a["key"].startswith("fused [") for n in before["nodes"] for a in n["attrs"])


def test_cost_overlays_are_the_ops_costs_at_the_bound_dims():
    ex = explore(user_fn, *AVALS, dims={"T": 4, "P": 0}, serve=False)
    final = ex.collections[0][1][-1]
    (flops_name, flops), (bytes_name, moved) = ex.overlays
    assert flops_name == "cost: flops at T=4, P=0" and bytes_name == "cost: bytes moved at T=4, P=0"
    (mm,) = [n for n, e in final.eqn_of.items() if e.prim.name == "matmul"]
    gid = final.json["id"]
    assert flops[gid]["results"][mm]["value"] == 2 * 4 * 64 * 64      # (4, 64) @ (64, 64): a multiply-add is 2
    assert moved[gid]["results"][mm]["value"] == 4 * (4 * 64 + 64 * 64 + 4 * 64)   # read x and w, write y
    assert flops[gid]["gradient"][0]["stop"] == 0 and flops[gid]["gradient"][-1]["stop"] == 1


def test_export_writes_what_model_explorer_loads(ex, tmp_path):
    paths = ex.export(str(tmp_path / "out"))
    assert [os.path.basename(p) for p in paths] == ["graphs.json", "cost_flops_at_T_1_P_0.nodedata.json",
                                                    "cost_bytes_moved_at_T_1_P_0.nodedata.json"]
    collections = json.load(open(paths[0]))
    assert [c["label"] for c in collections] == ["fused (default)", "unfused (none)"]
    ids = {g["id"]: {n["id"] for n in g["nodes"]} for c in collections for g in c["subgraphs"]}
    for p in paths[1:]:
        data = json.load(open(p))
        for gid, per in data.items():
            assert set(per["results"]) <= ids[gid] and per["results"]


def test_explore_refuses_what_it_cannot_show():
    with pytest.raises(TypeError, match="a Graph or a function"):
        explore(42, serve=False)
    with pytest.raises(ValueError, match="unknown pipeline or pass 'fuse_everything'"):
        explore(user_fn, *AVALS, passes="fuse_everything", serve=False)
    e = Exploration()
    g = explore(user_fn, *AVALS, serve=False).collections[0][1]
    e.add_collection("a", g)
    with pytest.raises(ValueError, match="already shown"):
        e.add_collection("b", g)


# -- the command line -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama():
    return str(zoo.cached_model("llama", "f32", n_ctx_train=512))


def test_cli_export_of_a_model_with_compare_and_layer(llama, tmp_path, capsys):
    out = tmp_path / "x"
    code, _, err = cli(capsys, "explore", llama, "--compare", "none", "--layer", 1, "--at", "T=2,P=3",
                       "-ctk", "bf16", "--export", out)
    assert code == 0, err
    collections = json.load(open(out / "graphs.json"))
    assert [c["label"] for c in collections] == ["fused (default)", "unfused (none)"]
    final = collections[0]["subgraphs"][-1]
    assert final["id"] == "09 plan_memory"
    assert {n["namespace"].split("/")[0] for n in final["nodes"]} == {"blk.1"}     # --layer 1 only
    att = [n for n in final["nodes"] if n["label"] == "rope_attention"]
    assert len(att) == 1 and "bf16[" in attr(att[0], "eqn")[0]                      # -ctk bf16: the K cache
    qm = [n for n in final["nodes"] if n["label"] == "qmatmul"]
    assert qm and all(attr(n, "kernel") == [kernel_table()["fmatmul f32"]] for n in qm)   # f32 weights
    w = attr(next(n for n in qm if "blk.1.attn_q.weight" in attr(n, "weight")[0]), "weight")[0]
    assert w.endswith("f32[64,64], 16.00 KiB")                   # 64 x 64 f32 weights
    assert os.path.exists(out / "cost_flops_at_T_2_P_3.nodedata.json")
    code, _, err = cli(capsys, "explore", llama, "--export", out)
    assert code == 1 and "graphs.json already exists there: remove it or give --force" in err
    assert cli(capsys, "explore", llama, "--export", out, "--force")[0] == 0


@pytest.fixture
def registrations():
    """Architectures a test's plugin registers are removed after it (test_plugins registers its own names)."""
    from ggraph.models import ARCHITECTURES
    before = dict(ARCHITECTURES)
    yield
    ARCHITECTURES.clear()
    ARCHITECTURES.update(before)


def test_cli_with_a_plugin_architecture(llama, tmp_path, capsys, registrations):
    model = edited(llama, tmp_path / "my.gguf", rename_arch="explorelm")
    p = tmp_path / "explorelm_plugin.py"
    p.write_text(textwrap.dedent('''
        from ggraph.models import register_architecture
        register_architecture("explorelm", lambda key, names, n_layer: dict(rope_style="interleaved", act="silu"))
    '''))
    code, _, err = cli(capsys, "explore", "--plugin", p, model, "--export", tmp_path / "out")
    assert code == 0, err
    final = json.load(open(tmp_path / "out" / "graphs.json"))[0]["subgraphs"][-1]
    assert any(n["namespace"] == "blk.1/attn" and n["label"] == "rope_attention" for n in final["nodes"])


def test_cli_profile_overlays_the_program_that_ran(llama, tmp_path, capsys):
    code, _, err = cli(capsys, "explore", llama, "--profile", "-t", 1, "--pp", 8, "--export", tmp_path)
    assert code == 0, err
    assert "profiled at 1 thread(s): prefill T=8" in err
    graphs = json.load(open(tmp_path / "graphs.json"))[0]["subgraphs"]
    assert graphs[-1]["id"] == "10 program (profiled)"
    nodes = {n["id"]: n for n in graphs[-1]["nodes"]}
    for step in ("prefill_T_8", "decode_P_8"):
        (data,) = json.load(open(tmp_path / f"profile_{step}_time_us.nodedata.json")).values()
        times = {n: r["value"] for n, r in data["results"].items()}
        assert {nodes[n]["label"] for n in times} >= {"qmatmul", "rope_attention"}   # the kernels that ran
        assert all(t > 0 for t in times.values())
        (share,) = json.load(open(tmp_path / f"profile_{step}_share_of_the_step.nodedata.json")).values()
        total = sum(r["value"] for r in share["results"].values())
        assert 0.3 < total <= 1.0 + 1e-9                          # the rest: barriers, ops on no node
        (roof,) = json.load(open(tmp_path / f"profile_{step}_fraction_of_roofline.nodedata.json")).values()
        assert set(roof["results"]) == set(times)


@pytest.mark.parametrize("argv,says", [
    (["--at", "T=one"], "--at T=one: expected T=N,P=N"),
    (["--layer", "9"], "--layer 9: the model has layers 0..1"),
    (["--compare", "fastest"], "--compare: unknown pipeline or pass 'fastest'"),
    (["--no-pass", "fuse_all"], "--no-pass: unknown pass(es) fuse_all"),
    (["--profile", "--pp", "0"], "--pp must be at least 1"),
])
def test_cli_errors_are_one_line_naming_the_flag(llama, tmp_path, capsys, argv, says):
    code, _, err = cli(capsys, "explore", llama, "--export", tmp_path, *argv)
    assert code == 1 and err.count("\n") == 1 and says in err, err


def test_cli_refuses_a_port_in_use(llama, capsys):
    import socket
    pytest.importorskip("model_explorer")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, _, err = cli(capsys, "explore", llama, "--no-browser", "--port", port)
    assert code == 1 and f"--port {port}: already in use" in err, err


# -- a mixture of experts and a recurrent family (hf_models' tiny files, converted by llama.cpp) ---------

def family_export(family: str, tmp_path, capsys, *argv) -> dict:
    """The last graph of the fused collection ``ggraph explore FILE --export`` writes for ``family``'s q8_0 file."""
    hf_models = pytest.importorskip("hf_models")
    path = hf_models.converted(family, "q8_0")
    code, _, err = cli(capsys, "explore", path, "--export", tmp_path / family, *argv)
    assert code == 0, err
    return json.load(open(tmp_path / family / "graphs.json"))[0]["subgraphs"][-1]


@pytest.mark.slow
def test_experts_show_their_kernel_and_the_bytes_of_the_chosen_experts(tmp_path, capsys):
    g = family_export("qwen3moe", tmp_path, capsys)
    experts = nodes_by_label(g, "qmatmul_experts")
    assert len(experts) == 3 * 2 and {n["namespace"] for n in experts} == {"blk.0/ffn", "blk.1/ffn"}
    gate = next(n for n in experts if "ffn_gate_exps" in attr(n, "weight")[0])
    (weight,) = attr(gate, "weight")
    assert weight.endswith('"blk.0.ffn_gate_exps.weight": q8_0[8,128,256], 272.00 KiB') or \
        weight.endswith('"blk.1.ffn_gate_exps.weight": q8_0[8,128,256], 272.00 KiB')
    (read,) = attr(gate, "weights read")                     # top-2 of 8 at T=1: a quarter of the experts
    assert read.startswith("2 of 8 experts at T=1, P=0 (2 a token): 68.00 KiB of 272.00 KiB")
    (kernel,) = attr(gate, "kernel")
    table = kernel_table()
    assert kernel.startswith(table["qmatmul_experts"]) and kernel.endswith(f"the q8_0 dot: {table['qmatmul q8_0']}")
    (route,) = [n for n in nodes_by_label(g, "top_k") if n["namespace"] == "blk.0/ffn"]
    assert attr(route, "param k") == ["2"] and attr(route, "kernel") == [table["routing"]]
    wide = family_export("qwen3moe", tmp_path / "wide", capsys, "--at", "T=8,P=0")
    (read,) = attr(nodes_by_label(wide, "qmatmul_experts")[0], "weights read")
    assert read.startswith("8 of 8 experts at T=8, P=0")        # 16 picks cover every expert


@pytest.mark.slow
@pytest.mark.parametrize("family, ops", [("mamba2", ["fused_causal_conv", "fused_ssm_scan"]),
                                         ("lfm2", ["fused_causal_conv"])])
def test_recurrent_ops_show_their_kernel_params_and_state(family, ops, tmp_path, capsys):
    g = family_export(family, tmp_path, capsys)
    (row,) = [v for k, v in kernel_table().items() if "ssm_scan" in k.split(", ")]     # one row for both ops
    for op in ops:
        found = nodes_by_label(g, op)
        assert found and all(n["namespace"].endswith("/recurrent") for n in found), op
        n = found[0]
        (kernel,) = attr(n, "kernel")
        assert kernel.startswith(op.removeprefix("fused_") + ": ") and kernel in row    # its own part of the row
        assert attr(n, "param overwrite") == ["True"]
        (eqn,) = attr(n, "eqn")
        assert f"= {op}[overwrite=True] " in eqn and " state" in eqn        # the state it reads and writes back
        shapes = [m["attrs"][1]["value"] for m in n["outputsMetadata"]]
        assert len(shapes) == 2                                  # the output and the state carried to the next step
    traced = json.load(open(tmp_path / family / "graphs.json"))[0]["subgraphs"][0]
    assert nodes_by_label(traced, ops[-1].removeprefix("fused_"))   # as traced, the op before fuse_recurrent


# -- in a real browser ------------------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]


def spare_port() -> int:
    """A port the system has free now: a served page lives as long as the test process, so it must not take
    8080, which later tests (ggraph serve's defaults) expect to find free."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium, headless, driven by Playwright (.ci/run installs Chromium on CI)."""
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH: apt-get install chromium (.ci/run does on CI)")
    pytest.importorskip("model_explorer", reason="Model Explorer is the [explore] extra (in [test])")
    sync = pytest.importorskip("playwright.sync_api", reason="playwright is in the [test] extra")
    with sync.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def shots(tmp_path):
    folder = os.environ.get("GGRAPH_SCREENSHOTS") or str(tmp_path)
    os.makedirs(folder, exist_ok=True)
    return folder


def red_pixels(png: bytes) -> int:
    """Pixels near the overlay gradient's top colour (#bd0026): only an applied overlay paints them."""
    import io

    import numpy as np
    from PIL import Image
    a = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    return int((np.abs(a - np.array([0xbd, 0x00, 0x26])).sum(axis=2) < 60).sum())


def open_page(browser, url):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(url)
    page.wait_for_function("() => { const e = document.querySelector('graph-selector .option-label');"
                           " return e && e.textContent.trim() !== '-'; }", timeout=60_000)
    page.wait_for_timeout(1500)                                # the layout's animation settles
    return page


def ui_state(page) -> dict:
    return json.loads(urllib.parse.parse_qs(urllib.parse.urlparse(page.url).query)["data"][0])["uiState"]


def check_page(page, passes: list[str], eqn: str, shots: str, name: str):
    """The pass list has every pass; a node's details show its eqn; expanding opens every layer; the
    overlay paints nodes."""
    assert page.inner_text("graph-selector .option-label") == passes[-1]
    page.screenshot(path=os.path.join(shots, f"{name}-selected.png"))
    assert eqn in page.inner_text("body")                      # the selected node's side panel
    page.click("graph-selector .graph-selector-label")
    listed = page.inner_text(".cdk-overlay-container")
    page.screenshot(path=os.path.join(shots, f"{name}-passes.png"))
    assert all(p in listed for p in passes), listed
    page.click(".cdk-overlay-backdrop")
    page.click(".expand-all >> nth=0")
    page.wait_for_timeout(1500)
    png = page.screenshot(path=os.path.join(shots, f"{name}-expanded.png"))
    opened = ui_state(page)["paneStates"][0]["deepestExpandedGroupNodeIds"]
    return opened, red_pixels(png)


def test_the_page_of_a_user_function(browser, shots):
    ex = explore(user_fn, *AVALS, serve=False)
    final = ex.collections[0][1][-1]
    (mm,) = [n for n, e in final.eqn_of.items() if e.prim.name == "matmul"]
    url = ex.serve(port=spare_port(), open_browser=False, select=mm)
    assert f'<iframe src="{url}"' in ex._repr_html_()         # Jupyter shows the served page inline
    page = open_page(browser, url)
    passes = [g.json["id"] for g in ex.collections[0][1]]
    (eqn,) = attr(node(final.json, mm), "eqn")
    opened, red = check_page(page, passes, eqn, shots, "user-fn")
    assert "blk.1/mix/scan_1___group___" in opened and "blk.0/ffn___group___" in opened
    assert red > 100                                           # the largest value's node, in the top colour
    page.close()


@pytest.mark.slow
def test_the_demo_model_page_with_the_unfused_graph_beside(browser, shots):
    from ggraph.demo import demo_model_path
    from ggraph.models import load
    graph = load(str(demo_model_path())).graph(ctx=512, last_only=True)
    ex = explore(graph, compare="none", serve=False)
    final = ex.collections[0][1][-1]
    att = next(n for n, e in final.eqn_of.items() if e.scope == "blk.0.attn" and e.prim.name == "rope_attention")
    url = ex.serve(port=spare_port(), open_browser=False, select=att)
    page = open_page(browser, url)
    assert "unfused_none (unfused (none))" in page.inner_text("body")         # the second pane
    passes = [g.json["id"] for g in ex.collections[0][1]]
    (eqn,) = attr(node(final.json, att), "eqn")
    opened, red = check_page(page, passes, eqn[:40], shots, "demo")
    assert {"blk.0/attn___group___", "blk.17/ffn___group___"} <= set(opened)     # the deepest layers open
    assert red > 0
    page.close()
