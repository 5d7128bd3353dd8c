"""AutoAWQ GEMM layout (quant_method "awq", version "gemm"), int4 only.

Per linear `[N out, K in]`, group g:
  qweight int32 [K, N/8]   packed along N, slot j of a word = column AWQ_ORDER[j] of its 8
  qzeros  int32 [K/g, N/8] same packing, the plain zero point (no offset)
  scales  fp16  [K/g, N]
dequant: (q - z) * s. Asymmetric by design; a symmetric scheme is stored with z = 8.
"""
from __future__ import annotations

import torch

from fitllm.quant.formats.packing import AWQ_ORDER, KernelWeight, pack_dim0, pack_dim1, unpack_dim1
from fitllm.quant.scheme import QuantError, QuantizedWeight, QuantScheme

SUFFIXES = ("qweight", "qzeros", "scales")


def check_scheme(scheme: QuantScheme) -> None:
    if scheme.bits != 4 or scheme.group_size == -1 or (scheme.act_order and not scheme.static_groups):
        raise QuantError("--format autoawq: the AutoAWQ GEMM layout holds int4 with a group size and "
                         "no act-order g_idx; use --format compressed-tensors or gptq")


def quantization_config(scheme: QuantScheme) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": scheme.group_size, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": None}


def write(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    return {
        "qweight": pack_dim1(qw.q.t(), 4, AWQ_ORDER),
        "qzeros": pack_dim1(qw.zero.t(), 4, AWQ_ORDER),
        "scales": qw.scale.t().to(torch.float16).contiguous(),
    }


def read(t: dict[str, torch.Tensor], qc: dict, dtype) -> KernelWeight:
    group = int(qc.get("group_size", 128))
    q = unpack_dim1(t["qweight"], 4, AWQ_ORDER)  # [K, N]
    zeros = unpack_dim1(t["qzeros"], 4, AWQ_ORDER)
    if group == -1:
        group = q.shape[0]
    return KernelWeight(pack_dim0(q, 4), t["scales"].to(dtype), zeros.to(dtype), 4, group)
