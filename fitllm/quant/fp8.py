"""FP8 (e4m3): per-output-channel weight scales; activation scales dynamic per token at run time
(nothing stored) or static per tensor from the calibration inputs' absolute maximum."""
from __future__ import annotations

from typing import Optional

import torch

from fitllm.quant.scheme import FP8Weight

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def fp8_quantize(w: torch.Tensor, input_amax: Optional[torch.Tensor] = None) -> FP8Weight:
    scale = (w.float().abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    input_scale = None if input_amax is None else (input_amax.float() / FP8_MAX).clamp(min=1e-12).reshape(())
    return FP8Weight(q, scale, input_scale)
