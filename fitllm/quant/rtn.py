"""Round-to-nearest: grid parameters from each group's range, then rounding. The other
integer methods reuse these helpers (AWQ after scaling, GPTQ column by column)."""
from __future__ import annotations

from typing import Optional

import torch

from fitllm.quant.scheme import QuantizedWeight, QuantScheme


def grid_params(w: torch.Tensor, scheme: QuantScheme, clip: Optional[torch.Tensor] = None):
    """Scale and zero point for rows of `w` [N, g] (one group each): returns ([N], [N]).

    `clip` [N] shrinks the range (AWQ's clipping search). Scales are rounded to the dtype the
    checkpoint stores them in, so the integers are chosen against the scale actually used."""
    w = w.float()
    hi, lo = w.amax(dim=1), w.amin(dim=1)
    if clip is not None:
        hi, lo = hi * clip, lo * clip
    if scheme.sym:
        half = 1 << (scheme.bits - 1)
        # symmetric around zero = half; 2*amax/qmax as GPTQ and llm-compressor do
        scale = 2 * torch.maximum(hi.abs(), lo.abs()) / scheme.qmax
        scale = scale.clamp(min=1e-8).to(scheme.scale_dtype).float()
        zero = torch.full_like(scale, half)
    else:
        hi, lo = hi.clamp(min=0), lo.clamp(max=0)  # keep 0 exactly representable
        scale = ((hi - lo) / scheme.qmax).clamp(min=1e-8).to(scheme.scale_dtype).float()
        zero = torch.round(-lo / scale).clamp(scheme.zero_min, scheme.qmax)
    return scale, zero


def quantize_with(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmax: int) -> torch.Tensor:
    """Integers for `w` [N, k] given per-row scale/zero [N] (or broadcastable [N, k])."""
    if scale.dim() == 1:
        scale, zero = scale[:, None], zero[:, None]
    return torch.clamp(torch.round(w.float() / scale) + zero, 0, qmax)


def fake_quant(w: torch.Tensor, scale, zero, qmax: int) -> torch.Tensor:
    if scale.dim() == 1:
        scale, zero = scale[:, None], zero[:, None]
    return (quantize_with(w, scale, zero, qmax) - zero) * scale


def rtn_quantize(w: torch.Tensor, scheme: QuantScheme, clip: Optional[torch.Tensor] = None) -> QuantizedWeight:
    """Round-to-nearest of `w` [N, K]; `clip` [N, G] optional range shrink per group."""
    n, k = w.shape
    size = k if scheme.group_size == -1 else scheme.group_size
    groups = w.float().reshape(n, k // size, size)
    flat = groups.reshape(-1, size)
    scale, zero = grid_params(flat, scheme, None if clip is None else clip.reshape(-1))
    q = quantize_with(flat, scale, zero, scheme.qmax).reshape(n, k)
    return QuantizedWeight(q.to(torch.uint8), scale.reshape(n, -1), zero.reshape(n, -1).to(torch.int32),
                           scheme.bits, scheme.group_size, scheme.sym)


def mse_grid_params(w: torch.Tensor, scheme: QuantScheme, steps: int = 10, max_shrink: float = 0.25):
    """Like grid_params, but each row's range shrunk by the factor (1 .. 1-max_shrink) that
    minimises its squared rounding error: clipping a few outliers buys finer steps for the rest."""
    best_err = torch.full((w.shape[0],), float("inf"), dtype=torch.float64, device=w.device)
    best_scale = best_zero = None
    for i in range(steps + 1):
        clip = torch.full((w.shape[0],), 1 - max_shrink * i / steps, device=w.device)
        scale, zero = grid_params(w, scheme, clip)
        err = (fake_quant(w, scale, zero, scheme.qmax) - w.float()).pow(2).sum(1).double()
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = scale if best_scale is None else torch.where(better, scale, best_scale)
        best_zero = zero if best_zero is None else torch.where(better, zero, best_zero)
    return best_scale, best_zero
