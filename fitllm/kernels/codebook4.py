"""4-bit codebook GEMM (bitsandbytes NF4 / FP4 weights): y = x @ W^T, W dequantized inside the kernel.

Layout (bitsandbytes' own bytes, one row of the weight per row of `codes`):
  codes    uint8 [N, K/2]    two 4-bit codes a byte, input column 2j in the high nibble, 2j+1 in the low
  absmax   float16 [N, K/B]  each block of B consecutive input columns of a row shares one scale
  codebook float32 [16]      the value of each code (NF4's normal quantiles or FP4's), in [-1, 1]
  w[n, k] = codebook[code[n, k]] * absmax[n, k // B]

Unlike the affine int4 of fitllm.kernels.w4a16 ((q - z) * s), a code is looked up, not converted: each
program holds the 16 values in registers and picks one per weight by its four bits (a tree of selects; a
load from the table per weight, the first version, ran 2-47x slower than cuBLAS on an H100); a K tile's
scales are loaded once per row and block (at M = 1 applied to each block's sum, not to each weight).
Each program takes a [BM, BN] tile of y and a share of K (split-K, summed with fp32 atomics where one
tile's programs would not fill the GPU). Not tuned; the select tree not yet timed: see
benchmarks/bench_codebook4.py.
"""
from __future__ import annotations

import torch

from ._utils import backend_for, deterministic, device_index, interpreting, num_sms

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton still get the reference
    triton = None


def dequantize_codebook4(codes, absmax, codebook, blocksize: int, dtype=torch.float32) -> torch.Tensor:
    """-> W [N, K] in `dtype`, computed in float32 (as bitsandbytes dequantizes)."""
    n = codes.shape[0]
    idx = torch.stack([codes >> 4, codes & 15], dim=-1).reshape(n, -1).long()
    w = codebook.float()[idx].reshape(n, -1, blocksize) * absmax.float()[:, :, None]
    return w.reshape(n, -1).to(dtype)


def codebook4_gemm_ref(x, codes, absmax, codebook, blocksize: int):
    """Torch reference and CPU path: the weight dequantized to x's dtype, then one matmul."""
    return x @ dequantize_codebook4(codes, absmax, codebook, blocksize, x.dtype).t()


if triton is not None:

    @triton.jit
    def _pick(c, b: tl.constexpr, v0, v1):
        return tl.where((c & b) != 0, v1, v0)

    @triton.jit
    def _lookup(c, t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12, t13, t14, t15):
        """codebook[c] for 4-bit codes c: bit 0 picks within pairs, bit 1 within quads, and so on."""
        a0, a1, a2, a3 = _pick(c, 1, t0, t1), _pick(c, 1, t2, t3), _pick(c, 1, t4, t5), _pick(c, 1, t6, t7)
        a4, a5, a6, a7 = _pick(c, 1, t8, t9), _pick(c, 1, t10, t11), _pick(c, 1, t12, t13), _pick(c, 1, t14, t15)
        b0, b1, b2, b3 = _pick(c, 2, a0, a1), _pick(c, 2, a2, a3), _pick(c, 2, a4, a5), _pick(c, 2, a6, a7)
        return _pick(c, 8, _pick(c, 4, b0, b1), _pick(c, 4, b2, b3))

    @triton.jit
    def _codebook4_kernel(x_ptr, codes_ptr, absmax_ptr, cb_ptr, y_ptr, M, N, K, stride_xm, stride_cn, stride_an,
                          stride_ym, BLOCKSIZE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          HALF_K: tl.constexpr, NB: tl.constexpr, SPLIT_K: tl.constexpr, GEMV: tl.constexpr,
                          UPCAST: tl.constexpr, SELECT: tl.constexpr = True):
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rj = tl.arange(0, HALF_K)  # byte j of a K tile holds input columns 2j and 2j+1
        m_ok, n_ok = rm < M, rn < N
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        t0, t1, t2, t3 = tl.load(cb_ptr), tl.load(cb_ptr + 1), tl.load(cb_ptr + 2), tl.load(cb_ptr + 3)
        t4, t5, t6, t7 = tl.load(cb_ptr + 4), tl.load(cb_ptr + 5), tl.load(cb_ptr + 6), tl.load(cb_ptr + 7)
        t8, t9, t10, t11 = tl.load(cb_ptr + 8), tl.load(cb_ptr + 9), tl.load(cb_ptr + 10), tl.load(cb_ptr + 11)
        t12, t13, t14, t15 = tl.load(cb_ptr + 12), tl.load(cb_ptr + 13), tl.load(cb_ptr + 14), tl.load(cb_ptr + 15)
        for t in range(pid_k, K // (2 * HALF_K), SPLIT_K):
            byte = t * HALF_K + rj
            c = tl.load(codes_ptr + rn[:, None] * stride_cn + byte[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
            # the tile's NB blocks' scales (NB = 1: the tile lies inside one block)
            s = tl.load(absmax_ptr + rn[:, None] * stride_an + (2 * t * HALF_K) // BLOCKSIZE + tl.arange(0, NB)[None, :],
                        mask=n_ok[:, None], other=0.0).to(tl.float32)
            # [BN, HALF_K]: the code values of columns 2j, and of columns 2j + 1 (SELECT=False: a load from
            # the table per weight, the first version, kept for benchmarks/bench_codebook4.py's comparison)
            if SELECT:
                v_hi = _lookup(c >> 4, t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12, t13, t14, t15)
                v_lo = _lookup(c & 15, t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12, t13, t14, t15)
            else:
                v_hi, v_lo = tl.load(cb_ptr + (c >> 4)), tl.load(cb_ptr + (c & 15))
            x_even = tl.load(x_ptr + rm[:, None] * stride_xm + 2 * byte[None, :], mask=m_ok[:, None], other=0.0)
            x_odd = tl.load(x_ptr + rm[:, None] * stride_xm + 2 * byte[None, :] + 1, mask=m_ok[:, None], other=0.0)
            if GEMV:  # one row of x: each block's sum of code value x input, then scaled once (CUDA cores)
                part = v_hi * x_even.to(tl.float32) + v_lo * x_odd.to(tl.float32)
                per_block = tl.sum(tl.reshape(part, [BN, NB, HALF_K // NB]), axis=2)
                acc += tl.sum(per_block * s, axis=1)[None, :]
            else:  # scaled per element, rounded to x's dtype, as the tensor cores take it
                w_hi = tl.reshape(tl.reshape(v_hi, [BN, NB, HALF_K // NB]) * s[:, :, None], [BN, HALF_K])
                w_lo = tl.reshape(tl.reshape(v_lo, [BN, NB, HALF_K // NB]) * s[:, :, None], [BN, HALF_K])
                w_hi = tl.trans(w_hi.to(x_even.dtype))
                w_lo = tl.trans(w_lo.to(x_odd.dtype))
                if UPCAST:  # triton 3.6's interpreter multiplies bf16 bit patterns as integers: the same sums in fp32
                    acc = tl.dot(x_even.to(tl.float32), w_hi.to(tl.float32), acc, input_precision="ieee")
                    acc = tl.dot(x_odd.to(tl.float32), w_lo.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(x_even, w_hi, acc)
                    acc = tl.dot(x_odd, w_lo, acc)
        y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
        else:  # y is the float32 sum the programs of one tile share
            tl.atomic_add(y_ptrs, acc, mask=mask)


def _block_k(k: int, blocksize: int) -> int | None:
    """The K tile: 128 or 64 columns, dividing K, with whole blocks in a tile or the tile inside one block
    (bitsandbytes' block sizes are powers of 2); None if neither fits (then the reference runs)."""
    return next((bk for bk in (128, 64) if k % bk == 0 and (bk % blocksize == 0 or blocksize % bk == 0)), None)


def _config(m: int, n: int, k: int, blocksize: int, sms: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, HALF_K, NB, SPLIT_K): small tiles and K split across programs until ~2 waves of programs run."""
    bm = 1 if m == 1 else (16 if m <= 16 else 64)
    bn = 64 if m <= 64 else 128
    block_k = _block_k(k, blocksize)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    k_tiles = k // block_k
    split = max(1, min(k_tiles, (2 * sms) // max(tiles, 1)))
    return bm, bn, block_k // 2, max(block_k // blocksize, 1), split


def codebook4_gemm_triton(x, codes, absmax, codebook, blocksize: int, select: bool = True):
    """select=False: the table loaded per weight (the first version; benchmarks only)."""
    M, K = x.shape
    N = codes.shape[0]
    if codes.shape[1] * 2 != K or _block_k(K, blocksize) is None:
        raise ValueError(f"codebook4 GEMM: K = {K} must be a multiple of 64, match codes {tuple(codes.shape)} and "
                         f"hold whole blocks of {blocksize} (or lie in them)")
    bm, bn, half_k, nb, split = _config(M, N, K, blocksize, num_sms(device_index(x)))
    if deterministic():  # atomics sum in arrival order: one program per tile instead (slower at small M)
        split = 1
    y = torch.zeros(M, N, device=x.device, dtype=torch.float32) if split > 1 else torch.empty(
        M, N, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), split)
    _codebook4_kernel[grid](x, codes, absmax, codebook, y, M, N, K, x.stride(0), codes.stride(0), absmax.stride(0),
                            y.stride(0), BLOCKSIZE=blocksize, BM=bm, BN=bn, HALF_K=half_k, NB=nb, SPLIT_K=split,
                            GEMV=bm == 1, UPCAST=interpreting(), SELECT=select)
    return y.to(x.dtype) if split > 1 else y


def codebook4_gemm(x, codes, absmax, codebook, blocksize: int):
    """y [M, N] = x [M, K] @ W^T: the Triton kernel on CUDA (or FITLLM_KERNEL_BACKEND=triton), else the reference."""
    if backend_for(x) == "triton" and triton is not None and _block_k(x.shape[1], blocksize) is not None:
        return codebook4_gemm_triton(x.contiguous(), codes, absmax, codebook, blocksize)
    return codebook4_gemm_ref(x, codes, absmax, codebook, blocksize)
