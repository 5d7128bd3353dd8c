"""NF4 (QLoRA's 4-bit NormalFloat) blockwise quantization, as bitsandbytes does it: each block of
`blocksize` consecutive weights of a row is divided by its absolute maximum and each value takes the
nearest of 16 codes, the quantiles of a normal distribution scaled to [-1, 1] (Dettmers et al., 2023,
appendix E). Data-free, like RTN; the result is a CodebookWeight bitsandbytes' format carries."""
from __future__ import annotations

import torch

from fitllm.quant.scheme import CodebookWeight

NF4_CODES = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
             -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
             0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
             0.7229568362236023, 1.0)


def nf4_quantize(w: torch.Tensor, blocksize: int = 64) -> CodebookWeight:
    """w [N, K] -> codes [N, K/2] (input column 2j in the high nibble), absmax float32 [N, K/blocksize]."""
    n, k = w.shape
    if k % blocksize or blocksize % 2:
        raise ValueError(f"NF4: block size {blocksize} must be even and divide the input size {k}")
    blocks = w.float().reshape(n, k // blocksize, blocksize)
    absmax = blocks.abs().amax(dim=-1)
    scaled = (blocks / absmax.clamp(min=1e-38)[..., None]).clamp(-1, 1).reshape(n, k)
    codebook = torch.tensor(NF4_CODES, device=w.device)
    midpoints = (codebook[1:] + codebook[:-1]) / 2  # nearest code: a value at a midpoint takes the lower one
    q = torch.bucketize(scaled, midpoints).to(torch.uint8).reshape(n, k // 2, 2)
    return CodebookWeight((q[..., 0] << 4) | q[..., 1], absmax, codebook, blocksize)
