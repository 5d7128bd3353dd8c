"""Tokenizer and chat template through transformers; each token's bytes."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Optional, Sequence

from fitllm.models.errors import ModelLoadError


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:
        raise ModelLoadError(f"{folder}: cannot load the tokenizer ({exc.__class__.__name__}: {exc})") from None


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: byte-level BPE spells every byte as one character."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return {ch: b for b, ch in enumerate(chars)}


class TokenBytes:
    """Token ids -> their bytes, as the tokenizer's decoder spells them: byte-level BPE pieces
    through GPT-2's table, byte-fallback pieces <0xNN> as that byte, SentencePiece's "\u2581" as a
    space. None for special and added tokens (they are not text). The decoder is read once, so a
    few ids cost only their own pieces."""

    def __init__(self, tokenizer):
        decoder = _decoder_types(tokenizer)
        self.tokenizer, self.byte_fallback = tokenizer, "ByteFallback" in decoder
        self.table = byte_decoder() if "ByteLevel" in decoder else {}
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self.not_text = set(getattr(tokenizer, "all_special_ids", [])) | set(added)

    def __call__(self, ids: Sequence[int]) -> list[Optional[bytes]]:
        return [self._bytes(i, piece) for i, piece in zip(ids, self.tokenizer.convert_ids_to_tokens(list(ids)))]

    def _bytes(self, token_id: int, piece) -> Optional[bytes]:
        if token_id in self.not_text or not isinstance(piece, str) or not piece:
            return None
        if self.byte_fallback and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        if self.table and all(ch in self.table for ch in piece):
            return bytes(self.table[ch] for ch in piece)
        return piece.replace("\u2581", " ").encode("utf-8")


def vocabulary_bytes(tokenizer) -> list[Optional[bytes]]:
    """Every token id's bytes (TokenBytes)."""
    return TokenBytes(tokenizer)(range(len(tokenizer)))


def _decoder_types(tokenizer) -> str:
    """The fast tokenizer's decoder description (its types), or "" without one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return ""
    return json.dumps(json.loads(backend.to_str()).get("decoder"))
