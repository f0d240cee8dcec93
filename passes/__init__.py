"""Graph passes and the pass manager. Importing this package registers every pass."""
from ggraph.passes import cse, dce, fold, inline_composites  # noqa: F401  (registration)
from ggraph.passes import fuse_dequant_matmul, fuse_elementwise, fuse_recurrent, fuse_rope_attention  # noqa: F401
from ggraph.passes import plan_memory  # noqa: F401
from ggraph.passes import instrument_imatrix  # noqa: F401  (only in the "imatrix" pipeline)
from ggraph.passes.manager import PASSES, PassError, PipelineError, RewriteLog, graph_pass, note, resolve, run, skip
from ggraph.passes.pipeline import PIPELINES

__all__ = ["PASSES", "PIPELINES", "PassError", "PipelineError", "RewriteLog", "graph_pass", "note", "resolve", "run",
           "skip"]
