"""Pictures of graphs: ``dot.py`` builds the networkx model and DOT text (per layer, or one
box per layer for a whole model); ``draw.py`` renders PNG and SVG with graphviz or matplotlib."""
