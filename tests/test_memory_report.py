"""``ggraph bench --memory``: planned bytes (weights, KV cache, activations) beside measured RSS, and its plot."""
import json

import pytest

import zoo
from ggraph.backends.llvm.program import lifetimes, pack
from ggraph.bench import memory
from ggraph.bench.plot import plot_memory
from ggraph.cli import main
from ggraph.runtime.session import Session

PNG = b"\x89PNG\r\n\x1a\n"
WIDE = dict(zoo.K_QUANT_DIMS, n_layer=3)          # head dim 64: every cache type's blocks fit


@pytest.fixture(scope="module")
def model():
    return str(zoo.cached_model("llama", "f32", **WIDE))


def kv_bytes(model, ctx, cache_type):
    s = Session(model, backend="numpy", ctx=ctx, cache_type_k=cache_type, cache_type_v=cache_type)
    return s.memory()["kv_cache"]


def test_kv_cache_is_linear_in_ctx_and_its_bytes_per_value_follow_the_type(model):
    layers, heads, dim = 3, WIDE["n_head_kv"], WIDE["head_dim"]
    values = 2 * layers * heads * dim                        # K and V values per token
    assert kv_bytes(model, 256, "f32") == 256 * values * 4
    assert kv_bytes(model, 256, "f16") == kv_bytes(model, 256, "bf16") == 256 * values * 2
    assert kv_bytes(model, 256, "q8_0") == 256 * values // 32 * 34          # 32 values: 32 int8 + an f16 scale
    assert kv_bytes(model, 256, "q4_0") == 256 * values // 32 * 18          # 32 values: 16 bytes of nibbles + scale
    for t in ("f16", "q8_0"):
        assert kv_bytes(model, 1024, t) == 4 * kv_bytes(model, 256, t)
    assert kv_bytes(model, 512, "q8_0") * 64 == kv_bytes(model, 512, "f16") * 34


def test_planned_parts_add_up(model):
    s = Session(model, threads=1, ctx=256, cache_type_k="f32", cache_type_v="f32")
    plan = s.memory()
    assert plan["total"] == plan["weights"] + plan["kv_cache"] + plan["activations"]
    assert plan["weights"] == sum(t.nbytes for t in s.model.file.tensors.values())
    assert plan["kv_cache"] == sum(c.nbytes for c in s.k_cache + s.v_cache)
    assert 0 < plan["activations"] == s.program(last_only=True).arena_bytes({"T": 256, "P": 0})
    assert s.memory(tokens=1)["activations"] < plan["activations"]


def test_arena_buffers_alive_together_never_share_bytes():
    quantised = zoo.cached_model("llama", "q8_0", **WIDE)   # q8_0 matmuls quantise activations into scratch
    prog = Session(quantised, threads=2, ctx=256, cache_type_k="f32", cache_type_v="f32").program(last_only=True)
    spans = lifetimes(prog.spec)
    sizes = {i: prog.spec.buffers[i].size({"T": 64, "P": 100}) for i in spans}
    offsets, total = pack(sizes, spans)
    assert total < sum(sizes.values())                      # scratch and activations do share the arena
    for i in spans:
        for j in spans:
            if i < j and spans[i][0] <= spans[j][1] and spans[j][0] <= spans[i][1]:
                assert offsets[i] + sizes[i] <= offsets[j] or offsets[j] + sizes[j] <= offsets[i], (i, j)


def test_pack_puts_buffers_of_disjoint_lifetimes_in_the_same_place():
    offsets, total = pack({0: 100, 1: 100, 2: 50}, {0: (0, 1), 1: (2, 3), 2: (1, 2)})
    assert offsets[0] == offsets[1] == 0 and offsets[2] == 100 and total == 150


def test_programs_load_through_the_system_linker_or_lljit_alike(model, tmp_path):
    """A process with ``ld`` loads a program as one shared object; one without it links the same
    objects with LLJIT, and both give the same logits. Each runs in a process of its own, as a
    user's would: a fatal error in LLVM's JIT fails this test with its message, not the whole run."""
    import subprocess
    import sys

    import numpy as np
    from ggraph.backends.llvm import jit
    if jit.system_linker() is None:
        pytest.skip("no system linker: programs load through LLJIT only")
    code = ("import sys, numpy as np; from ggraph.backends.llvm import jit; from ggraph.runtime.session import Session\n"
            "if sys.argv[1] == 'lljit': jit.system_linker = lambda: None\n"
            f"s = Session({str(model)!r}, threads=2, ctx=64, cache_type_k='f32', cache_type_v='f32')\n"
            "np.save(sys.argv[2], s.logits([5, 9, 200, 31, 7]))\n"
            "print(type(s.program(last_only=False).lib._tracker).__name__)\n")
    kinds, logits = {}, {}
    for loader in ("ld", "lljit"):
        out = tmp_path / f"{loader}.npy"
        r = subprocess.run([sys.executable, "-c", code, loader, str(out)], capture_output=True, text=True)
        assert r.returncode == 0, f"{loader}: exit {r.returncode}\n{r.stderr[-3000:]}"
        kinds[loader], logits[loader] = r.stdout.split()[-1], np.load(out)
    assert kinds["ld"] == "_Dylib" and kinds["lljit"] != "_Dylib"
    np.testing.assert_array_equal(logits["ld"], logits["lljit"])


def test_a_warm_process_never_loads_llvm(model):
    """Once a program is cached, running it maps no LLVM: its library alone is ~35 MiB resident."""
    import subprocess
    import sys
    code = ("import sys; from ggraph.runtime.session import Session; "
            f"s = Session({str(model)!r}, threads=1, ctx=64); s.logits([5, 9, 200]); "
            "print('llvmlite.binding' in sys.modules)")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr
    assert runs[1].stdout.split()[-1] == "False"


def test_a_point_measured_in_a_fresh_process(model):
    r = memory.measure_point("ggraph", model, 128, "f32", "f32", threads=1)
    assert (r["ctx"], r["fill"], r["decode"]) == (128, 128 - memory.DECODE_STEPS, memory.DECODE_STEPS)
    p = r["planned"]
    assert p["total"] == p["weights"] + p["kv_cache"] + p["activations"]
    assert r["end"]["hwm"] >= r["end"]["rss"] > 0 and r["end"]["hwm"] >= r["load"]["rss"] > 0
    assert r["end"]["file"] > r["load"]["file"] + p["weights"] / 2    # the run reads the mapped weights
    table = memory.memory_table([r])
    assert "f32/f32" in table and f"{p['total'] / 2**20:.1f}" in table


def test_fill_leaves_room_for_the_decode_steps():
    assert memory.fill_for(4096, None) == (4092, 4)
    assert memory.fill_for(4096, 1000) == (1000, 4)
    assert memory.fill_for(512, 4096) == (508, 4)
    assert memory.fill_for(2, None) == (1, 1)


def test_points_leave_out_what_llama_cpp_cannot_run():
    points = memory.memory_points([512], [("f16", "f16"), ("q8_0", "q8_0")], llama_cpp=True, flash_attn=(True, False))
    assert points == [("ggraph", 512, "f16", "f16", True), ("llama.cpp", 512, "f16", "f16", True),
                      ("llama.cpp", 512, "f16", "f16", False), ("ggraph", 512, "q8_0", "q8_0", True),
                      ("llama.cpp", 512, "q8_0", "q8_0", True)]


def fake_rows():
    """Points shaped as measure_point returns them: ggraph with its plan, llama.cpp with both -fa settings."""
    rows = []
    for k, kv in (("f16", 2), ("q8_0", 34 / 32)):
        for ctx in (512, 4096, 32768):
            kv_bytes = int(ctx * 24 * 2 * 128 * kv)
            plan = {"weights": 380 << 20, "kv_cache": kv_bytes, "activations": 26 << 20}
            plan["total"] = sum(plan.values())
            rows.append({"engine": "ggraph", "ctx": ctx, "cache_k": k, "cache_v": k, "fill": ctx - 4, "decode": 4,
                         "flash_attn": True, "planned": plan, "load": {"rss": 150 << 20},
                         "end": {"rss": plan["total"] + (120 << 20), "hwm": plan["total"] + (130 << 20)}})
            for fa in (True, False) if k == "f16" else (True,):
                peak = plan["total"] + (200 << 20) + (0 if fa else ctx * 14 * 512 * 4)
                rows.append({"engine": "llama.cpp", "ctx": ctx, "cache_k": k, "cache_v": k, "fill": ctx - 4,
                             "decode": 4, "flash_attn": fa, "load": {"rss": peak - (40 << 20)},
                             "end": {"rss": peak, "hwm": peak}})
    return rows


def test_table_sets_each_point_beside_llama_cpp():
    lines = memory.memory_table(fake_rows()).splitlines()
    assert "llama.cpp fa on" in lines[1] and "llama.cpp fa off" in lines[1] and len(lines) == 2 + 6
    q8 = [line for line in lines if line.startswith("q8_0/q8_0")]
    assert len(q8) == 3 and all(line.rstrip().endswith("-") for line in q8)     # no -fa 0 for a q8_0 V cache


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "memory.png"
    assert plot_memory(fake_rows(), path, model="qwen.gguf", threads=2) == str(path)
    assert path.read_bytes()[:8] == PNG and path.stat().st_size > 20_000


def test_cli_table_json_and_plot(model, tmp_path, capsys):
    png = tmp_path / "m.png"
    assert main(["bench", "--memory", model, "--ctx", "64,128", "-ctk", "f32", "-ctv", "f32", "--fill", "40",
                 "--plot", str(png), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [(r["ctx"], r["fill"], r["cache_k"]) for r in rows] == [(64, 40, "f32"), (128, 40, "f32")]
    kv = [r["planned"]["kv_cache"] for r in rows]
    assert kv[1] == 2 * kv[0] and png.read_bytes()[:8] == PNG


@pytest.mark.parametrize("extra, message", [
    (["--depth", "100"], "--memory measures memory, not speed: --depth do not apply"),
    (["--fill", "0"], "--fill must be at least 1 token, got 0"),
    (["-t", "1,2"], "--memory takes one --threads value, got '1,2'"),
    (["--cache-types", "f16,q3"], "--cache-types must be one of f32, f16, bf16, q8_0, q4_0, got 'q3'"),
    (["--ctx", "0"], "--ctx must be integers of at least 1, got '0'"),
])
def test_bad_memory_arguments_are_one_line(model, capsys, extra, message):
    assert main(["bench", "--memory", model, *extra]) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_llama_cpp_points_beside_ggraph(model, capsys):
    pytest.importorskip("llama_cpp")
    assert main(["bench", "--memory", model, "--ctx", "128", "-ctk", "f32", "-ctv", "f32", "--vs-llama-cpp",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [(r["engine"], r["flash_attn"]) for r in rows] == [("ggraph", True), ("llama.cpp", True),
                                                             ("llama.cpp", False)]
    assert all(r["end"]["hwm"] > 0 for r in rows) and "planned" not in rows[1]
