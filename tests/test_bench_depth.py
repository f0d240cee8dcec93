"""``ggraph bench --depth``: prefill and decode timed after depth tokens already in the KV cache, as llama-bench -d."""
import json

import pytest

import zoo
from ggraph.bench import measure
from ggraph.cli import main
from ggraph.runtime.session import Session

F32_CACHE = ["-ctk", "f32", "-ctv", "f32"]


@pytest.fixture(scope="module")
def model():
    return str(zoo.cached_model("llama", "f32"))


@pytest.fixture
def steps(monkeypatch):
    """Every Session.step as (tokens in the cache before it, tokens it runs)."""
    seen = []
    real = Session.step

    def step(self, tokens, last_only=True):
        seen.append((self.n_past, len(tokens)))
        return real(self, tokens, last_only)
    monkeypatch.setattr(Session, "step", step)
    return seen


def test_timed_prefill_and_decode_start_at_the_depth(model, steps):
    runner = measure.GGraphRunner(model, threads=1, ctx=128, cache_type_k="f32", cache_type_v="f32")
    steps.clear()                                       # the warm-up steps
    r = measure.bench_side_by_side([runner], pp=8, tg=3, depth=40, repeats=2)[0]
    assert (r.depth, r.pp, r.tg, r.ctx, r.cache_k) == (40, 8, 3, 128, "f32") and r.pp_tok_s > 0 and r.tg_tok_s > 0
    assert steps[0] == (0, 40)                          # the depth, prefilled once, untimed
    rounds = steps[1:]
    assert rounds == [(40, 8), (40, 1), (41, 1), (42, 1)] * 2      # each round: prefill at P=40, decode from 40


def test_a_deeper_depth_prefills_only_the_tokens_it_lacks(model, steps):
    runner = measure.GGraphRunner(model, threads=1, ctx=128, cache_type_k="f32", cache_type_v="f32")
    steps.clear()
    measure.bench_side_by_side([runner], pp=4, tg=1, depth=10, repeats=1)
    measure.bench_side_by_side([runner], pp=4, tg=1, depth=30, repeats=1)
    assert (10, 20) in steps and (0, 30) not in steps


def test_rows_and_table_have_a_depth_column(model, capsys):
    args = ["bench", model, "-p", "8", "-n", "2", "-d", "0,32", "--repeats", "1", *F32_CACHE]
    assert main(args + ["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [r["depth"] for r in rows] == [0, 32] and {r["ctx"] for r in rows} == {64}    # 32 + 8 + 2, at least 64
    assert {(r["cache_k"], r["cache_v"]) for r in rows} == {("f32", "f32")}
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    head = lines[0].split()
    assert "depth" in head and len(lines) == 3
    assert [line.split()[head.index("depth")] for line in lines[1:]] == ["0", "32"]


def test_a_given_ctx_is_used(model, capsys):
    assert main(["bench", model, "-p", "4", "-n", "1", "-d", "8", "--ctx", "100", "--repeats", "1", "--json",
                 *F32_CACHE]) == 0
    assert json.loads(capsys.readouterr().out)["ctx"] == 100


@pytest.mark.parametrize("extra, message", [
    (["-d", "-4"], "--depth must be integers of at least 0, got '-4'"),
    (["-d", "4090"], "depth + pp + tg is 4186 tokens, beyond the model's trained context of 4096; give --ctx"),
    (["-d", "100", "--ctx", "64"], "--ctx 64 is too small: the largest depth + pp + tg is 196 tokens"),
    (["--ctx", "512,1024"], "--ctx takes one context length when benchmarking speed"),
    (["-ctk", "q5_k"], "--cache-type-k must be one of f32, f16, bf16, q8_0, q4_0, got 'q5_k'"),
    (["-ctv", "f8"], "--cache-type-v must be one of f32, f16, bf16, q8_0, q4_0, got 'f8'"),
    (["--fill", "10"], "--fill and --cache-types belong to --memory"),
])
def test_bad_values_are_one_line(model, capsys, extra, message):
    assert main(["bench", model, "--repeats", "1", *extra]) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_quantised_v_needs_flash_attention_in_llama_cpp(model, capsys):
    pytest.importorskip("llama_cpp")
    assert main(["bench", model, "--vs-llama-cpp", "-ctv", "q8_0", "--flash-attn", "off"]) == 1
    assert "llama.cpp needs flash attention for a q8_0 V cache: use --flash-attn on" in capsys.readouterr().err


@pytest.mark.slow
def test_llama_cpp_runs_at_the_same_depth_with_both_flash_attention_settings(model, capsys, monkeypatch):
    pytest.importorskip("llama_cpp")
    seen = []
    real = measure.LlamaCppRunner.prefill

    def prefill(self, ids, depth):
        seconds = real(self, ids, depth)
        seen.append((self.fields["flash_attn"], self.llm.n_tokens - len(ids)))     # the cache before the prefill
        return seconds
    monkeypatch.setattr(measure.LlamaCppRunner, "prefill", prefill)
    assert main(["bench", model, "-p", "8", "-n", "2", "-d", "24", "--repeats", "2", "--vs-llama-cpp", "--json",
                 *F32_CACHE]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [(r["engine"], r["flash_attn"], r["depth"]) for r in rows] == \
        [("ggraph", "", 24), ("llama.cpp", "on", 24), ("llama.cpp", "off", 24)]
    assert seen == [("on", 24), ("off", 24)] * 2          # rounds alternate between the engines


def test_plot_keeps_depths_apart(tmp_path):
    from ggraph.bench import plot
    rows = [dict(engine="ggraph", passes="default", pp=512, tg=32, threads=1, depth=d, cache_k="f16", cache_v="f16",
                 flash_attn="", pp_tok_s=pp, tg_tok_s=tg) for d, pp, tg in ((0, 200, 30), (4096, 150, 20))]
    rows += [dict(r, engine="llama.cpp", passes="", flash_attn="on", pp_tok_s=r["pp_tok_s"] / 2) for r in rows]
    assert plot.ratios(rows, "pp_tok_s") == [1.0, 1.0, 0.5, 0.5]      # each depth against its own ggraph row
    assert plot.run_name(rows[2]) == "llama.cpp -fa 1"
    path = tmp_path / "depth.png"
    plot.plot_results(rows, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
