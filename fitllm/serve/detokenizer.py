"""Incremental detokenization with stop strings.

Text for new tokens is the difference between decoding a short window of recent tokens with and
without them (the offsets scheme of TGI and vLLM): tokenizers merge bytes and spaces across
token boundaries, so tokens cannot be decoded one by one. While the window's text ends in U+FFFD
a multi-byte character is still incomplete and nothing is emitted, so a client never sees
half of a character.

Stop strings: text that could be the start of a stop string is held back until the next tokens
decide; a stop string found (possibly spanning many tokens) ends the text just before it (or just
after it, with include_stop: vLLM's include_stop_str_in_output). The text of the first `min_tokens`
tokens is never searched: a stop string must begin after it (vLLM's min_tokens).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

# Prompt tokens to decode in front of the first generated ones: SentencePiece tokenizers drop a
# leading space when a token is decoded at the start of a text.
PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, include_stop: bool = False, min_tokens: int = 0):
        self.tokenizer, self.skip_special, self.include_stop = tokenizer, skip_special_tokens, include_stop
        self.unsearched = min_tokens  # tokens still to come whose text no stop string may begin in
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self.ids = list(prompt_ids[-PROMPT_CONTEXT:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.stop = [s for s in stop if s]
        self.text = ""  # all decoded output text, including what is held back
        self.sent = 0  # characters of `text` already returned
        self.stopped = False
        self.stop_string: Optional[str] = None  # the stop string that ended the text

    def add(self, token_id: int) -> str:
        """Feed one generated token; return the text that is now safe to emit."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        self.text += self._decode_new()
        if self.unsearched > 0:
            self.unsearched -= 1
        elif self.stop:
            return self._emit(self._check_stop())
        return self._emit(len(self.text))

    def flush(self) -> str:
        """At the end of generation (not by a stop string): whatever is held back."""
        if self.stopped:
            return ""
        tail = self._decode(self.ids[self.prefix_offset:])
        prev = self._decode(self.ids[self.prefix_offset:self.read_offset])
        if len(tail) > len(prev):  # an incomplete character at the very end
            self.text += tail[len(prev):]
            self.read_offset = len(self.ids)
        return self._emit(len(self.text))

    def _decode_new(self) -> str:
        prev = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prev) or full.endswith("\ufffd"):
            return ""  # nothing yet, or a character still incomplete: wait for more bytes
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prev):]

    def _check_stop(self) -> int:
        """How much of `text` may be emitted; truncates `text` at a stop string."""
        # A stop string cannot start in text already sent (it would have been held back),
        # but may start up to len(stop) - 1 characters before the newly decoded text.
        window = max(0, self.sent)
        hits = [(self.text.find(s, window), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            at, stop = min(hits)
            self.text = self.text[: at + (len(stop) if self.include_stop else 0)]
            self.stopped, self.stop_string = True, stop
            return len(self.text)
        return len(self.text) - self._held_back()

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text) - self.sent), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _emit(self, upto: int) -> str:
        out = self.text[self.sent:upto]
        self.sent = max(self.sent, upto)
        return out


def _decoder(tokenizer, skip_special_tokens: bool) -> Callable[[Sequence[int]], str]:
    """ids -> text, without clean-up (it strips spaces before punctuation, which would change
    the text; the server's own decode does not clean up either). A fast tokenizer is called
    through its Rust backend: transformers' wrapper costs more than the decode itself, and the
    engine thread runs this twice per generated token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "decode"):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                        clean_up_tokenization_spaces=False)
