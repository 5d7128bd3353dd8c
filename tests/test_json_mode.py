"""Structured output. JSON mode: the byte automaton against Python's json module. JSON schemas:
the compiled automaton against the jsonschema package (an independent validator) on random
schemas, pydantic's schemas and the embedded model; the compiler's errors. Both: token masks
against walking every token, and the engine's output on the embedded model."""
from __future__ import annotations

import datetime
import enum
import itertools
import json
import random
import re
import uuid
from typing import Literal, Optional, Union

import jsonschema
import pydantic
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fitllm.models.tokenizer import vocabulary_bytes
from fitllm.serve import json_mode as jm
from fitllm.serve import json_regex
from fitllm.serve.sampling import SamplingParams

SCALARS = st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.text(max_size=8) \
    | st.floats(allow_nan=False, allow_infinity=False, width=32)
STYLES = st.sampled_from([dict(), dict(indent=2), dict(separators=(",", ":")), dict(ensure_ascii=False)])
OBJECTS = st.dictionaries(st.text(max_size=6), st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                                                            | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                                                            max_leaves=12), max_size=4)


OBJ = jm.JSON_OBJECT


def is_done(config) -> bool:
    return OBJ.done(config)


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
    config = OBJ.start
    for i, b in enumerate(data):
        assert not is_done(config), data[:i]  # nothing may close the object early
        config = OBJ.step(config, b)
        assert config is not None, (data, i)
    assert is_done(config)


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


def whitespace_fits(data: bytes) -> bool:
    """The whitespace the automaton takes between tokens (outside strings): one space, or a newline
    and at most MAX_WHITESPACE - 1 spaces or tabs."""
    outside = re.sub(rb'"(?:[^"\\]|\\.)*"', b'""', data)
    run = re.compile(rb" |\n[ \t]{0,%d}" % (jm.MAX_WHITESPACE - 1))
    return all(run.fullmatch(r) for r in re.findall(rb"[ \t\n\r]+", outside))


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(near_json() | st.lists(BYTES, max_size=16).map(bytes))
def test_accepted_bytes_are_exactly_json_objects(data):
    """Completeness and soundness: the automaton ends in `done` iff json.loads reads a dict from
    the bytes (without whitespace around the object, as JSON mode writes it), and it rejects a
    byte only where no continuation could make the bytes so far valid (checked: the prefix before
    a rejected byte was accepted)."""
    valid = is_json_object(data)
    if valid and whitespace_fits(data):
        assert is_done(OBJ.walk(OBJ.start, data)), data
    elif not valid:
        assert not is_done(OBJ.walk(OBJ.start, data)), data


EDGE_CASES = [b'{"a\nb": 1}', b'{"a": 1,}', b'{"a": [1,]}', b'{,}', b'{"a" 1}', b'{"a":: 1}', b'{"a": 01}',
              b'{"a": 1.}', b'{"a": .5}', b'{"a": -}', b'{"a": 1e}', b'{"a": 1e+}', b'{"a": 1E-7}', b'{"a": -0.0e0}',
              b'{"a": tru}', b'{"a": nul}', b'{"a": truex}', b'{"a": "\\x"}', b'{"a": "\\u12G4"}',
              b'{"a": "\\u00e9\\n"}', b'{"\xc3\xa9": 1}', b'{"\xc3": 1}', b'{"\xed\xa0\x80": 1}',
              b'{"\xf0\x9f\x98\x80": []}', b'{"a": {}}', b'{"a": [[], {}]}', b'{} ', b'{}{}', b'[]', b'"a"',
              b'{"a": 1 }',
              b'{"a": "\t"}', b'{\t"a":1}', b'{"a": NaN}', b'{"a": Infinity}', b'{"a":  1}', b'{\n\n"a": 1}',
              b'{\r\n"a": 1}', b'{\n\t "a": 1}', b'{"a": 1 \n}', b'{"a b": 1}']


@pytest.mark.parametrize("data", EDGE_CASES)
def test_edge_cases_agree_with_json_loads(data):
    assert is_done(OBJ.walk(OBJ.start, data)) == (is_json_object(data) and whitespace_fits(data))


def test_limits_on_whitespace_and_depth():
    assert OBJ.walk(OBJ.start, b"{\n" + b" " * (jm.MAX_WHITESPACE - 1) + b"}") is not None
    assert OBJ.walk(OBJ.start, b"{\n" + b" " * jm.MAX_WHITESPACE) is None
    assert OBJ.walk(OBJ.start, b"{  ") is None and OBJ.walk(OBJ.start, b"{\n\n") is None
    assert OBJ.walk(OBJ.start, b'{"a":' + b"[" * (jm.MAX_DEPTH - 1)) is not None
    assert OBJ.walk(OBJ.start, b'{"a":' + b"[" * jm.MAX_DEPTH) is None


@pytest.fixture(scope="module")
def grammar(embedded_tokenizer):
    return jm.JsonGrammar(vocabulary_bytes(embedded_tokenizer), 49152, [2])


def nested(depth: int) -> dict:
    return {"k": [nested(depth - 1), 1.5]} if depth else {"leaf": "é\n"}


def test_pretty_printed_deep_objects_are_accepted():
    assert is_done(OBJ.walk(OBJ.start, json.dumps(nested(15), indent=2).encode()))  # 15 levels x 2 = 61 spaces
    assert is_done(OBJ.walk(OBJ.start, json.dumps(nested(7), indent=4).encode()))


def test_masks_equal_walking_every_token(grammar):
    """Every state of three documents (nested past what any token closes, pretty-printed), each
    mask through the cache, whose keys merge states: equal to walking every token from the state."""
    text = b'{"name": "J\\u00e9r\\"ome", "n": [-1.5e+3, true, {}], "x": null}'
    deep = json.dumps(nested(4), indent=4, ensure_ascii=False).encode()
    mixed = b'{"a": {"b": [1, {"c": [[], {}]}]}, "d": [[{"e": {}}], [[1]], {"f": [{"g": {"h": [2]}}]}]}'
    configs = {OBJ.walk(OBJ.start, doc[:i]) for doc in (text, deep, mixed) for i in range(len(doc) + 1)}
    assert len(configs) > 100 and len({frozenset(grammar.state_key(OBJ, s) for s in c) for c in configs}) < len(configs)
    for config in configs:
        assert_mask_is_exact(grammar, OBJ, config)


def assert_mask_is_exact(grammar, schema, config):
    """The cached mask equals walking every token from the configuration."""
    want = torch.zeros(49152, dtype=torch.bool)
    if schema.done(config):
        want[2] = True
    ok = [i for i, d in enumerate(grammar.tokens) if d and schema.walk(config, d) is not None]
    want[ok] = True
    got = grammar.mask(schema, config, "cpu")
    assert torch.equal(got, want), (config, (got != want).nonzero().flatten()[:10])
    assert got.any()
    assert grammar.mask(schema, config, "cpu") is got  # cached


def engine_and_prompt(model, tokenizer, question: str):
    from fitllm.serve.engine import EngineConfig, LLMEngine

    eng = LLMEngine(EngineConfig(max_num_batched_tokens=64, block_size=8, num_kv_blocks=256, max_model_len=512),
                    model=model, tokenizer=tokenizer)
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
    return eng, tokenizer.encode(text, add_special_tokens=False)


def test_engine_output_is_one_json_object(embedded_model, embedded_tokenizer):
    eng, prompt = engine_and_prompt(embedded_model, embedded_tokenizer,
                                    "Describe a cat as JSON with the keys name, age and colours.")
    params = [SamplingParams(max_tokens=120, temperature=0.0, json_object=True)] + \
        [SamplingParams(max_tokens=120, temperature=1.0, seed=s, json_object=True, ignore_eos=s == 2)
         for s in range(3)] + [SamplingParams(max_tokens=120, temperature=0.0)]
    outs = eng.generate([prompt] * len(params), params)
    free = outs[-1].new_text
    assert not free.startswith("{")  # unconstrained, this model opens a markdown code block instead
    for out in outs[:-1]:
        data = out.new_text.encode("utf-8")
        config = OBJ.walk(OBJ.start, data)
        assert config is not None, out.new_text  # every output is a prefix of a JSON object
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.new_text), dict) and is_done(config)
    # (greedy nests the same object until max_tokens: this small model repeats itself)
    assert sum(o.finish_reason == "stop" for o in outs[:-1]) >= 2
    # the output ends where the object closes, even with ignore_eos (nothing else may follow)
    assert outs[3].finish_reason == "stop" and outs[3].new_text.endswith("}")
    assert eng.stats()["kv_blocks_used"] == 0


# --- JSON schemas ---
NAMES = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=5)
# strings with a pattern, format or length (patterns in ASCII, where Python's re and ECMA agree)
TEXT_RULES = [{"pattern": "^[a-z]{1,3}$"}, {"pattern": "^(ab|c)+$"}, {"pattern": "x[0-9]"}, {"pattern": "^\\d+-[^-]*$"},
              {"format": "date"}, {"format": "date-time"}, {"format": "uuid"}, {"format": "email"},
              {"minLength": 2}, {"maxLength": 3}, {"minLength": 1, "maxLength": 2}, {"pattern": "^[a-c]*$", "minLength": 2}]


@st.composite
def bounded_numbers(draw):
    kind = draw(st.sampled_from(["integer", "number"]))
    values = st.integers(-40, 40) | st.sampled_from([-2.5, 0.125, 1.5, 1e-3])
    schema = {"type": kind}
    for side in ("minimum", "maximum"):
        if draw(st.booleans()):
            schema["exclusive" + side.title() if draw(st.booleans()) else side] = draw(values)
    if draw(st.booleans()):  # (steps exact in binary: jsonschema divides floats, the automaton works exactly)
        schema["multipleOf"] = draw(st.sampled_from([2, 3, 7, 0.5, 0.25, 1.5]))
    try:
        jm.Schema({"type": "array", "items": schema})
    except jm.SchemaError:
        schema = {"type": kind, "minimum": 0}  # (an empty range)
    return schema


LEAVES = st.sampled_from([{"type": t} for t in ("string", "integer", "number", "boolean", "null")]) \
    | st.lists(SCALARS, min_size=1, max_size=4).map(lambda v: {"enum": v}) \
    | SCALARS.map(lambda v: {"const": v}) | st.just({}) \
    | st.sampled_from(TEXT_RULES).map(lambda rule: {"type": "string", **rule}) | bounded_numbers()


@st.composite
def objects(draw, inner):
    props = draw(st.dictionaries(NAMES, inner, min_size=1, max_size=4))
    required = [name for name in props if draw(st.booleans())]
    return {"type": "object", "properties": props, "required": required}


@st.composite
def arrays(draw, inner):
    lo = draw(st.integers(0, 2))
    hi = draw(st.none() | st.integers(lo, lo + 3))
    schema = {"type": "array", "items": draw(inner), "minItems": lo, **({} if hi is None else {"maxItems": hi})}
    if draw(st.booleans()):  # a tuple: the first items' own schemas, then items (or none: items false)
        schema["prefixItems"] = draw(st.lists(inner, min_size=1, max_size=3))
        if draw(st.booleans()):
            schema["items"] = False
            schema["minItems"] = min(lo, len(schema["prefixItems"]))
    return schema


@st.composite
def unique_arrays(draw):
    """uniqueItems over enum values (pydantic's set of an Enum / Literal), some of them equal as JSON
    Schema compares (1 and 1.0)."""
    values = draw(st.lists(SCALARS | st.sampled_from([1, 1.0, True]), min_size=1, max_size=4))
    distinct = len({jm._identity(json.loads(json.dumps(v))) for v in values})
    lo = draw(st.integers(0, min(2, distinct)))
    hi = draw(st.none() | st.integers(lo, distinct + 1))
    return {"type": "array", "items": {"enum": values}, "uniqueItems": True, "minItems": lo,
            **({} if hi is None else {"maxItems": hi})}


UNIQUE_SCALARS = st.sampled_from([{"type": t} for t in ("integer", "number", "boolean", "string")]) \
    | bounded_numbers() | st.just({"type": ["integer", "boolean", "null"]}) \
    | st.just({"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"enum": [1, 2.5, "a", True]}]})


@st.composite
def unique_scalar_arrays(draw):
    """uniqueItems over scalars (pydantic's set[int], frozenset[float], set[bool], unions of them): minItems
    where the values are enough (else the schema is refused, tested elsewhere)."""
    schema = {"type": "array", "items": draw(UNIQUE_SCALARS), "uniqueItems": True,
              "minItems": draw(st.integers(0, 2)), **draw(st.sampled_from([{}, {"maxItems": 3}]))}
    try:
        jm.Schema(schema)
    except jm.SchemaError:
        schema["minItems"] = 0
    return schema


def containers(inner):
    return objects(inner) | arrays(inner) | unique_arrays() | unique_scalar_arrays() \
        | inner.map(lambda s: {"type": "object", "additionalProperties": s}) \
        | st.lists(inner, min_size=2, max_size=3).map(lambda options: {"anyOf": options}) \
        | st.tuples(inner, inner).map(lambda pair: {"type": ["object", "string"], "properties": {"x": pair[0]}})


SCHEMAS = (objects(st.recursive(LEAVES, containers, max_leaves=8))
           | arrays(st.recursive(LEAVES, containers, max_leaves=8)))


@st.composite
def instances(draw, schema):
    """A value of the schema, objects' keys in the schema's order (as the automaton writes them)."""
    if schema == {}:
        return draw(SCALARS)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return draw(st.sampled_from(schema["enum"]))
    if "anyOf" in schema:
        return draw(instances(draw(st.sampled_from(schema["anyOf"]))))
    kind = schema["type"] if isinstance(schema["type"], str) else draw(st.sampled_from(schema["type"]))
    if kind == "object" and "properties" in schema:
        return {name: draw(instances(sub)) for name, sub in schema["properties"].items()
                if name in schema.get("required", []) or draw(st.booleans())}
    if kind == "object":
        return draw(st.dictionaries(NAMES, instances(schema.get("additionalProperties", {})), max_size=3))
    if kind == "array" and schema.get("uniqueItems") and "enum" not in schema["items"]:
        plain = instances(schema["items"]).filter(lambda v: "e" not in json.dumps(v))  # (numbers: plain decimals)
        return draw(st.lists(plain, unique_by=lambda v: jm._identity(v), min_size=schema["minItems"],
                             max_size=schema.get("maxItems", 4)))
    if kind == "array" and schema.get("uniqueItems"):
        distinct = list({jm._identity(json.loads(json.dumps(v))): v for v in reversed(schema["items"]["enum"])}.values())
        hi = min(schema.get("maxItems", len(distinct)), len(distinct))
        return draw(st.permutations(distinct))[:draw(st.integers(schema.get("minItems", 0), hi))]
    if kind == "array":
        lo, prefix, rest = schema.get("minItems", 0), schema.get("prefixItems", []), schema["items"]
        hi = schema.get("maxItems", lo + 3)
        if rest is False:
            hi = min(hi, len(prefix))
        size = draw(st.integers(lo, hi))
        return [draw(instances(prefix[i] if i < len(prefix) else rest)) for i in range(size)]
    if kind == "string" and len(schema) > 1:
        return draw(text_of(schema))
    if kind in ("integer", "number") and len(schema) > 1:
        return draw(number_of(schema))
    return draw({"string": st.text(max_size=5), "integer": st.integers(-10**6, 10**6), "boolean": st.booleans(),
                 "null": st.none(), "number": st.floats(allow_nan=False, allow_infinity=False) | st.integers()}[kind])


def text_of(schema: dict):
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    pattern = schema.get("pattern") or (f"^(?:{json_regex.FORMATS[schema['format']]})$" if "format" in schema else None)
    if pattern is None:
        return st.text(min_size=lo, max_size=hi if hi is not None else lo + 4)
    ascii_text = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
    return st.from_regex(pattern, fullmatch="^" in pattern, alphabet=ascii_text) \
        .filter(lambda v: lo <= len(v) <= (hi if hi is not None else len(v)))


def number_of(schema: dict):
    """Values in the bounds, as plain decimals (bounds refuse exponents: 1e-05 is written 0.00001)."""
    def fits(v) -> bool:
        return jsonschema.Draft202012Validator(schema).is_valid(v)
    if schema["type"] == "integer":
        return st.integers(-50, 50).filter(fits)
    return (st.integers(-50, 50) | st.decimals(-50, 50, places=3).map(float)).filter(fits) \
        .filter(lambda v: "e" not in repr(v))


FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER  # (date, email, uuid, ...; date-time where rfc3339-validator is)
# (keys and enum / const strings are taken as json writes them without ensure_ascii: one spelling)
SCHEMA_STYLES = st.sampled_from([dict(indent=2), dict(separators=(",", ":")), dict(indent="\t")]) \
    .map(lambda style: {**style, "ensure_ascii": False})


def is_valid(text: bytes, schema: dict) -> bool:
    """The oracle: Python's json reads it and the jsonschema package validates it."""
    try:
        value = json.loads(text.decode("utf-8"), parse_constant=lambda name: 1 / 0)
    except (ValueError, UnicodeDecodeError, ZeroDivisionError):
        return False
    return jsonschema.Draft202012Validator(schema, format_checker=FORMATS).is_valid(value)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_values_of_the_schema_are_accepted(data):
    """Completeness: a value the schema allows, serialized in its properties' order, is accepted
    byte by byte and the automaton ends exactly at its last byte."""
    schema = data.draw(SCHEMAS)
    value = data.draw(instances(schema))
    text = json.dumps(value, **data.draw(SCHEMA_STYLES)).encode("utf-8")
    assert is_valid(text, schema)  # (the generator's own check)
    compiled = jm.Schema(schema)
    config = compiled.start
    for i, b in enumerate(text):
        assert not compiled.done(config), text[:i]
        config = compiled.step(config, b)
        assert config is not None, (schema, text, i)
    assert compiled.done(config)


def random_text(schema: jm.Schema, rng: random.Random, limit: int = 600) -> bytes:
    """Bytes chosen at random among those the automaton takes, drifting towards closing quotes and
    brackets as the text grows; asserts there is always a byte to take (no dead end)."""
    config, out = schema.start, bytearray()
    while not schema.done(config) and len(out) < limit:
        choices = [b for b in range(256) if schema.step(config, b) is not None]
        assert choices, (schema.document, bytes(out))
        weights = [(1 + len(out) / 8) if b in b'"}],' else 0.1 if b in b" \n" else 1.0 for b in choices]
        b = rng.choices(choices, weights)[0]
        out.append(b)
        config = schema.step(config, b)
    return bytes(out)


def finished_walks(compiled: jm.Schema, schema: dict, seed: int, limit: int, check=lambda text: None) -> int:
    """20 random walks of the automaton (random_text); each one that finishes must be valid for
    jsonschema and pass `check`. How many finished."""
    rng, finished = random.Random(seed), 0
    for _ in range(20):
        text = random_text(compiled, rng, limit=limit)
        if compiled.done(compiled.walk(compiled.start, text)):
            assert is_valid(text, schema), text
            check(text)
            finished += 1
    return finished


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SCHEMAS, st.integers(0, 2**32))
def test_everything_the_automaton_writes_is_valid(schema, seed):
    """Soundness: walks of random accepted bytes never dead-end, and what they finish is a value
    the schema allows."""
    compiled = jm.Schema(schema)
    rng = random.Random(seed)
    for _ in range(3):
        text = random_text(compiled, rng)
        if compiled.done(compiled.walk(compiled.start, text)):
            assert is_valid(text, schema), (schema, text)


class Colour(str, enum.Enum):
    RED = "red"
    DARK_RED = "dark red"


class Pet(pydantic.BaseModel):
    name: str
    legs: int
    colour: Colour
    kind: Literal["cat", "dog"] = "cat"
    weight: Optional[float] = None
    friends: list["Pet"] = []


class Owner(pydantic.BaseModel):
    owner: str
    pets: list[Pet]
    tags: dict[str, bool]
    note: Optional[str] = None


class Tagged(pydantic.BaseModel):
    colours: set[Colour]
    sizes: frozenset[Literal["s", "m", "l"]] = frozenset()


def test_unique_items_of_enums_never_repeat_nor_dead_end():
    """pydantic's set of an Enum ($ref) or of a Literal: uniqueItems over their values. An item is only
    begun from the values not taken yet, and a comma only where one is left."""
    schema = Tagged.model_json_schema()
    assert schema["properties"]["colours"]["uniqueItems"] is True
    compiled = jm.Schema(schema)
    walk = lambda doc: compiled.walk(compiled.start, doc.encode())  # noqa: E731
    assert compiled.done(walk('{"colours": ["red", "dark red"], "sizes": ["l", "s"]}'))
    for stray in ('{"colours": ["red", "red"', '{"colours": ["red", "dark red",', '{"colours": [], "sizes": ["m", "s", "l",'):
        assert walk(stray) is None, stray
    finished_walks(compiled, schema, 0, 400, Tagged.model_validate_json)


class Labels(pydantic.BaseModel):
    tags: set[str]
    note: str = ""


def test_unique_strings_never_repeat_as_values(grammar):
    """pydantic's set[str]: uniqueItems over plain strings. Each item's text is kept as decoded
    characters, so an item equal to an earlier one as a value cannot close (an escape spelling it
    otherwise included), while one that only starts alike goes on."""
    schema = Labels.model_json_schema()
    assert schema["properties"]["tags"] == {"items": {"type": "string"}, "title": "Tags", "type": "array",
                                            "uniqueItems": True}
    compiled = jm.Schema(schema)
    walk = lambda doc: compiled.walk(compiled.start, doc.encode())  # noqa: E731
    doc = '{"tags": ["a", "ab", "", "\\u00e9t\u00e9", "A"], "note": "a"}'
    assert compiled.done(walk(doc))
    for stray in ('{"tags": ["a", "a"', '{"tags": ["a", "\\u0061"', '{"tags": ["", ""', '{"tags": ["\u00e9", "\\u00e9"'):
        assert walk(stray) is None, stray
    for fine in ('{"tags": ["a", "a', '{"tags": ["a", "\\u0061b"', '{"tags": ["ab", "a"'):
        assert walk(fine) is not None, fine
    def distinct(text):
        tags = json.loads(text)["tags"]
        assert len(set(tags)) == len(tags)
    assert finished_walks(compiled, schema, 5, 400, distinct) >= 5
    data = doc.encode()
    for config in {compiled.walk(compiled.start, data[:i]) for i in range(len(data) + 1)}:
        assert_mask_is_exact(grammar, compiled, config)


class Ids(pydantic.BaseModel):
    ids: set[int]
    weights: frozenset[float] = frozenset()
    levels: set[pydantic.conint(ge=1, le=3)] = set()
    flags: set[bool] = set()
    mixed: set[Union[int, bool, Literal["x"]]] = set()


def token_ids(grammar, *texts: bytes) -> list[int]:
    return [i for i, d in enumerate(grammar.tokens) if d in texts]


def test_unique_numbers_never_repeat_nor_dead_end(grammar):
    """pydantic's set[int], frozenset[float], a set of bounded integers, set[bool] and a set of a union:
    uniqueItems over scalars, values compared as JSON Schema does (1 and 1.0 equal, -0 and 0 too, true
    and 1 not). A number item is finished at the byte after it, which is refused where its value is an
    earlier item's; a digit is refused where every value it can still become is taken, and a comma where
    no value is left, so no walk dead-ends."""
    schema = Ids.model_json_schema()
    assert schema["properties"]["ids"] == {"items": {"type": "integer"}, "title": "Ids", "type": "array",
                                           "uniqueItems": True}
    compiled = jm.Schema(schema)
    walk = lambda doc: compiled.walk(compiled.start, doc.encode())  # noqa: E731
    doc = ('{"ids": [1, 2, 10, -0, 11, -1], "weights": [0.5, 1, 1.25, -0.5], "levels": [3, 1, 2], '
           '"flags": [true, false], "mixed": [1, true, "x", 2, false]}')
    assert compiled.done(walk(doc))
    Ids.model_validate_json(doc)
    for stray in ('{"ids": [1, 1]', '{"ids": [1, 1,', '{"ids": [7, 7 ', '{"ids": [0, -0', '{"ids": [-0, 0',
                  '{"ids": [1, 10, 1]', '{"ids": [1e', '{"ids": [], "weights": [1, 1.0]', '{"ids": [], "weights": [1e',
                  '{"ids": [], "weights": [0.5, 0.50,', '{"ids": [], "levels": [3, 3', '{"ids": [], "levels": [4',
                  '{"ids": [], "levels": [1, 2, 3,', '{"ids": [], "flags": [true, true',
                  '{"ids": [], "flags": [true, false,', '{"ids": [], "mixed": [1, true, 1]',
                  '{"ids": [], "mixed": [1, 1.0',
                  '{"ids": [], "mixed": ["x", "x"', '{"ids": [], "mixed": [false, false'):
        assert walk(stray) is None, stray
    for fine in ('{"ids": [1, 1', '{"ids": [1, 10, 1', '{"ids": [1, -1', '{"ids": [], "weights": [1, 1.0',
                 '{"ids": [], "weights": [1, 1.01]', '{"ids": [], "levels": [3, 2, 1]', '{"ids": [], "levels": [3, 2,',
                 '{"ids": [], "mixed": [1, true, 0]', '{"ids": [], "mixed": [true, 1, 12'):
        assert walk(fine) is not None, fine
    # the masks: after a repeat of 7 nothing may end the item, digits may go on; the last level left is all
    # that may begin
    ends = token_ids(grammar, b",", b"]", b", ", b"]}", b" ")
    assert len(ends) >= 4
    repeat = walk('{"ids": [7, 12, 7')
    mask = grammar.mask(compiled, repeat, "cpu")
    assert not mask[ends].any() and mask[token_ids(grammar, b"0", b"5")].all()
    assert grammar.mask(compiled, walk('{"ids": [7, 12, 70'), "cpu")[token_ids(grammar, b",", b"]")].all()
    last = grammar.mask(compiled, walk('{"ids": [], "levels": [1, 3, '), "cpu")
    assert last[token_ids(grammar, b"2")].all() and not last[token_ids(grammar, b"1", b"3", b"]")].any()
    data = doc.encode()
    for config in {compiled.walk(compiled.start, data[:i]) for i in range(len(data) + 1)}:
        assert_mask_is_exact(grammar, compiled, config)

    def distinct(text):
        for name, items in json.loads(text).items():
            assert len({jm._identity(v) for v in items}) == len(items), (name, items)
    assert finished_walks(compiled, schema, 7, 500, lambda text: (distinct(text), Ids.model_validate_json(text))) >= 5


@pytest.mark.parametrize("items, lo", [
    ({"type": "integer", "minimum": 1, "maximum": 3}, 3), ({"type": "integer", "minimum": -2, "maximum": 1}, 2),
    ({"type": ["integer", "null"], "minimum": 0, "maximum": 10, "multipleOf": 5}, 4),
    ({"anyOf": [{"type": "integer", "minimum": 0, "maximum": 2}, {"enum": [1, 2.0, 3.5, "a"]}, {"type": "boolean"}]},
     6),
])
def test_unique_items_of_few_values_never_dead_end(items, lo):
    """Every configuration reachable in an array of unique items drawn from a few values (taken up to
    minItems, all of them) has a byte to go on with or is done: repeats that would strand the walk
    (a digit that can only become a taken value, a comma with nothing left) are refused before."""
    compiled = jm.Schema({"type": "array", "items": items, "uniqueItems": True, "minItems": lo})
    seen, todo = {compiled.start}, [compiled.start]
    while todo:  # (newlines and tabs left out: indentation multiplies the configurations, not the values)
        config = todo.pop()
        after = [c for c in (compiled.step(config, b) for b in range(256) if b not in b"\n\t") if c is not None]
        assert after or compiled.done(config), config
        todo += [c for c in after if c not in seen and not seen.add(c)]
    assert len(seen) > 20


SEVERAL_PATTERNS = {"type": "object", "patternProperties": {
    "^a_": {"type": "integer"}, "^b_": {"type": "string", "maxLength": 3}, "^c_": {"type": "integer"},
    "^[0-9]+$": {"type": "boolean"}, "x$": {"type": "null"}, "^nox": False}, "additionalProperties": False}


def test_several_pattern_properties_give_each_key_its_schema(grammar):
    """patternProperties with several patterns: a key matches one of them, its value follows that pattern's
    schema; patterns of one schema are one group. A key that patterns of two schemas match ("a_x" under
    "^a_" and "x$") is never finished, and a character comes only while the key can still end matching
    one group alone; keys of a false schema never come. Accepted documents, refused prefixes, masks exact,
    random walks that jsonschema reads (it holds a key to every pattern it matches)."""
    compiled = jm.Schema(SEVERAL_PATTERNS)
    walk = lambda doc: compiled.walk(compiled.start, doc.encode())  # noqa: E731
    doc = '{"a_n": -1, "b_s": "abc", "c_": 2, "12": true, "zx": null, "a_xy": 3, "nx": null}'
    assert compiled.done(walk(doc)) and compiled.done(walk("{}"))
    jsonschema.validate(json.loads(doc), SEVERAL_PATTERNS)
    for stray in ('{"a_n": "s"', '{"b_s": 1', '{"b_s": "abcd', '{"c_": true', '{"12": 1', '{"zx": 1', '{"d"',
                  '{"a_x"', '{"a_x": ', '{"b_x"', '{"nox', '{"a_": 1, "q"'):
        assert walk(stray) is None, stray
    for fine in ('{"a_x', '{"a_xy"', '{"1', '{"12', '{"no', '{"1x": null}', '{"b_xy": "x"}'):
        assert walk(fine) is not None, fine
    data = doc.encode()
    for config in {compiled.walk(compiled.start, data[:i]) for i in range(len(data) + 1)}:
        assert_mask_is_exact(grammar, compiled, config)
    assert finished_walks(compiled, SEVERAL_PATTERNS, 4, 400) >= 5
    # patterns whose keys overlap but whose schemas are the same: one group, the key takes the value
    same = jm.Schema({"type": "object", "patternProperties": {"^a": {"type": "integer"}, "b$": {"type": "integer"}}})
    assert same.done(same.walk(same.start, b'{"ab": 1, "b": 2}'))
    # one pattern still as before (pydantic's dict with constrained keys), false as only {}
    one = jm.Schema({"type": "object", "patternProperties": {"^k": False}})
    assert one.done(one.walk(one.start, b"{}")) and one.walk(one.start, b'{"') is None


@pytest.mark.parametrize("patterns", [["^a", "b$"], ["^[ab]+$", "^a*$", "b{2}"], ["x", "^x", "^(?:x|y)$"]])
def test_choice_can_finish_equals_brute_force(patterns):
    """json_regex.Choice (each pattern its own group): can_finish against trying every string of up to 4
    characters drawn from one code point of each class the patterns tell apart; accepted exactly where
    the patterns that match are of one group."""
    choice = json_regex.Choice([(json_regex.Regex(p), i) for i, p in enumerate(patterns)])
    letters = [cp for cp in choice.cuts if not 0xD800 <= cp <= 0xDFFF]
    for word in itertools.product(letters[:6], repeat=2):
        text = "".join(map(chr, word))
        state = choice.start
        for cp in word:
            state = choice.step(state, cp) if state else state
        matched = [p for p in patterns if re.search(p, text)]
        assert bool(state) and choice.accepts(state) == (len(matched) == 1), (text, matched)
    for state in {choice.start} | {choice.step(choice.start, cp) for cp in letters}:
        if not state:
            continue
        ends = set()  # lengths after which a string is accepted
        for n in range(5):
            for word in itertools.product(letters, repeat=n):
                at = state
                for cp in word:
                    at = choice.step(at, cp) if at else at
                if at and choice.accepts(at):
                    ends.add(n)
        for lo in range(4):
            for hi in (lo, lo + 1, None):
                want = any(lo <= n and (hi is None or n <= hi) for n in ends)
                if want or hi is not None:  # (past 4 characters brute force cannot say no)
                    assert choice.can_finish(state, lo, hi) == want, (state, lo, hi)


def test_pydantic_schemas_with_refs_enums_and_recursion():
    schema = Owner.model_json_schema()  # $defs, $ref (a recursive one), enum, const, anyOf with null, defaults
    compiled = jm.Schema(schema)
    owner = Owner(owner="Ann", pets=[Pet(name="Tom", legs=4, colour=Colour.DARK_RED, weight=4.5,
                                         friends=[Pet(name="Rex", legs=3, colour="red", kind="dog")])],
                  tags={"x": True})
    for text in (owner.model_dump_json(), owner.model_dump_json(indent=2), owner.model_dump_json(exclude_defaults=True)):
        assert compiled.done(compiled.walk(compiled.start, text.encode())), text
    assert compiled.walk(compiled.start, owner.model_dump_json().replace('"legs":4', '"legs":4.5').encode()) is None
    assert compiled.walk(compiled.start, owner.model_dump_json().replace('"red"', '"blue"').encode()) is None
    rng = random.Random(0)
    finished = 0
    for _ in range(30):
        text = random_text(compiled, rng, limit=1500)
        if compiled.done(compiled.walk(compiled.start, text)):
            Owner.model_validate_json(text)  # pydantic itself reads it
            finished += 1
    assert finished >= 10


@pytest.mark.parametrize("schema, message", [
    ({"type": "string"}, "top-level value must be an object or an array"),
    ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
     "a.uniqueItems: supported where the items are enum / const values"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"enum": [1, 1.0, 2]}, "uniqueItems": True,
                                             "minItems": 3}}}, "more than the 2 distinct values"),
    ({"type": "array", "items": {"type": "boolean"}, "uniqueItems": True, "minItems": 3},
     "schema: minItems (3) is more than the 2 distinct values its items allow"),  # set[bool] of 3
    ({"type": "array", "items": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                           {"type": "integer", "minimum": 5, "maximum": 14}, {"enum": [3, 15.0]}]},
      "uniqueItems": True, "minItems": 17}, "more than the 16 distinct values"),  # (overlaps counted once)
    ({"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}, "uniqueItems": True,
      "minItems": 6}, "more than the 5 distinct values"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "object"}, "uniqueItems": True}}},
     "properties.a.uniqueItems: supported where the items are enum / const values, strings, numbers"),
    ({"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "array"}]}, "uniqueItems": True},
     "schema.uniqueItems: supported where"),
    ({"type": "array", "items": {"$ref": "#"}, "uniqueItems": True}, "schema.uniqueItems: supported where"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "integer"}, "uniqueItems": True},
     "no prefixItems"),
    ({"type": "array", "items": {"type": "string", "format": "date"}, "uniqueItems": True},
     "uniqueItems: strings with a pattern, format or maxLength are not supported"),
    ({"type": "object", "patternProperties": {"": {"type": "integer"}, ".*": {"type": "string"}}},
     "schema.patternProperties: every key that matches a pattern also matches one of another schema"),
    ({"type": "object", "properties": {"a": {}}, "patternProperties": {"^a": {}, "^b": {}}},
     "patternProperties: supported as one or more patterns on an object that lists no properties"),
    ({"type": "object", "patternProperties": {"^a": {}}, "additionalProperties": {}}, "supported as one or more"),
    ({"type": "object", "patternProperties": {"^a": {}, "[z-a]": {}}},
     r"patternProperties.\[z-a\]: a range out of order"),
    ({"type": "object", "patternProperties": {"^a": {}, "^b": {"type": "date"}}},
     r"patternProperties.\^b.type: expected one of"),
    ({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 0}}}, "greater than 0"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 1, "maximum": 4, "multipleOf": 5}}},
     "no integer lies between its minimum and maximum that is a multiple of its multipleOf"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 1, "maximum": 4, "multipleOf": 2.5}}},
     "that is a multiple"),  # (an integer multiple of 2.5 is a multiple of 5)
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=a)"}}}, "properties.a.pattern: lookaround"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "ipv6"}}}, 'a.format: "ipv6" is not supported'),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "date", "pattern": "a"}}}, "next to 'format'"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^ab$", "maxLength": 1}}},
     "no string of 0 to 1 characters matches the pattern"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": 3, "maxLength": 2}}},
     "minLength (3) is more than maxLength (2)"),
    ({"type": "object", "properties": {"a": {"type": "integer", "exclusiveMinimum": 1, "maximum": 1.5}}},
     "no integer lies between"),
    ({"type": "object", "properties": {"a": {"type": "number", "exclusiveMinimum": True}}}, "expected a number"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": True}, "only false is supported"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "'b' is not among the properties"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/B"}}}, "does not point into the schema"),
    ({"type": "object", "properties": {"a": {"$ref": "http://x/y"}}}, "only references inside the schema"),
    ({"type": "array", "items": [{}, {}]}, "use prefixItems"),
    ({"type": "array", "prefixItems": [{}], "items": False, "minItems": 2}, "more than the 1 items"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "minItems (3) is more than maxItems (2)"),
    ({"type": "object", "properties": {"a": {"enum": []}}}, "expected a non-empty list"),
    ({"type": "object", "properties": {"a": {"allOf": [{}, {}]}}}, "only one schema"),
    ({"type": "object", "properties": {"a": {"type": "date"}}}, "properties.a.type: expected one of"),
    ({"type": "object", "properties": {"a": {"type": "string", "items": {}}}}, "'items' does not apply"),
    ({"type": "object", "properties": {"a": {"const": float("nan")}}}, "properties.a"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/B"}}, "$defs": {"B": {"anyOf": [
        {"$ref": "#/$defs/B"}, {"type": "null"}]}}}, "leads back to itself"),
])
def test_schemas_that_cannot_be_enforced_are_refused_with_where(schema, message):
    with pytest.raises(jm.SchemaError, match=message.replace("(", r"\(").replace(")", r"\)")):
        jm.Schema(schema)


def test_enum_and_type_both_apply():
    both = jm.Schema({"type": "object", "properties": {"e": {"type": "string", "enum": [1, "x", None]},
                                                       "c": {"type": ["integer", "null"], "enum": [2.0, 2.5, None]}}})
    assert both.walk(both.start, b'{"e": 1') is None and both.done(both.walk(both.start, b'{"e": "x", "c": null}'))
    assert both.done(both.walk(both.start, b'{"c": 2.0}')) and both.walk(both.start, b'{"c": 2.5') is None


def test_nesting_cap_is_never_walked_into():
    """A value begins only where its smallest form fits under MAX_DEPTH; a schema whose values
    cannot fit is refused at once (it would otherwise fail mid-answer)."""
    tree = jm.Schema({"type": "object", "properties": {"next": {"$ref": "#"}, "leaf": {"type": "integer"}}})
    deep = tree.walk(tree.start, b'{"next": ' * (jm.MAX_DEPTH - 1) + b"{")
    assert deep is not None and tree.walk(deep, b'"next"') is None and tree.done(tree.walk(deep, b'"leaf": 1' + b"}" * 32))
    needs_2 = jm.Schema({"type": "array", "items": {"type": "object", "properties": {
        "p": {"type": "array", "items": {"type": "integer"}, "minItems": 1}}, "required": ["p"]}, "minItems": 1})
    assert needs_2.min_depth[needs_2.root] == 3
    with pytest.raises(jm.SchemaError, match="no value of it fits in 32 levels"):
        jm.Schema({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]})
    rng = random.Random(1)
    for _ in range(20):  # random walks over a schema that can recurse: no dead end at the cap either
        text = random_text(tree, rng, limit=400)
        assert tree.walk(tree.start, text) is not None


def test_strict_reading_of_objects():
    closed = jm.Schema({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                        "required": ["b"]})
    assert closed.done(closed.walk(closed.start, b'{"b": 1}'))
    assert closed.done(closed.walk(closed.start, b'{"a": 1, "b": 2}'))
    assert closed.walk(closed.start, b'{"b": 1, "a": 2}') is None  # the schema's order
    assert closed.walk(closed.start, b'{"a": 1}') is None or not closed.done(closed.walk(closed.start, b'{"a": 1}'))
    assert closed.walk(closed.start, b'{"a": 1,}') is None
    assert closed.walk(closed.start, b'{"b": 1, "c"') is None  # no other keys
    free = jm.Schema({"type": "object"})  # no properties listed: any keys, any values (JSON mode)
    assert free.done(free.walk(free.start, b'{"z": [1, {"y": null}]}'))
    empty = jm.Schema({"type": "object", "additionalProperties": False})
    assert empty.done(empty.walk(empty.start, b"{}")) and empty.walk(empty.start, b'{"') is None
    counted = jm.Schema({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2})
    assert counted.walk(counted.start, b"[]") is None and counted.walk(counted.start, b"[1,2,") is None
    assert counted.done(counted.walk(counted.start, b"[1, 2]"))


def test_schema_masks_equal_walking_every_token(grammar):
    """Configurations of one state and of several (a key that is a prefix of another, enum values
    sharing a prefix, anyOf of an integer and a number), each mask through the cache."""
    schema = jm.Schema({"type": "object", "properties": {
        "id": {"type": "integer"}, "ids": {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "number"}]},
                                           "maxItems": 3},
        "mode": {"enum": ["on", "one", 1, 12, None]}, "deep": {"type": "object", "additionalProperties": {"type": "boolean"}}},
        "required": ["id"]})
    doc = b'{"id": -12, "ids": [1, 2.5e1, 3], "mode": "one", "deep": {"x": true, "y": false}}'
    configs = {schema.walk(schema.start, doc[:i]) for i in range(len(doc) + 1)}
    assert len(configs) > 60 and any(len(c) > 1 for c in configs)
    for config in configs:
        assert_mask_is_exact(grammar, schema, config)


def test_strings_and_numbers_with_rules():
    schema = jm.Schema({"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"}, "day": {"type": "string", "format": "date"},
        "name": {"type": "string", "minLength": 2, "maxLength": 4}, "n": {"type": "integer", "minimum": -5, "maximum": 12},
        "p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}}})
    walk = lambda doc: schema.walk(schema.start, doc.encode())  # noqa: E731
    assert schema.done(walk('{"code": "AB-123", "day": "2026-12-06", "name": "J\\u00e9\u00e9", "n": -5, "p": 1.0}'))
    for stray in ('{"code": "AB-1234', '{"code": "Ab', '{"day": "2026-02-30', '{"name": "a"', '{"name": "abcde',
                  '{"n": 13', '{"n": -6', '{"n": 1.', '{"n": 1e', '{"p": 0,', '{"p": 1.01', '{"p": -', '{"p": 0.5e'):
        assert walk(stray) is None, stray
    for fine in ('{"n": 1', '{"n": -', '{"p": 0.', '{"p": 0.00001', '{"name": "ab\\', '{"name": "ab\\u00'):
        assert walk(fine) is not None, fine


def test_multiple_of_is_exact_on_the_decimal_text():
    """multipleOf on the value as written (0.3 is a multiple of 0.1, which float division denies), with and
    without bounds: a digit is refused as soon as no multiple can follow it; integers take the integer
    multiples of a fractional step."""
    schema = jm.Schema({"type": "object", "properties": {
        "t": {"type": "number", "multipleOf": 0.1}, "q": {"type": "number", "multipleOf": 0.25, "minimum": -1},
        "k": {"type": "integer", "multipleOf": 7, "maximum": 30}, "h": {"type": "integer", "multipleOf": 2.5}}})
    walk = lambda doc: schema.walk(schema.start, doc.encode())  # noqa: E731
    assert schema.done(walk('{"t": 0.3, "q": -0.75, "k": -14, "h": 10}'))
    assert schema.done(walk('{"t": 12, "q": 3.50, "k": 28, "h": -5}'))
    for stray in ('{"t": 0.31', '{"t": 0.3e', '{"q": 0.3', '{"q": -1.25', '{"q": 0.7,', '{"k": 2,',
                  '{"k": 3', '{"k": 35', '{"k": 4', '{"h": 12,', '{"h": 7,'):
        assert walk(stray) is None, stray  # ('{"k": 3': 30 is past the last multiple of 7 under the maximum)
    for fine in ('{"t": 0.30', '{"q": 0.2', '{"q": 0.7', '{"q": -1', '{"k": 2', '{"k": -1', '{"h": 1', '{"h": 3'):
        assert walk(fine) is not None, fine


def test_constrained_masks_equal_walking_every_token(grammar):
    """Masks of states inside strings with a pattern, a format or lengths (escapes and multi-byte
    characters under way included), inside bounded numbers and multiples, and in unique items."""
    schema = jm.Schema({"type": "object", "properties": {
        "w": {"type": "string", "pattern": "^[a-z ]+$"}, "e": {"type": "string", "format": "email"},
        "s": {"type": "string", "minLength": 3, "maxLength": 6}, "f": {"type": "string", "pattern": "é\\d"},
        "n": {"type": "integer", "minimum": 10, "maximum": 300}, "x": {"type": "number", "maximum": -0.5},
        "m": {"type": "number", "multipleOf": 0.25},
        "u": {"type": "array", "items": {"enum": ["x", "yy", 3]}, "uniqueItems": True}}})
    doc = ('{"w": "hello world", "e": "ann.lee@mail.org", "s": "a\\n\\u00e9\u00e9b", "f": "xé1", "n": 250, "x": -3.25, '
           '"m": -12.75, "u": ["yy", 3, "x"]}')
    data = doc.encode()
    configs = {schema.walk(schema.start, data[:i]) for i in range(len(data) + 1)}
    assert None not in configs and len(configs) > 70
    for config in configs:
        assert_mask_is_exact(grammar, schema, config)


class Scores(pydantic.BaseModel):
    by_level: dict[Literal["low", "high", "a.b"], int]  # propertyNames: enum
    by_code: dict[pydantic.constr(pattern=r"^[A-Z]{2}\d$"), bool]  # patternProperties
    by_id: dict[pydantic.constr(min_length=2, max_length=3), int] = {}  # propertyNames: lengths


def test_property_names_limit_the_keys_of_free_objects(grammar):
    """propertyNames and patternProperties (pydantic's dict with Literal or constrained keys): each key
    is walked through its pattern, lengths or listed names; the values follow additionalProperties or
    the pattern's schema. Accepted documents, refused prefixes, random walks that pydantic and
    jsonschema read, masks exact on keys."""
    schema = Scores.model_json_schema()
    kinds = [sorted(p.get("propertyNames", p.get("patternProperties", {}))) for p in schema["properties"].values()]
    assert kinds == [["enum"], ["^[A-Z]{2}\\d$"], ["maxLength", "minLength"]]
    compiled = jm.Schema(schema)
    walk = lambda doc: compiled.walk(compiled.start, doc.encode())  # noqa: E731
    doc = '{"by_level": {"low": 1, "a.b": 2}, "by_code": {"AB1": true, "ZZ9": false}, "by_id": {"x\\n": 3}}'
    assert compiled.done(walk(doc))
    for stray in ('{"by_level": {"lo": 1', '{"by_level": {"ab', '{"by_level": {"mid"', '{"by_code": {"Ab',
                  '{"by_code": {"AB12', '{"by_code": {"AB1": 1', '{"by_level": {}, "by_code": {}, "by_id": {"x"',
                  '{"by_level": {}, "by_code": {}, "by_id": {"abcd'):
        assert walk(stray) is None, stray
    assert finished_walks(compiled, schema, 3, 600, Scores.model_validate_json) >= 5
    data = doc.encode()
    for config in {compiled.walk(compiled.start, data[:i]) for i in range(len(data) + 1)}:
        assert_mask_is_exact(grammar, compiled, config)
    # next to listed properties propertyNames must take each; const; a key schema of another type
    assert jm.Schema({"type": "object", "properties": {"ab": {}}, "propertyNames": {"maxLength": 2}})
    with pytest.raises(jm.SchemaError, match="propertyNames: the property 'abc' is not a name it allows"):
        jm.Schema({"type": "object", "properties": {"abc": {}}, "propertyNames": {"maxLength": 2}})
    one = jm.Schema({"type": "object", "propertyNames": {"const": "k"}, "additionalProperties": {"type": "null"}})
    assert one.done(one.walk(one.start, b'{"k": null}')) and one.walk(one.start, b'{"j"') is None
    with pytest.raises(jm.SchemaError, match="propertyNames: expected a schema of strings"):
        jm.Schema({"type": "object", "propertyNames": {"type": "integer"}})


class Reading(pydantic.BaseModel):
    sensor: str = pydantic.Field(pattern="^[a-z]+-[0-9]{2}$")
    taken: datetime.date
    at: datetime.datetime
    id: uuid.UUID
    value: float = pydantic.Field(ge=-40, lt=125)
    count: int = pydantic.Field(gt=0, le=1000)
    note: str = pydantic.Field(min_length=1, max_length=12)
    where: tuple[float, float, Optional[str]]  # prefixItems


def test_pydantic_constraints_and_formats():
    compiled = jm.Schema(Reading.model_json_schema())
    sample = Reading(sensor="hall-07", taken="2026-12-06", at="2026-12-06T23:05:09Z", id=uuid.uuid4(), value=21.5,
                     count=3, note="ok", where=(1.5, -2, None))
    assert compiled.done(compiled.walk(compiled.start, sample.model_dump_json().encode()))
    # pydantic itself reads them too: pattern, dates, UUID, bounds, lengths
    assert finished_walks(compiled, Reading.model_json_schema(), 2, 1500, Reading.model_validate_json) >= 5


def test_tagged_values_follow_their_schema(embedded_model, embedded_tokenizer):
    """tagged_json (strict tools under tool_choice 'auto'): text is free, but after the open tag
    comes one value of the schema and then the close tag. Here '<' and '>' stand for the tags and
    a logit bias makes the model open one whenever it is free to."""
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": "add"}, "arguments": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}},
        "required": ["name", "arguments"]}, {"type": "object", "properties": {"name": {"const": "now"}, "arguments": {
            "type": "object", "additionalProperties": False}}, "required": ["name", "arguments"]}]}
    open_, close = (embedded_tokenizer.encode(t, add_special_tokens=False)[0] for t in ("<", ">"))
    eng, prompt = engine_and_prompt(embedded_model, embedded_tokenizer, "Add 2 and 3.")
    params = [SamplingParams(max_tokens=60, temperature=t, seed=s, tagged_json=(schema, open_, close),
                             logit_bias={open_: 100.0}, ignore_eos=True) for t, s in ((0.0, 0), (1.0, 1), (1.0, 2))]
    params.append(SamplingParams(max_tokens=20, temperature=0.0, tagged_json=(schema, open_, close)))  # no bias
    outs = eng.generate([prompt] * len(params), params)
    closed = 0
    for out in outs[:3]:
        ids = out.new_token_ids
        assert out.error is None and ids[0] == open_
        for start in [i for i, t in enumerate(ids) if t == open_]:
            end = ids.index(close, start) if close in ids[start:] else len(ids)
            text = embedded_tokenizer.decode(ids[start + 1:end])
            if end < len(ids):  # a closed call: one whole value of the schema
                jsonschema.validate(json.loads(text), schema)
                closed += 1
    assert closed >= 3
    plain = eng.generate([prompt], [SamplingParams(max_tokens=20, temperature=0.0)])[0]
    assert outs[3].new_token_ids == plain.new_token_ids or open_ in outs[3].new_token_ids  # free until a tag
    assert eng.stats()["kv_blocks_used"] == 0


def test_engine_output_keeps_items_unique_and_keys_to_their_pattern(embedded_model, embedded_tokenizer):
    """The engine under a schema of unique integers, unique numbers and several patternProperties: every
    output is a prefix the automaton takes, and every finished one validates (jsonschema checks both)."""
    schema = {"type": "object", "properties": {
        "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 4}, "uniqueItems": True,
                "minItems": 3},
        "sizes": {"type": "array", "items": {"type": "number"}, "uniqueItems": True, "maxItems": 4},
        "by": {"type": "object", "patternProperties": {"^n_": {"type": "integer"}, "^s_": {"type": "string"}},
               "additionalProperties": False}}, "required": ["ids", "sizes", "by"]}
    eng, prompt = engine_and_prompt(embedded_model, embedded_tokenizer, "List some numbers as JSON.")
    params = [SamplingParams(max_tokens=80, temperature=t, seed=s, json_schema=schema)
              for t, s in ((0.0, 0), (1.0, 1), (1.0, 2), (1.0, 3))]
    outs = eng.generate([prompt] * len(params), params)
    compiled = jm.Schema(schema)
    for out in outs:
        assert out.error is None and compiled.walk(compiled.start, out.new_text.encode()) is not None, out.new_text
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.new_text), schema)
    assert sum(o.finish_reason == "stop" for o in outs) >= 2, [o.new_text for o in outs]
    assert eng.stats()["kv_blocks_used"] == 0


def test_engine_output_follows_the_schema(embedded_model, embedded_tokenizer):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 30},
                                               "born": {"type": "string", "format": "date"},
                                               "colours": {"type": "array", "items": {"enum": ["black", "white",
                                                                                             "ginger"]},
                                                           "minItems": 1, "maxItems": 3}},
              "required": ["name", "age", "born", "colours"]}
    eng, prompt = engine_and_prompt(embedded_model, embedded_tokenizer, "Describe a cat as JSON.")
    params = [SamplingParams(max_tokens=80, temperature=0.0, json_schema=schema)] + \
        [SamplingParams(max_tokens=80, temperature=1.0, seed=s, json_schema=schema, ignore_eos=s == 1)
         for s in range(3)] + [SamplingParams(max_tokens=80, temperature=0.0, json_object=True)]
    outs = eng.generate([prompt] * len(params), params)
    compiled = jm.Schema(schema)
    for out in outs[:-1]:
        assert compiled.walk(compiled.start, out.new_text.encode()) is not None, out.new_text
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.new_text), schema, format_checker=FORMATS)
    assert sum(o.finish_reason == "stop" for o in outs[:-1]) >= 2, [o.new_text for o in outs]
    assert compiled.walk(compiled.start, outs[-1].new_text.encode()) is None  # JSON mode alone strays from it
    with pytest.raises(ValueError, match="uniqueItems: supported where"):
        eng.generate([prompt], [SamplingParams(json_schema={"type": "object", "properties": {
            "a": {"type": "array", "uniqueItems": True}}})])
    assert eng.stats()["kv_blocks_used"] == 0


def test_untyped_schemas_take_the_types_their_keywords_imply():
    """No "type": the keywords say which types (read strictly, as a "type" listing them would), so no keyword
    is dropped by reading the schema as any value."""
    def accepts(schema: dict, text: bytes) -> bool:  # (as an array's item: the top level is an object or array)
        compiled = jm.Schema({"type": "array", "items": schema})
        config = compiled.start
        for b in b"[" + text + b"]":
            config = compiled.step(config, b)
            if config is None:
                return False
        return compiled.done(config)

    assert accepts({"minimum": 3}, b"5") and not accepts({"minimum": 3}, b"2")
    assert not accepts({"minimum": 3}, b'"a"')
    keyed = {"patternProperties": {"^a": {"type": "integer"}}}
    assert accepts(keyed, b'{"ab": 1}') and not accepts(keyed, b'{"b": 1}') and not accepts(keyed, b'{"ab": "s"}')
    either = {"minLength": 2, "minimum": 3}
    assert accepts(either, b'"ab"') and accepts(either, b"4")
    assert not accepts(either, b'"a"') and not accepts(either, b"2") and not accepts(either, b"true")
    assert accepts({"format": "date"}, b'"2024-01-02"') and not accepts({"format": "date"}, b'"x"')
    with pytest.raises(jm.SchemaError, match="uniqueItems"):
        jm.Schema({"type": "array", "items": {"uniqueItems": True}})  # (unique items of any value: said so)
