"""The roofline of ``bench --profile``: each op's limit is a real upper bound, its data read from where it sits."""
import pytest

from ggraph import f32, ops, trace
from ggraph.bench import peaks as peaks_mod
from ggraph.bench.measure import activation_bytes, eqn_bound, machine_peaks
from ggraph.compiler import compile_graph
from ggraph.ir.dtypes import param, q8_0

DRAM = 20.0                                         # GB/s
PEAKS = {"f32": 100.0, "int8": 400.0, "ghz": 3.0,
         "reads": [("L1", 64 << 10, 400.0), ("L2", 2 << 20, 200.0), ("L3", 32 << 20, 80.0), ("DRAM", float("inf"), DRAM)]}


def elementwise():
    return trace(lambda x, y: ops.add(ops.mul(x, y), x), f32["T", 4096], f32["T", 4096]).eqns[0]


def matmul():
    g = trace(lambda x, w: ops.linear(x, w), f32["T", 640], param("blk.0.w", q8_0[1024, 640]))
    return next(e for e in compile_graph(g, backend="numpy").graph.eqns if e.prim.name == "qmatmul")


def test_a_small_loop_is_bounded_by_the_cache_that_holds_its_data():
    e = elementwise()
    _, nbytes = e.cost({"T": 16})                   # 3 x 16 x 4096 x 4 B = 768 KiB: in L2
    reads = 2 * 16 * 4096 * 4                       # x and y; the output's stores overlap the loads
    at_l2_speed = reads / 150e9                     # a loop reading L2 at 150 GB/s
    assert nbytes / (DRAM * 1e9) / at_l2_speed > 7  # the DRAM roof would put it at 1000% of its limit
    assert eqn_bound(e, {"T": 16}, DRAM, PEAKS) == pytest.approx(reads / 200e9)
    assert eqn_bound(e, {"T": 16}, DRAM, PEAKS) / at_l2_speed <= 1.0
    _, big = e.cost({"T": 4096})                    # 192 MiB: no cache holds it
    assert eqn_bound(e, {"T": 4096}, DRAM, PEAKS) == pytest.approx(big / (DRAM * 1e9))


def test_weights_stream_from_dram_and_activations_from_cache():
    e = matmul()
    flops, nbytes = e.cost({"T": 1})
    acts = activation_bytes(e, {"T": 1})
    assert acts == (640 + 1024) * 4                 # x and the output; the weight is not an activation
    weights = nbytes - acts
    assert eqn_bound(e, {"T": 1}, DRAM, PEAKS) == pytest.approx(weights / (DRAM * 1e9) + 640 * 4 / 400e9)
    assert eqn_bound(e, {"T": 512}, DRAM, PEAKS) == pytest.approx(e.cost({"T": 512})[0] / 400e9)   # compute-bound


def test_without_cache_levels_every_byte_is_at_the_bandwidth():
    e = elementwise()
    _, nbytes = e.cost({"T": 16})
    assert eqn_bound(e, {"T": 16}, DRAM, {"f32": 100.0, "int8": 400.0}) == pytest.approx(nbytes / (DRAM * 1e9))


def test_machine_peaks_read_levels_are_ordered_and_scaled():
    from ggraph.backends.llvm.target import host_target
    got = machine_peaks(host_target(), 2)
    names = [name for name, _, _ in got["reads"]]
    assert names[-1] == "DRAM" and names[:-1] == sorted(names[:-1]) and len(names) >= 2
    holds = [h for _, h, _ in got["reads"]]
    assert holds == sorted(holds) and holds[-1] == float("inf")
    rates = [g for _, _, g in got["reads"]]
    assert rates == sorted(rates, reverse=True) and rates[-1] > 0.5     # a smaller level is never slower
    sizes = peaks_mod.cache_sizes()
    private = [name for name, (_, alone) in sizes.items() if alone]
    for name, h, _ in got["reads"]:
        if name in private:
            assert h == 2 * sizes[name][0]          # a core's own cache counts once per thread


def test_a_fused_loop_in_cache_runs_below_its_roof():
    """Measured: a fused elementwise loop over data that fits L2, timed natively (best of many runs),
    against the roof measured now. Above 1 + noise means the roof is not an upper bound."""
    import numpy as np
    from ggraph.backends.llvm.target import host_target
    g = trace(lambda x, y: ops.add(ops.mul(x, y), x), f32["T", 4096], f32["T", 4096])
    prog = compile_graph(g, backend="llvm", threads=1, profile=True)
    x, y = np.ones((16, 4096), np.float32), np.full((16, 4096), 0.5, np.float32)
    best: dict = {}
    for _ in range(200):
        prog(x, y)
        for call, seconds in prog.last_profile:
            best[id(call.eqn)] = (call.eqn, min(seconds, best.get(id(call.eqn), (None, 1.0))[1]))
    roof = machine_peaks(host_target(), 1)
    for eqn, seconds in best.values():
        frac = eqn_bound(eqn, {"T": 16}, roof["reads"][-1][2], roof) / seconds
        assert frac <= 1.25, f"{eqn.prim.name} at {frac:.0%} of its roof"
