"""GPTQ v1 layout (quant_method "gptq", checkpoint_format "gptq"), as AutoGPTQ/GPTQModel write it.

Per linear `[N out, K in]`, G groups, per = 32 / bits:
  qweight int32 [K/per, N]  packed along K, low bits first (the fitllm kernel layout)
  qzeros  int32 [G, N/per]  packed along N, storing zero - 1 (v1's historical offset)
  scales  fp16  [G, N]
  g_idx   int32 [K]         group of each input column (act-order / desc_act)
dequant: (q - (stored_zero + 1)) * s. Because of the offset a zero point of 0 cannot be
stored; fitllm's quantizer keeps zero >= 1 for this format. `checkpoint_format: gptq_v2`
(GPTQModel's internal form) stores the zero point without the offset.
`lm_head: true` says the lm_head is quantized too; GPTQModel's `dynamic` rules give single modules
other bits or leave them dense (module_config).
"""
from __future__ import annotations

import re
from typing import Optional

import torch

from fitllm.quant.formats.packing import KernelWeight, pack_dim1, unpack_dim1
from fitllm.quant.scheme import QuantError, QuantizedWeight, QuantScheme

SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
OVERRIDABLE = ("bits", "group_size", "desc_act", "sym")  # what a `dynamic` rule may change


def module_config(qc: dict, name: str) -> Optional[dict]:
    """The quantization config of module `name` (HF name, e.g. `lm_head`) under GPTQModel's
    `dynamic` rules, as vLLM applies them: the first pattern that matches the start of the name
    decides; `-:regex` leaves the module unquantized (None), `+:regex` (or a bare regex) overrides
    bits / group_size / desc_act / sym."""
    for pattern, override in (qc.get("dynamic") or {}).items():
        if pattern.startswith("-:"):
            if re.match(pattern[2:], name):
                return None
        elif re.match(pattern.removeprefix("+:"), name):
            return {**qc, **{k: v for k, v in override.items() if k in OVERRIDABLE}}
    return qc


def check_scheme(scheme: QuantScheme) -> None:
    if scheme.bits not in (4, 8):
        raise QuantError(f"--format gptq: {scheme.bits}-bit is not supported (4 or 8)")


def quantization_config(scheme: QuantScheme, lm_head_bits: Optional[int] = None) -> dict:
    """lm_head_bits: the lm_head is quantized too (`lm_head: true`), with a `dynamic` rule when its
    bits differ from the rest."""
    qc = {"quant_method": "gptq", "bits": scheme.bits, "group_size": scheme.group_size,
          "desc_act": scheme.act_order, "sym": scheme.sym, "static_groups": scheme.static_groups,
          "true_sequential": True, "damp_percent": scheme.damp, "lm_head": lm_head_bits is not None,
          "checkpoint_format": "gptq", "pack_dtype": "int32"}
    if lm_head_bits is not None and lm_head_bits != scheme.bits:
        qc["dynamic"] = {"+:lm_head": {"bits": lm_head_bits}}
    return qc


def write(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    from fitllm.quant.formats.packing import pack_dim0

    if int(qw.zero.min()) < 1:
        raise QuantError("gptq v1 format cannot store a zero point of 0 (it stores zero-1); "
                         "quantize with --format gptq from the start or use compressed-tensors")
    return {
        "qweight": pack_dim0(qw.q.t(), qw.bits),
        "qzeros": pack_dim1(qw.zero.t() - 1, qw.bits),
        "scales": qw.scale.t().to(torch.float16).contiguous(),
        "g_idx": qw.groups().to(torch.int32),
    }


def read(t: dict[str, torch.Tensor], qc: dict, dtype) -> KernelWeight:
    bits = int(qc.get("bits", 4))
    offset = 0 if qc.get("checkpoint_format") == "gptq_v2" else 1
    zeros = unpack_dim1(t["qzeros"], bits) + offset  # a stored 0xF (zero 0 wrapped) reads as 16, as in vLLM
    k = t["qweight"].shape[0] * 32 // bits
    group = int(qc.get("group_size", 128))
    group = k if group == -1 else group
    g_idx = t.get("g_idx")
    if g_idx is not None and torch.equal(g_idx.long(), torch.arange(k) // group):
        g_idx = None
    return KernelWeight(t["qweight"], t["scales"].to(dtype), zeros.to(dtype), bits, group,
                        None if g_idx is None else g_idx.to(torch.int32))
