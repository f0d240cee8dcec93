"""Model architectures as traced ggraph functions."""
