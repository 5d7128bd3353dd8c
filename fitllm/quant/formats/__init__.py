"""Checkpoint formats, each with `quantization_config(scheme)`, `write(qweight) -> {suffix: tensor}`
and `read(tensors, config, dtype) -> KernelWeight`."""
from __future__ import annotations

import importlib

from fitllm.quant.scheme import QuantError

MODULES = {"compressed-tensors": "compressed_tensors", "autoawq": "autoawq", "awq": "autoawq", "gptq": "gptq",
           "bitsandbytes": "bitsandbytes"}


def get_format(name: str):
    """The format module (imported on demand: compressed-tensors pulls in a large import tree)."""
    if name not in MODULES:
        raise QuantError(f"--format: unknown format {name!r} (compressed-tensors, autoawq, gptq, bitsandbytes)")
    return importlib.import_module(f"fitllm.quant.formats.{MODULES[name]}")
