"""Bit packing shared by the formats and by fitllm's kernel layout.

Every layout packs 32/bits unsigned integers into one int32, element j of a word at bits
[j*bits, (j+1)*bits). They differ in which axis is packed and, for AutoAWQ, in which element
goes into which slot:
- GPTQ qweight and the fitllm kernel layout: along K (rows of the [K, N] matrix), in order.
- GPTQ qzeros: along N, in order.
- AutoAWQ qweight/qzeros: along N, slot j holds column AWQ_ORDER[j] of each 8-column block.
"""
from __future__ import annotations

import torch

# AutoAWQ GEMM: slot j of a packed int32 holds column AWQ_ORDER[j] of its block of 8 columns
# (so the kernel's shifts unpack to the order its tensor-core fragments want).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # column c lives in slot AWQ_REVERSE[c]


def pack_dim0(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] integers in 0..2^bits-1 -> [R*bits/32, C] int32, rows packed low to high.
    The one packer of fitllm's kernel layout (qweight [K/per, N]); pack_dim1 reuses it."""
    per = 32 // bits
    r, c = q.shape
    if r % per:
        raise ValueError(f"cannot pack {r} rows into int32 words of {per} ({bits}-bit packing)")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) >= 1 << bits):  # would spill into the next slot
        raise ValueError(f"values out of range for {bits} bits: [{int(q.min())}, {int(q.max())}]")
    q = q.to(torch.int32).reshape(r // per, per, c)
    out = torch.zeros(r // per, c, dtype=torch.int32, device=q.device)
    for j in range(per):
        out |= q[:, j] << (bits * j)  # the top slot may set the sign bit: int32 wraps, as intended
    return out


def unpack_dim0(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_dim0: [R/per, C] int32 -> [R, C] int32."""
    per, mask = 32 // bits, (1 << bits) - 1
    parts = [(packed >> (bits * j)) & mask for j in range(per)]
    return torch.stack(parts, dim=1).reshape(-1, packed.shape[1])


def pack_dim1(q: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """[R, C] -> [R, C*bits/32] int32, columns packed; `order` (AWQ_ORDER) permutes slots."""
    per = 32 // bits
    blocks = q.to(torch.int32).reshape(q.shape[0], -1, per)
    if order is not None:
        blocks = blocks[:, :, list(order)]
    return pack_dim0(blocks.permute(2, 0, 1).reshape(per, -1), bits).reshape(q.shape[0], -1)


def unpack_dim1(packed: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    per = 32 // bits
    slots = unpack_dim0(packed.reshape(1, -1), bits).reshape(per, packed.shape[0], packed.shape[1])
    blocks = slots.permute(1, 2, 0)  # [R, C/per, slot]
    if order is not None:
        blocks = blocks[:, :, [list(order).index(c) for c in range(per)]]
    return blocks.reshape(packed.shape[0], -1)


def _in_input_order(w: torch.Tensor, perm) -> torch.Tensor:
    """A dequantized [N, K] weight whose column j holds input column perm[j] (act-order rows sorted
    by group), with its columns put back in the input's order."""
    from fitllm.kernels._utils import scatter_columns

    return w if perm is None else scatter_columns(w, perm)


class KernelWeight:
    """fitllm's one runtime layout (what fitllm.kernels.w4a16 consumes): qweight [K/per, N] int32
    packed along K, scales/zeros [G, N] (zeros as float integers), optional g_idx [K] int32.
    perm (act-order weights on the GPU whose rows were sorted by group, grouped_by_permutation):
    the input columns the stored rows hold, in order; the GEMM takes x[:, perm]."""

    def __init__(self, qweight, scales, zeros, bits: int, group_size: int, g_idx=None, perm=None):
        self.qweight, self.scales, self.zeros, self.g_idx = qweight, scales, zeros, g_idx
        self.bits, self.group_size, self.perm = bits, group_size, perm

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * 32 // self.bits

    def groups(self) -> torch.Tensor:
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.in_features, device=self.qweight.device) // self.group_size

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """[N, K] in `dtype` (the torch reference path)."""
        q = unpack_dim0(self.qweight, self.bits).to(dtype)  # [K, N]
        g = self.groups()
        return _in_input_order(((q - self.zeros[g].to(dtype)) * self.scales[g].to(dtype)).t(), self.perm)

    def permute_outputs(self, idx: torch.Tensor) -> "KernelWeight":
        """The same weight with output j holding output idx[j]."""
        return KernelWeight(self.qweight[:, idx], self.scales[:, idx], self.zeros[:, idx], self.bits, self.group_size,
                            self.g_idx, self.perm)

    def grouped_by_permutation(self) -> "KernelWeight | None":
        """An act-order weight (g_idx) as the same weight with its input rows sorted by group, so it
        needs no g_idx, carrying that order as `perm` (int32 [K]): y = x W^T = x[:, perm] W_sorted^T. So
        the kernels for plain groups serve it, given the gathered x (exllama and Marlin do the same).
        None when there is nothing to sort, or its groups are not group_size rows each."""
        if self.g_idx is None:
            return None
        g = self.g_idx.long()
        perm = torch.argsort(g, stable=True)
        if not torch.equal(g[perm], torch.arange(self.in_features, device=g.device) // self.group_size):
            return None
        q = unpack_dim0(self.qweight, self.bits)[perm]
        return KernelWeight(pack_dim0(q, self.bits), self.scales, self.zeros, self.bits, self.group_size,
                            perm=perm.to(torch.int32))


class TiledWeight:
    """The GPU form of a 4- or 8-bit KernelWeight without g_idx: qtile [N, Kp*bits/32] in the tiled
    layout of fitllm.kernels.w4a16_tiled (built for its tensor-core kernel), scales/zeros as
    KernelWeight's. perm (act-order weights, KernelWeight.grouped_by_permutation): the input columns
    the stored rows hold, in order; the GEMM gathers x[:, perm] first."""

    g_idx = None

    def __init__(self, qtile, scales, zeros, group_size: int, in_features: int, perm=None, bits: int = 4):
        self.qtile, self.scales, self.zeros = qtile, scales, zeros
        self.group_size, self.in_features, self.perm, self.bits = group_size, in_features, perm, bits

    @classmethod
    def from_kernel(cls, kw: KernelWeight) -> "TiledWeight":
        """kw (no g_idx) tiled; an act-order weight sorted by group keeps its perm."""
        from fitllm.kernels.w4a16_tiled import tile_pack

        return cls(tile_pack(kw.qweight, kw.bits), kw.scales, kw.zeros, kw.group_size, kw.in_features, kw.perm,
                   kw.bits)

    def permute_outputs(self, idx: torch.Tensor) -> "TiledWeight":
        """The same weight with output j holding output idx[j]."""
        from fitllm.kernels.w4a16_tiled import permute_tile_rows

        return TiledWeight(permute_tile_rows(self.qtile, idx, self.bits), self.scales[:, idx], self.zeros[:, idx],
                           self.group_size, self.in_features, self.perm, self.bits)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """[N, K] in `dtype`, columns in the input's order (tests, evaluation tools)."""
        from fitllm.kernels.w4a16_tiled import dequantize_tiled_ref

        w = dequantize_tiled_ref(self.qtile, self.scales, self.zeros, self.group_size, self.in_features, dtype,
                                 self.bits)
        return _in_input_order(w, self.perm)


def to_kernel(qw, dtype=torch.float32) -> KernelWeight:
    """QuantizedWeight -> kernel layout; drops g_idx when it is plain k // group_size."""
    k = qw.q.shape[1]
    size = k if qw.group_size == -1 else qw.group_size
    g_idx = None if qw.trivial_g_idx() else qw.g_idx.to(torch.int32)
    return KernelWeight(pack_dim0(qw.q.t(), qw.bits), qw.scale.t().to(dtype).contiguous(),
                        qw.zero.t().to(dtype).contiguous(), qw.bits, size, g_idx)
