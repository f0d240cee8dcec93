"""Which layers use sliding-window attention."""


def swa_layers(key, n_layer: int, default_pattern: int) -> tuple[bool, ...]:
    """Which layers slide: ``attention.sliding_window_pattern`` (a period, or one flag per layer).

    With period n, layer i slides iff i % n < n - 1 (llama.cpp's set_swa_pattern).
    """
    pattern = key("attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, (int, float)):
        n = int(pattern)
        return tuple(n == 0 or i % n < n - 1 for i in range(n_layer))
    flags = tuple(bool(x) for x in pattern)
    if len(flags) != n_layer:
        raise ValueError(f"attention.sliding_window_pattern has {len(flags)} flags for {n_layer} layers")
    return flags
