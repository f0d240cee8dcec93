"""Beyond one machine, on Ray (``pip install 'ggraph[cluster]'``): ``bench.py`` runs a benchmark sweep across
the nodes of a Ray cluster, one whole node per benchmark, each compiling for its own CPU."""
from ggraph.cluster.bench import Failure, NodeInfo, Sweep, bench_sweep, connect, select_nodes

__all__ = ["Failure", "NodeInfo", "Sweep", "bench_sweep", "connect", "select_nodes"]
