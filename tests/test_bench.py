"""ggraph bench: JSON, sweeps with pipelines compared, and profiles against the roofline."""
import json

import pytest

import zoo
from ggraph import bench
from ggraph.cli import main


@pytest.fixture(scope="module")
def model():
    return str(zoo.cached_model("llama", "q8_0"))


def test_bench_json_has_both_speeds(model, capsys):
    assert main(["bench", model, "--pp", "8", "--tg", "4", "--threads", "2", "--json", "--repeats", "1"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["pp_tok_s"] > 0 and r["tg_tok_s"] > 0 and (r["pp"], r["tg"], r["threads"]) == (8, 4, 2)


def test_sweep_compares_pipelines(model, capsys):
    assert main(["bench", model, "-p", "4,8", "-n", "2", "-t", "1", "--compare", "fused,unfused", "--repeats", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["engine", "passes", "threads"] and len(out) == 5
    assert sum("default" in line for line in out) == 2 and sum(" none " in line for line in out) == 2


def test_profile_covers_every_call(model):
    prof = bench.profile_ggraph(model, pp=8, threads=2)
    for step in ("prefill", "decode"):
        ops = {r["name"]: r for r in prof[step]["op"]}
        assert {"fused", "rope_attention"} <= set(ops) and any(k.startswith("qmatmul") for k in ops)
        assert sum(r["share"] for r in prof[step]["op"]) == pytest.approx(1.0)
        assert all(r["seconds"] >= 0 and r["bytes"] > 0 for r in prof[step]["op"] if r["name"] not in ("iota", "barrier/idle"))
        assert {"blk.0", "blk.1", "output"} <= {r["name"] for r in prof[step]["layer"]}
        idle = ops["barrier/idle"]                       # two threads wait for each other at every barrier
        assert idle["calls"] >= sum(r["calls"] for r in prof[step]["op"] if r is not idle) and idle["seconds"] > 0
    assert prof["roofline"]["bandwidth_gb_s"] > 0.5 and prof["roofline"]["peak_gflop_s"] > 1


def test_profile_of_a_long_prompt_is_its_last_ubatch(model):
    def matmul_flops(prof):
        return sum(r["flops"] for r in prof["prefill"]["op"] if r["name"].startswith("qmatmul"))
    long = bench.profile_ggraph(model, pp=12, ubatch=8)
    assert long["prefill_step"] == {"T": 4, "P": 8}
    assert matmul_flops(long) == matmul_flops(bench.profile_ggraph(model, pp=4, ubatch=8))


def test_profile_at_depth_times_the_steps_after_the_cache(model, capsys):
    def attention_bytes(prof, step):
        return sum(r["bytes"] for r in prof[step]["op"] if r["name"] == "rope_attention")
    deep = bench.profile_ggraph(model, pp=4, depth=20)
    assert deep["prefill_step"] == {"T": 4, "P": 20}
    shallow = bench.profile_ggraph(model, pp=4)
    assert attention_bytes(deep, "decode") > attention_bytes(shallow, "decode")
    assert main(["bench", model, "-p", "4", "-n", "2", "-d", "0,20", "--profile", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "prefill of 4 tokens at depth 20, by op:" in out and "decode at P=24" in out and "decode at P=4" in out


def test_profile_counts_each_ops_fastest_run():
    from types import SimpleNamespace
    from ggraph.bench.measure import profile_rows
    from ggraph.ir.prims import add_p
    eqn = SimpleNamespace(prim=add_p, scope="blk.0.ffn", cost=lambda dims: (0, 1000))
    call = SimpleNamespace(eqn=eqn)
    runs = [([(call, 2.0), (call, 1.0)], 0.25), ([(call, 0.5)], 0.5), ([(call, 9.0)], 0.125)]
    rows = profile_rows(runs, {}, 1.0, {"f32": 1, "int8": 1})
    # per run summed, then the fastest run; the waiting is a row of its own, its fastest run too
    assert [(r["name"], r["seconds"]) for r in rows["op"]] == [("add", 0.5), ("barrier/idle", 0.125)]
    assert [r["share"] for r in rows["layer"]] == [0.8, 0.2]


def test_profile_reports_operations_per_core_cycle():
    from types import SimpleNamespace
    from ggraph.bench.measure import profile_rows, profile_table
    from ggraph.ir.prims import add_p
    eqn = SimpleNamespace(prim=add_p, scope="blk.0", cost=lambda dims: (6e9, 1000))
    rows = profile_rows([([(SimpleNamespace(eqn=eqn), 0.5)], 0.0)], {}, 1.0, {"f32": 1, "int8": 1}, core_hz=4e9)
    assert rows["op"][0]["ops_cycle"] == 3.0                     # 6e9 ops in 0.5 s on cores ticking 4e9 a second
    assert "op/cyc" in profile_table("t", rows["op"]).splitlines()[1]


def test_profile_needs_llvm(model, capsys):
    assert main(["bench", model, "--backend", "numpy", "--profile", "--pp", "2", "--tg", "1", "--repeats", "1"]) == 1
    assert "use --backend llvm" in capsys.readouterr().err


def test_peaks_are_measured_with_the_feature_sets_instructions():
    from ggraph.backends.llvm import jit
    from ggraph.backends.llvm.target import host_target, named_target
    from ggraph.bench import peaks
    host = host_target()
    got = peaks.measure(host, 1, seconds=0.01)
    tiles = {"tiles"} if host.has("amx-int8") else set()
    assert set(got) == {"ghz", "f32", "int8"} | tiles and all(0 < v < float("inf") for v in got.values())
    assert 0.3 < got["ghz"] < 10                                            # a clock, not a rate of something else
    if tiles:
        assert got["tiles"] > 2 * got["int8"], "a tile multiply does 16x16x64 multiply-adds"
    for name, dot in (("avx512_vnni", "vpdpbusd"), ("avx2", "vpmaddubsw"), ("amx", "vpdpbusd")):   # assembly only
        asm = jit.emit_assembly(peaks.module(named_target(name)), named_target(name))
        int8 = asm.split("peak_int8:")[1].split("peak_")[0]             # none hoisted out of the loop as one
        assert int8.count(dot) >= peaks.CHAINS, f"{name}: the int8 loop must run {peaks.CHAINS} {dot} an iteration"
    asm = jit.emit_assembly(peaks.module(named_target("amx")), named_target("amx"))
    tiles = asm.split("peak_tiles:")[1].split("peak_")[0]
    assert tiles.count("tdpbssd") >= 4                                                  # four independent tiles
    # of operands loaded from memory (random bytes): only the accumulators start at zero, as a tile
    # multiply of zero tiles runs faster than a real one
    assert tiles.count("tileloadd") == 4 and tiles.count("tilezero") == 4


def test_tiled_matmuls_are_bounded_by_the_tile_peak():
    """With a tile peak measured (amx), a prefill's super-block matmuls are bounded by it; decode, and
    32-weight block types (which stay on vpdpbusd), by the int8 peak."""
    from ggraph.bench.measure import _bound
    peaks = {"f32": 1.0, "int8": 10.0, "tiles": 100.0}
    flop = 1e9
    assert _bound("qmatmul q4_k", flop, 0, 1e9, peaks, 512) == flop / 100e9
    assert _bound("qmatmul q4_k", flop, 0, 1e9, peaks, 1) == flop / 10e9
    assert _bound("qmatmul q8_0", flop, 0, 1e9, peaks, 512) == flop / 10e9
    assert _bound("qmatmul q4_k", flop, 0, 1e9, {"f32": 1.0, "int8": 10.0}, 512) == flop / 10e9
    assert _bound("rope_attention", flop, 0, 1e9, peaks, 512) == flop / 1e9


def test_roofline_bounds_every_engine_by_the_same_work(model, capsys):
    from ggraph.bench.measure import roofline_limits
    from ggraph.runtime.session import Session
    s = Session(model, threads=1, ctx=256)
    peaks = {"f32": 50.0, "int8": 100.0}
    shallow, deep = (roofline_limits(s, 16, 4, d, 10.0, peaks) for d in (0, 200))
    assert deep["tg_limit_tok_s"] < shallow["tg_limit_tok_s"]               # more cache to read at depth
    assert deep["pp_limit_tok_s"] < shallow["pp_limit_tok_s"]
    slower = roofline_limits(s, 16, 4, 0, 5.0, peaks)                       # half the bandwidth
    assert slower["tg_limit_tok_s"] < shallow["tg_limit_tok_s"]
    assert main(["bench", model, "-p", "4", "-n", "2", "--roofline", "--repeats", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["pp_limit_tok_s"] > 0 and r["tg_limit_tok_s"] > 0 and r["bandwidth_gb_s"] > 0
    assert r["limit_target"] and r["peak_int8_gop_s"] > 0 and r["peak_gflop_s"] > 0
    if r["limit_target"] != "generic":          # one u8 x s8 instruction does 4 ops per f32 lane's 2; the
        assert r["peak_int8_gop_s"] >= r["peak_gflop_s"]      # generic twin's int8 dot is four scalar MACs
    assert main(["bench", model, "-p", "4", "-n", "2", "--roofline", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "roofline at 1 thread:" in out and "of limit" in out


def test_roofline_bandwidth_is_read_beside_the_engines(model):
    """--roofline's stream reads, every round, as many bytes as an engine's round: at least the file's
    matmul weights once per decode step, more with more steps and more cache behind them."""
    from ggraph.bench.measure import GGraphRunner, StreamRunner, bench_side_by_side, round_bytes
    from ggraph.gguf import GGUFFile
    runner = GGraphRunner(model, threads=1, ctx=256)
    weights = sum(t.nbytes for t in GGUFFile(model).tensors.values() if t.name.endswith(".weight")
                  and t.name != "token_embd.weight" and len(t.shape) == 2)
    one = round_bytes(runner.session, 0, 1, 0)
    assert one >= weights
    assert round_bytes(runner.session, 0, 4, 0) > 3 * weights and round_bytes(runner.session, 0, 4, 200) > \
        round_bytes(runner.session, 0, 4, 0) > round_bytes(runner.session, 0, 2, 0)
    assert round_bytes(runner.session, 16, 4, 0) > round_bytes(runner.session, 0, 4, 0)
    stream = StreamRunner(1, mbytes=4)
    reads = []
    program = stream.program
    stream.program = lambda x: reads.append(x.nbytes) or program(x)
    bench_side_by_side([runner], pp=4, tg=2, depth=0, repeats=2, stream=stream, stream_bytes=3 * stream.array.nbytes)
    assert reads == [4 << 20] * 6 and stream.best > 0.1
