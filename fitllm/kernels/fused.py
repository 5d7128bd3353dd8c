"""Fused elementwise kernels of the decoder: RMSNorm (+ residual add), RoPE, SiLU·mul.

Each has a torch reference of the same signature (the CPU path and the test oracle) that is, line
for line, what fitllm.models.decoder computed before these kernels existed. The Triton kernels
compute the same function, rounding where the reference rounds (e.g. RMSNorm casts the normalised
row to the activation dtype *before* the weight multiply, as the HF implementations do), so
results agree to the last bit up to reduction order and the GPU's exp/sqrt.

  rms_norm(x, weight, eps, residual=None) -> out, or (out, x + residual) when residual is given:
      the residual add of a decoder layer fused into the next norm (vLLM's fused_add_rms_norm).
  apply_rope(q, k, cos, sin) -> (q, k), rotated IN PLACE (both backends), rotate-half convention.
  silu_mul(gate_up) -> silu(gate) * up, gate_up [..., 2I] -> [..., I].

Dispatch as for the GEMMs (_utils.backend_for): Triton on CUDA tensors, the reference elsewhere,
FITLLM_KERNEL_BACKEND forces either. The launches are CUDA-graph safe: shapes come from tensor
metadata only, no host syncs, outputs are allocated with the input's (static) shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._utils import backend_for, interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton still get the reference
    triton = None


# --------------------------------------------------------------------------- torch references

def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def _rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, Hq, D], k [T, Hk, D]; cos/sin [T, D/2] float32. Rotates q and k in place."""
    q.copy_(_rope_ref(q, cos, sin))
    k.copy_(_rope_ref(k, cos, sin))
    return q, k


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# --------------------------------------------------------------------------- Triton kernels

if triton is not None:

    @triton.jit
    def _cast(x, DT: tl.constexpr, RNE_BF16: tl.constexpr):
        # triton 3.6's interpreter casts fp32 -> bf16 by truncation; there, round to nearest even
        # by hand first (the cast is then exact), so it computes the GPU's (and torch's) function.
        if RNE_BF16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
        return x.to(DT)

    @triton.jit
    def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, h_ptr, N, n_inner, sx_o, sx_i, sr_o, sr_i, eps,
                         HAS_RES: tl.constexpr, RNE: tl.constexpr, RNE_OUT: tl.constexpr, BLOCK_N: tl.constexpr):
        # Row `row` of x sits at (row // n_inner) * sx_o + (row % n_inner) * sx_i: [T, N] or [T, H, N]
        # views (q|k slices of the qkv output) without a copy. out and h are contiguous.
        row = tl.program_id(0).to(tl.int64)
        outer, inner = row // n_inner, row % n_inner
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        DT = x_ptr.dtype.element_ty
        x = tl.load(x_ptr + outer * sx_o + inner * sx_i + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(r_ptr + outer * sr_o + inner * sr_i + cols, mask=mask, other=0.0).to(tl.float32)
            h = _cast(x + r, DT, RNE)  # the reference adds in the activation dtype
            tl.store(h_ptr + row * N + cols, h, mask=mask)
            x = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / N + eps)
        y = _cast(x * rstd, DT, RNE).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * N + cols, _cast(w * y, out_ptr.dtype.element_ty, RNE_OUT), mask=mask)

    @triton.jit
    def _rope_heads(x_ptr, t, H, s_t, s_h, s_d, c, s, HALF, RNE: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        heads = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < H) & (d < HALF)
        p1 = x_ptr + t * s_t + heads * s_h + d * s_d
        p2 = p1 + HALF * s_d
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
        DT = x_ptr.dtype.element_ty
        tl.store(p1, _cast(x1 * c - x2 * s, DT, RNE), mask=mask)
        tl.store(p2, _cast(x2 * c + x1 * s, DT, RNE), mask=mask)

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, HQ, HK, HALF,
                     sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sc_t, ss_t,
                     RNE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        # One program per (token, q or k): all heads of one token in one tile, rotated in place.
        t = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)[None, :]
        c = tl.load(cos_ptr + t * sc_t + d, mask=d < HALF, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * ss_t + d, mask=d < HALF, other=0.0).to(tl.float32)
        if tl.program_id(1) == 0:
            _rope_heads(q_ptr, t, HQ, sq_t, sq_h, sq_d, c, s, HALF, RNE, BLOCK_H, BLOCK_D)
        else:
            _rope_heads(k_ptr, t, HK, sk_t, sk_h, sk_d, c, s, HALF, RNE, BLOCK_H, BLOCK_D)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, I, sx_t, RNE: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        g = tl.load(x_ptr + t * sx_t + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + t * sx_t + I + cols, mask=mask, other=0.0).to(tl.float32)
        DT = out_ptr.dtype.element_ty
        a = _cast(g / (1.0 + tl.exp(-g)), DT, RNE).to(tl.float32)  # F.silu rounds, then the multiply
        tl.store(out_ptr + t * I + cols, _cast(a * u, DT, RNE), mask=mask)


def _rne(dtype: torch.dtype) -> bool:
    return interpreting() and dtype == torch.bfloat16


def _warps(block: int) -> int:
    return max(1, min(block // 512, 16))


def _row_layout(t: torch.Tensor):
    """(n_inner, stride_outer, stride_inner) addressing the rows of a [..., N] tensor with unit
    last stride, or None when that needs a copy (more than two leading dims that do not merge)."""
    if t.stride(-1) != 1:
        return None
    if t.dim() == 1:
        return 1, 0, 0
    if t.dim() == 2:
        return 1, t.stride(0), 0
    if t.dim() == 3:
        return t.shape[1], t.stride(0), t.stride(1)
    return None


# --------------------------------------------------------------------------- Triton wrappers

def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    N = x.shape[-1]
    if weight.shape != (N,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"rms_norm: x {tuple(x.shape)}, weight {tuple(weight.shape)}, residual "
                         f"{None if residual is None else tuple(residual.shape)}")
    if residual is not None and residual.dtype != x.dtype:  # mixed dtypes promote: not the kernel's case
        return rms_norm_ref(x, weight, eps, residual)
    if _row_layout(x) is None:
        x = x.contiguous()
    if residual is not None and _row_layout(residual) is None:
        residual = residual.contiguous()
    weight = weight.contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)  # `weight * h` promotes, as the reference
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rows = x.numel() // N if N else 0
    if residual is not None:
        h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        n_inner, sx_o, sx_i = _row_layout(x)
        _, sr_o, sr_i = _row_layout(residual)  # same shape as x, so the same n_inner
    else:
        h = out  # unused
        (n_inner, sx_o, sx_i), sr_o, sr_i = _row_layout(x), 0, 0
    if rows:
        block = triton.next_power_of_2(N)
        _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, h, N, n_inner,
                                  sx_o, sx_i, sr_o, sr_i, float(eps), HAS_RES=residual is not None,
                                  RNE=_rne(x.dtype), RNE_OUT=_rne(out_dtype), BLOCK_N=block, num_warps=_warps(block))
    return out if residual is None else (out, h)


def apply_rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    T, HQ, D = q.shape
    HK = k.shape[1]
    half = cos.shape[-1]
    if (k.shape[0] != T or k.shape[2] != D or D != 2 * half or cos.shape != (T, half) or sin.shape != (T, half)
            or k.dtype != q.dtype or cos.stride(-1) != 1 or sin.stride(-1) != 1):
        raise ValueError(f"apply_rope: q {tuple(q.shape)}, k {tuple(k.shape)} {k.dtype}, cos {tuple(cos.shape)}, "
                         f"sin {tuple(sin.shape)}")
    if T:
        block_h = triton.next_power_of_2(max(HQ, HK))
        block_d = triton.next_power_of_2(half)
        _rope_kernel[(T, 2)](q, k, cos, sin, HQ, HK, half, *q.stride(), *k.stride(), cos.stride(0), sin.stride(0),
                             RNE=_rne(q.dtype), BLOCK_H=block_h, BLOCK_D=block_d,
                             num_warps=_warps(block_h * block_d))
    return q, k


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"silu_mul: last dim {two_i} is odd")
    I = two_i // 2
    x = gate_up if gate_up.dim() == 2 else gate_up.reshape(-1, two_i)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(*gate_up.shape[:-1], I, dtype=gate_up.dtype, device=gate_up.device)
    T = x.shape[0]
    if T and I:
        block = min(triton.next_power_of_2(I), 1024)
        _silu_mul_kernel[(T, triton.cdiv(I, block))](x, out, I, x.stride(0), RNE=_rne(x.dtype), BLOCK=block,
                                                     num_warps=_warps(block) * 2)
    return out


# --------------------------------------------------------------------------- dispatch

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim, math in float32, output in x's dtype (promoted with weight's).
    With `residual`: h = x + residual first, returns (rms_norm(h), h)."""
    if backend_for(x) == "triton":
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate-half RoPE on q [T, Hq, D] and k [T, Hk, D] (any strides, e.g. views of the qkv
    output), cos/sin [T, D/2] float32; computed in float32. IN PLACE; returns (q, k)."""
    if backend_for(q) == "triton":
        return apply_rope_triton(q, k, cos, sin)
    return apply_rope_ref(q, k, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate first) -> silu(gate) * up [..., I]."""
    if backend_for(gate_up) == "triton":
        return silu_mul_triton(gate_up)
    return silu_mul_ref(gate_up)
