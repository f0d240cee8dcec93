"""``ggraph bench --plot``: tok/s bars with ratios, and a roofline panel when results carry a profile."""
import pytest

from ggraph.bench import plot as bench_plot
from ggraph.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


def result(engine="ggraph", passes="default", threads=1, pp_tok_s=100.0, tg_tok_s=10.0, **extra):
    return dict(engine=engine, passes=passes, pp=16, tg=4, threads=threads, pp_tok_s=pp_tok_s, tg_tok_s=tg_tok_s,
                backend="llvm", load_s=0.5, **extra)


def profiled(**extra):
    """A result with a profile in bench.profile_ggraph's form (prefill/decode sections of op rows)."""
    rows = {"prefill": [dict(name="qmatmul q8_0", seconds=0.2, bytes=4e8, flops=6.4e9, roofline=0.4),
                        dict(name="fused", seconds=0.02, bytes=2e7, flops=1e7, roofline=0.1)],
            "decode": [dict(name="qmatmul q8_0", seconds=0.05, bytes=2.5e8, flops=5e8, roofline=0.7),
                       dict(name="take", seconds=0.001, bytes=3e3, flops=0, roofline=0.01)]}
    roof = {"bandwidth_gb_s": 7.0, "peak_gflop_s": 150.0, "peak_int8_gop_s": 300.0}
    return result(profile={k: {"op": v, "layer": []} for k, v in rows.items()} | {"roofline": roof}, roofline=roof,
                  **extra)


def test_ratios_are_to_the_first_row_of_each_configuration():
    rs = [result(pp_tok_s=100), result(passes="none", pp_tok_s=25), result(threads=2, pp_tok_s=180),
          result(engine="llama.cpp", passes="", threads=2, pp_tok_s=360)]
    assert bench_plot.ratios(rs, "pp_tok_s") == [1.0, 0.25, 1.0, 2.0]


def test_roof_fraction_is_the_bound_time_over_the_time_taken():
    roof = {"bandwidth_gb_s": 10.0, "peak_gflop_s": 100.0}
    copy = {"seconds": 2.0, "bytes": 5e9, "flops": 0.0}                 # 0.5 s at 10 GB/s
    gemm = {"seconds": 1.0, "bytes": 1e9, "flops": 50e9}                # compute-bound: 0.5 s at 100 GFLOP/s
    assert bench_plot.roof_fraction(copy, roof) == pytest.approx(0.25)
    assert bench_plot.roof_fraction(gemm, roof) == pytest.approx(0.5)
    assert bench_plot.roof_fraction(dict(gemm, bound_s=0.9), roof) == pytest.approx(0.9)   # the profile's own


def test_profile_rows_read_both_forms():
    sections = bench_plot.profile_rows(profiled()["profile"])
    assert [(r["phase"], r["op"]) for r in sections] == [("prefill", "qmatmul q8_0"), ("prefill", "fused"),
                                                          ("decode", "qmatmul q8_0"), ("decode", "take")]
    assert sections[0]["bound_s"] == pytest.approx(0.08)
    flat = bench_plot.profile_rows([dict(op="qmatmul", phase="decode", seconds=1, bytes=2, flops=3)] * 2)
    assert bench_plot.op_kinds(flat) == [dict(phase="decode", op="qmatmul", seconds=2.0, bytes=4.0, flops=6.0)]


def test_plot_writes_png_svg_with_and_without_a_profile(tmp_path):
    plain = [result(), result(passes="none", pp_tok_s=30, tg_tok_s=2), result(threads=2, pp_tok_s=170, tg_tok_s=16)]
    assert bench_plot.plot_results(plain, tmp_path / "plain.png") == str(tmp_path / "plain.png")
    assert (tmp_path / "plain.png").read_bytes()[:8] == PNG
    assert len(bench_plot.figure(plain).axes) == 2
    fig = bench_plot.figure([profiled(), result(passes="none", pp_tok_s=30)])
    assert len(fig.axes) == 4 and "roofline" in fig.axes[2].get_title()
    assert [t.get_text() for t in fig.axes[3].get_yticklabels()] == ["qmatmul q8_0  [1]", "fused  [2]",
                                                                      "qmatmul q8_0  [3]", "take"]   # take: no flops
    bench_plot.plot_results([profiled()], tmp_path / "roof.svg")
    assert "<svg" in (tmp_path / "roof.svg").read_text()[:500]


def test_bad_results_name_the_field():
    with pytest.raises(ValueError, match="no results"):
        bench_plot.figure([])
    with pytest.raises(ValueError, match="result 1 has no tg_tok_s"):
        bench_plot.figure([result(), {k: v for k, v in result().items() if k != "tg_tok_s"}])
    bad = profiled()
    del bad["profile"]["decode"]["op"][1]["flops"]
    with pytest.raises(ValueError, match=r"result 0 profile.decode row 1 has no flops"):
        bench_plot.figure([bad])
    with pytest.raises(ValueError, match="roofline needs bandwidth_gb_s and peak_gflop_s"):
        bench_plot.figure([result(roofline={"bandwidth_gb_s": 1.0})])
    with pytest.raises(ValueError, match=r"write a \.png, \.svg, \.pdf file, got 'x\.jpg'"):
        bench_plot.plot_results([result()], "x.jpg")


def test_bench_cli_plot(tmp_path, capsys):
    zoo = pytest.importorskip("zoo")
    pytest.importorskip("llama_cpp")
    model = str(zoo.cached_model("llama", "q8_0"))
    png = tmp_path / "bench.png"
    assert main(["bench", model, "--pp", "4", "--tg", "2", "-t", "1", "--repeats", "1", "--compare", "fused,unfused",
                 "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == PNG and f"wrote {png}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", model, "--plot", str(tmp_path / "bench.txt")])
    assert "argument --plot: bench plot: write a .png, .svg, .pdf file" in capsys.readouterr().err


def test_table_shows_dashes_for_what_was_not_timed():
    from ggraph.cli.bench import bench_table
    rows = [result(tg_tok_s=0.0, flash_attn=None, cache_k="f16", cache_v="f16", depth=0),
            result(engine="llama.cpp", passes="", tg_tok_s=0.0, pp_tok_s=50.0, flash_attn="on",
                   cache_k="f16", cache_v="f16", depth=0)]
    for r in rows:
        r["tg"] = 0
    table = bench_table(rows).splitlines()
    assert "0.00x" not in "\n".join(table)
    assert table[2].split()[-2:] == ["-", "-"] and "0.50x" in table[2]


def test_a_plot_into_a_missing_directory_is_refused_before_measuring(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:                 # argparse's usage error, before any measuring
        main(["bench", "--demo", "--plot", str(tmp_path / "no" / "such" / "b.png")])
    assert stop.value.code == 2 and "does not exist" in capsys.readouterr().err


def crowded(n=14):
    """A profile whose op kinds sit almost on one spot of the roofline, in both phases: labels must still not collide."""
    rows = {phase: [dict(name=f"op{k}", seconds=0.01 * (k + 1), bytes=1e7 * (1 + 0.01 * k), flops=1e8 * (1 + 0.02 * k),
                         roofline=0.5) for k in range(n)] + [dict(name="barrier/idle", seconds=0.05, bytes=0, flops=0,
                                                                  roofline=0.0)]
            for phase in ("prefill", "decode")}
    roof = {"bandwidth_gb_s": 7.0, "peak_gflop_s": 150.0, "peak_int8_gop_s": 300.0}
    return result(profile={k: {"op": v, "layer": []} for k, v in rows.items()}, roofline=roof)


def _boxes(fig, ax):
    """Each number's text box on the roofline (without its leader line)."""
    from matplotlib.text import Text
    renderer = fig.canvas.get_renderer()
    return {t.get_text(): Text.get_window_extent(t, renderer) for t in ax.texts if t.get_text().isdigit()}


def test_every_point_on_the_roofline_is_numbered_and_no_two_numbers_overlap():
    fig = bench_plot.figure([crowded()])
    ax = fig.axes[2]
    points = sum(len(c.get_offsets()) for c in ax.collections)
    boxes = _boxes(fig, ax)
    assert sorted(map(int, boxes)) == list(range(1, points + 1))            # TOP_OPS per phase, each numbered
    listed = list(boxes.values())
    for i, a in enumerate(listed):
        for b in listed[i + 1:]:
            assert not a.overlaps(b), "two roofline numbers overlap"
    frame = ax.get_window_extent(fig.canvas.get_renderer())
    assert all(frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 and b.y1 <= frame.y1 for b in listed)
    # the table beside the points carries the same numbers
    ticks = [t.get_text() for t in fig.axes[3].get_yticklabels()]
    assert sorted(int(t.split("[")[1].rstrip("]")) for t in ticks if "[" in t) == sorted(map(int, boxes))


def test_the_table_is_sorted_within_each_phase_as_its_title_says():
    table = bench_plot.table_rows(bench_plot._profiled([crowded()]))
    for block in ("prefill", "decode"):
        shares = [t["share"] for t in table if t["block"] == block and t["row"] is not None]
        assert shares == sorted(shares, reverse=True) and len(shares) == bench_plot.TOP_OPS
        rest = [t for t in table if t["block"] == block and t["row"] is None]
        assert len(rest) == 1 and rest[0]["label"] == "3 more op kinds"      # 14 op kinds and the idle row
    assert [t["block"] for t in table].index("decode") == bench_plot.TOP_OPS + 1   # prefill's block first
    assert "most time first" in bench_plot.figure([crowded()]).axes[3].get_title()


def test_compared_pipelines_are_called_fused_and_unfused():
    rs = [result(passes="default"), result(passes="none", pp_tok_s=20), result(passes="rms_norm,dce", pp_tok_s=50)]
    assert [bench_plot.run_name(r) for r in rs] == ["ggraph fused", "ggraph unfused", "ggraph rms_norm,dce"]
    fig = bench_plot.figure(rs)
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["ggraph fused", "ggraph unfused",
                                                                           "ggraph rms_norm,dce"]
