"""GPTQ v1 layout (quant_method "gptq", checkpoint_format "gptq"), as AutoGPTQ/GPTQModel write it.

Per linear `[N out, K in]`, G groups, per = 32 / bits:
  qweight int32 [K/per, N]  packed along K, low bits first (the fitllm kernel layout)
  qzeros  int32 [G, N/per]  packed along N, storing zero - 1 (v1's historical offset), the 1 taken
                            off each whole int32 word (GPTQModel: `qzeros -= 0x11111111`), so a
                            zero point of 0 borrows from the next slot; read by the inverse word add
  scales  fp16  [G, N]
  g_idx   int32 [K]         group of each input column (act-order / desc_act)
dequant: (q - (stored_zero + 1)) * s. Because of the offset a zero point of 0 cannot be
stored slot by slot; fitllm's quantizer keeps zero >= 1 for this format (then the word and the
slot arithmetic agree). Reading adds 1 slot by slot in some kernels (vLLM's, by its old comment
here; not checked), which misreads such a slot as 16; fitllm inverts GPTQModel's word arithmetic,
as GPTQModel's own loader does. `checkpoint_format: gptq_v2`
(GPTQModel's internal form) stores the zero point without the offset.
`lm_head: true` says the lm_head is quantized too; GPTQModel's `dynamic` rules give single modules
other bits or leave them dense (module_config). `meta.quantizer` lists the producer, and for sym=False
the GPTQModel v1 convention GPTQModel's loader requires of asymmetric files (see producers()).
"""
from __future__ import annotations

import re
from typing import Optional, Sequence

import torch

from fitllm.quant.formats.packing import KernelWeight, pack_dim1, unpack_dim1
from fitllm.quant.scheme import QuantError, QuantizedWeight, QuantScheme

SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
OVERRIDABLE = ("bits", "group_size", "desc_act", "sym")  # what a `dynamic` rule may change


def module_config(qc: dict, name: str, aliases: Sequence[str] = ()) -> Optional[dict]:
    """The quantization config of module `name` (HF name, e.g. `lm_head`; aliases: the other names the
    checkpoint may give it) under GPTQModel's `dynamic` rules, as vLLM applies them: the first pattern
    that matches the start of a name decides; `-:regex` leaves the module unquantized (None),
    `+:regex` (or a bare regex) overrides bits / group_size / desc_act / sym."""
    for pattern, override in (qc.get("dynamic") or {}).items():
        if not any(re.match(pattern.removeprefix("-:").removeprefix("+:"), n) for n in (name, *aliases)):
            continue
        if pattern.startswith("-:"):
            return None
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
    qc["meta"] = {"quantizer": producers(scheme.sym)}
    return qc


# GPTQModel's loader (7.7; the check came with its v2 format in 0.9) refuses an asymmetric v1 checkpoint
# unless `meta.quantizer` names GPTQModel >= 0.9.0 ("only supported if produced by gptqmodel version >= 0.9.0"):
# AutoGPTQ's older v1 export wrapped zero points of 0, and 0.9 is where the export became the word arithmetic
# `read` inverts. fitllm's zero points are >= 1, so its bytes are those GPTQModel's own export writes for the
# same zeros; the second entry names that convention (fitllm, the producer, comes first). vLLM and fitllm's
# reader ignore `meta`.
GPTQMODEL_V1_CONVENTION = "gptqmodel:0.9.0"


def producers(sym: bool) -> list[str]:
    from fitllm import __version__

    return [f"fitllm:{__version__}"] + ([] if sym else [GPTQMODEL_V1_CONVENTION])


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
    qzeros = t["qzeros"]
    if qc.get("checkpoint_format") != "gptq_v2":  # undo v1's offset on the whole word, as GPTQModel
        # does: a zero point of 0 was stored as 0xF and a borrow from the next slot, which a
        # slot-wise +1 would read as 16 and the next as one less; the carry restores both
        ones = sum(1 << (bits * j) for j in range(32 // bits))
        qzeros = (qzeros.long() + ones) & 0xFFFFFFFF
    zeros = unpack_dim1(qzeros, bits)
    k = t["qweight"].shape[0] * 32 // bits
    group = int(qc.get("group_size", 128))
    group = k if group == -1 else group
    g_idx = t.get("g_idx")
    if g_idx is not None and torch.equal(g_idx.long(), torch.arange(k) // group):
        g_idx = None
    return KernelWeight(t["qweight"], t["scales"].to(dtype), zeros.to(dtype), bits, group,
                        None if g_idx is None else g_idx.to(torch.int32))
