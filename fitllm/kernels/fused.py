"""Fused elementwise kernels of the decoder: RMSNorm (+ residual add), RoPE, SiLU·mul.

Each has a torch reference of the same signature (the CPU path and the test oracle) that is, line
for line, what fitllm.models.decoder computed before these kernels existed. The Triton kernels
compute the same function, rounding where the reference rounds (e.g. RMSNorm casts the normalised
row to the activation dtype *before* the weight multiply, as the HF implementations do), so
results agree to the last bit up to reduction order and the GPU's exp/sqrt.

  rms_norm(x, weight, eps, residual=None) -> out, or (out, x + residual) when residual is given:
      the residual add of a decoder layer fused into the next norm (vLLM's fused_add_rms_norm).
  apply_rope(q, k, cos, sin) -> (q, k), rotated IN PLACE (both backends), rotate-half convention.
  silu_mul(gate_up) -> silu(gate) * up, gate_up [..., 2I] -> [..., I] (or Gemma's gelu_tanh(gate) * up).
  rms_norm(..., perm=idx) (the next GEMM's FusedLinear.input_perm, an act-order weight's storage
      order): the output comes with its columns in that order (_utils.Gathered), written so by the
      norm itself, which spares the GEMM its gather_columns launch.
  rms_norm (with a residual) and silu_mul also take a split-K GEMM's unfinished sum (_utils.PendingSum):
      they read it, round it as the GEMM would have, and zero its workspace, which spares the GEMM
      the two round trips to L2 that finishing y costs (+8 % int4 batch-1 decode on the H200).
  rms_norm(..., quant=Fp8Input) and silu_mul(..., quant=Fp8Input) (the next layer's
      FusedLinear.input_quant): their output comes as e4m3 codes and scales for a W8A8 fp8 GEMM
      (_utils.Fp8Activations), bit for bit what that GEMM's own quantizer would make of it, so the
      GEMM skips that launch (fp8 batch-1 decode +2.3 %, the producers of 1000 tokens 34 % faster).
      quant=X16Input: one row comes as 16-bit integers for a batch-1 4-bit GEMM on dp4a
      (w4a16_dp4a.X16); more rows come as they are.
  head_affine(x, rot, shift, pre, post, add, out_dtype, split=None) -> per-head ((x - shift) * pre)
      @ rot * post + add: the KV cache's maps between model space and cache space (kv_cache.py) in
      one launch instead of ~6 elementwise kernels and a matmul each; with split=(h0, dtype2), heads
      from h0 on go to a second output in dtype2 (q, k and v of one layer mapped in one launch).
  greedy_tokens(logits) -> int64 [R]: each row's argmax (the first maximal column, as torch), -1
      where the row has a NaN or infinite value: the greedy sampler's step in one launch instead of
      a float copy and two single-row reductions (~45 µs per batch-1 step over Llama-3's vocab).
  gather_columns(x, idx) -> x[:, idx]: the input of an act-order GEMM, whose weight rows are stored
      sorted by group (quant.layers), as a PDL launch (torch's index_select breaks the chain); in the
      decoder only where no producer writes that order (the norms: rms_norm's perm; o_proj's input:
      paged_attention's out_cols; a context without those, e.g. NoCacheContext, leaves o_proj's).

Dispatch as for the GEMMs (_utils.backend_for): Triton on CUDA tensors, the reference elsewhere,
FITLLM_KERNEL_BACKEND forces either. The launches are CUDA-graph safe: shapes come from tensor
metadata only, no host syncs, outputs are allocated with the input's (static) shape. On sm90+ they
launch with programmatic dependent launch (_pdl.py: each waits for its predecessor, then lets the
next kernel launch).

The kernels live in _fused_triton, imported on the first Triton call: the decoder imports this
module, and importing triton at that point would fix triton's mode before a test could set
TRITON_INTERPRET=1 (triton.language's own @jit helpers are created at import), and would make
every CPU-only process pay for the import.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._utils import (X16, Fp8Activations, Fp8Input, Gathered, PendingSum, X16Input, backend_for, interpreting, pdl_args,
                     splitk_workspace)


# --------------------------------------------------------------------------- torch references

def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 fp32_product: bool = False):
    """fp32_product (Gemma's order): the normalised row times the weight in float32, rounded once to x's
    dtype; else Llama's, the row rounded to x's dtype first and the product in the promoted dtype."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (weight.float() * h).to(x.dtype) if fp32_product else weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def _rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]  # partial RoPE: the dims past 2 * half pass through
    x1, x2, rest = x.float().split([half, half, x.shape[-1] - 2 * half], dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1).to(x.dtype)


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, Hq, D], k [T, Hk, D]; cos/sin [T, R/2] float32 for the first R <= D dims of each head
    (R < D: partial RoPE, the rest untouched). Rotates q and k in place."""
    q.copy_(_rope_ref(q, cos, sin))
    k.copy_(_rope_ref(k, cos, sin))
    return q, k


ACTIVATIONS = ("silu", "gelu_tanh")


def silu_mul_ref(gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") if act == "gelu_tanh" else F.silu(gate)) * up


def head_affine_ref(x: torch.Tensor, rot: torch.Tensor | None, shift: torch.Tensor | None, pre: torch.Tensor | None,
                    post: torch.Tensor | None, add: torch.Tensor | None, out_dtype: torch.dtype,
                    split: tuple[int, torch.dtype] | None = None):
    """x [T, H, D]; shift/pre/post/add [P, D] float32 or None (P divides H: head h uses row
    h // (H // P)); rot [D, D] or None. y = (((x - shift) * pre) @ rot) * post + add in float32;
    for a 16-bit rot the rotation's operand is rounded to that dtype first (a tensor-core product).
    split=(h0, dtype2): returns (y[:, :h0] in out_dtype, y[:, h0:] in dtype2)."""
    if split is not None:
        y = head_affine_ref(x, rot, shift, pre, post, add, torch.float32)
        return y[:, : split[0]].to(out_dtype), y[:, split[0]:].to(split[1])
    t, h, d = x.shape
    p = next((v.shape[0] for v in (shift, pre, post, add) if v is not None), 1)
    y = x.float().reshape(t, p, h // p, d)
    if shift is not None:
        y = y - shift[:, None, :]
    if pre is not None:
        y = y * pre[:, None, :]
    if rot is not None:  # operands rounded to rot's dtype, products summed in fp32 (tensor cores)
        y = y.to(rot.dtype).float() @ rot.float()
    if post is not None:
        y = y * post[:, None, :]
    if add is not None:
        y = y + add[:, None, :]
    return y.reshape(t, h, d).to(out_dtype)


def gather_columns_ref(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [T, K], idx int32/int64 [K'] -> x[:, idx] [T, K'] (contiguous)."""
    return x.index_select(1, idx)


def greedy_tokens_ref(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> argmax per row (int64), -1 for rows with a non-finite value."""
    return logits.argmax(dim=-1).masked_fill(~torch.isfinite(logits).all(dim=-1), -1)


def _kernels():
    from . import _fused_triton  # lazily: see the module docstring

    return _fused_triton


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every output buffer comes from here (the tests swap in a NaN-filled one)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _rne(dtype: torch.dtype) -> bool:
    return interpreting() and dtype == torch.bfloat16


def _warps(block: int) -> int:
    return max(1, min(block // 512, 16))


def _rows(t: torch.Tensor):
    """t [..., N] -> (t, n_inner, stride_outer, stride_inner): row r of t starts at
    (r // n_inner) * stride_outer + (r % n_inner) * stride_inner. [T, N] and [T, H, N] views (the
    q|k slices of the qkv output) go without a copy; t comes back copied only when it must be."""
    if t.dim() > 3:
        t = t.reshape(-1, t.shape[-1])
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 3:
        return t, t.shape[1], t.stride(0), t.stride(1)
    return t, 1, (t.stride(0) if t.dim() == 2 else 0), 0


# --------------------------------------------------------------------------- Triton wrappers

def _quant_out(quant: Fp8Input | X16Input | None, shape, rows: int, dtype: torch.dtype, device):
    """(output buffer, scale pointer, QUANT mode, kernel options) of a producer kernel: e4m3 codes and
    scales when an fp8 GEMM asked for them, X16's codes and stats when a 4-bit GEMM on dp4a did (one
    row of at least 128 values), else the plain output in `dtype`."""
    if isinstance(quant, X16Input) and (rows != 1 or shape[-1] < 128):
        quant = None  # dp4a is the batch-1 GEMV's
    if quant is None:
        out = _empty(shape, dtype, device)
        return out, out, 0, {}
    opts = dict(ACT=_kernels().TL_DTYPES[dtype], EXACT=interpreting())
    if isinstance(quant, X16Input):
        x16 = X16.empty(1, shape[-1], dtype, device)
        return x16.codes, x16.stats, 3, dict(opts, QUANT=3)
    q = _empty(shape, torch.float8_e4m3fn, device)
    if quant.static_scale is None:
        scale, mode = _empty((rows, 1), torch.float32, device), 1
    else:
        scale, mode = quant.static_scale.to(device=device, dtype=torch.float32).reshape(1), 2
    return q, scale, mode, dict(opts, QUANT=mode)


def _with_quant(out: torch.Tensor, scale: torch.Tensor, mode: int, dtype: torch.dtype, K: int):
    if mode == 3:
        return X16(out, scale, K, dtype)
    return Fp8Activations(out, scale, dtype) if mode else out


def rms_norm_triton(x: torch.Tensor | PendingSum, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None, quant: Fp8Input | X16Input | None = None,
                    perm: torch.Tensor | None = None, permuted_weight: torch.Tensor | None = None,
                    fp32_product: bool = False):
    N = x.shape[-1]
    has_res = residual is not None
    if weight.shape != (N,) or (has_res and residual.shape != x.shape):
        raise ValueError(f"rms_norm: x {tuple(x.shape)}, weight {tuple(weight.shape)}, residual "
                         f"{tuple(residual.shape) if has_res else None}")
    _check_perm(perm, x, quant, weight, permuted_weight)
    if perm is not None and not _kernels().HAS_GATHER:  # an older Triton: normalise, then gather
        return _gathered(rms_norm_triton(x, weight, eps, residual, fp32_product=fp32_product), perm,
                         gather_columns_triton)
    pending = isinstance(x, PendingSum)
    if pending and not (has_res and residual.dtype == x.dtype):  # the kernel takes a sum with a residual only
        x, pending = x.materialize(), False
    if has_res and residual.dtype != x.dtype:  # mixed dtypes promote: not the kernel's case
        return _gathered(rms_norm_ref(x, weight, eps, residual, fp32_product), perm)
    dtype, device = x.dtype, residual.device if pending else x.device
    out_dtype = dtype if fp32_product else torch.promote_types(weight.dtype, dtype)  # as the reference
    rows = x.shape.numel() // N if N else 0
    if len(x.shape) != 2 or out_dtype != dtype or not _kernels().TL_DTYPES.get(dtype):
        quant = None  # quantized rows for the next GEMM: only of [T, N] activations in their own dtype
    out, scale, mode, quant_opts = _quant_out(quant, x.shape, rows, out_dtype, device)  # row r at r * N
    h = _empty(x.shape, dtype, device) if has_res else out  # (out: a placeholder, never written)
    x, n_inner, sx_o, sx_i = _rows(x.acc if pending else x)
    residual, _, sr_o, sr_i = _rows(residual) if has_res else (x, n_inner, 0, 0)  # same shape: same n_inner
    if rows:
        block = _pow2(N)
        _kernels().rms_norm_kernel[(rows,)](
            x, residual, (weight if permuted_weight is None else permuted_weight).contiguous(), out, h, scale,
            out if perm is None else perm, N, n_inner, sx_o, sx_i,
            sr_o, sr_i, float(eps), HAS_RES=has_res, X_SUM=pending, RNE=_rne(dtype), RNE_OUT=_rne(out_dtype),
            ROUND_ROW=not fp32_product,
            BLOCK_N=block, PERM=perm is not None, W_PERMUTED=permuted_weight is not None, num_warps=_warps(block),
            **quant_opts, **pdl_args(h))
    out = _with_quant(out, scale, mode, out_dtype, N) if perm is None else Gathered(out, perm)
    return (out, h) if has_res else out


def _check_perm(perm: torch.Tensor | None, x, quant: Fp8Input | X16Input | None, weight: torch.Tensor,
                permuted_weight: torch.Tensor | None) -> None:
    if perm is not None and (len(x.shape) != 2 or perm.shape != (x.shape[-1],) or quant is not None):
        raise ValueError(f"rms_norm: perm {tuple(perm.shape)} needs x [T, N] with N = its length and no quant, "
                         f"got x {tuple(x.shape)}, quant {quant}")
    if permuted_weight is not None and (perm is None or permuted_weight.shape != weight.shape
                                        or permuted_weight.dtype != weight.dtype):
        raise ValueError(f"rms_norm: permuted_weight {tuple(permuted_weight.shape)} {permuted_weight.dtype} needs a "
                         f"perm and the weight's shape and dtype ({tuple(weight.shape)} {weight.dtype})")


def _gathered(result, perm: torch.Tensor | None, gather=gather_columns_ref):
    """rms_norm's (out[, h]) with out's columns in perm's order, as the kernel writes them."""
    if perm is None:
        return result
    out, h = result if isinstance(result, tuple) else (result, None)
    out = Gathered(gather(out, perm), perm)
    return out if h is None else (out, h)


def apply_rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    T, HQ, D = q.shape
    HK = k.shape[1]
    half = cos.shape[-1]
    if (k.shape[0] != T or k.shape[2] != D or D < 2 * half or cos.shape != (T, half) or sin.shape != (T, half)
            or k.dtype != q.dtype or cos.stride(-1) != 1 or sin.stride(-1) != 1):
        raise ValueError(f"apply_rope: q {tuple(q.shape)}, k {tuple(k.shape)} {k.dtype}, cos {tuple(cos.shape)}, "
                         f"sin {tuple(sin.shape)}")
    if T:
        block_h = _pow2(max(HQ, HK))
        block_d = _pow2(half)
        _kernels().rope_kernel[(T, 2)](
            q, k, cos, sin, HQ, HK, half, *q.stride(), *k.stride(), cos.stride(0), sin.stride(0),
            RNE=_rne(q.dtype), BLOCK_H=block_h, BLOCK_D=block_d, num_warps=_warps(block_h * block_d), **pdl_args(q))
    return q, k


FP8_SILU_MAX_BLOCK = 32768  # a row in one program's registers (1024 threads, 32 values of each half)


def silu_mul_triton(gate_up: torch.Tensor | PendingSum, quant: Fp8Input | X16Input | None = None,
                    act: str = "silu"):
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"silu_mul: last dim {two_i} is odd")
    I = two_i // 2
    pending = isinstance(gate_up, PendingSum)
    x = gate_up.acc if pending else gate_up  # a PendingSum's acc is [T, 2I] and contiguous
    x = x if x.dim() == 2 else x.reshape(-1, two_i)
    if x.stride(-1) != 1:
        x = x.contiguous()
    T = x.shape[0]
    if len(gate_up.shape) != 2 or _pow2(I) > FP8_SILU_MAX_BLOCK or not _kernels().TL_DTYPES.get(gate_up.dtype):
        quant = None  # quantized rows for the next GEMM: [T, 2I] only, each row in one program
    out, scale, mode, quant_opts = _quant_out(quant, (*gate_up.shape[:-1], I), T, gate_up.dtype, x.device)
    if T and I:
        # the fp8 epilogue needs a row's absolute max: the whole row in one program; X16 a 128-tile's
        block = _pow2(I) if mode in (1, 2) else min(_pow2(I), 1024)
        _kernels().silu_mul_kernel[(T, (I + block - 1) // block)](
            x, out, scale, I, x.stride(0), X_SUM=pending, RNE=_rne(gate_up.dtype), BLOCK=block,
            num_warps=min(_warps(block) * 2, 32), GELU=act == "gelu_tanh", **quant_opts, **pdl_args(x))
    return _with_quant(out, scale, mode, gate_up.dtype, I)


def head_affine_triton(x: torch.Tensor, rot: torch.Tensor | None, shift: torch.Tensor | None,
                       pre: torch.Tensor | None, post: torch.Tensor | None, add: torch.Tensor | None,
                       out_dtype: torch.dtype, split: tuple[int, torch.dtype] | None = None):
    T, H, D = x.shape
    params = [v for v in (shift, pre, post, add) if v is not None]
    P = params[0].shape[0] if params else 1
    h0 = H if split is None else split[0]
    if H % P or any(v.shape != (P, D) or v.dtype != torch.float32 for v in params) or (
            rot is not None and rot.shape != (D, D)) or not 0 < h0 <= H:
        raise ValueError(f"head_affine: x {tuple(x.shape)}, rot {None if rot is None else tuple(rot.shape)}, "
                         f"params {[(tuple(v.shape), v.dtype) for v in params]} (want [P, D] float32, P | H), "
                         f"split {split}")
    if D & (D - 1):  # the kernel's tiles want a power of two
        return head_affine_ref(x, rot, shift, pre, post, add, out_dtype, split)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = _empty((T, h0, D), out_dtype, x.device)
    out2 = _empty((T, H - h0, D), split[1], x.device) if split is not None else out
    if T:
        bt = 16 if T <= 256 else 64  # >= 16: a tl.dot tile; larger for prefill (rot is re-read per tile)
        dummy = params[0] if params else out
        _kernels().head_affine_kernel[(-(-T // bt), H)](
            x, rot if rot is not None else out, *(v if v is not None else dummy for v in (shift, pre, post, add)),
            out, out2, h0, T, H // P, x.stride(0), x.stride(1), *(rot.stride() if rot is not None else (0, 0)),
            D=D, BT=bt, HAS_ROT=rot is not None, HAS_SHIFT=shift is not None, HAS_PRE=pre is not None,
            HAS_POST=post is not None, HAS_ADD=add is not None,
            RNE=rot is not None and _rne(rot.dtype), RNE_OUT=_rne(out_dtype), RNE_OUT2=_rne(out2.dtype),
            UPCAST=interpreting(), num_warps=4, **pdl_args(x))
    return out if split is None else (out, out2)


def greedy_tokens_triton(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"greedy_tokens: logits must be [rows, vocab], got {tuple(logits.shape)}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    out = _empty((rows,), torch.int64, logits.device)
    if rows and vocab:
        chunk = 4096  # one program per 4096 columns: a 128k vocabulary is 32 programs per row, not one
        nch = -(-vocab // chunk)
        pm = torch.empty(rows * nch, dtype=torch.float32, device=logits.device)
        pi = torch.empty(rows * nch, dtype=torch.int32, device=logits.device)
        cnt = splitk_workspace(logits.device, 0, rows)[1]  # zero between launches: the last chunk resets it
        _kernels().greedy_tokens_kernel[(rows, nch)](logits, out, pm, pi, cnt, vocab, logits.stride(0), CHUNK=chunk,
                                                    BLOCK=1024, NCH=_pow2(nch), num_warps=4,
                                                    **pdl_args(logits))
    return out


# From this many elements gather_columns permutes whole rows in the SM (gather_row_kernel): below it
# the scattered loads of gather_columns_kernel are faster (H100: 1.4 vs 1.8 µs at [1, 4096], 4.1 vs
# 5.7 at [256, 4096]; 10.8 vs 6.0 at [1024, 4096], 19.2 vs 6.0 at [256, 14336]; RESULTS.md).
GATHER_ROWS_FROM = 1 << 21


def gather_columns_triton(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or idx.dim() != 1:
        raise ValueError(f"gather_columns: x must be [T, K] and idx [K'], got {tuple(x.shape)}, {tuple(idx.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    T, K = x.shape[0], idx.shape[0]
    out = _empty((T, K), x.dtype, x.device)
    if T and K and T * K >= GATHER_ROWS_FROM and K == x.shape[1] and K <= 16384 and _kernels().HAS_GATHER:
        _kernels().gather_row_kernel[(T,)](x, idx, out, K, x.stride(0), BLOCK_K=_pow2(K),
                                           num_warps=8 if K <= 4096 else 16, **pdl_args(x))
    elif T and K:
        block = min(_pow2(K), 1024)
        _kernels().gather_columns_kernel[(T, -(-K // block))](x, idx, out, K, x.stride(0), BLOCK=block, num_warps=4,
                                                              **pdl_args(x))
    return out


# --------------------------------------------------------------------------- dispatch

def rms_norm(x: torch.Tensor | PendingSum, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             quant: Fp8Input | X16Input | None = None, perm: torch.Tensor | None = None,
             permuted_weight: torch.Tensor | None = None, fp32_product: bool = False):
    """RMSNorm over the last dim, math in float32, output in x's dtype (promoted with weight's).
    With `residual`: h = x + residual first, returns (rms_norm(h), h). x may be a GEMM's
    PendingSum: taken (and its workspace zeroed) here. quant (the next GEMM's FusedLinear.input_quant):
    the Triton path may return the output quantized for that GEMM (Fp8Activations, X16). perm (the next
    GEMM's FusedLinear.input_perm, x [T, N]): the output is Gathered, its columns in perm's order
    (both paths); permuted_weight (optional, weight[perm] made once by the caller) spares the kernel
    gathering the weight. The kernel reads `weight`, `residual` and `perm` before it waits for the kernel
    launched just before it (PDL): they must not be that kernel's output (the decoder's residual is
    a norm's, two or more launches back). fp32_product: Gemma's order (rms_norm_ref); the output is then
    in x's dtype whatever the weight's."""
    if isinstance(x, PendingSum) and backend_for(x.acc) != "triton":
        x = x.materialize()
    if backend_for(x.acc if isinstance(x, PendingSum) else x) == "triton":
        return rms_norm_triton(x, weight, eps, residual, quant, perm, permuted_weight, fp32_product)
    _check_perm(perm, x, quant, weight, permuted_weight)
    return _gathered(rms_norm_ref(x, weight, eps, residual, fp32_product), perm)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate-half RoPE on q [T, Hq, D] and k [T, Hk, D] (any strides, e.g. views of the qkv
    output), cos/sin [T, R/2] float32 for the first R dims (R = D, or fewer: partial RoPE);
    computed in float32. IN PLACE; returns (q, k)."""
    if backend_for(q) == "triton":
        return apply_rope_triton(q, k, cos, sin)
    return apply_rope_ref(q, k, cos, sin)


def silu_mul(gate_up: torch.Tensor | PendingSum, quant: Fp8Input | X16Input | None = None, act: str = "silu"):
    """gate_up [..., 2I] (gate first) -> silu(gate) * up [..., I] (act="gelu_tanh": Gemma's
    gelu(gate, approximate="tanh") * up). gate_up may be a GEMM's PendingSum: taken (and its
    workspace zeroed) here. quant: as rms_norm's."""
    if act not in ACTIVATIONS:
        raise ValueError(f"silu_mul: activation {act!r} is not one of {ACTIVATIONS}")
    if isinstance(gate_up, PendingSum):
        if backend_for(gate_up.acc) == "triton":
            return silu_mul_triton(gate_up, quant, act)
        gate_up = gate_up.materialize()
    if backend_for(gate_up) == "triton":
        return silu_mul_triton(gate_up, quant, act)
    return silu_mul_ref(gate_up, act)


def head_affine(x: torch.Tensor, rot: torch.Tensor | None, shift: torch.Tensor | None, pre: torch.Tensor | None,
                post: torch.Tensor | None, add: torch.Tensor | None, out_dtype: torch.dtype,
                split: tuple[int, torch.dtype] | None = None):
    """Per-head affine map with an optional rotation, y = (((x - shift) * pre) @ rot) * post + add
    (see head_affine_ref for shapes, rounding and `split`)."""
    if backend_for(x) == "triton":
        return head_affine_triton(x, rot, shift, pre, post, add, out_dtype, split)
    return head_affine_ref(x, rot, shift, pre, post, add, out_dtype, split)


def gather_columns(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [T, K] -> x[:, idx] (idx int32 or int64, values in 0..K-1), a new contiguous tensor."""
    if backend_for(x) == "triton":
        return gather_columns_triton(x, idx)
    return gather_columns_ref(x, idx)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> each row's argmax (int64; the first maximal column), -1 where the row has
    a NaN or infinite value."""
    if backend_for(logits) == "triton":
        return greedy_tokens_triton(logits)
    return greedy_tokens_ref(logits)
