"""Shared fixtures: the embedded model (real weights) and tiny random models of each family."""
from __future__ import annotations

import os
import sys

# Triton picks interpreter or compiler per function when it is decorated (@triton.jit), and
# triton.language decorates its own helpers when it is imported, so TRITON_INTERPRET must be set
# before anything imports triton. The test machines have no GPU: the interpreter is the only way
# the kernel tests run the Triton kernels. Setting it here, once for the whole session (pytest
# imports this file before any test module), makes every file behave the same alone or in any
# order; it changes nothing for CPU tensors on the default backend (they take the torch path).
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("triton was imported before tests/conftest.py could set TRITON_INTERPRET=1 "
                       "(a pytest plugin?); run with TRITON_INTERPRET=1 in the environment")
os.environ["TRITON_INTERPRET"] = "1"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

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
