"""Tokenizer and chat template through transformers; each token's bytes."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Optional

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


def vocabulary_bytes(tokenizer) -> list[Optional[bytes]]:
    """Each token id's bytes, as the tokenizer's decoder spells them: byte-level BPE pieces through
    GPT-2's table, byte-fallback pieces <0xNN> as that byte, SentencePiece's "\u2581" as a space.
    None for special and added tokens (they are not text)."""
    decoder = _decoder_types(tokenizer)
    table = byte_decoder() if "ByteLevel" in decoder else {}
    not_text = set(getattr(tokenizer, "all_special_ids", [])) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    out: list[Optional[bytes]] = []
    for i, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if i in not_text or not isinstance(piece, str) or not piece:
            out.append(None)
        elif "ByteFallback" in decoder and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append(bytes([int(piece[3:5], 16)]))
        elif table and all(ch in table for ch in piece):
            out.append(bytes(table[ch] for ch in piece))
        else:
            out.append(piece.replace("\u2581", " ").encode("utf-8"))
    return out


def _decoder_types(tokenizer) -> str:
    """The fast tokenizer's decoder description (its types), or "" without one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return ""
    return json.dumps(json.loads(backend.to_str()).get("decoder"))
