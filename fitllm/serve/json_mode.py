"""JSON mode (OpenAI's `response_format: {"type": "json_object"}`): the output is one JSON object.

A pushdown automaton over bytes says which tokens may come next; the sampler masks the others.
Its state is an immutable tuple (mode, container stack, detail), so the allowed-token mask of a
state is computed once and cached, under a key that drops what no token could tell apart (stack
entries deeper than any token closes, whitespace counts far from the cap): requests repeat the
same few dozen keys.

A mask is found without walking the whole vocabulary: inside a string every token of whole
characters free of `"`, `\\` and control bytes keeps the string going (a precomputed set);
elsewhere tokens are grouped by their first two bytes, so a group the state refuses costs one
step. Tokens are byte strings (byte-level BPE and SentencePiece's byte fallback alike); special
tokens never appear inside the object, and the output ends when it closes. Whitespace runs are
capped so a model cannot idle forever (64 bytes: a newline and 15 levels of 4-space indent), and
so is nesting.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

import torch

MAX_WHITESPACE = 64  # consecutive whitespace bytes between two tokens of the JSON text
MAX_DEPTH = 32
WHITESPACE = frozenset(b" \t\n\r")
DIGITS = frozenset(b"0123456789")
HEX = frozenset(b"0123456789abcdefABCDEF")
ESCAPES = frozenset(b'"\\/bfnrtu')
LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}
# a UTF-8 lead byte -> (continuation bytes, the range of the first one)
UTF8_LEADS = {**{b: (1, 0x80, 0xBF) for b in range(0xC2, 0xE0)}, 0xE0: (2, 0xA0, 0xBF),
              **{b: (2, 0x80, 0xBF) for b in range(0xE1, 0xF0) if b != 0xED}, 0xED: (2, 0x80, 0x9F),
              0xF0: (3, 0x90, 0xBF), 0xF1: (3, 0x80, 0xBF), 0xF2: (3, 0x80, 0xBF), 0xF3: (3, 0x80, 0xBF),
              0xF4: (3, 0x80, 0x8F)}
# number parts: after "-", after a leading 0, in the integer, after ".", in the fraction, after e, after e+/-,
# in the exponent
NUMBER_DONE = frozenset({"zero", "int", "frac", "exp"})

# Modes: "top" (the object's "{"), "value", "key_or_close" (after "{"), "key" (after "," in an object),
# "value_or_close" (after "["), "colon", "after" (a value ended: "," or a close), "string", "number",
# "literal", "done" (only EOS). Detail: whitespace run, or (is_key, escape, utf8) in a string, the
# number part, the literal's remaining bytes.
START = ("top", (), 0)
State = tuple


def step(state: State, b: int) -> Optional[State]:
    """The state after byte b, or None where b cannot come next."""
    mode, stack, detail = state
    if mode == "string":
        return _string_step(stack, detail, b)
    if mode == "number":
        part = _number_step(detail, b)
        if part is not None:
            return ("number", stack, part)
        return step(("after", stack, 0), b) if detail in NUMBER_DONE else None
    if mode == "literal":
        if b != detail[0]:
            return None
        return ("literal", stack, detail[1:]) if len(detail) > 1 else ("after", stack, 0)
    if mode in ("done", "top") or b not in WHITESPACE:
        return _structural_step(mode, stack, b)
    return (mode, stack, detail + 1) if detail < MAX_WHITESPACE else None


def _structural_step(mode: str, stack: tuple, b: int) -> Optional[State]:
    c = chr(b)
    if mode == "top":
        return ("key_or_close", ("o",), 0) if c == "{" else None
    if mode in ("key_or_close", "key"):
        if c == '"':
            return ("string", stack, (True, 0, ()))
        return _close(stack, "o") if c == "}" and mode == "key_or_close" else None
    if mode == "colon":
        return ("value", stack, 0) if c == ":" else None
    if mode == "after":
        if c == ",":
            return ("key", stack, 0) if stack[-1] == "o" else ("value", stack, 0)
        return _close(stack, "o" if c == "}" else "a") if c in "}]" else None
    if mode in ("value", "value_or_close"):
        if c == "]" and mode == "value_or_close":
            return _close(stack, "a")
        return _value_start(stack, b)
    return None  # done: nothing but EOS


def _value_start(stack: tuple, b: int) -> Optional[State]:
    c = chr(b)
    if c in "{[":
        if len(stack) >= MAX_DEPTH:
            return None
        return ("key_or_close", stack + ("o",), 0) if c == "{" else ("value_or_close", stack + ("a",), 0)
    if c == '"':
        return ("string", stack, (False, 0, ()))
    if c == "-":
        return ("number", stack, "minus")
    if b in DIGITS:
        return ("number", stack, "zero" if c == "0" else "int")
    if b in LITERALS:
        return ("literal", stack, LITERALS[b])
    return None


def _close(stack: tuple, kind: str) -> Optional[State]:
    if not stack or stack[-1] != kind:
        return None
    rest = stack[:-1]
    return ("after", rest, 0) if rest else ("done", (), 0)


def _string_step(stack: tuple, detail: tuple, b: int) -> Optional[State]:
    # escape: 0 none, 1 after a backslash, 2-5 hex digits of \\u still to come; utf8: the continuation
    # bytes a multi-byte character still needs and the range of the next one (UTF-8 exactly: no
    # overlong forms, surrogates or code points past U+10FFFF)
    is_key, escape, utf8 = detail
    if utf8:
        left, lo, hi = utf8
        if not lo <= b <= hi:
            return None
        return ("string", stack, (is_key, 0, (left - 1, 0x80, 0xBF) if left > 1 else ()))
    if escape == 1:
        if b not in ESCAPES:
            return None
        return ("string", stack, (is_key, 5 if b == ord("u") else 0, ()))
    if escape >= 2:
        return ("string", stack, (is_key, 0 if escape == 2 else escape - 1, ())) if b in HEX else None
    if b == ord('"'):
        return ("colon", stack, 0) if is_key else ("after", stack, 0)
    if b == ord("\\"):
        return ("string", stack, (is_key, 1, ()))
    if b < 0x20:
        return None
    if b < 0x80:
        return ("string", stack, detail)
    lead = UTF8_LEADS.get(b)
    return None if lead is None else ("string", stack, (is_key, 0, lead))


def _number_step(part: str, b: int) -> Optional[str]:
    digit = b in DIGITS
    c = chr(b)
    if part == "minus":
        return ("zero" if c == "0" else "int") if digit else None
    if part in ("zero", "int"):
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


WHITESPACE_MODES = frozenset({"value", "key_or_close", "key", "value_or_close", "colon", "after"})


def walk(state: State, data: bytes) -> Optional[State]:
    for b in data:
        state = step(state, b)
        if state is None:
            return None
    return state


class JsonGrammar:
    """The masks of one vocabulary. token_bytes[i]: token i's bytes, None for a special token
    (never inside the object); eos_ids end the output once the object is closed."""

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
        self.string_safe = torch.tensor(sorted(string_safe), dtype=torch.long)
        self.string_special = [i for i, d in enumerate(self.tokens) if d and i not in string_safe]
        self.cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.cache_size = cache_size

    def advance(self, state: State, token_id: int) -> Optional[State]:
        """The state after the token (EOS leaves "done" as it is); None where it cannot come."""
        if state[0] == "done":
            return state if token_id in self.eos_ids else None
        data = self.tokens[token_id] if token_id < len(self.tokens) else None
        return walk(state, data) if data else None

    def cache_key(self, state: State) -> tuple:
        """What the state's mask depends on. Below the deepest entry a token can close, the stack
        only matters where it could empty (the object closing) or overflow; the whitespace run
        only where a token's leading whitespace could pass the cap. Exact: equal keys, equal masks."""
        mode, stack, detail = state
        if self.max_closes < len(stack) and len(stack) + self.max_opens <= MAX_DEPTH:
            stack = ("...",) + stack[-self.max_closes:] if self.max_closes else ("...",)
        if mode in WHITESPACE_MODES:
            detail = max(0, detail - (MAX_WHITESPACE - min(self.max_leading_ws, MAX_WHITESPACE)))
        return mode, stack, detail

    def mask(self, state: State, device: torch.device | str) -> torch.Tensor:
        """Bool [vocab_size] on `device`: the tokens that may come next."""
        key = (self.cache_key(state), str(device))
        hit = self.cache.get(key)
        if hit is not None:
            self.cache.move_to_end(key)
            return hit
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        if state[0] == "done":
            allowed[self.eos_ids] = True
        elif state[0] == "string" and state[2][1:] == (0, ()):  # no escape or character under way
            allowed[self.string_safe] = True
            allowed[[i for i in self.string_special if walk(state, self.tokens[i]) is not None]] = True
        else:
            allowed[self._walk_groups(state)] = True
        mask = allowed.to(device)
        self.cache[key] = mask
        if len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return mask

    def _walk_groups(self, state: State) -> list[int]:
        """The tokens the state takes, group by group of their first two bytes."""
        ok = []
        for first, groups in self.by_prefix.items():
            after_first = step(state, first)
            if after_first is None:
                continue
            for second, ids in groups.items():
                if second < 0:
                    ok += ids
                    continue
                after_second = step(after_first, second)
                if after_second is not None:
                    ok += [i for i in ids if walk(after_second, self.tokens[i][2:]) is not None]
        return ok
