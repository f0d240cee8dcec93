"""Batch: sequences in slots of slotted KV caches, stepped together. On the llvm backend each
sequence's logits are the bits it gets in a batch of its own (every kernel computes a token's row
the same way whoever shares the step), and they agree with a Session running it alone (whose
prefill kernels round differently) as closely as two correct programs do (the Session and the numpy
reference); on the numpy reference, to rounding."""
import numpy as np
import pytest

import zoo
from ggraph.runtime.batch import Batch
from ggraph.runtime.session import Session

PROMPTS = {0: [5, 6, 7, 8, 9, 10, 11], 1: [20, 21, 22], 2: [30 + i for i in range(13)]}


def run_both(path, backend, ctx=48, single=None, **kw):
    """Prefill two slots, then a third beside a decode, then all three decode: (batch, alone) logits,
    alone = each sequence in a batch of one slot (or, with ``single=Session``, a Session)."""
    b = Batch(path, slots=3, ctx=ctx, backend=backend, threads=2, **kw)
    if single is Session:
        alone = {s: Session(path, ctx=ctx, backend=backend, threads=2, **kw) for s in PROMPTS}
        run = lambda s, ids: alone[s].step(ids)[-1]                          # noqa: E731
    else:
        alone = {s: Batch(path, slots=1, ctx=ctx, backend=backend, threads=2, **kw) for s in PROMPTS}
        run = lambda s, ids: alone[s].step({0: ids})[0]                     # noqa: E731
    got, want = [], []

    def step(work):
        out = b.step(work)
        ref = {s: run(s, ids) for s, ids in work.items()}
        got.append(np.stack([out[s] for s in sorted(work)]))
        want.append(np.stack([ref[s] for s in sorted(work)]))
        return {s: int(np.argmax(out[s])) for s in out}
    last = step({0: PROMPTS[0], 2: PROMPTS[2]})
    last.update(step({1: PROMPTS[1], 0: [last[0]]}))
    for _ in range(6):
        last = step({s: [t] for s, t in last.items()})
    return np.concatenate(got), np.concatenate(want)


@pytest.mark.parametrize("arch, mix", [("llama", "f32"), ("gemma3", "f32"), ("gemma2", "q8_0"), ("qwen2", "q4_k_m"),
                                       ("phi3", "f16")])
def test_batch_equals_each_sequence_alone_on_llvm(arch, mix):
    path = zoo.cached_model(arch, mix)
    got, want = run_both(path, "llvm")
    np.testing.assert_array_equal(got, want)
    got, want = run_both(path, "llvm", single=Session)
    # as closely as two correct programs: no further apart than the Sessions are from the numpy reference
    # (a Gemma's f16 GELU table turns rounding differences into steps: 0.04 apart on a 2.9 logit, 0.1 from numpy)
    _, ref = run_both(path, "numpy", single=Session)
    np.testing.assert_allclose(got, want, rtol=0, atol=max(1e-3 * np.abs(want).max(), np.abs(want - ref).max()))


def test_batch_with_quantised_caches():
    kw = dict(cache_type_k="q8_0", cache_type_v="q4_0")
    got, want = run_both(zoo.cached_model("gemma3", "q8_0"), "llvm", **kw)
    np.testing.assert_array_equal(got, want)       # (a Session's other rounding moves a few 4-bit cache levels)


def test_batch_on_the_numpy_reference():
    got, want = run_both(zoo.cached_model("gemma3", "f32"), "numpy", single=Session)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())


def test_batch_refuses_bad_steps():
    b = Batch(zoo.cached_model("llama", "f32"), slots=2, ctx=8, threads=1, ubatch=6)
    for work, match in (({}, "at least one slot"), ({2: [1]}, "slot must be in 0..1"), ({0: []}, "no tokens"),
                        ({0: [1] * 9}, "ctx=8"), ({0: [1] * 4, 1: [1] * 3}, "ubatch=6"), ({0: [10 ** 7]}, "vocabulary")):
        with pytest.raises(ValueError, match=match):
            b.step(work)
    assert b.n_past == (0, 0)                                        # nothing ran
    b.step({0: [1, 2, 3], 1: [4]})
    b.truncate(0, 1)
    assert b.n_past == (1, 1)
    with pytest.raises(ValueError, match="truncate"):
        b.truncate(1, 5)
