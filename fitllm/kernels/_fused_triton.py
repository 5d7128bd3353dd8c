"""Triton kernels behind fitllm.kernels.fused (the wrappers, the references and the dispatch are
there). Imported only on the first Triton call: see fused's docstring."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._pdl import pdl_start
from .fp8 import quantize_row
from .w4a16_dp4a import quantize_row_x16

# tl.gather (Triton 3.2+) permutes a row in the SM: RMSNorm's perm and the row gather use it; without it
# fused.py gathers with gather_columns_kernel instead
HAS_GATHER = hasattr(tl, "gather")


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
def _sum_words(ptrs, mask):
    """Words of a GEMM's pending fp32 sum (kernels._utils.PendingSum), read at L2 (.cg): the GEMM's
    atomics land there."""
    return tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")


@triton.jit
def _zero_words(ptrs, mask):
    """Those words zeroed at L2 for the next split-K GEMM: only after a CTA barrier that follows every
    thread's _sum_words (see _take_sum)."""
    tl.store(ptrs, tl.zeros(ptrs.shape, tl.float32), mask=mask, cache_modifier=".cg")


@triton.jit
def _as_stored(v, DT: tl.constexpr, RNE: tl.constexpr):
    """A pending sum's words rounded to DT as the GEMM would have stored y (back in fp32 for the math)."""
    return _cast(v, DT, RNE).to(tl.float32)


@triton.jit
def _take_sum(ptrs, mask, DT: tl.constexpr, RNE: tl.constexpr):
    """A GEMM's pending fp32 sum (kernels._utils.PendingSum): rounded to DT as the GEMM would have
    stored it, and its workspace zeroed for the next split-K GEMM. The barrier is needed: the
    compiler may store the zeros in another register layout than the load's, so without it a thread
    could zero words another thread has not read yet (seen on the H200: benchmarks/defer_check.py).
    (One atomic exchange a word is also right, but scalar and slower: RESULTS.md, thirteenth
    session.)"""
    v = _sum_words(ptrs, mask)
    tl.debug_barrier()
    _zero_words(ptrs, mask)
    return _as_stored(v, DT, RNE)


@triton.jit
def _take_two_sums(pa, pb, mask, DT: tl.constexpr, RNE: tl.constexpr):
    """_take_sum of two slices with one barrier (its wait is a round trip to memory: one, not two)."""
    a, b = _sum_words(pa, mask), _sum_words(pb, mask)
    tl.debug_barrier()
    _zero_words(pa, mask)
    _zero_words(pb, mask)
    return _as_stored(a, DT, RNE), _as_stored(b, DT, RNE)


@triton.jit
def _store_out(out_ptr, row, cols, N, v, mask, s_ptr, RNE: tl.constexpr, QUANT: tl.constexpr, ACT: tl.constexpr,
               EXACT: tl.constexpr, col0=0):
    """A kernel's output row v (fp32, columns cols of N): rounded to the output's dtype, or rounded to
    the activation dtype ACT and quantized for the next GEMM, exactly as that GEMM's own quantizer
    would quantize the rounded row: QUANT 1 / 2 e4m3 codes with a dynamic scale per row / the static
    scale (an fp8 GEMM), 3 X16 (a batch-1 4-bit GEMM on dp4a: out_ptr its codes, s_ptr its stats; cols
    are col0 + arange, col0 a multiple of 128)."""
    if QUANT == 3:
        quantize_row_x16(_cast(v, ACT, RNE).to(tl.float32), col0, out_ptr, s_ptr, row, N)
    elif QUANT:
        quantize_row(_cast(v, ACT, RNE).to(tl.float32), mask, out_ptr + row * N + cols, s_ptr, row, QUANT == 2,
                     EXACT)
    else:
        tl.store(out_ptr + row * N + cols, _cast(v, out_ptr.dtype.element_ty, RNE), mask=mask)


@triton.jit
def rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, h_ptr, s_ptr, idx_ptr, N, n_inner, sx_o, sx_i, sr_o, sr_i, eps,
                    HAS_RES: tl.constexpr, RNE: tl.constexpr, RNE_OUT: tl.constexpr, BLOCK_N: tl.constexpr,
                    X_SUM: tl.constexpr = False, QUANT: tl.constexpr = 0, ACT: tl.constexpr = tl.bfloat16,
                    EXACT: tl.constexpr = False, PERM: tl.constexpr = False, PDL: tl.constexpr = False,
                    W_PERMUTED: tl.constexpr = False, ROUND_ROW: tl.constexpr = True):
    # Row `row` of x sits at (row // n_inner) * sx_o + (row % n_inner) * sx_i: [T, N] or [T, H, N]
    # views (q|k slices of the qkv output) without a copy. out and h are contiguous. X_SUM: x is a
    # GEMM's pending fp32 sum (taken here; HAS_RES then, whose dtype is the activations'). QUANT: out
    # and s_ptr get the row quantized for the next GEMM (see _store_out). PERM: out's column j is
    # the normalised column idx[j] (an act-order GEMM's input order, fused.rms_norm's perm);
    # W_PERMUTED: w holds the weight in that order already (read contiguously, not gathered).
    # ROUND_ROW: the normalised row is rounded to the activation dtype before the weight multiplies
    # it (Llama's order); else the product is taken in fp32 (Gemma's, fused.rms_norm_ref).
    # The weight and the residual are read before waiting for the previous kernel (PDL): neither is
    # that kernel's output (the decoder's residual comes from a norm two or more launches back), and
    # their round trip to memory then overlaps the wait instead of following the sum's.
    row = tl.program_id(0).to(tl.int64)
    outer, inner = row // n_inner, row % n_inner
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    if PERM:
        src = tl.load(idx_ptr + cols, mask=mask, other=0)
    if PERM and not W_PERMUTED:
        w = tl.load(w_ptr + src, mask=mask, other=0.0).to(tl.float32)
    else:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + outer * sr_o + inner * sr_i + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_start(PDL)
    DT = h_ptr.dtype.element_ty if HAS_RES else x_ptr.dtype.element_ty
    if X_SUM:
        x = _take_sum(x_ptr + outer * sx_o + inner * sx_i + cols, mask, DT, RNE)
    else:
        x = tl.load(x_ptr + outer * sx_o + inner * sx_i + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h = _cast(x + r, DT, RNE)  # the reference adds in the activation dtype
        tl.store(h_ptr + row * N + cols, h, mask=mask)
        x = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / N + eps)
    y = x * rstd
    if ROUND_ROW:
        y = _cast(y, DT, RNE)
    if PERM:  # gathered in 16 bits, after the rounding: half the shared-memory traffic of fp32
        y = tl.gather(y, src, 0)
    y = y.to(tl.float32)
    _store_out(out_ptr, row, cols, N, w * y, mask, s_ptr, RNE_OUT, QUANT, ACT, EXACT)


@triton.jit
def _rotated(x1, x2, c, s, DT: tl.constexpr, RNE: tl.constexpr):
    """Rotate-half RoPE of the halves x1, x2 (fp32) by cos c and sin s, rounded to DT as the
    reference rounds. Returns the new (first, second) halves."""
    return _cast(x1 * c - x2 * s, DT, RNE), _cast(x2 * c + x1 * s, DT, RNE)


@triton.jit
def _rotate_half(p1, p2, c, s, mask, RNE: tl.constexpr):
    """_rotated of the halves at p1 and p2, in their dtype."""
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    return _rotated(x1, x2, c, s, p1.dtype.element_ty, RNE)


@triton.jit
def _rope_heads(x_ptr, t, H, s_t, s_h, s_d, c, s, HALF, RNE: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < H) & (d < HALF)
    p1 = x_ptr + t * s_t + heads * s_h + d * s_d
    p2 = p1 + HALF * s_d
    r1, r2 = _rotate_half(p1, p2, c, s, mask, RNE)
    tl.store(p1, r1, mask=mask)
    tl.store(p2, r2, mask=mask)


@triton.jit
def rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, HQ, HK, HALF,
                sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sc_t, ss_t,
                RNE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    # One program per (token, q or k): all heads of one token in one tile, rotated in place.
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, :]
    c = tl.load(cos_ptr + t * sc_t + d, mask=d < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * ss_t + d, mask=d < HALF, other=0.0).to(tl.float32)
    if tl.program_id(1) == 0:
        _rope_heads(q_ptr, t, HQ, sq_t, sq_h, sq_d, c, s, HALF, RNE, BLOCK_H, BLOCK_D)
    else:
        _rope_heads(k_ptr, t, HK, sk_t, sk_h, sk_d, c, s, HALF, RNE, BLOCK_H, BLOCK_D)


@triton.jit
def silu_mul_kernel(x_ptr, out_ptr, s_ptr, I, sx_t, RNE: tl.constexpr, BLOCK: tl.constexpr, X_SUM: tl.constexpr = False,
                    QUANT: tl.constexpr = 0, ACT: tl.constexpr = tl.bfloat16, EXACT: tl.constexpr = False,
                    PDL: tl.constexpr = False, GELU: tl.constexpr = False):
    # X_SUM: x is a GEMM's pending fp32 sum (taken here). QUANT: out and s_ptr get the row quantized
    # for the next GEMM (see _store_out; fp8: one program a row, BLOCK >= I; X16: BLOCK a multiple of
    # 128). GELU: gelu_tanh(gate)
    # (Gemma) instead of silu(gate).
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1) * BLOCK
    cols = col0 + tl.arange(0, BLOCK)
    mask = cols < I
    DT = ACT if QUANT else out_ptr.dtype.element_ty
    if X_SUM:
        g, u = _take_two_sums(x_ptr + t * sx_t + cols, x_ptr + t * sx_t + I + cols, mask, DT, RNE)
    else:
        g = tl.load(x_ptr + t * sx_t + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + t * sx_t + I + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # 0.5 * (1 + tanh(z)) = sigmoid(2z), z = sqrt(2 / pi) * (g + 0.044715 g^3)
        a = g / (1.0 + tl.exp(-1.5957691216057308 * (g + 0.044715 * g * g * g)))
    else:
        a = g / (1.0 + tl.exp(-g))
    a = _cast(a, DT, RNE).to(tl.float32)  # the activation rounds (as F.silu / F.gelu do), then the multiply
    _store_out(out_ptr, t, cols, I, a * u, mask, s_ptr, RNE, QUANT, DT, EXACT, col0)


@triton.jit
def gather_columns_kernel(x_ptr, idx_ptr, out_ptr, K, sx_t, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    # out[t, j] = x[t, idx[j]]: one program per (row, BLOCK columns)
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    src = tl.load(idx_ptr + cols, mask=mask, other=0)
    tl.store(out_ptr + t * K + cols, tl.load(x_ptr + t * sx_t + src, mask=mask), mask=mask)


@triton.jit
def gather_row_kernel(x_ptr, idx_ptr, out_ptr, K, sx_t, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    # out[t, :] = x[t, idx]: one program per row, the row read and written coalesced and permuted in
    # the SM (tl.gather), not by scattered global loads (many rows: 2.6-8.7x faster, H100)
    src = tl.load(idx_ptr + tl.arange(0, BLOCK_K), mask=tl.arange(0, BLOCK_K) < K, other=0)
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    mask = cols < K
    x = tl.load(x_ptr + t * sx_t + cols, mask=mask, other=0.0)
    tl.store(out_ptr + t * K + cols, tl.gather(x, src, 0), mask=mask)


@triton.jit(do_not_specialize=["T"])  # else T % 16 == 0 (or T == 1) compiles again, mid-serving
def head_affine_kernel(x_ptr, r_ptr, shift_ptr, pre_ptr, post_ptr, add_ptr, y_ptr, y2_ptr, H0, T, G, sx_t, sx_h,
                       sr_0, sr_1, D: tl.constexpr, BT: tl.constexpr, HAS_ROT: tl.constexpr, HAS_SHIFT: tl.constexpr,
                       HAS_PRE: tl.constexpr, HAS_POST: tl.constexpr, HAS_ADD: tl.constexpr,
                       RNE: tl.constexpr, RNE_OUT: tl.constexpr, RNE_OUT2: tl.constexpr, UPCAST: tl.constexpr,
                       PDL: tl.constexpr = False):
    # One program per (BT tokens, head h); its parameters are row h // G. Heads below H0 go to y
    # [T, H0, D], the others to y2 [T, H - H0, D] (both contiguous; y2 is y when H0 = H).
    pdl_start(PDL)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    mask = (rows < T)[:, None]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * sx_t + h * sx_h + d[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    prow = (h // G) * D + d
    if HAS_SHIFT:
        x -= tl.load(shift_ptr + prow)[None, :]
    if HAS_PRE:
        x *= tl.load(pre_ptr + prow)[None, :]
    if HAS_ROT:
        r = tl.load(r_ptr + d[:, None] * sr_0 + d[None, :] * sr_1)  # any strides: R^T is a view
        xr = _cast(x, r.dtype, RNE)  # the reference rounds the operand to rot's dtype first
        if UPCAST:  # the interpreter's 16-bit tl.dot is wrong: the same products in fp32
            x = tl.dot(xr.to(tl.float32), r.to(tl.float32))
        elif r.dtype == tl.float32:
            x = tl.dot(xr, r, input_precision="ieee")  # fp32 models: no TF32 rounding
        else:
            x = tl.dot(xr, r)
    if HAS_POST:
        x *= tl.load(post_ptr + prow)[None, :]
    if HAS_ADD:
        x += tl.load(add_ptr + prow)[None, :]
    H = tl.num_programs(1)
    if h < H0:
        tl.store(y_ptr + (rows.to(tl.int64)[:, None] * H0 + h) * D + d[None, :],
                 _cast(x, y_ptr.dtype.element_ty, RNE_OUT), mask=mask)
    else:
        tl.store(y2_ptr + (rows.to(tl.int64)[:, None] * (H - H0) + h - H0) * D + d[None, :],
                 _cast(x, y2_ptr.dtype.element_ty, RNE_OUT2), mask=mask)



@triton.jit
def _lane_best(x_ptr, row, lo, hi, sx, BLOCK: tl.constexpr):
    # Each lane keeps the best value it saw in columns [lo, hi) and its first column (strictly
    # greater replaces: a lane visits its columns in increasing order), and whether it saw a NaN or
    # an infinity. Then the row slice's max, the first column holding it, and the flag.
    cols = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], hi, tl.int32)
    bad = tl.zeros([BLOCK], tl.int32)
    for start in range(lo, hi, BLOCK):
        c = start + cols
        inside = c < hi
        v = tl.load(x_ptr + row * sx + c, mask=inside, other=0.0).to(tl.float32)
        bad |= (inside & ((v != v) | (tl.abs(v) == float("inf")))).to(tl.int32)
        take = inside & ((v > best) | (best_i == hi))  # the first value seen always counts (-inf rows)
        best = tl.where(take, v, best)
        best_i = tl.where(take, c, best_i)
    m = tl.max(best, 0)
    return m, tl.min(tl.where(best == m, best_i, hi), 0), tl.max(bad, 0)


@triton.jit
def greedy_tokens_kernel(x_ptr, out_ptr, pm_ptr, pi_ptr, cnt_ptr, N, sx, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                         NCH: tl.constexpr, PDL: tl.constexpr = False):
    # Program (row, chunk) reduces CHUNK columns to (max, first column, non-finite flag); the last
    # chunk of a row to finish (a ticket from the row's counter, which it resets) combines the
    # row's partials: the first column holding the max wins, as torch.argmax; -1 if any flag is set.
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1)
    nch = tl.num_programs(1)
    lo = ch * CHUNK
    m, first, bad = _lane_best(x_ptr, row, lo, tl.minimum(lo + CHUNK, N), sx, BLOCK)
    part = row * nch + ch
    tl.store(pm_ptr + part, m)
    tl.store(pi_ptr + part, tl.where(bad > 0, -1, first))
    tl.debug_barrier()
    if tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel") == nch - 1:
        j = tl.arange(0, NCH)
        ok = j < nch
        pm = tl.load(pm_ptr + row * nch + j, mask=ok, other=float("-inf"), cache_modifier=".cg")
        pi = tl.load(pi_ptr + row * nch + j, mask=ok, other=N, cache_modifier=".cg")
        top = tl.max(pm, 0)
        token = tl.min(tl.where(ok & (pm == top), pi, N), 0)
        tl.store(out_ptr + row, tl.where(tl.min(pi, 0) < 0, -1, token).to(tl.int64))
        tl.atomic_xchg(cnt_ptr + row, 0, sem="relaxed")


TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}  # the ACT argument
