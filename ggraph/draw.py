"""``import ggraph.draw``: the pictures of a graph, ``ggraph.view.draw`` itself under its short name."""
import sys

from ggraph.view import draw as _draw

sys.modules[__name__] = _draw
