"""Quantize on the fly (no calibration, no files): RTN int4, FP8 per channel, or NF4 (blocks of 64, bitsandbytes'
default, whatever group_size says).

Either a loaded model (quantize_in_memory: random-weight GPU benchmarks, the int4 self-drafter of speculative
decoding, which shares everything but the linear layers with its target), or a dense checkpoint as it loads
(at_load_factory: `quant serve MODEL --quantization nf4|int4|fp8`), one matrix at a time on the target device, so
neither the host nor the device ever holds the dense model.
"""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Optional

import torch

from fitllm.models.config import ModelConfig
from fitllm.models.decoder import CausalLM
from fitllm.models.errors import ModelLoadError
from fitllm.models.linear import DenseLinear, LinearFactory
from fitllm.quant.formats.packing import to_kernel
from fitllm.quant.fp8 import fp8_quantize
from fitllm.quant.layers import QuantLinear
from fitllm.quant.nf4 import nf4_quantize
from fitllm.quant.rtn import rtn_quantize
from fitllm.quant.scheme import QuantError, QuantScheme, choose_group_size

ON_THE_FLY_METHODS = ("int4", "fp8", "nf4")
NF4_BLOCK = 64  # bitsandbytes' default


def check_method(method: str) -> None:
    if method not in ON_THE_FLY_METHODS:
        raise QuantError(f"quantization {method!r} on the fly is not supported (choose {', '.join(ON_THE_FLY_METHODS)})")


def quantize_weight(weight: torch.Tensor, method: str, scheme: QuantScheme, dtype: torch.dtype):
    """One dense [N, K] weight -> the runtime weight QuantLinear serves (scheme: int4's RTN grid)."""
    if method == "fp8":
        return fp8_quantize(weight)
    if method == "nf4":
        return nf4_quantize(weight, NF4_BLOCK)
    return to_kernel(rtn_quantize(weight, scheme), dtype)


def at_load_factory(method: str, config: ModelConfig, dtype: torch.dtype, device) -> LinearFactory:
    """make_linear for a dense checkpoint quantized as it loads: each matrix is moved to `device` in fp32,
    quantized there and kept only in its quantized form (the lm_head stays dense)."""
    check_method(method)
    from fitllm.budget import linear_shapes

    size, _ = choose_group_size([k for _, k, _ in linear_shapes(config)], None)
    scheme = QuantScheme("rtn", bits=4, group_size=size, sym=False)

    def quantize(weight: torch.Tensor):
        return quantize_weight(weight.to(device, torch.float32), method, scheme, dtype)

    return lambda prefix, in_features, out_sizes, bias: _QuantizedAsLoaded(prefix, in_features, out_sizes, bias,
                                                                            quantize, dtype, device)


class _QuantizedAsLoaded(QuantLinear):
    """A QuantLinear whose checkpoint matrices are dense: each is quantized as it arrives, so neither the host
    nor the device holds more than one dense matrix at a time."""

    def __init__(self, prefix, in_features, out_sizes, bias, quantize, dtype, device):
        super().__init__(prefix, in_features, out_sizes, bias, lambda tensors, name: tensors["quantized"], dtype,
                         device)
        self.quantize = quantize

    def load(self, shard: int, name: str, tensor: torch.Tensor) -> None:
        if name == "bias":
            return super().load(shard, name, tensor)
        if name != "weight":
            raise ModelLoadError(f"{self.names[shard]}.{name}: --quantization takes a dense checkpoint")
        self.pending[shard]["quantized"] = self.quantize(tensor)


@torch.no_grad()
def quantize_in_memory(model: CausalLM, method: str = "int4", group_size: Optional[int] = None,
                       lm_head_bits: Optional[int] = None) -> CausalLM:
    """Replace every dense linear of `model` with a quantized one, in place; returns the model.
    lm_head_bits (4 or 8, int4 method only): the lm_head too, RTN at those bits (a tied one becomes a
    quantized copy of the embedding table)."""
    check_method(method)
    dense = {name: (m.prefix, m.in_features, m.out_sizes, m.weight, m.bias)
             for name, m in model.fused_linears().items() if isinstance(m, DenseLinear)}
    if lm_head_bits is not None and method != "int4":
        raise QuantError("a quantized lm_head goes with int4 layers only")
    if lm_head_bits is not None and not isinstance(model.lm_head, QuantLinear):
        weight = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        dense["lm_head"] = ("lm_head", weight.shape[1], [weight.shape[0]], weight, None)
    size, _ = choose_group_size([k for _, k, _, _, _ in dense.values()], group_size)
    scheme = QuantScheme("rtn", bits=4, group_size=size, sym=False)
    for name, (prefix, in_features, out_sizes, weight, bias) in dense.items():
        quantized = QuantLinear(prefix, in_features, out_sizes, bias is not None, reader=None, dtype=model.dtype,
                                device=model.device)
        layer_scheme = replace(scheme, bits=lm_head_bits) if name == "lm_head" else scheme
        quantized.set_parts([quantize_weight(weight, method, layer_scheme, model.dtype)])
        if bias is not None:
            quantized.bias.copy_(bias)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, quantized)
    return model


def quantized_copy(model: CausalLM, method: str = "int4", group_size: Optional[int] = None) -> CausalLM:
    """A second model whose linears are quantized and whose embeddings and norms are the same
    tensors as `model`'s (no second copy of them)."""
    return quantize_in_memory(shared_copy(model), method, group_size)


def shared_copy(model: CausalLM) -> CausalLM:
    """A second model made of new modules over the same parameter and buffer tensors as `model`'s
    (for replacing some of its modules without a second copy of the rest)."""
    shared = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo=shared)
