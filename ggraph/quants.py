"""``import ggraph.quants``: the numpy block formats, ``ggraph.gguf.quants`` itself under its short name."""
import sys

from ggraph.gguf import quants as _quants

sys.modules[__name__] = _quants
