"""State caches beside KV caches: a toy hybrid architecture (RWKV-style token shift and a running sum in
recurrent layers, attention in the others) registered by the test, run through Session, Conversation,
Batch, serve and the CLI. The oracle for each path is a fresh prefill of the whole token sequence, whose
recurrence is written here in numpy float64 as well."""
import numpy as np
import pytest

import zoo
from gguf_edit import edited
from test_models import prompt_ids

from ggraph import models
from ggraph.runtime import Session
from ggraph.ir.dims import Sym
from ggraph.gguf import Typed
from ggraph.ir.dtypes import Aval, f32
from ggraph.models import qwen2
from ggraph.models.transformer import Layer, attention, ffn, head
from ggraph import ops
from ggraph.ir.trace import scope

ARCH = "shiftlm"
N_LAYER = 4
RECURRENT = (0, 2)
GAIN = 0.5                                   # the running mean's weight in a recurrent layer's output


def shift_flags(key, names, n_layer):
    kv = key("attention.head_count_kv")
    return dict(qwen2.flags(key, names, n_layer), recurrent_layers=tuple(i for i, n in enumerate(kv) if n == 0))


def shift_states(cfg):
    D = cfg.n_embd
    return [{"shift": Aval((1, D), f32), "total": (D,)} if i in cfg.recurrent_layers else {}
            for i in range(cfg.n_layer)]


def token_shift(cfg, blk, x, pos, state):
    """y_t = h_t + a * h_{t-1} + GAIN * (h_0 + ... + h_{t-1}) / (t + 1) over the whole sequence, h = norm(x):
    the previous row is the shift state at t = 0 of a step, the running sum the total state."""
    D = cfg.n_embd
    T = x.shape[0]
    h = ops.rms_norm(x, blk["attn_norm.weight"], eps=cfg.norm_eps)                   # (T, D)
    prev = ops.slice(ops.concat([state["shift"], h], 0), 0, 0, T)                   # (T, D): h_{t-1}
    t = ops.reshape(ops.iota(T), (T, 1))
    before = ops.cast(ops.less(ops.reshape(ops.iota(T), (1, T)), t), "f32")         # (T, T): u < t
    hT = ops.transpose(h, (1, 0))                                                   # (D, T)
    running = ops.matmul(before, hT) + ops.reshape(state["total"], (1, D))          # (T, D): sum of h_u, u < t
    count = ops.cast(ops.reshape(pos, (T, 1)), "f32") + 1.0                         # (T, 1)
    y = h + prev * blk["shift.weight"] + running * (GAIN / count)
    new = {"shift": ops.slice(h, 0, Sym("T") - 1, Sym("T")),
           "total": state["total"] + ops.reshape(ops.reduce_sum(hT), (D,))}
    return ops.linear(y, blk["ssm_out.weight"]), new


def shift_forward(cfg, w, tokens, P, k_caches, v_caches, *, states, last_only=False, rope_factors=None):
    T = tokens.shape[0]
    with scope("embd"):
        x = ops.take(w["token_embd.weight"], tokens)                                # (T, D)
        pos = ops.iota(T) + P
    k_out, v_out, new_states = [], [], []
    for i in range(cfg.n_layer):
        blk = Layer(w, i)
        with scope(f"blk.{i}"):
            if i in cfg.recurrent_layers:
                with scope("shift"):
                    a, new = token_shift(cfg, blk, x, pos, states[i])
                kc = vc = None
            else:
                with scope("attn"):
                    a, kc, vc = attention(cfg, blk, i, x, pos, P, k_caches[i], v_caches[i], rope_factors)
                new = {}
            x = x + a
            with scope("ffn"):
                x = x + ffn(cfg, blk, x)
        k_out.append(kc)
        v_out.append(vc)
        new_states.append(new)
    with scope("output"):
        if last_only:
            x = ops.slice(x, 0, Sym("T") - 1, Sym("T"))
        x = ops.rms_norm(x, w["output_norm.weight"], eps=cfg.norm_eps)
        return head(cfg, w, x), k_out, v_out, new_states


def write_shiftlm(path):
    """A tiny file of the architecture: a 4-layer qwen2 whose layers 0 and 2 trade attention for a token
    shift (head_count_kv 0 there)."""
    src = zoo.cached_model("qwen2", "f32", n_layer=N_LAYER)
    rng = np.random.default_rng(7)
    hp = zoo.config("qwen2", n_layer=N_LAYER)
    D = hp["n_embd"]
    tensors = {}
    for i in RECURRENT:
        for name in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q.bias", "attn_k.bias",
                     "attn_v.bias", "attn_output.weight"):
            tensors[f"blk.{i}.{name}"] = None
        tensors[f"blk.{i}.shift.weight"] = rng.uniform(0.2, 0.9, D).astype(np.float32)
        tensors[f"blk.{i}.ssm_out.weight"] = (rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32)
    kv = [0 if i in RECURRENT else hp["n_head_kv"] for i in range(N_LAYER)]
    return edited(src, path, rename_arch=ARCH, keys={f"{ARCH}.attention.head_count_kv": Typed(kv, "u32")},
                  tensors=tensors)


def register():
    models.register_architecture(ARCH, shift_flags, shift_forward, states=shift_states, replace=True)


@pytest.fixture(scope="module")
def shiftlm(tmp_path_factory):
    """The architecture registered for this module, and its file."""
    register()
    yield write_shiftlm(tmp_path_factory.mktemp("shiftlm") / "shiftlm.gguf")
    models.ARCHITECTURES.pop(ARCH, None)


BACKENDS = [("numpy", {}), ("llvm", {"threads": 1})]
EXACT = dict(cache_type_k="f32", cache_type_v="f32")


def session(path, backend="numpy", ctx=96, **kw):
    options = dict(BACKENDS)[backend]
    return Session(path, backend=backend, ctx=ctx, **EXACT, **options, **kw)


def close(got, want, backend):
    tol = 2e-5 if backend == "numpy" else 2e-4
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max()))


def test_the_graph_takes_states_and_kv_caches_only_for_attention_layers(shiftlm):
    m = models.load(shiftlm)
    assert m.config.recurrent_layers == RECURRENT and m.kv_layers == (1, 3) and m.stateful and not m.batched
    assert str(m.state_avals()) == "[{'shift': f32[1,64], 'total': f32[64]}, {}, {'shift': f32[1,64], 'total': " \
                                   "f32[64]}, {}]"                   # a shape alone declares an f32 state
    text = str(m.graph(32, last_only=True))
    head_line = text.splitlines()[0]
    assert "k0:f32[32,2,16] k1:f32[32,2,16] v0" in head_line and "k2" not in head_line
    assert "state0:f32[1,64] state1:f32[64] state2:f32[1,64] state3:f32[64]" in head_line
    assert text.count("= state_write state") == 4
    with pytest.raises(ValueError, match="has a forward of its own: batched steps need the shared decoder"):
        m.batch_graph(2, 32)


def test_a_shared_decoder_graph_has_no_states():
    m = models.load(zoo.cached_model("qwen2", "f32", n_layer=N_LAYER))
    assert not m.stateful and m.batched and m.kv_layers == tuple(range(N_LAYER)) and m.state_avals() == [{}] * N_LAYER
    text = str(m.graph(32))
    assert "state" not in text and " k3:" in text.splitlines()[0]


@pytest.mark.parametrize("backend", [b for b, _ in BACKENDS])
def test_prefill_equals_prefill_then_token_by_token_decode(shiftlm, backend):
    ids = prompt_ids(24)
    s = session(shiftlm, backend)
    want = s.logits(ids)
    for k in (1, 7):
        s.reset()
        got = [s.step(ids[:k], last_only=False)] + [s.step([t], last_only=False) for t in ids[k:]]
        close(np.concatenate(got), want, backend)
    # the state carries the history: zeroing it mid-sequence changes the next logits
    s.reset()
    s.step(ids[:12])
    for a in s.states:
        a.fill(0)
    assert not np.allclose(s.step(ids[12:13]), want[12], atol=1e-3)


def test_reset_and_a_new_session_start_from_zero_states(shiftlm):
    ids, other = prompt_ids(10), prompt_ids(10, seed=3)
    s = session(shiftlm)
    want = s.logits(ids)
    s.step(other)
    assert all(np.any(a) for a in s.states)
    s.reset()
    assert s.n_past == 0 and not any(np.any(a) for a in s.states)
    np.testing.assert_array_equal(s.logits(ids), want)
    np.testing.assert_array_equal(session(shiftlm).logits(ids), want)        # a second session: its own zeros
    s.generate(other, max_tokens=3, temperature=0)                             # a generate without reuse resets
    np.testing.assert_array_equal(s.logits(ids), want)


def test_truncate_restores_the_state_from_the_nearest_snapshot(shiftlm):
    from ggraph.runtime.session import SNAPSHOT_EVERY
    ids = prompt_ids(20 + SNAPSHOT_EVERY + 10, seed=5)
    fresh = session(shiftlm, ctx=128).logits(ids)
    s = session(shiftlm, ctx=128)
    s.step(ids[:20])                                     # a prefill: a snapshot at 20
    for t in ids[20:]:                                   # decode: a snapshot at 20 + SNAPSHOT_EVERY
        s.step([t])
    assert [at for at, _ in s.seq.snapshots] == [20, 20 + SNAPSHOT_EVERY]
    for n, recomputed in ((20 + SNAPSHOT_EVERY + 5, 5), (33, 13), (20, 0), (4, 4)):
        s.truncate(n)
        assert s.n_past == n and s.seq.recomputed == recomputed and s.cached_tokens == tuple(ids[:n])
        close(s.step(ids[n:], last_only=False), fresh[n:], "numpy")


def test_a_chat_turn_that_reuses_the_prefix_equals_a_fresh_prefill(shiftlm):
    from ggraph.runtime.conversation import Conversation
    s = session(shiftlm, ctx=256)
    conv = Conversation(s, max_tokens=40, temperature=0)
    "".join(conv.send("Hello there"))
    ids = s.chat_ids(conv.messages + [{"role": "user", "content": "And again?"}])
    held = s.n_past
    kept = next(i for i, (a, b) in enumerate(zip(s.cached_tokens + (-1,), ids)) if a != b)
    assert 0 < kept < held                      # the reply's end is re-rendered: the state must go back
    s.truncate(kept)
    assert s.seq.recomputed > 0
    close(s.step(ids[kept:], last_only=False), session(shiftlm, ctx=256).logits(ids)[kept:], "numpy")
    # and through Conversation itself: the second reply is a fresh session's reply to the whole chat
    s2 = session(shiftlm, ctx=256)
    conv2 = Conversation(s2, max_tokens=6, temperature=0)
    "".join(conv2.send("Hello there"))
    reply = "".join(conv2.send("And again?"))
    assert conv2.stats["cached_tokens"] > 0 and conv2.stats["recomputed_tokens"] > 0
    assert reply == session(shiftlm, ctx=256).chat(conv2.messages[:-1], max_tokens=6, temperature=0)


def test_memory_counts_the_states(shiftlm):
    from ggraph import memory
    from ggraph.runtime.session import MAX_SNAPSHOTS
    s = session(shiftlm)
    one = 2 * (64 + 64) * 4                               # two recurrent layers: shift (1, 64) and total (64,)
    assert sum(a.nbytes for a in s.states) == one
    plan = s.memory()
    assert plan["states"] == (1 + MAX_SNAPSHOTS) * one
    assert plan["total"] == plan["weights"] + plan["kv_cache"] + plan["states"] + plan["activations"]
    assert plan["kv_cache"] == 2 * 2 * 96 * 2 * 16 * 4     # K and V of the two attention layers only
    with pytest.raises(memory.MemoryBudgetError, match=r"and recurrent states \(1 × 1024 bytes"):
        session(shiftlm, max_memory=plan["kv_cache"] + 10)


def test_batch_and_serve_give_each_request_its_solo_text(shiftlm):
    from ggraph.runtime.batch import Batch
    from ggraph.serve.engine import Engine
    a, b = prompt_ids(9, seed=1), prompt_ids(5, seed=2)
    alone = {k: session(shiftlm, ctx=48).logits(ids)[-1] for k, ids in ((0, a), (1, b))}
    batch = Batch(shiftlm, slots=2, ctx=48, backend="numpy", **EXACT)
    assert batch.sequential
    out = batch.step({0: a, 1: b})
    for k in (0, 1):
        close(out[k], alone[k], "numpy")
    batch.truncate(0, 4)                                   # a slot's own state goes back with it
    close(batch.step({0: a[4:]})[0], alone[0], "numpy")
    prompts = [prompt_ids(6, seed=s) for s in (11, 12, 13)]        # three requests: a slot is used again
    want = [session(shiftlm, "llvm", ctx=48).generate(p, max_tokens=8, temperature=0) for p in prompts]
    engine = Engine(shiftlm, parallel=2, ctx=48, backend="llvm", threads=1, **EXACT)
    try:
        results, done = [[], [], []], []
        for i, p in enumerate(prompts):
            engine.submit(p, dict(max_tokens=8, temperature=0),
                          lambda kind, v, i=i: results[i].append(v) if kind == "piece" else done.append((kind, v)))
        import time
        deadline = time.time() + 120
        while len(done) < 3 and time.time() < deadline:
            time.sleep(0.05)
    finally:
        engine.close()
    assert [k for k, _ in done] == ["done"] * 3 and ["".join(r) for r in results] == want


def test_cli_run_chat_bench_dump(shiftlm, capsys, monkeypatch):
    import io
    from ggraph.cli import main
    path = str(shiftlm)
    assert main(["run", path, "-p", "Hello", "-n", "4", "--temp", "0", "--ctx", "64"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip("\n") == "Hello" + Session(path, ctx=64).generate("Hello", max_tokens=4, temperature=0)
    assert main(["dump", path, "--layer", "0", "--ctx", "32"]) == 0
    out = capsys.readouterr().out
    assert "state0:f32[1,64]" in out and "state_write state0" in out and "state_write state1" in out
    assert main(["bench", path, "-p", "8", "-n", "4", "-d", "40", "--repeats", "2", "--json"]) == 0
    assert '"depth": 40' in capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\nAnd again?\n"))
    assert main(["chat", path, "-n", "4", "--temp", "0", "--ctx", "128"]) == 0
    assert capsys.readouterr().out.strip()


def test_bench_memory_counts_states_in_a_fresh_process(shiftlm, tmp_path, capsys):
    """Each point runs in its own process: the plugin that registers the architecture goes with it."""
    import sys
    from pathlib import Path
    from ggraph.cli import main
    plugin = tmp_path / "shiftlm_plugin.py"
    plugin.write_text(f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                      "import test_state_caches\ntest_state_caches.register()\n")
    assert main(["bench", "--plugin", str(plugin), "--memory", str(shiftlm), "--ctx", "64", "-ctk", "f32",
                 "-ctv", "f32", "--fill", "20"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "states" in lines[1] and lines[2].split()[5] == f"{9 * 1024 / 2**20:.1f}"


def broken(tmp_path, shiftlm, name, **changes):
    """The toy architecture registered as ``name`` with some of its parts replaced, on a renamed copy."""
    parts = dict(flags=shift_flags, forward=shift_forward, states=shift_states) | changes
    models.register_architecture(name, parts["flags"], parts["forward"], states=parts["states"], replace=True)
    return edited(shiftlm, tmp_path / f"{name}.gguf", rename_arch=name)


def test_bad_declarations_name_the_layer(shiftlm, tmp_path):
    def grow(cfg, w, tokens, P, k, v, **kw):               # returns a state of another shape
        logits, k, v, states = shift_forward(cfg, w, tokens, P, k, v, **kw)
        states[2]["total"] = ops.concat([states[2]["total"], states[2]["total"]], 0)
        return logits, k, v, states

    def drop_kv(cfg, w, tokens, P, k, v, **kw):            # forgets layer 3's V cache
        logits, k, v, states = shift_forward(cfg, w, tokens, P, k, v, **kw)
        v[3] = None
        return logits, k, v, states

    def bad_states(cfg):
        out = shift_states(cfg)
        out[1] = {"x": Aval(("T", 4), f32)}
        return out
    cases = [
        (dict(forward=grow), r"layer 2 state 'total' came back as f32\[128\], declared f32\[64\]"),
        (dict(forward=drop_kv), "layer 3 is not in recurrent_layers but the forward returned no V cache"),
        (dict(states=bad_states), r"layer 1 state 'x': f32\[T,4\] must be an Aval of a static positive shape"),
        (dict(flags=lambda key, names, n: dict(shift_flags(key, names, n), recurrent_layers=(0,))),
         r"head_count_kv\[2\] = 0 \(no KV cache\) but layer 2 is not in the architecture's recurrent_layers \(0,\)"),
    ]
    try:
        for i, (change, message) in enumerate(cases):
            path = broken(tmp_path, shiftlm, f"badlm{i}", **change)
            with pytest.raises(ValueError, match=message) as e:
                session(path).logits([1, 2, 3])
            assert "\n" not in str(e.value)
        with pytest.raises(ValueError, match="states need a forward of its own"):
            models.register_architecture("badlm", shift_flags, states=shift_states)
        with pytest.raises(TypeError, match="with states, forward must take them"):
            models.register_architecture("badlm", shift_flags, lambda cfg, w, tokens, P, k, v, *, last_only=False,
                                         rope_factors=None: None, states=shift_states)
        assert "badlm" not in models.ARCHITECTURES
    finally:
        for i in range(len(cases)):
            models.ARCHITECTURES.pop(f"badlm{i}", None)


def test_imatrix_perplexity_and_diff_start_each_run_from_zero_states(shiftlm, capsys):
    import io
    from test_perplexity import CALIBRATION
    from ggraph import imatrix, perplexity
    from ggraph.cli import main
    options = dict(n_ctx=32, n_chunks=2, backend="numpy", cache_type_k="f32", cache_type_v="f32", out=io.StringIO())
    sums, est = imatrix.collect(shiftlm, CALIBRATION, **options)
    assert "blk.0.ssm_out.weight" in sums.sums and "blk.0.attn_q.weight" not in sums.sums
    want = perplexity.perplexity(shiftlm, CALIBRATION, **options)      # each chunk a fresh Session.logits
    assert est.count == want.count > 0 and abs(est.nll - want.nll) < 1e-5 * abs(want.nll)
    assert main(["diff", str(shiftlm), "--tokens", "5,6,7"]) == 0
    assert "top-1 token agrees at 100%" in capsys.readouterr().out
