"""JSON schema patterns and formats (fitllm/serve/json_regex.py) against Python's re, which
jsonschema and pydantic check values with, and against Python's own readers of each format."""
from __future__ import annotations

import datetime
import ipaddress
import itertools
import random
import re
import uuid

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fitllm.serve.json_regex import FORMATS, PatternError, Regex

# patterns that read alike in both dialects on the strings below (ASCII, no line breaks)
PATTERNS = ["^[a-c]{2,4}$", "^(ab|c)+d?$", "x[0-9]", "^\\d{3}-\\d{2}$", "^[^a-c]*$", "b+$", "^(?:a|b\\.)*c", "a|^b",
            "^[\\w.]+@\\w+$", "^(?P<n>[0-9]){1,3}?x", "^\\s*a\\s*$", "^[\\D]+$", "^[^\\d]b$", "^a{2}|b{1,}c$", "^$",
            "^\\x61\\u0062[\\--/]$", "^[ab]*a[ab]{2}$", "^.a.$", "^(a|)b*$", "\\\\", "^[-a]+$"]
ALPHABET = "abcdx0129-. @\\_\t"


def accepts(regex: Regex, text: str) -> bool:
    state = regex.start
    for ch in text:
        state = regex.step(state, ord(ch))
        if not state:
            return False
    return regex.accepts(state)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(PATTERNS), st.text(alphabet=ALPHABET, max_size=8) | st.text(max_size=4))
def test_patterns_accept_what_python_re_searches(pattern, text):
    """Sound everywhere (what the automaton accepts, re.search finds); exact where the dialects
    agree (ASCII without line breaks)."""
    mine = accepts(Regex(pattern), text)
    theirs = re.search(pattern, text) is not None
    if mine:
        assert theirs, (pattern, text)
    if text.isascii() and "\n" not in text and "\r" not in text:
        assert mine == theirs, (pattern, text)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_can_finish_equals_brute_force(pattern):
    """can_finish(state, lo, hi) against trying every string of up to 4 characters drawn from one
    code point of each class the pattern tells apart (so every way forward is tried)."""
    regex = Regex(pattern)
    letters = [cp for cp in regex.cuts if not 0xD800 <= cp <= 0xDFFF]
    states = {regex.start} | {regex.step(regex.start, cp) for cp in letters}
    for state in filter(None, states):
        ends = set()  # lengths after which a string is accepted
        for n in range(5):
            for word in itertools.product(letters, repeat=n):
                s = state
                for cp in word:
                    s = regex.step(s, cp)
                    if not s:
                        break
                if s and regex.accepts(s):
                    ends.add(n)
        for lo, hi in ((0, 0), (0, 2), (1, 3), (2, 4), (3, 3), (4, 4)):
            assert regex.can_finish(state, lo, hi) == any(lo <= n <= hi for n in ends), (pattern, lo, hi)


@pytest.mark.parametrize("pattern, problem", [
    ("(?=a)", "lookaround"), ("(?<!a)b", "lookaround"), ("(?i)a", "inline flags"), ("(a)\\1", "backreferences"),
    ("\\bword", "word boundaries"), ("a{,3}", "'{,n}'"), ("a**", "nothing to repeat"), ("*a", "nothing to repeat"),
    ("(a", "missing ')'"), ("a)", "unbalanced"), ("[a", "missing ']'"), ("[]a]", "empty class"), ("a^b", "'^'"),
    ("(a$)", "'$'"), ("[z-a]", "out of order"), ("[\\d-z]", "class escape"), ("a{3,2}", "m < n"),
    ("\\ud800", "surrogate"), ("\\x4", "hex digits"), ("a\\", "cannot end"), ("(?:(?:a{100}){100}){100}", "too large"),
])
def test_patterns_that_are_refused(pattern, problem):
    with pytest.raises(PatternError, match=re.escape(problem)):
        Regex(pattern)


def random_value(regex: Regex, rng: random.Random, limit: int = 80) -> str:
    """Characters drawn at random (one of each class the state takes), ending when accepted
    and a coin says so; never a dead end (asserted)."""
    state, out = regex.start, []
    while True:
        options = [i for i in range(len(regex.cuts)) if regex.step_class(state, i)
                   and regex.can_finish(regex.step_class(state, i), 0, None)]
        if regex.accepts(state) and (not options or rng.random() < 0.3 or len(out) >= limit):
            return "".join(out)
        assert options, out
        i = rng.choice(options)
        hi = regex.cuts[i + 1] - 1 if i + 1 < len(regex.cuts) else 0x10FFFF
        cp = rng.randint(regex.cuts[i], min(hi, regex.cuts[i] + 300))
        out.append(chr(cp))
        state = regex.step(state, cp)


READERS = {
    "date": datetime.date.fromisoformat,
    "time": lambda v: datetime.time.fromisoformat(v.replace("Z", "+00:00")),
    "date-time": lambda v: datetime.datetime.fromisoformat(v.replace("Z", "+00:00")),
    "uuid": uuid.UUID,
    "ipv4": ipaddress.IPv4Address,
}


@pytest.mark.parametrize("form", sorted(FORMATS))
def test_formats_write_what_python_reads(form):
    regex, rng = Regex(f"^(?:{FORMATS[form]})$"), random.Random(form)
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER  # (the formats of the draft JSON schemas use)
    for _ in range(200):
        value = random_value(regex, rng)
        if form in READERS:
            READERS[form](value)
        assert checker.conforms(value, form), (form, value)
        if form == "email":
            local, _, domain = value.partition("@")
            assert local and "." in domain and ".." not in value and not local.startswith(".")


def test_formats_take_common_values():
    now = datetime.datetime(2026, 12, 6, 23, 5, 9, 123456)
    samples = {"date": ["2026-12-06", "0001-01-01", "2024-02-28"], "time": ["23:05:09Z", "00:00:00.5+01:30"],
               "date-time": ["2026-12-06T23:05:09Z", now.isoformat() + "+00:00"],
               "uuid": [str(uuid.uuid4()), str(uuid.uuid4()).upper()], "email": ["ann.lee+x@mail.example.org"],
               "hostname": ["localhost", "a-b.example.com"], "ipv4": ["10.0.0.255", "192.168.1.1"],
               "uri": ["https://example.com/a/b?q=1&r=x", "http://localhost:8000/v1"]}
    refused = {"date": ["2026-13-01", "2026-02-30", "0000-01-01", "2026-1-01"], "time": ["24:00:00Z", "12:00:00"],
               "uuid": ["123"], "ipv4": ["256.1.1.1", "01.1.1.1"], "email": ["a@b", "@x.com"],
               "uri": ["ftp://x.org", "https://"], "hostname": ["-a.com"]}
    for form, values in samples.items():
        regex = Regex(f"^(?:{FORMATS[form]})$")
        for value in values:
            assert accepts(regex, value), (form, value)
        for value in refused.get(form, []):
            assert not accepts(regex, value), (form, value)


def test_date_takes_february_29_of_leap_years_only():
    """Every year 0001-9999: the date format's February 29 against the calendar (Python's date reads the same)."""
    import calendar

    leap = re.compile(f"^(?:{FORMATS['date']})$")
    for year in range(1, 10000):
        assert bool(leap.match(f"{year:04d}-02-29")) == calendar.isleap(year), year
    regex = Regex(f"^(?:{FORMATS['date']})$")
    for value, ok in (("2024-02-29", True), ("2000-02-29", True), ("1900-02-29", False), ("2026-02-29", False),
                      ("0400-02-29", True), ("0004-02-29", True), ("0000-02-29", False)):
        assert accepts(regex, value) == ok, value


@st.composite
def regexes(draw, depth: int = 0) -> str:
    """Random patterns of the supported kind (ASCII: where the dialects agree)."""
    atoms = st.sampled_from(["a", "b", "x", "0", "\\.", "-", "[ab]", "[^a]", "[a-c0-9]", "\\d", "\\w", "\\s", ".",
                             "\\-", "[\\-x]", "\\\\"])
    if depth >= 2 or draw(st.booleans()):
        item = draw(atoms)
    else:
        inner = draw(st.lists(regexes(depth + 1), min_size=1, max_size=3))
        item = "(" + draw(st.sampled_from(["", "?:"])) + "|".join(inner) + ")"
    quantifier = draw(st.sampled_from(["", "", "*", "+", "?", "{2}", "{0,2}", "{1,}", "*?"]))
    more = draw(st.lists(regexes(depth + 1), max_size=2)) if depth < 2 else []
    return item + quantifier + "".join(more)


@settings(max_examples=300, deadline=None)
@given(regexes(), st.booleans(), st.booleans(), st.lists(st.text(alphabet="abx0.- _\\9c", max_size=6), min_size=4,
                                                          max_size=4))
def test_random_patterns_agree_with_python_re(body, start, end, texts):
    pattern = ("^" if start else "") + body + ("$" if end else "")
    regex = Regex(pattern)
    for text in texts:
        assert accepts(regex, text) == (re.search(pattern, text) is not None), (pattern, text)


def test_memo_tables_are_capped(monkeypatch):
    from fitllm.serve import json_regex

    monkeypatch.setattr(json_regex, "MEMO_LIMIT", 8)
    regex = Regex("^[a-c]{0,40}x$")
    state = regex.start
    for ch in "abcabcabcabcabcabcabc":
        state = regex.step(state, ord(ch))
        assert regex.can_finish(state, 1, None) and len(regex._steps) <= 8 and len(regex._finish) <= 8
    assert regex.accepts(regex.step(state, ord("x")))
