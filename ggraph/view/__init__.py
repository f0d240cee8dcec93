"""Pictures of graphs: ``dot.py`` builds the networkx model and DOT text (per layer, or one
box per layer for a whole model); ``draw.py`` renders PNG and SVG with graphviz or matplotlib;
``adapter.py`` writes a graph as Model Explorer's graph JSON and node data; ``explore.py`` serves
or exports the graph after every pass with its overlays (``ggraph explore``)."""
