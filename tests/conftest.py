"""Shared fixtures: the embedded model (real weights) and tiny random models of each family."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def embedded_folder() -> Path:
    from fitllm.models.hub import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def embedded_model(embedded_folder):
    from fitllm.models.loader import load_model

    return load_model(embedded_folder, dtype=torch.float32)


@pytest.fixture(scope="session")
def embedded_tokenizer(embedded_folder):
    from fitllm.models.tokenizer import load_tokenizer

    return load_tokenizer(embedded_folder)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.skip(f"{SHARED_DATA} not present")
    return SHARED_DATA
