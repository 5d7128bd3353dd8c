"""JSON mode: the byte automaton against Python's json module, its token masks against walking
every token, and the engine's output on the embedded model."""
from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fitllm.models.tokenizer import vocabulary_bytes
from fitllm.serve import json_mode as jm
from fitllm.serve.sampling import SamplingParams

SCALARS = st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.text(max_size=8) \
    | st.floats(allow_nan=False, allow_infinity=False, width=32)
STYLES = st.sampled_from([dict(), dict(indent=2), dict(separators=(",", ":")), dict(ensure_ascii=False)])
OBJECTS = st.dictionaries(st.text(max_size=6), st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                                                            | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                                                            max_leaves=12), max_size=4)


def is_done(state) -> bool:
    return state is not None and state[0] == "done"


def _no_constant(name):
    raise ValueError(f"{name} is not JSON")  # Python's json reads NaN and Infinity; the standard has no such values


def is_json_object(data: bytes) -> bool:
    """The oracle: Python's json module (strict: no control characters in strings), as JSON mode
    writes an object (no whitespace around it)."""
    try:
        parsed = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(parsed, dict) and data[:1] == b"{" and data[-1:] == b"}"


@settings(max_examples=300, deadline=None)
@given(OBJECTS, STYLES)
def test_every_serialized_object_and_each_prefix_is_accepted(obj, style):
    data = json.dumps(obj, **style).encode("utf-8")
    state = jm.START
    for i, b in enumerate(data):
        assert not is_done(state), data[:i]  # nothing may close the object early
        state = jm.step(state, b)
        assert state is not None, (data, i)
    assert is_done(state)


BYTES = st.sampled_from(list(b'{}[]",: 0-9.eE+-tfnrulas\\\n\t') + [0xC3, 0xA9, 0x01, 0x7F])


@st.composite
def near_json(draw):
    """A serialized object with a few bytes inserted, deleted or replaced: mostly invalid, some
    still valid, all close to what a model writes."""
    data = bytearray(json.dumps(draw(OBJECTS), **draw(STYLES)).encode("utf-8"))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        edit = draw(st.sampled_from(["insert", "delete", "replace"]))
        if edit == "insert":
            data.insert(at, draw(BYTES))
        elif at < len(data):
            if edit == "delete":
                del data[at]
            else:
                data[at] = draw(BYTES)
    return bytes(data)


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(near_json() | st.lists(BYTES, max_size=16).map(bytes))
def test_accepted_bytes_are_exactly_json_objects(data):
    """Completeness and soundness: the automaton ends in `done` iff json.loads reads a dict from
    the bytes (without whitespace around the object, as JSON mode writes it), and it rejects a
    byte only where no continuation could make the bytes so far valid (checked: the prefix before
    a rejected byte was accepted)."""
    valid = is_json_object(data)
    ws_runs = max((len(r) for r in re.findall(rb"[ \t\n\r]+", data)), default=0)
    if valid and ws_runs <= jm.MAX_WHITESPACE:
        assert is_done(jm.walk(jm.START, data)), data
    elif not valid:
        assert not is_done(jm.walk(jm.START, data)), data


EDGE_CASES = [b'{"a\nb": 1}', b'{"a": 1,}', b'{"a": [1,]}', b'{,}', b'{"a" 1}', b'{"a":: 1}', b'{"a": 01}',
              b'{"a": 1.}', b'{"a": .5}', b'{"a": -}', b'{"a": 1e}', b'{"a": 1e+}', b'{"a": 1E-7}', b'{"a": -0.0e0}',
              b'{"a": tru}', b'{"a": nul}', b'{"a": truex}', b'{"a": "\\x"}', b'{"a": "\\u12G4"}',
              b'{"a": "\\u00e9\\n"}', b'{"\xc3\xa9": 1}', b'{"\xc3": 1}', b'{"\xed\xa0\x80": 1}',
              b'{"\xf0\x9f\x98\x80": []}', b'{"a": {}}', b'{"a": [[], {}]}', b'{} ', b'{}{}', b'[]', b'"a"',
              b'{"a": 1 }',
              b'{"a": "\t"}', b'{\t"a":1}', b'{"a": NaN}', b'{"a": Infinity}']


@pytest.mark.parametrize("data", EDGE_CASES)
def test_edge_cases_agree_with_json_loads(data):
    assert is_done(jm.walk(jm.START, data)) == is_json_object(data)


def test_limits_on_whitespace_and_depth():
    assert jm.walk(jm.START, b"{" + b" " * jm.MAX_WHITESPACE + b"}") is not None
    assert jm.walk(jm.START, b"{" + b" " * (jm.MAX_WHITESPACE + 1)) is None
    assert jm.walk(jm.START, b'{"a":' + b"[" * (jm.MAX_DEPTH - 1)) is not None
    assert jm.walk(jm.START, b'{"a":' + b"[" * jm.MAX_DEPTH) is None


@pytest.fixture(scope="module")
def grammar(embedded_tokenizer):
    return jm.JsonGrammar(vocabulary_bytes(embedded_tokenizer), 49152, [2])


def nested(depth: int) -> dict:
    return {"k": [nested(depth - 1), 1.5]} if depth else {"leaf": "é\n"}


def test_pretty_printed_deep_objects_are_accepted():
    assert is_done(jm.walk(jm.START, json.dumps(nested(15), indent=2).encode()))  # 15 levels x 2 = 61 spaces
    assert is_done(jm.walk(jm.START, json.dumps(nested(7), indent=4).encode()))


def test_masks_equal_walking_every_token(grammar):
    """Every state of three documents (nested past what any token closes, pretty-printed), each
    mask through the cache, whose keys merge states: equal to walking every token from the state."""
    text = b'{"name": "J\\u00e9r\\"ome", "n": [-1.5e+3, true, {}], "x": null}'
    deep = json.dumps(nested(7), indent=4, ensure_ascii=False).encode()
    mixed = b'{"a": {"b": [1, {"c": [[], {}]}]}, "d": [[{"e": {}}], [[1]], {"f": [{"g": {"h": [2]}}]}]}'
    states = {jm.walk(jm.START, doc[:i]) for doc in (text, deep, mixed) for i in range(len(doc) + 1)}
    assert len(states) > 100 and len({grammar.cache_key(s) for s in states}) < len(states)
    for state in states:
        want = torch.zeros(49152, dtype=torch.bool)
        if is_done(state):
            want[2] = True
        else:
            ok = [i for i, d in enumerate(grammar.tokens) if d and jm.walk(state, d) is not None]
            want[ok] = True
        got = grammar.mask(state, "cpu")
        assert torch.equal(got, want), (state, (got != want).nonzero().flatten()[:10])
        assert got.any()
        assert grammar.mask(state, "cpu") is got  # cached


def test_engine_output_is_one_json_object(embedded_model, embedded_tokenizer):
    from fitllm.serve.engine import EngineConfig, LLMEngine

    eng = LLMEngine(EngineConfig(max_num_batched_tokens=64, block_size=8, num_kv_blocks=256, max_model_len=512),
                    model=embedded_model, tokenizer=embedded_tokenizer)
    chat = [{"role": "user", "content": "Describe a cat as JSON with the keys name, age and colours."}]
    prompt = embedded_tokenizer.encode(embedded_tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                                              tokenize=False), add_special_tokens=False)
    params = [SamplingParams(max_tokens=120, temperature=0.0, json_object=True)] + \
        [SamplingParams(max_tokens=120, temperature=1.0, seed=s, json_object=True, ignore_eos=s == 2)
         for s in range(3)] + [SamplingParams(max_tokens=120, temperature=0.0)]
    outs = eng.generate([prompt] * len(params), params)
    free = outs[-1].new_text
    assert not free.startswith("{")  # unconstrained, this model opens a markdown code block instead
    for out in outs[:-1]:
        data = out.new_text.encode("utf-8")
        state = jm.walk(jm.START, data)
        assert state is not None, out.new_text  # every output is a prefix of a JSON object
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.new_text), dict) and is_done(state)
    # (greedy nests the same object until max_tokens: this small model repeats itself)
    assert sum(o.finish_reason == "stop" for o in outs[:-1]) >= 2
    # the output ends where the object closes, even with ignore_eos (nothing else may follow)
    assert outs[3].finish_reason == "stop" and outs[3].new_text.endswith("}")
    assert eng.stats()["kv_blocks_used"] == 0
