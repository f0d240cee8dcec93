"""ggraph bench --cluster on a local two-node Ray cluster (tests/ray_cluster.py): rows from every node with
where they ran, a node without the file reported by name, --nodes, --json/--csv/--plot, Ctrl-C, no Ray."""
import json
import shutil
import signal
import subprocess
import sys
import time

import pytest

import zoo
from ggraph.cli import main
from ray_cluster import ray_cluster  # noqa: F401  (the module-scoped fixture)

FAST = ["-p", "4", "-n", "2", "--repeats", "1"]


@pytest.fixture(scope="module")
def model():
    return zoo.cached_model("llama")


@pytest.fixture(scope="module")
def homes(ray_cluster, model):
    """``~/both.gguf`` on both nodes, ``~/only_a.gguf`` on node_a alone (each node has its own HOME)."""
    for node in ray_cluster.nodes.values():
        shutil.copy(model, node.home / "both.gguf")
    shutil.copy(model, ray_cluster.nodes["node_a"].home / "only_a.gguf")
    return ray_cluster


def _rows(text: str) -> list[dict]:
    got = json.loads(text)
    return got.get("results", [got])


def test_a_sweep_gathers_rows_from_both_nodes(homes, capsys, tmp_path):
    import llvmlite.binding as llvm

    from ggraph.backends.llvm.target import host_target
    plot = tmp_path / "nodes.png"
    rc = main(["bench", "~/both.gguf", "--cluster", homes.address, *FAST, "--compare", "fused,unfused",
               "--roofline", "--json", "--plot", str(plot)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    rows = _rows(out.out)
    assert sorted((r["node"], r["passes"]) for r in rows) == [("node_a", "default"), ("node_a", "none"),
                                                               ("node_b", "default"), ("node_b", "none")]
    for r in rows:                  # each node read its own HOME's file and compiled for the CPU it runs on
        assert r["model_path"] == str(homes.nodes[r["node"]].home / "both.gguf")
        assert r["target"] == host_target().name and r["llvm_cpu"] == llvm.get_host_cpu_name()
        assert r["cpu"] and r["node_ip"] and r["node_id"] and r["pp_tok_s"] > 0 and r["tg_tok_s"] > 0
        assert r["bandwidth_gb_s"] > 0 and r["peak_int8_gop_s"] > 0 and r["limit_target"] == r["target"]
    assert out.err.count("] node_a (") == 2 and out.err.count("] node_b (") == 2      # streamed as they came
    assert plot.stat().st_size > 0


def test_a_node_without_the_file_is_reported_and_the_others_kept(homes, capsys):
    from ggraph.backends.llvm.target import NAMES, forced_target
    unrunnable = next(n for n in NAMES if not _runs(forced_target, n))
    assert main(["bench", "~/only_a.gguf", "--cluster", homes.address, *FAST, "--csv",
                 "--targets", f"generic,{unrunnable}"]) == 1
    out = capsys.readouterr()
    header, *lines = out.out.splitlines()
    cols = header.split(",")
    rows = [dict(zip(cols, line.split(","))) for line in lines]
    assert [(r["node"], r["target"]) for r in rows] == [("node_a", "generic")]
    missing = homes.nodes["node_b"].home / "only_a.gguf"
    assert f"ggraph bench: node node_b ({rows[0]['cpu']}): ~/only_a.gguf: no such file {missing}" in out.err
    assert f"ggraph bench: node node_a ({rows[0]['cpu']}): ~/only_a.gguf, {unrunnable}: GGRAPH_TARGET=" in out.err


def _runs(forced_target, name: str) -> bool:
    try:
        forced_target(name)
        return True
    except ValueError:
        return False


def test_python_api_streams_rows_and_failures(homes):
    from ggraph.cluster import Failure, Sweep, bench_sweep
    events = list(bench_sweep(homes.address, Sweep(models=("~/only_a.gguf",), pps=(4,), tgs=(1,), repeats=1)))
    failures = [e for e in events if isinstance(e, Failure)]
    rows = [r for e in events if not isinstance(e, Failure) for r in e]
    assert [f.node for f in failures] == ["node_b"] and "no such file" in failures[0].reason
    assert [r["node"] for r in rows] == ["node_a"]
    # a run that fails on the node: its own exception's message, for each node
    events = list(bench_sweep(homes.address, Sweep(models=("~/both.gguf",), threads=(1000,), pps=(4,), tgs=(1,))))
    assert sorted(f.node for f in events) == ["node_a", "node_b"]
    assert all(f.what == "both.gguf at 1000 threads" and f.reason.startswith("threads must be a whole number in 1..")
               for f in events), events


def test_nodes_selects_by_resource_through_ray_client(homes, capsys):
    rc = main(["bench", "~/both.gguf", "--cluster", homes.client_address, "--nodes", "node_b", *FAST, "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert [r["node"] for r in _rows(out.out)] == ["node_b"]
    from ggraph.cluster import Sweep, bench_sweep                    # by label, from Python
    runs = list(bench_sweep(homes.address, Sweep(models=("~/both.gguf",), pps=(4,), tgs=(1,), repeats=1),
                            nodes=["zone=a"]))
    assert [r["node"] for rows in runs for r in rows] == ["node_a"]
    assert main(["bench", "~/both.gguf", "--cluster", homes.address, "--nodes", "node_c", *FAST]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("ggraph bench: error: --nodes node_c: no alive node has that resource") and "node_a" in err


def test_bad_addresses_are_one_line_errors(model, capsys):
    pytest.importorskip("ray", reason="the cluster tests need ray: pip install 'ggraph[cluster]'")
    assert main(["bench", str(model), "--cluster", "nowhere", *FAST]) == 1
    assert capsys.readouterr().err == "ggraph bench: error: --cluster 'nowhere': give auto, HOST:PORT or " \
                                      "ray://HOST:PORT\n"
    from ray_cluster import free_port
    port = free_port()
    assert main(["bench", str(model), "--cluster", f"ray://127.0.0.1:{port}", *FAST]) == 1
    assert capsys.readouterr().err.startswith(f"ggraph bench: error: --cluster ray://127.0.0.1:{port}: cannot connect")
    assert main(["bench", str(model), "--nodes", "node_a", *FAST]) == 1
    assert capsys.readouterr().err == "ggraph bench: error: --nodes needs --cluster ADDRESS\n"


def test_without_ray_the_flag_says_how_to_install_it(model, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)                   # `import ray` raises ImportError
    assert main(["bench", str(model), "--cluster", "auto", *FAST]) == 1
    assert capsys.readouterr().err == "ggraph bench: error: --cluster needs Ray: pip install 'ggraph[cluster]'\n"


def test_ctrl_c_cancels_the_sweep_and_leaves_no_task_running(homes):
    from ray.util.state import list_jobs, list_tasks
    cmd = [sys.executable, "-m", "ggraph.cli", "bench", "~/both.gguf", "--cluster", "auto", "-p", "4,8", "-n", "2",
           "-t", "1,2", "--targets", "generic,avx2" if _x86() else "generic", "--repeats", "20"]
    proc = subprocess.Popen(cmd, env=homes.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd="/")
    seen = []                                       # until the first run's rows: each node has runs queued
    while not (seen and seen[-1].startswith("[1] node_")):
        seen.append(proc.stderr.readline())
        assert seen[-1], "".join(seen)              # the sweep ended before any row
    time.sleep(2)                                   # both nodes amid their next runs, not finishing their first
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted: the sweep's remaining tasks were cancelled" in err and out.startswith("node ")
    jobs = [j.job_id for j in list_jobs(address=homes.dashboard_url)
            if j.driver_info and str(j.driver_info.pid) == str(proc.pid)]       # this sweep's, not earlier ones
    assert len(jobs) == 1, jobs
    runs = []
    for _ in range(30):                             # the state API catches up with the cluster in a while
        runs = list_tasks(address=homes.dashboard_url, limit=1000, raise_on_missing_output=False,
                          filters=[("func_or_class_name", "=", "_run"), ("job_id", "=", jobs[0])])
        if not [t for t in runs if t.state not in ("FINISHED", "FAILED")]:
            break
        time.sleep(1)
    assert runs and all(t.state in ("FINISHED", "FAILED") for t in runs), [(t.name, t.state) for t in runs]
    assert any(t.state == "FAILED" for t in runs)  # cancelled ones: 8 runs asked for, few ran to the end
    assert len(runs) < 8


def _x86() -> bool:
    from ggraph.backends.llvm.target import host_arch
    return host_arch() == "x86_64"


def test_nodes_are_selected_by_resource_label_address_or_id():
    from ggraph.cluster import NodeInfo, select_nodes
    a = NodeInfo("aa11bb22cc33", "node_a", "10.0.0.1", "alpha", 8, ("node_a",), (("cpu", "zen4"),))
    b = NodeInfo("dd44ee55ff66", "node_b", "10.0.0.2", "beta", 4, ("node_b",), ())
    head = NodeInfo("0123456789ab", "beta:01234567", "10.0.0.3", "gamma", 0, (), ())   # --num-cpus 0: no work
    nodes = [a, b, head]
    assert select_nodes(nodes, None) == [a, b]
    assert select_nodes(nodes, ["node_b"]) == [b] and select_nodes(nodes, ["cpu=zen4"]) == [a]
    assert select_nodes(nodes, ["10.0.0.2", "alpha"]) == [b, a] and select_nodes(nodes, ["dd44ee"]) == [b]
    with pytest.raises(ValueError, match=r"^--nodes cpu=zen5: no alive node has that resource, label, address or id "
                                         r"\(nodes: node_a \(10.0.0.1\), node_b"):
        select_nodes(nodes, ["cpu=zen5"])
    with pytest.raises(ValueError, match=r"^--nodes gamma: node beta:01234567 \(10.0.0.3\) offers no CPUs"):
        select_nodes(nodes, ["gamma"])


def test_auto_is_refused_among_several_local_clusters(monkeypatch):
    pytest.importorskip("ray")
    import ray._private.services as services
    from ggraph.cluster import connect
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: frozenset({"10.0.0.1:6379", "10.0.0.1:6380"}))
    with pytest.raises(ValueError, match=r"^--cluster auto: 2 Ray clusters run on this machine \(10.0.0.1:6379, "
                                         r"10.0.0.1:6380\); give the address of one$"):
        connect("auto")
