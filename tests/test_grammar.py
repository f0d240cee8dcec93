"""Structured output: whatever the weights, sampled output stays inside the grammar. A random-weight
model samples freely (temperature 1), so only the mask keeps it valid; jsonschema is the oracle."""
import json
import re

import numpy as np
import pytest

import zoo
from ggraph.cli import main

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from ggraph.runtime.grammar import Grammar, GrammarError  # noqa: E402
from ggraph.runtime.session import Session  # noqa: E402


@pytest.fixture(scope="module")
def session():
    return Session(zoo.cached_model("llama", "f32"), ctx=1024, threads=1)


def _leaf(rng, depth: int) -> dict:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "array", "object", "null", "const"])
    if kind == "string":
        s = {"type": "string", "maxLength": int(rng.integers(0, 8))}
        if rng.random() < 0.3:
            s["minLength"] = int(rng.integers(0, s["maxLength"] + 1))
        return s
    if kind == "integer":
        lo = int(rng.integers(-1000, 1000))
        return {"type": "integer", "minimum": lo, "maximum": lo + int(rng.integers(0, 5000))}
    if kind == "number":
        return {"type": "number", "minimum": -10.5, "maximum": 99.25}
    if kind == "enum":
        return {"enum": ["red", "green", "blue", 3, None][: int(rng.integers(1, 6))]}
    if kind == "const":
        return {"const": "fixed"}
    if kind == "array" and depth < 2:
        return {"type": "array", "items": _leaf(rng, depth + 1), "maxItems": int(rng.integers(0, 4))}
    if kind == "object" and depth < 2:
        return _object(rng, depth + 1)
    return {"type": "boolean"} if kind != "null" else {"type": "null"}


def _object(rng, depth: int = 0) -> dict:
    names = [f"k{i}" for i in range(int(rng.integers(1, 5)))]
    props = {n: _leaf(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


SCHEMAS = [_object(np.random.default_rng(i)) for i in range(50)]


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_sampled_json_validates_against_its_schema(session, i):
    schema = SCHEMAS[i]
    out = session.generate("Data:", grammar=Grammar.json_schema(session.tokenizer, schema), max_tokens=600,
                           temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=i)
    assert session.stats["stop"] == "eog", (schema, out)           # the grammar ended it, not the budget
    jsonschema.validate(json.loads(out), schema)


def test_json_object_gives_an_object(session):
    for seed in range(3):
        out = session.generate("x", grammar=Grammar.json_object(session.tokenizer), max_tokens=200, temperature=0.5,
                               seed=seed)
        if session.stats["stop"] == "eog":                           # an open object may run past the budget
            assert isinstance(json.loads(out), dict)
        else:
            assert out.startswith("{")


def test_a_gbnf_grammar_bounds_the_language(session):
    g = Grammar.gbnf(session.tokenizer, 'root ::= ("yes" | "no") " " [0-9] [0-9]?')
    outs = {session.generate("Q:", grammar=g, max_tokens=20, temperature=1.0, seed=s) for s in range(12)}
    assert all(re.fullmatch(r"(yes|no) [0-9][0-9]?", o) for o in outs), outs
    assert len(outs) > 1                                              # it samples inside the language


def test_bad_grammars_and_schemas_are_refused_by_name(session):
    with pytest.raises(GrammarError, match="GBNF grammar"):
        Grammar.gbnf(session.tokenizer, 'root ::= ("unclosed')
    with pytest.raises(GrammarError, match="not valid JSON"):
        Grammar.json_schema(session.tokenizer, "{nope")
    with pytest.raises(GrammarError, match="JSON schema"):
        Grammar.json_schema(session.tokenizer, {"type": "object", "properties": {"a": {"type": "no-such-type"}}})
    other = Session(zoo.cached_model("llama", "f32"), ctx=64, threads=1)
    with pytest.raises(ValueError, match="another tokenizer"):
        other.generate("x", grammar=Grammar.json_object(session.tokenizer))


def test_run_takes_a_grammar_file(tmp_path, capsys):
    model = str(zoo.cached_model("llama", "f32"))
    g = tmp_path / "yn.gbnf"
    g.write_text('root ::= "yes" | "no"\n')
    assert main(["run", model, "-p", "Q:", "--grammar", str(g), "--no-echo", "--ctx", "64", "-t", "1"]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")
    s = tmp_path / "s.json"
    s.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                             "required": ["n"], "additionalProperties": False}))
    assert main(["run", model, "-p", "Q:", "--json-schema", str(s), "--no-echo", "--ctx", "64", "-t", "1"]) == 0
    assert re.fullmatch(r'\{"n":[0-9]\}', capsys.readouterr().out.strip())
    (tmp_path / "bad.json").write_text("{")
    assert main(["run", model, "-p", "Q:", "--json-schema", str(tmp_path / "bad.json")]) == 1
    assert "not valid JSON" in capsys.readouterr().err
    assert main(["run", model, "-p", "Q:", "--grammar", str(g), "--json-schema", str(s)]) == 1
    assert "not both" in capsys.readouterr().err
