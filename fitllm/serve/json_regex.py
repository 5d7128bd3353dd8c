"""The strings of a JSON schema that are more than any text (`pattern`, `format`, `minLength`,
`maxLength`), as an automaton over code points that json_mode steps one character at a time.

A pattern is read in the subset of ECMA 262 (the dialect JSON Schema names) that Python's re reads
the same way (jsonschema and pydantic check values with re): literals and escapes, `.`, classes
with ranges and negation, \\d \\w \\s and their negations, groups (capturing, named, non-capturing),
alternation, and the quantifiers * + ? {n} {n,} {n,m} (lazy or not: the same strings). Where the two
dialects differ, the automaton takes only what both accept: \\d and \\w are ASCII, \\s the
whitespace both know, and a negated class holding one of them is complemented within ASCII. A
pattern matches anywhere in the string, as JSON Schema says, unless ^ begins and $ ends a branch.
Lookaround, backreferences, word boundaries and flags are refused with a SchemaError.

The automaton is Thompson's NFA; a state of the walk is the frozenset of its positions, stepped
once per (positions, class of equivalent code points) and memoised, so a walk costs a dict lookup
per character once warm. `can_finish` answers whether a length window can still be met, which is
how the walk never enters a string it could not close. A Choice walks several patterns at once (the keys of
an object with several patternProperties) and accepts a string that patterns of one group only match.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Optional, Sequence

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)  # not characters: JSON text cannot hold them unpaired
MAX_POSITIONS = 20_000  # counted repetitions are unrolled; past this a pattern is refused
MEMO_LIMIT = 100_000  # entries a pattern's step / finish tables keep before starting over (they are only memos)
Ranges = tuple  # ((lo, hi), ...) sorted, disjoint, inclusive, surrogates removed

DIGIT = ((0x30, 0x39),)
WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
# ECMA's WhiteSpace and LineTerminator less U+FEFF (Python's \s does not take it)
SPACE = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
         (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000))
ASCII = ((0x00, 0x7F),)
CONTROL_ESCAPES = {"t": 0x09, "n": 0x0A, "v": 0x0B, "f": 0x0C, "r": 0x0D}
SYNTAX = set("^$\\.*+?()[]{}|/-")

# `format` as patterns: each accepts only values that Python's checks take (jsonschema's FormatChecker,
# pydantic): dates of years 0001-9999 with February 29 in leap years only, URIs of http(s) only.
_DAY = (r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
        r"|02-(?:0[1-9]|1[0-9]|2[0-8]))")
_YEAR = r"(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
# divisible by 4 but not ending in 00 (0004 ... 9996), or a multiple of 400 (0400 ... 9600)
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = rf"(?:{_YEAR}-{_DAY}|{_LEAP_YEAR}-02-29)"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_HEX = "[0-9a-fA-F]"
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": _DATE + "T" + _TIME,
    "uuid": "-".join(f"{_HEX}{{{n}}}" for n in (8, 4, 4, 4, 12)),
    "email": rf"[A-Za-z0-9_%+-]+(?:\.[A-Za-z0-9_%+-]+)*@(?:{_LABEL}\.)+[A-Za-z]{{2,63}}",
    "hostname": rf"{_LABEL}(?:\.{_LABEL})*",
    "ipv4": rf"{_OCTET}(?:\.{_OCTET}){{3}}",
    "uri": rf"https?://(?:{_LABEL}\.)*{_LABEL}(?::[0-9]{{1,4}})?(?:/[A-Za-z0-9._~%!$&'()*+,;=:@/-]*)?"
           r"(?:\?[A-Za-z0-9._~%!$&'()*+,;=:@/?-]*)?",
}


class PatternError(ValueError):
    """A pattern this module cannot read or would read differently from Python's re."""


def _normalize(ranges) -> Ranges:
    """Sorted, merged, surrogates cut out."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        for a, b in ((lo, min(hi, SURROGATES[0] - 1)), (max(lo, SURROGATES[1] + 1), hi)):
            if a > b:
                continue
            if out and a <= out[-1][1] + 1:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
    return tuple((a, b) for a, b in out)


def _complement(ranges: Ranges, within: Ranges = ((0, MAX_CODE_POINT),)) -> Ranges:
    out, at = [], 0
    for lo, hi in ranges:
        if lo > at:
            out.append((at, lo - 1))
        at = hi + 1
    out.append((at, MAX_CODE_POINT))
    return _intersect(_normalize(out), within)


def _intersect(a: Ranges, b: Ranges) -> Ranges:
    return _normalize([(max(x, y), min(p, q)) for x, p in a for y, q in b if max(x, y) <= min(p, q)])


ANY_CHAR = _normalize([(0, MAX_CODE_POINT)])
DOT = _complement(_normalize([(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]))
CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE, "D": _complement(DIGIT, ASCII), "W": _complement(WORD, ASCII),
                 "S": _complement(SPACE, ASCII)}


class _Parser:
    """Pattern text -> a tree: ("chars", ranges), ("seq", [...]), ("alt", [...]), ("repeat", tree, lo, hi)."""

    def __init__(self, text: str):
        self.text, self.i = text, 0

    def fail(self, problem: str):
        raise PatternError(f"{problem} at position {self.i} of {self.text!r}")

    def peek(self, k: int = 0) -> str:
        return self.text[self.i + k] if self.i + k < len(self.text) else ""

    def take(self) -> str:
        c = self.peek()
        self.i += 1
        return c

    def pattern(self) -> tuple:
        """The whole pattern: top-level branches, each anchored or padded with any text."""
        branches = []
        while True:
            start = self.peek() == "^"
            self.i += start
            seq = self.sequence(top=True)
            end = self.peek() == "$"
            self.i += end
            padding = ("repeat", ("chars", ANY_CHAR), 0, None)
            branches.append(("seq", ([] if start else [padding]) + [seq] + ([] if end else [padding])))
            if self.peek() == "|":
                self.i += 1
                continue
            if self.i < len(self.text):
                self.fail("unexpected " + repr(self.peek()))
            return ("alt", branches)

    def alternation(self) -> tuple:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def sequence(self, top: bool = False) -> tuple:
        items = []
        while self.peek() not in ("", "|", ")"):
            if self.peek() == "$" and top and self.peek(1) in ("", "|"):
                break
            items.append(self.quantified(self.atom()))
        if self.peek() == ")" and top:
            self.fail("unbalanced ')'")
        return ("seq", items)

    def atom(self) -> tuple:
        c = self.take()
        if c == "(":
            return self.group()
        if c == "[":
            return ("chars", self.char_class())
        if c == ".":
            return ("chars", DOT)
        if c == "\\":
            return ("chars", self.escape(in_class=False))
        if c in ("^", "$"):
            self.fail(f"'{c}' is supported only at the start / end of the pattern or of a top-level branch")
        if c in "*+?":
            self.fail("nothing to repeat")
        if c == "{" and self.counted() is not None:
            self.fail("nothing to repeat")
        return ("chars", _normalize([(ord(c), ord(c))]))

    def group(self) -> tuple:
        if self.peek() == "?":
            if self.text.startswith("?:", self.i):
                self.i += 2
            elif self.text.startswith("?P<", self.i) or (self.text.startswith("?<", self.i)
                                                          and self.peek(2) not in "=!"):
                close = self.text.find(">", self.i)
                if close < 0:
                    self.fail("unterminated group name")
                self.i = close + 1
            else:
                self.fail("lookaround and inline flags are not supported")
        inner = self.alternation()
        if self.take() != ")":
            self.fail("missing ')'")
        return inner

    def counted(self) -> Optional[tuple]:
        """{n}, {n,} or {n,m} at the cursor (just after '{'), consumed; None (nothing consumed) if not one."""
        close = self.text.find("}", self.i)
        body = self.text[self.i:close] if close >= 0 else ""
        lo, comma, hi = body.partition(",")
        if not lo and hi.isdigit():
            self.fail("'{,n}' is a quantifier in Python's re and text in ECMA")
        if not lo.isdigit() or (hi and not hi.isdigit()) or not lo.isascii() or not hi.isascii():
            return None
        self.i = close + 1
        bounds = (int(lo), (int(hi) if hi else None) if comma else int(lo))
        if bounds[1] is not None and bounds[1] < bounds[0]:
            self.fail("a {n,m} with m < n")
        return bounds

    def quantified(self, tree: tuple) -> tuple:
        while True:
            c = self.peek()
            if c in ("*", "+", "?"):
                self.i += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{":
                self.i += 1
                bounds = self.counted()
                if bounds is None:
                    self.i -= 1
                    return tree
                lo, hi = bounds
            else:
                return tree
            if self.peek() == "?":  # lazy: the same strings
                self.i += 1
            if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self.text[self.i + 1:self.i + 2].isdigit()):
                self.fail("nothing to repeat (a quantifier after a quantifier)")
            tree = ("repeat", tree, lo, hi)

    def escape(self, in_class: bool) -> Ranges:
        c = self.take()
        if c == "":
            self.fail("a pattern cannot end with '\\'")
        if c in CLASS_ESCAPES:
            return CLASS_ESCAPES[c]
        if c in CONTROL_ESCAPES:
            return ((CONTROL_ESCAPES[c],) * 2,)
        if c == "b" and in_class:
            return ((8, 8),)
        if c == "0" and not self.peek().isdigit():
            return ((0, 0),)
        if c in ("x", "u"):
            digits = self.text[self.i:self.i + (2 if c == "x" else 4)]
            if len(digits) != (2 if c == "x" else 4) or any(d not in "0123456789abcdefABCDEF" for d in digits):
                self.fail(f"'\\{c}' needs {2 if c == 'x' else 4} hex digits")
            self.i += len(digits)
            ranges = _normalize([(int(digits, 16),) * 2])
            if not ranges:
                self.fail("a surrogate code point")
            return ranges
        if c in SYNTAX or (in_class and c == "]"):
            return ((ord(c),) * 2,)
        self.fail(f"'\\{c}' is not supported (backreferences, word boundaries and other escapes)")

    def char_class(self) -> Ranges:
        negate = self.peek() == "^"
        self.i += negate
        if self.peek() == "]":
            self.fail("an empty class ('[]' or '[^]') reads differently in ECMA and Python")
        ranges: list[tuple[int, int]] = []
        shorthand = False
        while True:
            c = self.take()
            if c == "":
                self.fail("missing ']'")
            if c == "]":
                break
            if c == "\\":
                shorthand |= self.peek() in CLASS_ESCAPES
                item = self.escape(in_class=True)
            else:
                item = ((ord(c), ord(c)),)
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.i += 1
                hi_c = self.take()
                hi = self.escape(in_class=True) if hi_c == "\\" else ((ord(hi_c),) * 2,)
                if len(item) != 1 or len(hi) != 1 or item[0][0] != item[0][1] or hi[0][0] != hi[0][1]:
                    self.fail("a range between a class escape and a character")
                if hi[0][0] < item[0][0]:
                    self.fail("a range out of order")
                item = ((item[0][0], hi[0][0]),)
            ranges += item
        ranges = _normalize(ranges)
        if negate:  # a negated class with \d, \w or \s: outside ASCII the dialects disagree, so ASCII only
            return _complement(ranges, ASCII if shorthand else ANY_CHAR)
        return ranges


class _Automaton:
    """What json_mode walks a constrained string with: a state per string so far, code points classed by
    `cuts` (those between two cuts step alike), memoised answers to whether the string can still end.
    Subclasses give start, cuts, step_class, accepts and _search, and the memos _finish and _some."""

    def class_of(self, cp: int) -> int:
        """The class of code points cp steps alike with: those between two cuts."""
        return bisect_right(self.cuts, cp) - 1

    def step(self, state, cp: int):
        """The state after character cp (empty: it cannot come)."""
        return self.step_class(state, self.class_of(cp))

    def can_finish(self, state, lo: int, hi: Optional[int]) -> bool:
        """Whether some string of lo..hi more characters (hi None: any number) leads to acceptance."""
        key = (state, lo, hi)
        hit = self._finish.get(key)
        if hit is None:
            hit = _remember(self._finish, key, self._search(state, lo, hi))
        return hit

    def some_char(self, state, cp_lo: int, cp_hi: int, lo: int, hi: Optional[int]) -> bool:
        """Whether a character in cp_lo..cp_hi can come next and still leave lo..hi characters to finish
        with (a partly written character or escape: its possible code points form that range)."""
        key = (state, cp_lo, cp_hi, lo, hi)
        hit = self._some.get(key)
        if hit is None:
            hit = False
            i = self.class_of(cp_lo)
            while not hit and i < len(self.cuts) and self.cuts[i] <= cp_hi:
                after = self.step_class(state, i)
                hit = bool(after) and self.can_finish(after, lo, hi)
                i += 1
            _remember(self._some, key, hit)
        return hit


class Regex(_Automaton):
    """A pattern's automaton over code points. States of a walk: frozensets of positions."""

    def __init__(self, pattern: str):
        if not isinstance(pattern, str):
            raise PatternError("a pattern must be a string")
        self.pattern = pattern
        self.chars: list[Optional[Ranges]] = []  # a position's characters (None: an epsilon node)
        self.out: list[list[int]] = []
        start, end = self._build(_Parser(pattern).pattern())
        self.accept = end
        self._closures: dict[int, frozenset] = {}
        self.start = self._close([start])
        self.cuts = sorted({0, *SURROGATES, SURROGATES[1] + 1} | {b for r in self.chars if r for lo, hi in r
                                                                  for b in (lo, hi + 1) if b <= MAX_CODE_POINT})
        self._steps: dict[tuple, frozenset] = {}
        self._finish: dict[tuple, bool] = {}
        self._some: dict[tuple, bool] = {}

    # --- Thompson's construction ---
    def _node(self, chars: Optional[Ranges] = None) -> int:
        if len(self.chars) >= MAX_POSITIONS:
            raise PatternError(f"{self.pattern!r} is too large once its counted repetitions are unrolled")
        self.chars.append(chars)
        self.out.append([])
        return len(self.chars) - 1

    def _build(self, tree: tuple) -> tuple[int, int]:
        """(entry, exit) epsilon nodes of the tree's fragment."""
        kind = tree[0]
        entry, exit_ = self._node(), self._node()
        if kind == "chars":
            c = self._node(tree[1])
            self.out[entry].append(c)
            self.out[c].append(exit_)
        elif kind == "seq":
            at = entry
            for item in tree[1]:
                a, b = self._build(item)
                self.out[at].append(a)
                at = b
            self.out[at].append(exit_)
        elif kind == "alt":
            for item in tree[1]:
                a, b = self._build(item)
                self.out[entry].append(a)
                self.out[b].append(exit_)
        else:  # repeat
            _, inner, lo, hi = tree
            at = entry
            for _ in range(lo):
                a, b = self._build(inner)
                self.out[at].append(a)
                at = b
            if hi is None:  # a loop
                a, b = self._build(inner)
                self.out[at] += [a, exit_]
                self.out[b] += [a, exit_]
            else:  # optional copies
                for _ in range(hi - lo):
                    a, b = self._build(inner)
                    self.out[at] += [a, exit_]
                    at = b
            self.out[at].append(exit_)
        return entry, exit_

    def _closure(self, node: int) -> frozenset:
        """The character positions (and the accepting node) reached from `node` without a character."""
        hit = self._closures.get(node)
        if hit is None:
            seen, todo, found = {node}, [node], set()
            while todo:
                n = todo.pop()
                if self.chars[n] is not None or n == self.accept:
                    found.add(n)
                    if self.chars[n] is not None:
                        continue
                for m in self.out[n]:
                    if m not in seen:
                        seen.add(m)
                        todo.append(m)
            hit = self._closures[node] = frozenset(n for n in found if self.chars[n] != ())
        return hit

    def _close(self, nodes) -> frozenset:
        out = frozenset()
        for n in nodes:
            out |= self._closure(n)
        return out

    # --- the walk ---
    def accepts(self, state: frozenset) -> bool:
        return self.accept in state

    def step_class(self, state: frozenset, cls: int) -> frozenset:
        key = (state, cls)
        hit = self._steps.get(key)
        if hit is None:
            cp = self.cuts[cls]
            hit = _remember(self._steps, key, self._close(self.out[n][0] for n in state
                                                          if n != self.accept and _contains(self.chars[n], cp)))
        return hit

    def _search(self, state: frozenset, lo: int, hi: Optional[int]) -> bool:
        # layer by layer over the positions any string of that length reaches; past lo a layer seen
        # before means the layers cycle without acceptance
        seen, length = set(), 0
        while state:
            if length >= lo:
                if self.accept in state:
                    return True
                if state in seen or (hi is not None and length >= hi):
                    return False
                seen.add(state)
            state = self._close(self.out[n][0] for n in state if n != self.accept)
            length += 1
        return False


class Choice(_Automaton):
    """Several patterns walked at once, each in a group (json_mode: patternProperties, a group per schema of
    the values). A string is accepted where the patterns it matches are all of one group, and `group` says
    which: a string that patterns of two groups match is never finished, nor is one that only patterns of
    group None match. States: tuples of the patterns' states, () once none of them can go on."""

    def __init__(self, patterns: Sequence[tuple[Regex, Optional[int]]]):
        self.regexes = tuple(regex for regex, _ in patterns)
        self.groups = tuple(group for _, group in patterns)
        self.start = tuple(regex.start for regex in self.regexes)
        self.cuts = sorted(set().union(*(regex.cuts for regex in self.regexes)))  # (a class steps each pattern alike)
        self._steps: dict[tuple, tuple] = {}
        self._finish: dict[tuple, bool] = {}
        self._some: dict[tuple, bool] = {}

    def group(self, state: tuple) -> Optional[int]:
        """The one group of the patterns that accept (None: none accepts, or patterns of several groups do)."""
        found = {g for regex, g, at in zip(self.regexes, self.groups, state) if regex.accepts(at)}
        return found.pop() if len(found) == 1 else None

    def accepts(self, state: tuple) -> bool:
        return self.group(state) is not None

    def step_class(self, state: tuple, cls: int) -> tuple:
        key = (state, cls)
        hit = self._steps.get(key)
        if hit is None:
            cp = self.cuts[cls]
            after = tuple(regex.step(at, cp) if at else at for regex, at in zip(self.regexes, state))
            hit = _remember(self._steps, key, after if any(after) else ())
        return hit

    def _search(self, state: tuple, lo: int, hi: Optional[int]) -> bool:
        # breadth first over the states the strings of each length reach: one string must bring one pattern
        # to acceptance and keep the other groups' out, so (unlike Regex._search) states are not merged;
        # past lo a state met before adds nothing
        layer, seen, length = {state}, set(), 0
        while layer:
            if length >= lo:
                if any(self.accepts(at) for at in layer):
                    return True
                if hi is not None and length >= hi:
                    return False
                layer -= seen
                seen |= layer
            layer = {after for at in layer for cls in range(len(self.cuts)) if (after := self.step_class(at, cls))}
            length += 1
        return False


def _contains(ranges: Ranges, cp: int) -> bool:
    for lo, hi in ranges:
        if cp < lo:
            return False
        if cp <= hi:
            return True
    return False


ANY_TEXT = Regex("")  # no pattern: any string (an unanchored empty pattern matches everywhere)


def _remember(memo: dict, key, value):
    """memo[key] = value, the memo emptied first once it holds MEMO_LIMIT entries: a pattern's subsets of
    positions can be many (a long string through a large pattern), and a cached Regex lives on in the LRU."""
    if len(memo) >= MEMO_LIMIT:
        memo.clear()
    memo[key] = value
    return value
