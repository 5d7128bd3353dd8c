"""Tokenizer and chat template through transformers."""
from __future__ import annotations

from pathlib import Path

from fitllm.models.errors import ModelLoadError


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:
        raise ModelLoadError(f"{folder}: cannot load the tokenizer ({exc.__class__.__name__}: {exc})") from None
