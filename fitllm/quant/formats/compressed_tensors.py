"""compressed-tensors (quant_method "compressed-tensors"): the format vLLM, SGLang and transformers
read natively. The schema (QuantizationConfig/Scheme/Args) and the int packers come from the
`compressed-tensors` package itself, so fitllm writes what its own loaders expect.

pack-quantized (int4/int8) per linear `[N, K]`:
  weight_packed     int32 [N, K*bits/32]  signed values + 2^(bits-1), packed along K low bits first
  weight_scale      [N, G]
  weight_zero_point int32 [N*bits/32, G]  (asymmetric only) signed zero points packed along N
  weight_shape      int64 [2]
  weight_g_idx      int32 [K]             (act-order "group" only)
float-quantized (FP8): weight e4m3 [N, K], weight_scale [N, 1], input_scale [1] when static.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import compressed_tensors
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.utils.match import match_name

from fitllm.quant.formats.packing import KernelWeight, pack_dim0
from fitllm.quant.scheme import FP8Weight, QuantError, QuantScheme

INT_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
FP8_SUFFIXES = ("weight", "weight_scale", "input_scale")


def check_scheme(scheme: QuantScheme) -> None:
    if scheme.act_order and not scheme.static_groups and scheme.group_size != -1:
        raise QuantError("--format compressed-tensors: act-order needs static groups in this format "
                         "(compressed-tensors dropped g_idx); add --static-groups or use --format gptq")


def _scheme(scheme: QuantScheme) -> QuantizationScheme:
    if scheme.method == "fp8":
        weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
        inputs = (QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)
                  if scheme.fp8_static_input else
                  QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True))
        return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs, format="float-quantized")
    per_channel = scheme.group_size == -1
    # compressed-tensors >= 0.20 only knows act-order with static groups ("weight"): no g_idx
    actorder = "weight" if scheme.act_order else None
    weights = QuantizationArgs(num_bits=scheme.bits, type="int", symmetric=scheme.sym,
                               strategy="channel" if per_channel else "group",
                               group_size=None if per_channel else scheme.group_size, actorder=actorder)
    return QuantizationScheme(targets=["Linear"], weights=weights, format="pack-quantized")


def quantization_config(scheme: QuantScheme) -> dict:
    qs = _scheme(scheme)
    cfg = QuantizationConfig(config_groups={"group_0": qs}, format=qs.format,
                             quantization_status="compressed", ignore=["lm_head"])
    # the same keys compressed-tensors' own ModelCompressor writes into config.json
    return {"version": compressed_tensors.__version__, "quant_method": "compressed-tensors",
            "sparsity_config": {}, "transform_config": {}, **cfg.model_dump(mode="json", exclude={"quant_method"})}


def write(qw) -> dict[str, torch.Tensor]:
    if isinstance(qw, FP8Weight):
        out = {"weight": qw.weight, "weight_scale": qw.scale.float()[:, None].contiguous()}
        if qw.input_scale is not None:
            out["input_scale"] = qw.input_scale.float().reshape(1)
        return out
    offset = 1 << (qw.bits - 1)
    out = {
        "weight_packed": pack_to_int32((qw.q.to(torch.int32) - offset).to(torch.int8), qw.bits),
        "weight_scale": qw.scale.contiguous(),
        "weight_shape": torch.tensor(list(qw.q.shape), dtype=torch.int64),
    }
    if not qw.sym:
        out["weight_zero_point"] = pack_to_int32((qw.zero - offset).to(torch.int8), qw.bits, packed_dim=0)
    if not qw.trivial_g_idx():
        out["weight_g_idx"] = qw.g_idx.to(torch.int32)
    return out


def scheme_for(qc: dict, name: str, aliases: Sequence[str] = ()) -> Optional[dict]:
    """The weights/input args dict of the config group that targets module `name` (HF name; aliases: the
    other names the checkpoint may give it), or None when the module is ignored or untargeted (it stays
    dense)."""
    names = (name, *aliases)
    if any(match_name(n, ig) for ig in qc.get("ignore") or [] for n in names):
        return None
    for group in (qc.get("config_groups") or {}).values():
        targets = group.get("targets") or []
        if "Linear" in targets or any(t != "Linear" and match_name(n, t) for t in targets for n in names):
            return group
    return None


def read(t: dict[str, torch.Tensor], group: dict, dtype, name: str = ""):
    """Checkpoint tensors of one linear -> KernelWeight (int) or FP8Weight."""
    w = group.get("weights") or {}
    fmt = group.get("format") or "pack-quantized"
    if w.get("type") == "float":
        if "weight" not in t or "weight_scale" not in t:
            raise QuantError(f"{name}: float-quantized layer lacks weight/weight_scale")
        return FP8Weight(t["weight"], t["weight_scale"].float().reshape(-1), t.get("input_scale"))
    if fmt != "pack-quantized" or "weight_packed" not in t:
        raise QuantError(f"{name}: compressed-tensors format {fmt!r} is not supported (pack-quantized, float-quantized)")
    bits = int(w.get("num_bits", 4))
    shape = [int(s) for s in t["weight_shape"].tolist()]
    n, k = shape
    offset = 1 << (bits - 1)
    q = unpack_from_int32(t["weight_packed"], bits, torch.Size(shape)).to(torch.int32) + offset  # [N, K]
    scale = t["weight_scale"].reshape(n, -1)
    groups = scale.shape[1]
    if "weight_zero_point" in t and not w.get("symmetric", True):
        zero = unpack_from_int32(t["weight_zero_point"], bits, torch.Size([n, groups]), packed_dim=0).to(torch.int32) + offset
    else:
        zero = torch.full((n, groups), offset, dtype=torch.int32)
    size = k // groups
    g_idx = t.get("weight_g_idx")
    if g_idx is not None and torch.equal(g_idx.long(), torch.arange(k) // size):
        g_idx = None
    return KernelWeight(pack_dim0(q.t(), bits), scale.t().to(dtype).contiguous(), zero.t().to(dtype).contiguous(),
                        bits, size, None if g_idx is None else g_idx.to(torch.int32))
