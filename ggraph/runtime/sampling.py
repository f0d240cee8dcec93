"""Token sampling in llama.cpp's default order: repeat penalty, top-k, top-p, min-p, temperature."""
from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Sampler:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repeat_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        for name in ("top_k", "repeat_last_n"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"{name} must be a whole number >= 0, got {v!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.repeat_penalty <= 0:
            raise ValueError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")

    def __call__(self, logits: np.ndarray, history: list[int], rng: np.random.Generator) -> int:
        """Pick the next token from one row of logits (V,)."""
        if self.temperature == 0 and self.repeat_penalty == 1.0:
            return int(np.argmax(logits))                  # f32 to f64 keeps the order: no copy needed
        logits = np.asarray(logits, dtype=np.float64)
        if self.repeat_penalty != 1.0 and history:
            logits = penalize(logits, history[-self.repeat_last_n:], self.repeat_penalty)
        if self.temperature == 0:
            return int(np.argmax(logits))
        ids = np.argsort(-logits, kind="stable")
        if self.top_k > 0:
            ids = ids[:self.top_k]
        z = logits[ids]
        p = np.exp(z - z[0])
        p /= p.sum()
        if self.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(p), self.top_p) + 1)
            ids, z, p = ids[:keep], z[:keep], p[:keep]
        if self.min_p > 0:
            keep = p >= self.min_p * p[0]
            ids, z = ids[keep], z[keep]
        z = z / self.temperature
        p = np.exp(z - z.max())
        return int(rng.choice(ids, p=p / p.sum()))


def penalize(logits: np.ndarray, recent: list[int], penalty: float) -> np.ndarray:
    """llama.cpp's repeat penalty: divide positive logits of recent tokens, multiply negative ones."""
    out = logits.copy()
    ids = np.unique(np.asarray(recent, dtype=np.int64))
    v = out[ids]
    out[ids] = np.where(v > 0, v / penalty, v * penalty)
    return out
