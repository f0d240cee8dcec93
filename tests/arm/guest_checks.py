"""Run in the emulated guest by tests/test_arm.py: its checks on one emulated CPU in one process (every
guest start pays for imports at emulated speed), the results as JSON for the host to judge.

    python guest_checks.py OUT.json CHECK ...

CHECK is ``choice`` (the host's set and the sets refused by name), ``target`` (``ggraph target``'s text),
``logits:MODEL.gguf:IDS:OUT.npy`` (the model's logits on the llvm backend, 2 threads, f32 K and V caches as
the oracle's llama.cpp context keeps them; the set, and whether the program came from the cache) or
``pytest:ARG,ARG,...`` (outcomes by test id).
"""
import contextlib
import io
import json
import sys


def choice() -> dict:
    from ggraph.backends.llvm import target as T
    refused = []
    for name in T.NAMES:                              # every set the host cannot run, refused by name
        try:
            T.host_target(name)
        except ValueError as e:
            refused.append(str(e))
    return {"arch": T.host_arch(), "best": T.host_target().name,
            "runs": [t.name for t in T.runnable_targets()], "refused": refused}


def target() -> str:
    from ggraph.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["target"])
    assert not code, f"ggraph target exited {code}"
    return out.getvalue()


def session(path: str):
    """The session the logits check runs (tests/arm/precompile.py builds its program on the host)."""
    from ggraph.runtime.session import Session
    return Session(path, backend="llvm", threads=2, ctx=64, cache_type_k="f32", cache_type_v="f32")


def logits(path: str, ids: str, out: str) -> dict:
    import numpy as np
    s = session(path)
    np.save(out, s.logits([int(t) for t in ids.split(",")]))
    program = s.program(False)
    return {"target": program.target.name, "from_cache": program.lib.from_cache}


class _Outcomes:
    def __init__(self):
        self.outcomes = {}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.nodeid] = report.outcome


def run_pytest(args: str) -> dict:
    import pytest
    seen = _Outcomes()
    code = pytest.main(["-q", "-p", "no:cacheprovider", *args.split(",")], plugins=[seen])
    return {"exit": int(code), "outcomes": seen.outcomes}


def main(out: str, *checks: str) -> None:
    results = {}
    for check in checks:
        kind, _, rest = check.partition(":")
        try:
            if kind == "choice":
                results[check] = choice()
            elif kind == "target":
                results[check] = target()
            elif kind == "logits":
                results[check] = logits(*rest.split(":"))
            elif kind == "pytest":
                results[check] = run_pytest(rest)
            else:
                raise ValueError(f"guest_checks: unknown check {kind!r}")
        except Exception as e:                        # the host's test for this check fails with it
            results[check] = {"error": f"{type(e).__name__}: {e}"}
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
