"""``ggraph serve``: an OpenAI-compatible HTTP server (``app``) over a slot scheduler (``engine``)."""
