"""Quantize a loaded model on the fly (no calibration, no files): RTN int4, FP8 per channel, or NF4 (blocks of 64,
bitsandbytes' default, whatever group_size says).

For random-weight GPU benchmarks and the int4 self-drafter of speculative decoding, which shares
everything but the linear layers with its target.
"""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Optional

import torch

from fitllm.models.decoder import CausalLM
from fitllm.models.linear import DenseLinear
from fitllm.quant.formats.packing import to_kernel
from fitllm.quant.fp8 import fp8_quantize
from fitllm.quant.nf4 import nf4_quantize
from fitllm.quant.layers import QuantLinear
from fitllm.quant.rtn import rtn_quantize
from fitllm.quant.scheme import QuantError, QuantScheme, choose_group_size

ON_THE_FLY_METHODS = ("int4", "fp8", "nf4")


@torch.no_grad()
def quantize_in_memory(model: CausalLM, method: str = "int4", group_size: Optional[int] = None,
                       lm_head_bits: Optional[int] = None) -> CausalLM:
    """Replace every dense linear of `model` with a quantized one, in place; returns the model.
    lm_head_bits (4 or 8, int4 method only): the lm_head too, RTN at those bits (a tied one becomes a
    quantized copy of the embedding table)."""
    if method not in ON_THE_FLY_METHODS:
        raise QuantError(f"on-the-fly quantization {method!r} is not supported ({', '.join(ON_THE_FLY_METHODS)})")
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
        if method == "fp8":
            part = fp8_quantize(weight)
        elif method == "nf4":
            part = nf4_quantize(weight, 64)
        else:
            part = to_kernel(rtn_quantize(weight, layer_scheme), model.dtype)
        quantized.set_parts([part])
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
