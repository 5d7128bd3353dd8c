"""Incremental detokenization with the embedded model's byte-level BPE tokenizer."""
from __future__ import annotations

import pytest

from fitllm.serve.detokenizer import IncrementalDetokenizer

TEXT = "Héllo wörld 😀 你好, the end. Stop at <END> and not after."


def stream(tok, text, stop=(), prompt="Say:", include_stop=False, min_tokens=0):
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, tok.encode(prompt, add_special_tokens=False), stop, include_stop=include_stop,
                               min_tokens=min_tokens)
    pieces = []
    for i in ids:
        pieces.append(d.add(i))
        if d.stopped:
            break
    pieces.append(d.flush())
    return pieces, d


def test_pieces_join_to_the_full_decode_and_never_split_a_character(embedded_tokenizer):
    pieces, _ = stream(embedded_tokenizer, TEXT)
    assert "".join(pieces) == embedded_tokenizer.decode(embedded_tokenizer.encode(TEXT, add_special_tokens=False))
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("stop, expected", [
    (["<END>"], "Héllo wörld 😀 你好, the end. Stop at "),  # spans ' <', 'END', '>'
    (["d 😀"], "Héllo wörl"),  # spans a multi-byte character split over tokens
    (["nothing like this", "Stop"], "Héllo wörld 😀 你好, the end. "),
])
def test_stop_strings_spanning_tokens(embedded_tokenizer, stop, expected):
    pieces, d = stream(embedded_tokenizer, TEXT, stop)
    assert d.stopped and "".join(pieces) == expected


@pytest.mark.parametrize("stop, expected", [
    (["<END>"], "Héllo wörld 😀 你好, the end. Stop at <END>"),
    (["d 😀", "Stop"], "Héllo wörld 😀"),  # the earliest stop string wins, as without include_stop
])
def test_stop_string_kept_with_include_stop(embedded_tokenizer, stop, expected):
    """vLLM's include_stop_str_in_output: the text ends after the stop string instead of before it."""
    pieces, d = stream(embedded_tokenizer, TEXT, stop, include_stop=True)
    assert d.stopped and "".join(pieces) == expected


def test_stop_strings_wait_for_min_tokens(embedded_tokenizer):
    """vLLM's min_tokens: a stop string must begin after the first min_tokens tokens' text."""
    tok = embedded_tokenizer
    text = "the end. Then more text, the end again."
    ids = tok.encode(text, add_special_tokens=False)
    first = next(k for k in range(len(ids)) if "end" in tok.decode(ids[: k + 1]))  # the token completing "end"
    for m, expected in [(0, "the "), (first, "the "), (first + 1, "the end. Then more text, the ")]:
        pieces, d = stream(tok, text, ["end"], min_tokens=m)
        assert d.stopped and "".join(pieces) == expected, m
    pieces, d = stream(tok, text, ["end"], min_tokens=len(ids))  # never searched: all of it
    assert not d.stopped and "".join(pieces) == tok.decode(ids)


def test_partial_stop_is_held_back_then_released(embedded_tokenizer):
    tok = embedded_tokenizer
    d = IncrementalDetokenizer(tok, [], ["<ENDX>"])
    ids = tok.encode("a <END> b", add_special_tokens=False)
    emitted = [d.add(i) for i in ids]
    k = next(k for k in range(len(ids)) if tok.decode(ids[: k + 1]).endswith("<END"))
    assert "".join(emitted[: k + 1]) == "a "  # '<END' could still become '<ENDX>'
    assert not d.stopped and "".join(emitted) + d.flush() == "a <END> b"


def test_special_tokens_are_skipped(embedded_tokenizer):
    tok = embedded_tokenizer
    d = IncrementalDetokenizer(tok, [], [])
    ids = tok.encode("hi", add_special_tokens=False) + [tok.eos_token_id]
    assert "".join(d.add(i) for i in ids) + d.flush() == "hi"
