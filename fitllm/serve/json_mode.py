"""Structured output: JSON mode (`response_format` `json_object`) and JSON schemas (`json_schema`).

A schema is compiled into nodes (object, array, string, number, integer, literals, union) and a
pushdown automaton over bytes says which bytes may come next; the sampler masks the tokens whose
bytes the automaton refuses. JSON mode is the schema of any object. A configuration is a tuple
of states, more than one where the schema is ambiguous (anyOf, enum values sharing a prefix);
a state is an immutable tuple (mode, container stack, detail), so the allowed-token mask of a
configuration is computed once and cached, under a key that drops what no token could tell apart
(stack entries deeper than any token reaches, whitespace counts far from the cap).

A mask is found without walking the whole vocabulary: inside a string every token of whole
characters free of `"`, `\\` and control bytes keeps the string going (a precomputed set);
elsewhere tokens are grouped by their first two bytes, so a group the state refuses costs one
step. Tokens are byte strings (byte-level BPE and SentencePiece's byte fallback alike); special
tokens never appear inside the value, and the output ends when it closes. Whitespace between
tokens of the JSON text is one space, or one newline and its indentation (spaces or tabs, 64 bytes
at most: 15 levels of 4-space indent), so compact, `json.dumps` and pretty-printed JSON all fit but
a model cannot idle on blank lines or trailing spaces (weak models do); nesting is capped too.

What a schema means here (a strict reading, as OpenAI's structured outputs and xgrammar's):
properties come in the order the schema lists them, optional ones may be left out, and an object
that lists properties takes no others; an object that lists none takes any keys (with
`additionalProperties`' schema for their values). Every keyword that constrains values is
enforced or refused with a SchemaError naming it: nothing is silently ignored but annotations.
A string with a pattern, format or length is walked character by character through json_regex's
automaton (mode "text"); a number with bounds keeps its text so far and goes on only while some
way to finish it lies within them (plain decimals: no exponent). uniqueItems holds on scalar items: each
item's value (as JSON Schema compares them: 1 and 1.0 alike) is kept in its array's frame, and an item may
begin, go on or end only where it can still be a value no earlier item is; a number item ends at the byte
after it, and takes plain decimals only.
"""
from __future__ import annotations

import json
import math
from collections import OrderedDict
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from functools import lru_cache
from typing import Any, Optional, Sequence

import torch

from fitllm.serve.json_regex import ANY_TEXT, FORMATS, SYNTAX, Choice, PatternError, Regex

MAX_WHITESPACE = 64  # a newline and its indentation between two tokens of the JSON text
MAX_DEPTH = 32
# uniqueItems with a minItems: the items' values listed (to count them, overlaps removed) up to this many
LIST_LIMIT = 1 << 16
WHITESPACE = frozenset(b" \t\n\r")
ENDS_VALUE = WHITESPACE | frozenset(b",]}")  # the bytes that may follow a number
DIGITS = frozenset(b"0123456789")
HEX = frozenset(b"0123456789abcdefABCDEF")
ESCAPES = frozenset(b'"\\/bfnrtu')
ESCAPED_CHARS = {ord(k): v for k, v in zip('"\\/bfnrt', b'"\\/\b\f\n\r\t')}  # \" -> ", \n -> newline, ...
# a UTF-8 lead byte -> (continuation bytes, the range of the first one)
UTF8_LEADS = {**{b: (1, 0x80, 0xBF) for b in range(0xC2, 0xE0)}, 0xE0: (2, 0xA0, 0xBF),
              **{b: (2, 0x80, 0xBF) for b in range(0xE1, 0xF0) if b != 0xED}, 0xED: (2, 0x80, 0x9F),
              0xF0: (3, 0x90, 0xBF), 0xF1: (3, 0x80, 0xBF), 0xF2: (3, 0x80, 0xBF), 0xF3: (3, 0x80, 0xBF),
              0xF4: (3, 0x80, 0x8F)}
# number parts: after "-", after a leading 0, in the integer, after ".", in the fraction, after e, after e+/-,
# in the exponent
NUMBER_DONE = frozenset({"zero", "int", "frac", "exp"})
EXPONENT = frozenset({"e", "esign", "exp"})
# Keywords that say nothing about which values are valid, and the containers of $ref targets.
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                         "readOnly", "writeOnly", "$defs", "definitions"})
TYPE_KEYWORDS = {"object": {"properties", "required", "additionalProperties", "propertyNames", "patternProperties"},
                 "array": {"items", "prefixItems", "minItems", "maxItems", "uniqueItems"},
                 "string": {"pattern", "format", "minLength", "maxLength"},
                 "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
                 "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
                 "boolean": set(), "null": set()}

# Modes: "value" (a value of detail's node), "key_or_close" (after "{"), "key" (after "," in an object),
# "value_or_close" (after "["), "colon", "after" (a value ended: "," or a close), "string", "text",
# "number", "literal", "done" (only EOS). Detail: (whitespace, node) in the whitespace modes (0: none yet, -1:
# one space, no more; k > 0: a newline and k - 1 bytes of indentation); in a string
# (key_node: the value's node after an object key, else None; escape; utf8); (part, integer only) in a
# number, (part, integer only, node, text so far) in a number with bounds or a multipleOf or an item of unique
# items; (bytes left, property index or -1; an item of unique items: its whole text) in a literal. In "text", a
# string value with a pattern, format or length: (node, characters
# so far, the pattern's state, the character under way: () none, ("\\",) after a backslash, ("u", hex
# digits left, value so far), ("8", UTF-8 bytes left, bits so far, the next byte's range)), and a 5th entry
# for a key of an object whose propertyNames or patternProperties limit its keys (the value's node after it: an
# int; with several patterns, the first, the key's Choice telling which) or for an item of unique strings (its
# text so far: a str). Stack
# frames: ("o", node, next property) and ("a", node, items begun, capped where the count stops mattering),
# with a 4th entry in an array of unique items: the frozenset of its items' values so far (their _identity).
WHITESPACE_MODES = frozenset({"value", "key_or_close", "key", "value_or_close", "colon", "after"})
DONE = ("done", (), ())
State = tuple
Config = tuple  # of States


class SchemaError(ValueError):
    """A schema this server cannot enforce: "where: problem", where a path from "schema"."""

    def __init__(self, message: str):
        super().__init__(message)
        self.where, _, self.problem = message.partition(": ")


@dataclass(frozen=True)
class Node:
    kind: str  # object, array, string, number, integer, literals, union
    props: tuple = ()  # objects: ((key's JSON text with its quotes, value node, required), ...) in schema order
    extra: Optional[int] = None  # objects without props: the values' node (any key may come)
    key: Optional[int] = None  # objects without props: the keys' string node where propertyNames limits them
    # objects with several patternProperties: each group's values' node, by the group the key's Choice says it
    # matched (extra is the first)
    values: tuple = ()
    items: Optional[int] = None  # arrays: the items' node (past the prefix; None: no more items)
    prefix: tuple = ()  # arrays: the nodes of the first items, in order (prefixItems)
    min_items: int = 0
    max_items: Optional[int] = None
    unique: bool = False  # arrays: uniqueItems (items are then a union of literals, strings walked as text, numbers)
    literals: tuple = ()  # the JSON texts (bytes) of enum / const values, true, false and null
    options: tuple = ()  # a union's node ids
    # strings with a pattern, format or length (ANY_TEXT: lengths only); keys of several patternProperties: a Choice
    text: Optional[Regex | Choice] = None
    min_len: int = 0  # (in characters, as JSON Schema counts them)
    max_len: Optional[int] = None
    low: Optional[tuple] = None  # numbers: (bound, exclusive) below and above
    high: Optional[tuple] = None
    step: Optional[Fraction] = None  # numbers: multipleOf (integers: the smallest integer multiple of it)

    @property
    def tracked(self) -> bool:
        """A number whose text so far must be kept: its bounds or step decide which digits may follow."""
        return self.low is not None or self.high is not None or self.step is not None

    def keys_from(self, index: int) -> list[int]:
        """The properties that may come next when `index` is the first not yet passed: up to and
        including the first required one."""
        out = []
        for j in range(index, len(self.props)):
            out.append(j)
            if self.props[j][2]:
                break
        return out

    def may_close(self, index: int) -> bool:
        return not any(required for _, _, required in self.props[index:])

    def item(self, index: int) -> int:
        """An array's node for its item at `index`."""
        return self.prefix[index] if index < len(self.prefix) else self.items


def _is_type(value, t: str) -> bool:
    """JSON Schema's types of a JSON value (an integer is a number; 1.0 is an integer)."""
    if isinstance(value, bool):
        return t == "boolean"
    if isinstance(value, (int, float)):
        return t == "number" or (t == "integer" and float(value).is_integer())
    return {"string": str, "object": dict, "array": list, "null": type(None)}.get(t) is type(value)


def _json_text(value) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


class Schema:
    """A JSON schema compiled to the automaton's nodes. Raises SchemaError for what it cannot enforce."""

    def __init__(self, schema: Any):
        self.document = schema
        self.nodes: list[Optional[Node]] = []
        self._refs: dict[str, int] = {}
        self._any: Optional[int] = None
        self._starts: dict[int, list] = {}  # node -> first byte -> how a value can begin (filled as met)
        self.root = self._compile(schema, "schema")
        self._check_no_union_cycle()
        self.min_depth = self._min_depths()
        if self.min_depth[self.root] > MAX_DEPTH:
            raise SchemaError(f"schema: no value of it fits in {MAX_DEPTH} levels of nesting (does a required "
                              "property or item lead back to where it started?)")
        # the deepest any value the automaton may still begin needs (bounds what the mask cache key may drop)
        self.deepest = max((d for d in self.min_depth if d <= MAX_DEPTH), default=0)
        if any(self.nodes[i].kind not in ("object", "array") for i in self._alternatives(self.root)):
            raise SchemaError("schema: the top-level value must be an object or an array")
        self.key = json.dumps(schema)  # (not sorted: the order of properties is the order of the output)
        self.start: Config = (("value", (), (-1, self.root)),)  # no whitespace before the value
        self.start_spaced: Config = (("value", (), (0, self.root)),)  # a space or a newline may come first

    # --- compiling ---
    def _add(self, node: Optional[Node]) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def _union(self, nodes: list[int]) -> int:
        return nodes[0] if len(nodes) == 1 else self._add(Node("union", options=tuple(nodes)))

    def _alternatives(self, node: int) -> list[int]:
        n = self.nodes[node]
        return [o for opt in n.options for o in self._alternatives(opt)] if n.kind == "union" else [node]

    def _check_no_union_cycle(self) -> None:
        """A value must begin somewhere: a $ref that leads back to itself through anyOf / $ref alone
        (no object or array between) would never say which byte comes first. (Depth-first, each
        node once: a schema cannot make this check slow.)"""
        state: dict[int, bool] = {}  # node -> finished (False: on the current path)

        def visit(node: int) -> None:
            if state.get(node) is False:
                raise SchemaError("schema: a $ref leads back to itself without an object or array in between")
            if node in state or self.nodes[node].kind != "union":
                return
            state[node] = False
            for option in self.nodes[node].options:
                visit(option)
            state[node] = True

        for node in range(len(self.nodes)):
            visit(node)

    def _min_depths(self) -> list[float]:
        """Per node, the fewest containers deep its smallest value nests (inf: none is finite).
        The automaton begins a value only where that depth still fits under MAX_DEPTH, so a model
        can never walk into a value it cannot finish. A fixed point, for recursive schemas."""
        depth = [float("inf")] * len(self.nodes)
        changed = True
        while changed:
            changed = False
            for i, n in enumerate(self.nodes):
                if n.kind == "union":
                    d = min(depth[o] for o in n.options)
                elif n.kind == "object":
                    d = 1 + max([depth[node] for _, node, required in n.props if required], default=0)
                elif n.kind == "array":
                    d = 1 + max([depth[n.item(i)] for i in range(min(n.min_items, len(n.prefix) + 1))], default=0)
                else:
                    d = 0
                if d < depth[i]:
                    depth[i], changed = d, True
        return depth

    def fits(self, stack: tuple, node: int) -> bool:
        return len(stack) + self.min_depth[node] <= MAX_DEPTH

    def any_value(self) -> int:
        if self._any is None:
            self._any = self._add(None)  # first, so the containers can refer to it
            parts = [Node("object", extra=self._any), Node("array", items=self._any), Node("string"),
                     Node("number"), Node("literals", literals=(b"true", b"false", b"null"))]
            self.nodes[self._any] = Node("union", options=tuple(self._add(p) for p in parts))
        return self._any

    def _compile(self, s: Any, where: str) -> int:
        if s is True or s == {}:
            return self.any_value()
        if not isinstance(s, dict):
            raise SchemaError(f"{where}: a schema must be an object or true, got {json.dumps(s)[:60]}")
        if "$ref" in s:
            return self._ref(s, where)
        if "enum" in s or "const" in s:
            return self._literals(s, where)
        for word in ("anyOf", "oneOf", "allOf"):
            if word in s:
                return self._combination(s, word, where)
        unknown = set(s) - ANNOTATIONS - {"type"} - set().union(*TYPE_KEYWORDS.values())
        if unknown:
            raise SchemaError(f"{where}: keyword {sorted(unknown)[0]!r} is not supported")
        types = s.get("type")
        if types is None:  # untyped: the types its keywords imply (read strictly, as "type" would say), else any value
            types = [t for t in ("object", "array", "string", "number") if TYPE_KEYWORDS[t] & set(s)]
            if not types:
                return self.any_value()
        if isinstance(types, str):
            types = [types]
        if not isinstance(types, list) or not types or any(t not in TYPE_KEYWORDS for t in types):
            raise SchemaError(f"{where}.type: expected one of {sorted(TYPE_KEYWORDS)} or a list of them, "
                              f"got {json.dumps(types)}")
        for word in set(s) & set().union(*TYPE_KEYWORDS.values()):
            if not any(word in TYPE_KEYWORDS[t] for t in types):
                raise SchemaError(f"{where}: keyword {word!r} does not apply to type {json.dumps(s['type'])}")
        return self._union([self._typed(s, t, where) for t in dict.fromkeys(types)])

    def _typed(self, s: dict, t: str, where: str) -> int:
        if t == "object":
            return self._object(s, where)
        if t == "array":
            return self._array(s, where)
        if t == "boolean":
            return self._add(Node("literals", literals=(b"true", b"false")))
        if t == "null":
            return self._add(Node("literals", literals=(b"null",)))
        if t == "string":
            return self._string(s, where)
        return self._number(s, t, where)

    def _object(self, s: dict, where: str) -> int:
        props, required, extra = s.get("properties"), s.get("required", []), s.get("additionalProperties")
        if props is not None and not isinstance(props, dict):
            raise SchemaError(f"{where}.properties: expected an object")
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"{where}.required: expected a list of property names")
        key, values = self._property_names(s, props, where), None
        if "patternProperties" in s:  # (pydantic's dict with constrained string keys)
            key, values = self._pattern_properties(s, props, extra, key, where)
        if not props:
            if required:
                raise SchemaError(f"{where}.required: required properties need their schemas under 'properties'")
            if values is None and extra is not False:
                values = (self._compile(True if extra is None else extra, f"{where}.additionalProperties"),)
            if not values:
                return self._add(Node("object", props=()))  # only {}
            return self._add(Node("object", key=key, extra=values[0], values=values if len(values) > 1 else ()))
        if extra not in (None, False):
            raise SchemaError(f"{where}.additionalProperties: only false is supported next to 'properties' "
                              "(an object lists its properties or takes any keys, not both)")
        missing = [r for r in required if r not in props]
        if missing:
            raise SchemaError(f"{where}.required: {missing[0]!r} is not among the properties")
        return self._add(Node("object", props=tuple(
            (_json_text(name), self._compile(sub, f"{where}.properties.{name}"), name in required)
            for name, sub in props.items())))

    @staticmethod
    def _counts(s: dict, low: str, high: str, where: str) -> tuple[int, Optional[int]]:
        """A (minimum, maximum or None) pair of counts such as minItems / maxItems, checked."""
        lo, hi = s.get(low, 0), s.get(high)
        for word, value in ((low, lo), (high, hi)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise SchemaError(f"{where}.{word}: expected a non-negative integer")
        if hi is not None and lo > hi:
            raise SchemaError(f"{where}: {low} ({lo}) is more than {high} ({hi})")
        return lo, hi

    def _array(self, s: dict, where: str) -> int:
        lo, hi = self._counts(s, "minItems", "maxItems", where)
        if isinstance(s.get("items"), list):
            raise SchemaError(f"{where}.items: a list of schemas (draft 4's tuples) is not supported: use prefixItems")
        prefix = s.get("prefixItems", [])
        if not isinstance(prefix, list):
            raise SchemaError(f"{where}.prefixItems: expected a list of schemas")
        prefix = tuple(self._compile(sub, f"{where}.prefixItems.{i}") for i, sub in enumerate(prefix))
        if s.get("items") is False:  # nothing past the prefix
            hi = len(prefix) if hi is None else min(hi, len(prefix))
            if lo > hi:
                raise SchemaError(f"{where}: minItems ({lo}) is more than the {hi} items 'items: false' allows")
            return self._add(Node("array", prefix=prefix, min_items=lo, max_items=hi))
        items = self._compile(s.get("items", True), f"{where}.items")
        unique = s.get("uniqueItems", False)
        if not isinstance(unique, bool):
            raise SchemaError(f"{where}.uniqueItems: expected true or false")
        if unique:
            items = self._unique_items(items, prefix, lo, where)
        return self._add(Node("array", items=items, prefix=prefix, min_items=lo, max_items=hi, unique=unique))

    def _unique_items(self, items: int, prefix: tuple, lo: int, where: str) -> int:
        """uniqueItems, enforced on scalar items: the node the items are walked with (a union of their options).
        An enum / const value begins only while no earlier item took it (pydantic's set of an Enum or Literal);
        a string (no pattern, format or maxLength: some new one always remains) keeps its text and closes only
        where no earlier item had it (set[str]); a number keeps its text, takes a digit only while it can still
        end on a value of its bounds and step that no earlier item took, and ends (at the byte after it) only
        on such a value (set[int], set[float]), so a walk never dead-ends on repeats. Values compare as JSON
        Schema's do (1 and 1.0 equal, true and 1 not) across the options. A minItems more than the distinct
        values there are is refused here where that is certain (set[bool] of 3); past LIST_LIMIT values to
        list, options that might overlap are not worked out (an answer that long is cut by max_tokens first)."""
        options = self._scalar_options(items)
        if prefix or not options:
            raise SchemaError(f"{where}.uniqueItems: supported where the items are enum / const values, strings, "
                              "numbers, booleans or null (not objects or arrays, and no prefixItems)")
        walked = []
        for o in options:
            n = self.nodes[o]
            if n.kind == "string" and (n.text not in (None, ANY_TEXT) or n.max_len is not None):
                raise SchemaError(f"{where}.uniqueItems: strings with a pattern, format or maxLength are not "
                                  "supported as unique items")
            walked.append(self._add(Node("string", text=ANY_TEXT)) if n == Node("string") else o)  # (text kept)
        self._check_min_items(walked, lo, where)
        return self._union(walked)

    def _scalar_options(self, node: int, seen: Optional[set] = None) -> Optional[list[int]]:
        """The options of a union (anyOf, $ref, a list of types) past unions; None where one is an object or an
        array (or a $ref to a schema still being compiled: one around this one). A union met twice (a cycle,
        refused later) adds nothing."""
        n, seen = self.nodes[node], set() if seen is None else seen
        if n is None or n.kind in ("object", "array"):
            return None
        if n.kind != "union":
            return [node]
        if node in seen:
            return []
        seen.add(node)
        out = []
        for option in n.options:
            found = self._scalar_options(option, seen)
            if found is None:
                return None
            out += found
        return out

    def _check_min_items(self, options: list[int], lo: int, where: str) -> None:
        """minItems of unique items: refused where the distinct values of the options are fewer (counted where
        no one option has enough by itself: listed if they are at most LIST_LIMIT, else only their sum)."""
        sizes = [self._size(o) for o in options]
        if max(sizes) >= lo:
            return
        if sum(sizes) <= LIST_LIMIT:
            count = len({v for o in options for v in self._values(o)})
            if count < lo:
                raise SchemaError(f"{where}: minItems ({lo}) is more than the {count} distinct values its items allow")
        elif sum(sizes) < lo:
            raise SchemaError(f"{where}: minItems ({lo}) is more than the at most {sum(sizes)} distinct values its "
                              "items allow")

    def _size(self, node: int) -> float:
        """How many distinct values a scalar node takes (math.inf: no end of them)."""
        n = self.nodes[node]
        if n.kind == "literals":
            return len({_text_identity(text) for text in n.literals})
        return math.inf if n.kind == "string" else _count(n, None, False, None, False)

    def _values(self, node: int):
        """The identities of the values of a scalar node with finitely many."""
        n = self.nodes[node]
        if n.kind == "literals":
            yield from (_text_identity(text) for text in n.literals)
            return
        lo, lo_in, hi, hi_in = _narrowed(n, None, False, None, False)
        unit = _unit(n)
        if unit is None:  # (a number whose bounds meet: one value)
            yield "number", lo
            return
        first, last = _multiples(unit, lo, lo_in, hi, hi_in)
        yield from (("number", k * unit) for k in range(first, last + 1))

    def _property_names(self, s: dict, props: Optional[dict], where: str) -> Optional[int]:
        """propertyNames: the keys' string node (a pattern, format or lengths; enum / const of strings as
        a pattern of those), or None where it limits nothing. Next to listed properties it must take
        every one of them (then the listed keys are all there is to limit)."""
        names = s.get("propertyNames")
        if names is None or names is True:
            return None
        where = f"{where}.propertyNames"
        if not isinstance(names, dict) or names.get("type", "string") != "string":
            raise SchemaError(f"{where}: expected a schema of strings")
        listed = names.get("enum", [names["const"]] if "const" in names else None)
        if listed is not None:
            if not isinstance(listed, list) or not all(isinstance(k, str) for k in listed):
                raise SchemaError(f"{where}: enum / const of strings only")
            rest = set(names) - ANNOTATIONS - {"type", "enum", "const"}
            if rest:
                raise SchemaError(f"{where}: keyword {sorted(rest)[0]!r} next to enum/const is not supported")
            names = {"pattern": "^(?:" + "|".join(_escaped(k) for k in listed) + ")$"}
        key = self._compile({**names, "type": "string"}, where)  # (keys are strings: the keywords need no type)
        if self.nodes[key].kind != "string":
            raise SchemaError(f"{where}: expected a schema of strings")
        if self.nodes[key].text is None:
            return None  # any string
        for name in props or ():
            if not self.takes_text(key, name):
                raise SchemaError(f"{where}: the property {name!r} is not a name it allows")
        return None if props else key

    def _pattern_properties(self, s: dict, props, extra, key: Optional[int], where: str) -> tuple[Optional[int], tuple]:
        """patternProperties on an object that lists no properties: (its keys' node, the values' node of each
        group of patterns; none: only {}), read strictly: only keys that match a pattern come (JSON Schema would
        also take others, with any value, unless additionalProperties says otherwise). One pattern: the keys are
        strings of it. Several: a json_regex.Choice walks each key through all of them at once, and its value
        follows the schema of the pattern it matched. JSON Schema has a key that several patterns match take a
        value valid for each of their schemas; here such a key is written only where those schemas are the
        same (patterns of equal schemas, as JSON, form one group): the keys are restricted to those that match
        patterns of one group, character by character (a key never begins that could not end so), and keys
        that a pattern of schema false matches never come."""
        patterns = s["patternProperties"]
        where = f"{where}.patternProperties"
        if not isinstance(patterns, dict) or not patterns or props or extra not in (None, False) or key is not None:
            raise SchemaError(f"{where}: supported as one or more patterns on an object that lists no properties, "
                              "with no additionalProperties or propertyNames beside it")
        if len(patterns) == 1:
            (pattern, values), = patterns.items()
            key = self._compile({"type": "string", "pattern": pattern}, where)
            return (None, ()) if values is False else (key, (self._compile(values, where),))
        groups: dict[str, int] = {}  # a values' schema (as JSON) -> its group: the index of its node
        values, regexes = [], []
        for pattern, sub in patterns.items():
            try:
                regex = _regex(pattern)
            except PatternError as e:
                raise SchemaError(f"{where}.{pattern}: {e}") from None
            same = json.dumps(sub, sort_keys=True)
            if sub is not False and same not in groups:
                groups[same] = len(values)
                values.append(self._compile(sub, f"{where}.{pattern}"))
            regexes.append((regex, groups.get(same)))  # (schema false: group None, never accepted)
        if not values:
            return None, ()
        text = Choice(regexes)
        if not text.can_finish(text.start, 0, None):
            raise SchemaError(f"{where}: every key that matches a pattern also matches one of another schema (keys "
                              "that patterns of different schemas match are not written)")
        return self._add(Node("string", text=text)), tuple(values)

    def takes_text(self, node: int, value: str) -> bool:
        """Whether the string node takes `value` (its pattern and lengths)."""
        n = self.nodes[node]
        at = n.text.start
        for ch in value:
            at = n.text.step(at, ord(ch))
            if not at:
                return False
        return n.min_len <= len(value) and (n.max_len is None or len(value) <= n.max_len) and n.text.accepts(at)

    def _string(self, s: dict, where: str) -> int:
        lo, hi = self._counts(s, "minLength", "maxLength", where)
        pattern, form = s.get("pattern"), s.get("format")
        if pattern is not None and form is not None:
            raise SchemaError(f"{where}: 'pattern' next to 'format' is not supported")
        if form is not None:
            if form not in FORMATS:
                raise SchemaError(f"{where}.format: {json.dumps(form)} is not supported (supported: "
                                  f"{', '.join(FORMATS)})")
            pattern = f"^(?:{FORMATS[form]})$"
        if pattern is None and lo == 0 and hi is None:
            return self._add(Node("string"))
        try:
            text = ANY_TEXT if pattern is None else _regex(pattern)
        except PatternError as e:
            raise SchemaError(f"{where}.pattern: {e}") from None
        if not text.can_finish(text.start, lo, hi):
            raise SchemaError(f"{where}: no string of {lo} to {hi if hi is not None else 'any number of'} "
                              f"characters matches {'the format' if form else 'the pattern'}")
        return self._add(Node("string", text=text, min_len=lo, max_len=hi))

    def _number(self, s: dict, t: str, where: str) -> int:
        """A number or integer, with its bounds (the stricter where two are given on one side) and its
        multipleOf (values exactly as written: 0.1 is 1/10, so 0.3 is a multiple of it)."""
        low = high = step = None  # (value, exclusive)
        for word in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "multipleOf"):
            value = s.get(word)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise SchemaError(f"{where}.{word}: expected a number")
            value = Fraction(repr(value)) if isinstance(value, float) else Fraction(value)  # (0.1 is 1/10)
            if word == "multipleOf":
                if value <= 0:
                    raise SchemaError(f"{where}.multipleOf: expected a number greater than 0")
                # an integer multiple of p/q (lowest terms) is a multiple of p
                step = Fraction(value.numerator) if t == "integer" else value
                continue
            exclusive = word.startswith("exclusive")
            if word.endswith("inimum") and (low is None or value > low[0] or (value == low[0] and exclusive)):
                low = (value, exclusive)
            if word.endswith("aximum") and (high is None or value < high[0] or (value == high[0] and exclusive)):
                high = (value, exclusive)
        node = Node(t, low=low, high=high, step=step)
        if not _meets(node, None, False, None, False):
            raise SchemaError(f"{where}: no {t} lies between its minimum and maximum"
                              + (" that is a multiple of its multipleOf" if step is not None else ""))
        return self._add(node)

    def _literals(self, s: dict, where: str) -> int:
        values = [s["const"]] if "const" in s else s["enum"]
        extra = set(s) - ANNOTATIONS - {"const", "enum", "type"}
        if extra:
            raise SchemaError(f"{where}: keyword {sorted(extra)[0]!r} next to enum/const is not supported")
        if not isinstance(values, list) or not values:
            raise SchemaError(f"{where}.enum: expected a non-empty list")
        if "type" in s:  # both apply: the values of the type
            types = s["type"] if isinstance(s["type"], list) else [s["type"]]
            values = [v for v in values if any(_is_type(v, t) for t in types)]
            if not values:
                raise SchemaError(f"{where}: no enum / const value is of type {json.dumps(s['type'])}")
        try:
            texts = tuple(dict.fromkeys(_json_text(v) for v in values))
        except ValueError as e:
            raise SchemaError(f"{where}: {e}") from None
        return self._add(Node("literals", literals=texts))

    def _combination(self, s: dict, word: str, where: str) -> int:
        options = s[word]
        if not isinstance(options, list) or not options:
            raise SchemaError(f"{where}.{word}: expected a non-empty list of schemas")
        extra = set(s) - ANNOTATIONS - {word}
        if extra:
            raise SchemaError(f"{where}: keyword {sorted(extra)[0]!r} next to {word} is not supported")
        if word == "allOf" and len(options) > 1:
            raise SchemaError(f"{where}.allOf: only one schema is supported")
        # oneOf is read as anyOf: a value matching two options is not refused
        return self._union([self._compile(o, f"{where}.{word}.{i}") for i, o in enumerate(options)])

    def _ref(self, s: dict, where: str) -> int:
        ref = s["$ref"]
        extra = set(s) - ANNOTATIONS - {"$ref"}
        if extra:
            raise SchemaError(f"{where}: keyword {sorted(extra)[0]!r} next to $ref is not supported")
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError(f"{where}.$ref: only references inside the schema ('#/...') are supported")
        if ref not in self._refs:
            target = self.document
            for part in filter(None, ref[1:].split("/")):
                part = part.replace("~1", "/").replace("~0", "~")
                if not isinstance(target, dict) or part not in target:
                    raise SchemaError(f"{where}.$ref: {ref!r} does not point into the schema")
                target = target[part]
            self._refs[ref] = self._add(None)  # first, so a recursive schema finds it
            path = "schema" + ref[1:].replace("/", ".")  # (an error's place, written as the others are)
            self.nodes[self._refs[ref]] = Node("union", options=(self._compile(target, path),))
        return self._refs[ref]

    # --- the automaton ---
    # _step returns the state after a byte, None where the byte cannot come, or a list of two or
    # more states where the schema branches (rare: a deterministic walk stays free of lists).
    def step(self, config: Config, b: int) -> Optional[Config]:
        """The configuration after byte b, or None where b cannot come next."""
        return _config([self._step(state, b) for state in config])

    def walk(self, config: Optional[Config], data: bytes) -> Optional[Config]:
        if config is not None and len(config) == 1:  # one state, stepped without configurations until it branches
            state, step = config[0], self._step
            for i, b in enumerate(data):
                state = step(state, b)
                if type(state) is not tuple:
                    return None if state is None else self.walk(_config([state]), data[i + 1:])
            return (state,)
        for b in data:
            if config is None:
                return None
            config = self.step(config, b)
        return config

    @staticmethod
    def done(config: Optional[Config]) -> bool:
        return config is not None and DONE in config

    def _step(self, state: State, b: int):
        mode, stack, detail = state
        if mode == "string":
            return _string_step(stack, detail, b)
        if mode == "text":
            return self._text_step(stack, detail, b)
        if mode == "number":
            return self._in_number(stack, detail, b)
        if mode == "literal":
            rest, prop = detail
            if b != rest[0]:
                return None
            return ("literal", stack, (rest[1:], prop)) if len(rest) > 1 else self._literal_end(stack, prop)
        if mode == "done":
            return None
        ws, node = detail
        if b in WHITESPACE:
            ws = _whitespace(ws, b)
            return None if ws is None else (mode, stack, (ws, node))
        if mode == "value":
            return _branches(self._value_start(stack, node, b))
        if mode == "colon":
            return ("value", stack, (0, node)) if b == 0x3A else None  # ":"
        return self._in_container(mode, stack, b)

    def _in_number(self, stack: tuple, detail: tuple, b: int):
        """A number, byte by byte. Where its text is kept (bounds, a step, an item of unique items) a digit
        comes only while the number can still end on a value it may take, and the byte after it only where
        its value is one: an item of unique items is finished there, at the "," "]" or space after it."""
        part = _number_step(detail[0], b, detail[1])
        if len(detail) == 2:  # any number
            if part is not None:
                return ("number", stack, (part, detail[1]))
            return self._step(("after", stack, (0, None)), b) if detail[0] in NUMBER_DONE else None
        _, integer, node, text = detail
        n, used = self.nodes[node], stack[-1][3] if len(stack[-1]) == 4 else None
        if part is not None:
            text += bytes((b,))
            if not (_may_reach(n, text, part) if used is None else _fresh(n, text, part, used)):
                return None
            return ("number", stack, (part, integer, node, text))
        if detail[0] not in NUMBER_DONE or b not in ENDS_VALUE:  # (a byte the value's end refuses: not worth its value)
            return None
        value = _number_value(text)
        if not _meets(n, value, True, value, True):
            return None
        if used is not None:  # an item of unique items, ending: not an earlier item's value
            if ("number", value) in used:
                return None
            stack = _with_used(stack, ("number", value))
        return self._step(("after", stack, (0, None)), b)

    def _in_container(self, mode: str, stack: tuple, b: int):
        kind, node, count = stack[-1][:3]
        n, c = self.nodes[node], chr(b)
        if mode in ("key_or_close", "key"):
            if c == '"':
                return self._key_start(stack)
            return _close(stack) if c == "}" and mode == "key_or_close" and n.may_close(count) else None
        if mode == "value_or_close":
            if c == "]":
                return _close(stack) if n.min_items == 0 else None
            if n.max_items == 0:
                return None
            return _branches(self._value_start(self._item_begun(stack), n.item(0), b))
        # after a value
        if c == ",":
            if kind == "o":
                return ("key", stack, (0, None)) if self._next_keys(stack) else None
            if n.max_items is not None and count >= n.max_items:
                return None
            if n.unique and not self._item_left(n, stack[-1][3]):  # every value its items may take is taken
                return None
            return ("value", self._item_begun(stack), (0, n.item(count)))
        if c == "}" and kind == "o" and n.may_close(count):
            return _close(stack)
        if c == "]" and kind == "a" and count >= n.min_items:
            return _close(stack)
        return None

    def _item_begun(self, stack: tuple) -> tuple:
        _, node, count = stack[-1][:3]
        n = self.nodes[node]
        # counts past the minimum (or the maximum) and the prefix are alike
        cap = max(n.max_items if n.max_items is not None else n.min_items, len(n.prefix))
        return stack[:-1] + (("a", node, min(count + 1, cap)) + stack[-1][3:],)

    def _item_left(self, n: Node, used: frozenset) -> bool:
        """Whether an array of unique items has a value left for one more item (no earlier item took it)."""
        for option in self._alternatives(n.items):
            o = self.nodes[option]
            if o.kind == "literals":
                left = any(_text_identity(text) not in used for text in o.literals)
            else:  # a string (a new one always remains) or a number
                left = o.kind == "string" or _fresh(o, b"", "start", used)
            if left:
                return True
        return False

    def _next_keys(self, stack: tuple) -> list[int]:
        """The properties whose key may come next (their values fit); [-1]: any key (a free object; with
        several patternProperties, where each pattern's values fit: the key decides which comes)."""
        _, node, index = stack[-1]
        n = self.nodes[node]
        if n.extra is not None:
            return [-1] if all(self.fits(stack, v) for v in n.values or (n.extra,)) else []
        return [j for j in n.keys_from(index) if self.fits(stack, n.props[j][1])]

    def _key_start(self, stack: tuple):
        n = self.nodes[stack[-1][1]]
        if n.key is not None:  # propertyNames: the key's characters through its pattern and lengths
            free = ("text", stack, (n.key, 0, self.nodes[n.key].text.start, (), n.extra))
        else:
            free = ("string", stack, (n.extra, 0, ()))
        return _branches([free if j < 0 else
                          ("literal", stack, (n.props[j][0][1:], j)) for j in self._next_keys(stack)])

    def _literal_end(self, stack: tuple, prop: int | bytes) -> State:
        if isinstance(prop, bytes):  # an item of unique items: its value now taken
            return ("after", _with_used(stack, _text_identity(prop)), (0, None))
        if prop < 0:
            return ("after", stack, (0, None))
        _, node, _ = stack[-1]
        return ("colon", stack[:-1] + (("o", node, prop + 1),), (0, self.nodes[node].props[prop][1]))

    def _value_start(self, stack: tuple, node: int, b: int) -> list:
        """The states a value of `node` is in after its first byte b (a list: unions branch)."""
        if stack and len(stack[-1]) == 4:  # an item of unique items
            return self._unique_start(stack, node, b)
        row = self._starts.get(node)
        if row is None:
            row = self._starts[node] = [None] * 256
        starts = row[b]
        if starts is None:
            starts = row[b] = self._first_byte(node, b)
        return [(mode, stack + (frame,), detail) if frame else (mode, stack, detail)
                for mode, frame, detail in starts if not frame or self.fits(stack, frame[1])]

    def _unique_start(self, stack: tuple, node: int, b: int) -> list:
        """The states an item of unique items is in after its first byte b: an enum / const value no earlier
        item took, a string (its text kept: it may close only on a new one) or a number that can still end on
        a value not taken (its text kept)."""
        used, out = stack[-1][3], []
        for option in self._alternatives(node):
            n = self.nodes[option]
            if n.kind == "literals":
                out += [("after", _with_used(stack, _text_identity(text)), (0, None)) if len(text) == 1 else
                        ("literal", stack, (text[1:], text))
                        for text in n.literals if text[0] == b and _text_identity(text) not in used]
            elif n.kind == "string":
                out += [("text", stack, (option, 0, n.text.start, (), ""))] if b == 0x22 else []
            else:
                integer = n.kind == "integer"
                part = _number_step("start", b, integer)
                if part and _fresh(n, bytes((b,)), part, used):
                    out.append(("number", stack, (part, integer, option, bytes((b,)))))
        return out

    def _first_byte(self, node: int, b: int) -> list:
        """(mode, frame to push or None, detail) of each way a value of `node` can begin with b."""
        n, c = self.nodes[node], chr(b)
        if n.kind == "union":
            return [s for option in n.options for s in self._first_byte(option, b)]
        if n.kind == "object":
            return [("key_or_close", ("o", node, 0), (0, None))] if c == "{" else []
        if n.kind == "array":
            frame = ("a", node, 0) + ((frozenset(),) if n.unique else ())
            return [("value_or_close", frame, (0, None))] if c == "[" else []
        if n.kind == "string":
            if c != '"':
                return []
            return [("text", None, (node, 0, n.text.start, ()))] if n.text else [("string", None, (None, 0, ()))]
        if n.kind in ("number", "integer"):
            part = _number_step("start", b, n.kind == "integer")
            if part and n.tracked:
                return [("number", None, (part, n.kind == "integer", node, bytes((b,))))] \
                    if _may_reach(n, bytes((b,)), part) else []
            return [("number", None, (part, n.kind == "integer"))] if part else []
        return [("literal", None, (text[1:], -1)) if len(text) > 1 else ("after", None, (0, None))
                for text in n.literals if text[0] == b]

    def _text_step(self, stack: tuple, detail: tuple, b: int) -> Optional[State]:
        """A string value with a pattern, format or length, byte by byte: its characters go through the
        pattern's automaton; a character under way (escape, UTF-8) goes on only while some code point it
        may still become fits."""
        node, count, at, pending = detail[:4]
        n = self.nodes[node]
        if not pending:
            if b == 0x22:  # the closing quote
                if count < n.min_len or not n.text.accepts(at):
                    return None
                if len(detail) == 4:
                    return ("after", stack, (0, None))
                if isinstance(detail[4], int):  # an object's key: its value next (of the patterns it matched)
                    values = self.nodes[stack[-1][1]].values
                    return ("colon", stack, (0, values[n.text.group(at)] if values else detail[4]))
                text = ("str", detail[4])  # an item of unique strings: not one of the items before
                return None if text in stack[-1][3] else ("after", _with_used(stack, text), (0, None))
            if b < 0x20:
                return None
            if b < 0x80 and b != 0x5C:
                return self._text_char(stack, detail, b)
            lead = UTF8_LEADS.get(b)
            if b != 0x5C and lead is None:
                return None
            pending = ("\\",) if b == 0x5C else ("8", lead[0], b & (0x3F >> lead[0]), lead[1], lead[2])
        elif pending[0] == "\\":
            if b in ESCAPED_CHARS:
                return self._text_char(stack, detail, ESCAPED_CHARS[b])
            if b != 0x75:  # u
                return None
            pending = ("u", 4, 0)
        elif pending[0] == "u":
            if b not in HEX:
                return None
            value = pending[2] * 16 + int(chr(b), 16)
            if pending[1] == 1:
                return self._text_char(stack, detail, value)
            pending = ("u", pending[1] - 1, value)
        else:  # UTF-8
            _, left, value, lo, hi = pending
            if not lo <= b <= hi:
                return None
            value = value << 6 | (b & 0x3F)
            if left == 1:
                return self._text_char(stack, detail, value)
            pending = ("8", left - 1, value, 0x80, 0xBF)
        cp_lo, cp_hi = _code_points(pending)
        if n.max_len is not None and count >= n.max_len:
            return None
        if not n.text.some_char(at, cp_lo, cp_hi, *_room(n, count + 1)):
            return None
        return ("text", stack, (node, count, at, pending) + detail[4:])

    def _text_char(self, stack: tuple, detail: tuple, cp: int) -> Optional[State]:
        node, count, at, _ = detail[:4]
        n = self.nodes[node]
        count += 1
        if n.max_len is not None and count > n.max_len:
            return None
        after = n.text.step(at, cp)
        if not after or not n.text.can_finish(after, *_room(n, count)):
            return None
        # (without a maximum, counts past the minimum are alike)
        rest = detail[4:]
        if rest and isinstance(rest[0], str):  # an item of unique strings: its text so far
            rest = (rest[0] + chr(cp),)
        return ("text", stack, (node, count if n.max_len is not None else min(count, n.min_len), after, ()) + rest)


def _with_used(stack: tuple, value: tuple) -> tuple:
    """The stack with a value (its _identity) taken in its top frame (an array of unique items)."""
    top = stack[-1]
    return stack[:-1] + (top[:3] + (top[3] | {value},),)


def _identity(value) -> tuple:
    """What JSON Schema's equality compares (1 and 1.0 equal, true and 1 not), for uniqueItems."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return type(value).__name__, value
    if isinstance(value, (int, float, Decimal)):
        return "number", Fraction(value)
    return "json", json.dumps(value, sort_keys=True)


@lru_cache(maxsize=4096)
def _text_identity(text: bytes) -> tuple:
    """The identity of an enum / const value's JSON text: its numbers exactly as written (0.1 is 1/10, as a
    number item that writes 0.1 is), not as the nearest float."""
    return _identity(json.loads(text, parse_float=Decimal))


def _room(n: Node, count: int) -> tuple[int, Optional[int]]:
    """The fewest and most characters a string of node n with `count` of them may still take."""
    return max(0, n.min_len - count), None if n.max_len is None else n.max_len - count


def _code_points(pending: tuple) -> tuple[int, int]:
    """The code points a character under way may still become (contiguous: UTF8_LEADS already
    leaves out overlong forms and surrogates)."""
    if pending[0] == "\\":
        return 0, 0xFFFF  # \" \\ \/ \b \f \n \r \t or any \uXXXX
    if pending[0] == "u":
        shift = 4 * pending[1]
        return pending[2] << shift, ((pending[2] + 1) << shift) - 1
    _, left, value, lo, hi = pending
    shift = 6 * (left - 1)
    return (value << 6 | (lo & 0x3F)) << shift, ((value << 6 | (hi & 0x3F)) << shift) | ((1 << shift) - 1)


def _unit(n: Node) -> Optional[Fraction]:
    """What a number node's values are multiples of (None: any decimal)."""
    return n.step if n.step is not None else Fraction(1) if n.kind == "integer" else None


def _narrowed(n: Node, lo: Optional[Fraction], lo_in: bool, hi: Optional[Fraction], hi_in: bool) -> tuple:
    """The interval lo..hi (None: unbounded; _in: inclusive) within node n's bounds."""
    if n.low is not None:
        value, inclusive = n.low[0], not n.low[1]
        if lo is None or value > lo or (value == lo and not inclusive):
            lo, lo_in = value, inclusive
    if n.high is not None:
        value, inclusive = n.high[0], not n.high[1]
        if hi is None or value < hi or (value == hi and not inclusive):
            hi, hi_in = value, inclusive
    return lo, lo_in, hi, hi_in


def _multiples(unit: Fraction, lo: Fraction, lo_in: bool, hi: Fraction, hi_in: bool) -> tuple[int, int]:
    """(first, last): the multiples k * unit in the interval lo..hi are those of first <= k <= last."""
    first, last = math.ceil(lo / unit), math.floor(hi / unit)
    return first + (first * unit == lo and not lo_in), last - (last * unit == hi and not hi_in)


def _count(n: Node, lo: Optional[Fraction], lo_in: bool, hi: Optional[Fraction], hi_in: bool) -> float:
    """How many numbers of node n (within its bounds, multiples of its step) lie in the interval lo..hi (None:
    unbounded; _in: inclusive): math.inf where it is unbounded or, without a step, wider than a point."""
    lo, lo_in, hi, hi_in = _narrowed(n, lo, lo_in, hi, hi_in)
    if lo is None or hi is None:
        return math.inf
    unit = _unit(n)
    if unit is None:
        return math.inf if lo < hi else int(lo == hi and lo_in and hi_in)
    first, last = _multiples(unit, lo, lo_in, hi, hi_in)
    return max(0, last - first + 1)


def _meets(n: Node, lo: Optional[Fraction], lo_in: bool, hi: Optional[Fraction], hi_in: bool) -> bool:
    """Whether a number of node n lies in the interval lo..hi."""
    return _count(n, lo, lo_in, hi, hi_in) > 0


def _number_value(text: bytes) -> Fraction:
    """The exact value of a number's text (through Decimal: Python's int refuses over 4300 digits)."""
    return Fraction(Decimal(text.decode()))


def _spans(digits: bytes, part: str):
    """The magnitudes a number begun as `digits` (past its sign, a plain decimal: no exponent) can still end
    on, as intervals [a, b) (b None: unbounded) in increasing order: every decimal of one interval, or, while
    more digits may join its integer part, of one interval per length (1 -> [1, 2), [10, 20), ...)."""
    if part == "minus":
        yield Fraction(0), None
    elif part == "zero":
        yield Fraction(0), Fraction(1)
    elif part in ("dot", "frac"):
        start = _number_value(digits)
        yield start, start + Fraction(1, 10 ** len(digits.partition(b".")[2]))
    else:  # int
        w, scale = int(Decimal(digits.decode())), 1
        while True:
            yield Fraction(w * scale), Fraction((w + 1) * scale)
            scale *= 10


def _reachable(n: Node, text: bytes, part: str, enough: float = 1) -> float:
    """How many values of node n (within its bounds, on its step) a number begun as `text` can still end on,
    counted until `enough` (part "start": nothing written yet). Bounds, steps and unique items are checked on
    plain decimals, so none past an exponent. (The values a decimal prefix can still become are every decimal
    in its spans, so the multiples in them are the ones it can reach.)"""
    if part in EXPONENT:
        return 0
    if part == "start":
        return _count(n, None, False, None, False)
    negative = text.startswith(b"-")
    far = n.low if negative else n.high  # the bound on the side its magnitude grows to
    if part == "int" and far is None:  # long enough numbers pass any bound on the other side
        return math.inf
    total = 0
    for a, b in _spans(text[1:] if negative else text, part):
        if total >= enough or (far is not None and a > abs(far[0])):
            break
        total += _count(n, -b if b is not None else None, False, -a, True) if negative else _count(n, a, True, b, False)
    return total


def _may_reach(n: Node, text: bytes, part: str) -> bool:
    """Whether a number begun as `text` can still end within node n's bounds, on a multiple of its step."""
    return _reachable(n, text, part) > 0


def _can_become(text: bytes, part: str, value: Fraction) -> bool:
    """Whether a number begun as `text` (a plain decimal) can end on `value` (0 and -0 alike)."""
    if part == "start":
        return True
    negative = text.startswith(b"-")
    if value and (value < 0) != negative:
        return False
    for a, b in _spans(text[1:] if negative else text, part):
        if a > abs(value):
            return False
        if b is None or abs(value) < b:
            return True
    return False


def _fresh(n: Node, text: bytes, part: str, used: frozenset) -> bool:
    """Whether an item of unique items of number node n, begun as `text`, can still end on a value no earlier
    item took: more values within its reach than taken ones among them."""
    reach = _reachable(n, text, part, len(used) + 1)
    if not reach or reach > len(used):
        return reach > 0
    taken = sum(1 for kind, value in used if kind == "number" and _meets(n, value, True, value, True)
                and _can_become(text, part, value))
    return reach > taken


def _whitespace(ws: int, b: int) -> Optional[int]:
    """The whitespace state after byte b: one space, or a newline then spaces and tabs (capped)."""
    if ws == 0:
        return -1 if b == 0x20 else 1 if b == 0x0A else None
    return ws + 1 if ws > 0 and b in (0x20, 0x09) and ws < MAX_WHITESPACE else None


def _branches(states: list):
    """_step's return for a list of states: None, the one state, or the list."""
    return None if not states else states[0] if len(states) == 1 else states


def _config(results: list) -> Optional[Config]:
    """The configuration of _step's results (states, lists of them, None), duplicates dropped."""
    out = []
    for r in results:
        if type(r) is list:
            out += r
        elif r is not None:
            out.append(r)
    return tuple(dict.fromkeys(out)) or None


def _close(stack: tuple) -> State:
    rest = stack[:-1]
    return ("after", rest, (0, None)) if rest else DONE


def _string_step(stack: tuple, detail: tuple, b: int) -> Optional[State]:
    # escape: 0 none, 1 after a backslash, 2-5 hex digits of \\u still to come; utf8: the continuation
    # bytes a multi-byte character still needs and the range of the next one (UTF-8 exactly: no
    # overlong forms, surrogates or code points past U+10FFFF)
    key_node, escape, utf8 = detail
    if utf8:
        left, lo, hi = utf8
        if not lo <= b <= hi:
            return None
        return ("string", stack, (key_node, 0, (left - 1, 0x80, 0xBF) if left > 1 else ()))
    if escape == 1:
        if b not in ESCAPES:
            return None
        return ("string", stack, (key_node, 5 if b == 0x75 else 0, ()))  # \\u
    if escape >= 2:
        return ("string", stack, (key_node, 0 if escape == 2 else escape - 1, ())) if b in HEX else None
    if b == 0x22:  # the closing quote
        return ("colon", stack, (0, key_node)) if key_node is not None else ("after", stack, (0, None))
    if b == 0x5C:  # backslash
        return ("string", stack, (key_node, 1, ()))
    if b < 0x20:
        return None
    if b < 0x80:
        return ("string", stack, detail)
    lead = UTF8_LEADS.get(b)
    return None if lead is None else ("string", stack, (key_node, 0, lead))


def _number_step(part: str, b: int, integer: bool) -> Optional[str]:
    digit = b in DIGITS
    c = chr(b)
    if part in ("start", "minus"):
        if part == "start" and c == "-":
            return "minus"
        return ("zero" if c == "0" else "int") if digit else None
    if part in ("zero", "int"):
        if integer:
            return "int" if digit and part == "int" else None
        if c == ".":
            return "dot"
        if c in "eE":
            return "e"
        return "int" if digit and part == "int" else None
    if part in ("dot", "frac"):
        return "frac" if digit else ("e" if part == "frac" and c in "eE" else None)
    if part == "e":
        return "esign" if c in "+-" else ("exp" if digit else None)
    return "exp" if digit else None  # esign, exp


def _whole_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


JSON_OBJECT = Schema({"type": "object"})  # JSON mode: any object


@lru_cache(maxsize=256)
def _regex(pattern: str) -> Regex:
    return Regex(pattern)


def _escaped(literal: str) -> str:
    """A pattern that matches `literal` and nothing else."""
    return "".join("\\" + c if c in SYNTAX else c for c in literal)


@lru_cache(maxsize=64)
def _compiled(text: str) -> Schema:
    return Schema(json.loads(text))


def schema_for(json_schema: Optional[dict]) -> Schema:
    """The compiled schema of a request (None: JSON mode), compiled once per distinct schema."""
    if json_schema is None:
        return JSON_OBJECT
    try:
        return _compiled(json.dumps(json_schema))
    except RecursionError:
        raise SchemaError("schema: nested too deeply") from None


class JsonGrammar:
    """The masks of one vocabulary, for any schema. token_bytes[i]: token i's bytes, None for a
    special token (never inside the value); eos_ids end the output once the value is closed."""

    def __init__(self, token_bytes: Sequence[Optional[bytes]], vocab_size: int, eos_ids: Sequence[int],
                 cache_size: int = 512):
        # (a tokenizer may count more ids than the model has logits: those can never be sampled)
        self.tokens, self.vocab_size, self.eos_ids = list(token_bytes)[:vocab_size], vocab_size, sorted(eos_ids)
        self.by_prefix: dict[int, dict[int, list[int]]] = {}  # first byte -> second byte -> ids (-1: no second)
        string_safe = set()  # whole characters, no quote, backslash or control byte: a string takes them as they are
        for i, data in enumerate(self.tokens):
            if not data:
                continue
            self.by_prefix.setdefault(data[0], {}).setdefault(data[1] if len(data) > 1 else -1, []).append(i)
            if all(b >= 0x20 and b not in (0x22, 0x5C) for b in data) and _whole_utf8(data):
                string_safe.add(i)
        words = [d for d in self.tokens if d]
        # how deep into the stack a token can close, how many containers it can open, its leading whitespace
        self.max_closes = max(d.count(b"}") + d.count(b"]") for d in words)
        self.max_opens = max(d.count(b"{") + d.count(b"[") for d in words)
        self.max_leading_ws = max(len(d) - len(d.lstrip(b" \t\n\r")) for d in words)
        self.max_len = max(len(d) for d in words)  # (bytes: at least as many as the characters a token writes)
        self.string_safe = torch.tensor(sorted(string_safe), dtype=torch.long)
        self.string_special = [i for i, d in enumerate(self.tokens) if d and i not in string_safe]
        self.cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.cache_size = cache_size
        self.tries: OrderedDict[Regex, dict] = OrderedDict()  # a pattern -> its trie of the string-safe tokens

    def advance(self, schema: Schema, config: Config, token_id: int) -> Optional[Config]:
        """The configuration after the token (EOS leaves a closed value as it is); None where it cannot come."""
        if token_id in self.eos_ids:
            return (DONE,) if DONE in config else None
        data = self.tokens[token_id] if token_id < len(self.tokens) else None
        return schema.walk(config, data) if data else None

    def state_key(self, schema: Schema, state: State) -> tuple:
        """What a state's mask depends on. Below the deepest frame a token can reach (it closes
        max_closes and then reads the next one's kind), the stack only matters where it could
        empty (the value closing) or where a value begun in the token might not fit under the
        nesting cap; the whitespace run only where a token's leading whitespace could pass the
        cap. Exact: equal keys, equal masks."""
        mode, stack, detail = state
        reach = self.max_closes + 1
        if reach < len(stack) and len(stack) + self.max_opens + schema.deepest <= MAX_DEPTH:
            stack = ("...",) + stack[-reach:]
        if mode in WHITESPACE_MODES:
            ws = detail[0]  # (runs of indentation alike while a token's leading whitespace cannot reach the cap)
            detail = (ws if ws <= 0 else 1 + max(0, ws - (MAX_WHITESPACE - self.max_leading_ws)), detail[1])
        elif mode == "text" and schema.nodes[detail[0]].text is ANY_TEXT:
            # lengths only: the count matters only near the minimum or the maximum, within a token's reach
            node, count, at, pending = detail[:4]
            n, far = schema.nodes[node], self.max_len + 1
            room = None if n.max_len is None else min(n.max_len - count, far)
            detail = (node, (min(max(n.min_len - count, 0), far), room), at, pending) + detail[4:]
        return mode, stack, detail

    def mask(self, schema: Schema, config: Config, device: torch.device | str) -> torch.Tensor:
        """Bool [vocab_size] on `device`: the tokens that may come next."""
        key = (schema.key, frozenset(self.state_key(schema, state) for state in config), str(device))
        hit = self.cache.get(key)
        if hit is not None:
            self.cache.move_to_end(key)
            return hit
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        if DONE in config:
            allowed[self.eos_ids] = True
        live = tuple(s for s in config if s != DONE)
        plain = self._plain_text_tokens(schema, live[0]) if len(live) == 1 else None
        if plain is not None:  # inside a string: the string-safe tokens by rule, the others walked
            allowed[plain] = True
            allowed[[i for i in self.string_special if schema.walk(live, self.tokens[i]) is not None]] = True
        elif live:
            allowed[self._walk_groups(schema, live)] = True
        mask = allowed.to(device)
        self.cache[key] = mask
        if len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return mask

    def _plain_text_tokens(self, schema: Schema, state: State):
        """Inside a string, with no escape or character under way: the string-safe tokens the string
        takes (all of them, or those its pattern and lengths allow). None elsewhere."""
        mode, _, detail = state
        if mode == "string" and detail[1:] == (0, ()):
            return self.string_safe
        if mode == "text" and not detail[3]:
            return self._text_tokens(schema.nodes[detail[0]], detail[1], detail[2])
        return None

    def _trie(self, regex: Regex) -> dict:
        """The string-safe tokens as a trie over their characters' classes under the pattern (code points
        between two of its cuts step alike): most tokens share a few paths ([a-z]+ sees 'hello' and
        'world' as one), so a mask walks each path once. Key -1 holds the tokens ending at a node."""
        trie = self.tries.get(regex)
        if trie is None:
            trie = {}
            for i in self.string_safe.tolist():
                node = trie
                for ch in self.tokens[i].decode("utf-8"):
                    node = node.setdefault(regex.class_of(ord(ch)), {})
                node.setdefault(-1, []).append(i)
            self.tries[regex] = trie
            if len(self.tries) > 16:
                self.tries.popitem(last=False)
        self.tries.move_to_end(regex)
        return trie

    def _text_tokens(self, n: Node, count: int, at: frozenset) -> list[int]:
        """The string-safe tokens a constrained string with `count` characters at pattern state `at`
        takes (each of its characters steps the pattern, and the string can still be finished)."""
        out, todo = [], [(self._trie(n.text), at, count)]
        while todo:
            node, state, chars = todo.pop()
            for cls, child in node.items():
                if cls < 0:
                    if chars > count and n.text.can_finish(state, *_room(n, chars)):
                        out += child
                elif n.max_len is None or chars < n.max_len:
                    after = n.text.step_class(state, cls)
                    if after:
                        todo.append((child, after, chars + 1))
        return out

    def _walk_groups(self, schema: Schema, config: Config) -> list[int]:
        """The tokens the configuration takes, group by group of their first two bytes."""
        ok = []
        for first, groups in self.by_prefix.items():
            after_first = schema.step(config, first)
            if after_first is None:
                continue
            for second, ids in groups.items():
                if second < 0:
                    ok += ids
                    continue
                after_second = schema.step(after_first, second)
                if after_second is not None:
                    ok += [i for i in ids if schema.walk(after_second, self.tokens[i][2:]) is not None]
        return ok
