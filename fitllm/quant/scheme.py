"""What to quantize and how: the scheme, the group-size rule, and one quantized weight.

`QuantizedWeight` is fitllm's neutral form of an integer-quantized matrix, the meeting point of
the algorithms (which produce it) and the formats (which write it and read it back):
`q` unsigned integers [N, K] in 0..2^bits-1, `scale` and `zero` [N, groups] with dequant
`(q - zero[:, g]) * scale[:, g]` where g = g_idx[k] (or k // group_size without act-order).
Symmetric schemes keep zero = 2^(bits-1), so every format can carry both.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from fitllm.models.errors import FitLLMError

METHODS = ("rtn", "awq", "gptq", "fp8", "nf4")
FORMATS = ("compressed-tensors", "autoawq", "gptq", "bitsandbytes")


class QuantError(FitLLMError):
    """Bad quantization request or input (the message names the option or file)."""


@dataclass
class QuantScheme:
    method: str
    bits: int = 4
    group_size: int = 64  # -1: one scale per output channel
    sym: bool = False
    act_order: bool = False  # GPTQ: columns in decreasing Hessian diagonal order
    static_groups: bool = False  # GPTQ act-order: groups fixed by column index (no g_idx needed)
    damp: float = 0.3  # GPTQ: dampening, fraction of mean diagonal (0.01 overfits calibration text)
    fp8_static_input: bool = False  # FP8: static per-tensor activation scale from calibration
    zero_min: int = 0  # GPTQ v1 stores zero-1, so zero 0 cannot be written: that format sets 1
    scale_dtype: torch.dtype = torch.float32  # the dtype scales are stored in (rounded to it)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.method not in METHODS:
            raise QuantError(f"--method: unknown method {self.method!r} (choose one of {', '.join(METHODS)})")
        if self.method == "nf4" and self.bits != 4:
            raise QuantError(f"--bits: NF4 is 4-bit (got {self.bits})")
        if self.method != "fp8" and self.bits not in (4, 8):
            raise QuantError(f"--bits: {self.bits} is not supported (4 or 8)")

    @property
    def qmax(self) -> int:
        return (1 << self.bits) - 1


def choose_group_size(in_features: Sequence[int], requested: Optional[int]) -> tuple[int, str]:
    """Explicit group sizes must divide every input size; the default picks the largest of
    128/64/32 that does, else per channel. Returns (group_size, sentence explaining it)."""
    sizes = sorted(set(in_features))
    if requested is not None:
        if requested == -1:
            return -1, "per-channel scales (--group-size -1)"
        if requested <= 0:
            raise QuantError(f"--group-size: {requested} must be positive or -1 (per channel)")
        bad = [k for k in sizes if k % requested]
        if bad:
            raise QuantError(f"--group-size: {requested} does not divide input size {bad[0]} "
                             f"(sizes here: {sizes}); try 64, 32 or -1")
        return requested, f"group size {requested} (--group-size)"
    for g in (128, 64, 32):
        if all(k % g == 0 for k in sizes):
            why = "" if g == 128 else f" (128 does not divide input size {next(k for k in sizes if k % 128)})"
            return g, f"group size {g}{why}"
    return -1, f"per-channel scales (none of 128/64/32 divides all input sizes {sizes})"


@dataclass
class QuantizedWeight:
    q: torch.Tensor  # [N, K] uint8, 0..2^bits-1
    scale: torch.Tensor  # [N, G] float
    zero: torch.Tensor  # [N, G] int32 (unsigned zero point)
    bits: int
    group_size: int  # -1: per channel (G == 1)
    sym: bool
    g_idx: Optional[torch.Tensor] = None  # [K] int32 group of each input column (act-order)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def groups(self) -> torch.Tensor:
        """Group index of every input column."""
        if self.g_idx is not None:
            return self.g_idx.long()
        k = self.q.shape[1]
        size = k if self.group_size == -1 else self.group_size
        return torch.arange(k, device=self.q.device) // size

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        g = self.groups()
        return ((self.q.to(dtype) - self.zero[:, g].to(dtype)) * self.scale[:, g].to(dtype))

    def rows(self, sl: slice) -> "QuantizedWeight":
        """Output rows `sl` (to split a fused q|k|v back into checkpoint matrices)."""
        return QuantizedWeight(self.q[sl], self.scale[sl], self.zero[sl], self.bits, self.group_size, self.sym, self.g_idx)

    def trivial_g_idx(self) -> bool:
        if self.g_idx is None:
            return True
        size = self.q.shape[1] if self.group_size == -1 else self.group_size
        return bool(torch.equal(self.g_idx.long(), torch.arange(self.q.shape[1], device=self.g_idx.device) // size))


@dataclass
class FP8Weight:
    weight: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [N] float32 per output channel
    input_scale: Optional[torch.Tensor] = None  # scalar float32 when activations are static

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return self.weight.to(dtype) * self.scale.to(dtype)[:, None]

    def rows(self, sl: slice) -> "FP8Weight":
        return FP8Weight(self.weight[sl], self.scale[sl], self.input_scale)


@dataclass
class CodebookWeight:
    """A 4-bit codebook weight (bitsandbytes NF4 / FP4), in fitllm.kernels.codebook4's layout: codes uint8
    [N, K/2] (input column 2j in the high nibble), absmax [N, K/blocksize] (float32 from the quantizer, as
    bitsandbytes stores it; float16 once served: to()), codebook float32 [16]."""
    codes: torch.Tensor
    absmax: torch.Tensor
    codebook: torch.Tensor
    blocksize: int

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * 2

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        from fitllm.kernels.codebook4 import dequantize_codebook4

        return dequantize_codebook4(self.codes, self.absmax, self.codebook, self.blocksize, dtype)

    def rows(self, idx) -> "CodebookWeight":
        return CodebookWeight(self.codes[idx], self.absmax[idx], self.codebook, self.blocksize)

    def to(self, device) -> "CodebookWeight":
        """The served form on `device`: absmax in float16 (half the bytes of bitsandbytes' float32; its rounding,
        2^-11 relative, is far below the codes' own)."""
        return CodebookWeight(self.codes.to(device), self.absmax.to(device, torch.float16), self.codebook.to(device),
                              self.blocksize)

    def __repr__(self) -> str:
        return f"CodebookWeight([{self.codes.shape[0]}, {self.in_features}], blocksize={self.blocksize})"
