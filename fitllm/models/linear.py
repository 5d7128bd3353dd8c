"""Linear layers the decoder builds through a factory, so quantized backends can plug in.

A linear may fuse several checkpoint matrices along the output dimension (q|k|v, gate|up): the
loader hands each checkpoint tensor over with its shard index and name suffix ("weight",
"qweight", "weight_scale", ...); the layer stores it, and `finalize()` runs once after loading
(quantized layers repack there). The dense layer copies straight into its slice: no second copy.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fitllm.models.errors import ModelLoadError


class FusedLinear(nn.Module):
    """Base: in_features -> sum(out_sizes), one GEMM for several checkpoint matrices.

    forward(x, defer=False) -> y. defer=True is the decoder's promise that y goes straight to one
    of fitllm.kernels.fused's RMSNorm (with a residual) or SiLU·mul, or (qkv) to the launch that
    applies RoPE and writes the KV cache, which also take a split-K GEMM's unfinished sum
    (kernels._utils.PendingSum): a layer may then return one instead of y.
    """

    def __init__(self, prefix: str, in_features: int, out_sizes: Sequence[int], bias: bool):
        super().__init__()
        self.prefix = prefix
        self.in_features = in_features
        self.out_sizes = list(out_sizes)
        self.out_features = sum(out_sizes)
        self.has_bias = bias

    def shard_slice(self, shard: int) -> slice:
        start = sum(self.out_sizes[:shard])
        return slice(start, start + self.out_sizes[shard])

    def load(self, shard: int, name: str, tensor: torch.Tensor) -> None:
        raise NotImplementedError

    def finalize(self) -> None:
        """Called once after all tensors are loaded."""

    def input_quant(self):
        """How this layer's one GEMM wants x quantized (kernels._utils: Fp8Input for a W8A8 fp8 GEMM,
        X16Input for a 4-bit one whose batch-1 GEMV runs on dp4a), which its producer (a fused RMSNorm
        or SiLU·mul) may then do; None: x as it is."""
        return None

    def input_perm(self):
        """The column order this layer's one GEMM wants x in (an act-order weight stored sorted by
        group, quant.layers), which its producer (a fused RMSNorm, or the attention for o_proj) may
        write x in, handing over kernels._utils.Gathered; None: x as it is."""
        return None

    def permute_outputs(self, idx: torch.Tensor) -> bool:
        """Make output j what output idx[j] was (decoder.MLP.fold_input_order); False where this
        layer cannot, unchanged."""
        return False


class DenseLinear(FusedLinear):
    def __init__(self, prefix, in_features, out_sizes, bias, dtype=None, device=None):
        super().__init__(prefix, in_features, out_sizes, bias)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features, dtype=dtype, device=device), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(self.out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    def load(self, shard: int, name: str, tensor: torch.Tensor) -> None:
        target = {"weight": self.weight, "bias": self.bias}.get(name)
        if target is None:
            raise ModelLoadError(f"{self.prefix}: unexpected tensor {name!r} for a dense layer (is the checkpoint quantized?)")
        expected = target[self.shard_slice(shard)].shape
        if tuple(tensor.shape) != tuple(expected):
            raise ModelLoadError(f"{self.prefix} shard {shard}: {name} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")
        target.data[self.shard_slice(shard)].copy_(tensor)

    def permute_outputs(self, idx: torch.Tensor) -> bool:
        self.weight.data = self.weight.data[idx]
        if self.bias is not None:
            self.bias.data = self.bias.data[idx]
        return True

    def forward(self, x: torch.Tensor, defer: bool = False) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)  # always y (see FusedLinear)


class LinearFactory(Protocol):
    def __call__(self, prefix: str, in_features: int, out_sizes: Sequence[int], bias: bool) -> FusedLinear: ...


def dense_factory(dtype: torch.dtype, device: torch.device | str) -> LinearFactory:
    def make(prefix: str, in_features: int, out_sizes: Sequence[int], bias: bool) -> FusedLinear:
        return DenseLinear(prefix, in_features, out_sizes, bias, dtype=dtype, device=device)

    return make
