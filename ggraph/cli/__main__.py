"""``python -m ggraph.cli``: the ``ggraph`` command."""
import sys

from ggraph.cli import main

sys.exit(main())
