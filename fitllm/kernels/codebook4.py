"""4-bit codebook GEMM (bitsandbytes NF4 / FP4 weights): y = x @ W^T, W dequantized inside the kernel.

Layout (bitsandbytes' own bytes, one row of the weight per row of `codes`):
  codes    uint8 [N, K/2]    two 4-bit codes a byte, input column 2j in the high nibble, 2j+1 in the low
  absmax   float16 [N, K/B]  each block of B consecutive input columns of a row shares one scale
  codebook float32 [16]      the value of each code (NF4's normal quantiles or FP4's), in [-1, 1]
  w[n, k] = codebook[code[n, k]] * absmax[n, k // B]

Unlike the affine int4 of fitllm.kernels.w4a16 ((q - z) * s), a code is looked up, not converted: at M = 1
and in the dequantization kernel from the 16-entry table per weight (cached in L1), for the tensor cores from
the 16 values held in registers, picked by the code's four bits (a tree of selects: table loads ran 3x slower
there on an H100, the tree 1.5-1.8x slower in the other two); a K tile's scales are loaded once per row and
block (at M = 1 applied to each block's sum, not to each weight). Each program takes a [BM, BN] tile of y
and a share of K (split-K, summed with fp32 atomics where one tile's programs would not fill the GPU). From
DEQUANT_FROM_M rows on, the weight is instead dequantized by a second kernel and multiplied by cuBLAS.
Configs from one H100 sweep; timings in benchmarks/bench_codebook4.py.
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
    def _load_table(cb_ptr):
        """The 16 code values, held in registers for _lookup."""
        return (tl.load(cb_ptr), tl.load(cb_ptr + 1), tl.load(cb_ptr + 2), tl.load(cb_ptr + 3), tl.load(cb_ptr + 4),
                tl.load(cb_ptr + 5), tl.load(cb_ptr + 6), tl.load(cb_ptr + 7), tl.load(cb_ptr + 8), tl.load(cb_ptr + 9),
                tl.load(cb_ptr + 10), tl.load(cb_ptr + 11), tl.load(cb_ptr + 12), tl.load(cb_ptr + 13),
                tl.load(cb_ptr + 14), tl.load(cb_ptr + 15))

    @triton.jit
    def _lookup(c, t):
        """codebook[c] for 4-bit codes c, t = _load_table(...): bit 0 picks within pairs, bit 1 within quads,
        and so on."""
        a0, a1, a2, a3 = (_pick(c, 1, t[0], t[1]), _pick(c, 1, t[2], t[3]), _pick(c, 1, t[4], t[5]),
                          _pick(c, 1, t[6], t[7]))
        a4, a5, a6, a7 = (_pick(c, 1, t[8], t[9]), _pick(c, 1, t[10], t[11]), _pick(c, 1, t[12], t[13]),
                          _pick(c, 1, t[14], t[15]))
        b0, b1, b2, b3 = _pick(c, 2, a0, a1), _pick(c, 2, a2, a3), _pick(c, 2, a4, a5), _pick(c, 2, a6, a7)
        return _pick(c, 8, _pick(c, 4, b0, b1), _pick(c, 4, b2, b3))

    @triton.jit
    def _codebook4_kernel(x_ptr, codes_ptr, absmax_ptr, cb_ptr, y_ptr, M, N, K, stride_xm, stride_cn, stride_an,
                          stride_ym, BLOCKSIZE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          HALF_K: tl.constexpr, NB: tl.constexpr, SPLIT_K: tl.constexpr, UPCAST: tl.constexpr):
        """Rows of x on the tensor cores: each [BN, 2 * HALF_K] weight tile dequantized in registers."""
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rj = tl.arange(0, HALF_K)  # byte j of a K tile holds input columns 2j and 2j+1
        m_ok, n_ok = rm < M, rn < N
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        table = _load_table(cb_ptr)
        for t in range(pid_k, K // (2 * HALF_K), SPLIT_K):
            byte = t * HALF_K + rj
            c = tl.load(codes_ptr + rn[:, None] * stride_cn + byte[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
            # the tile's NB blocks' scales (NB = 1: the tile lies inside one block)
            s = tl.load(absmax_ptr + rn[:, None] * stride_an + (2 * t * HALF_K) // BLOCKSIZE + tl.arange(0, NB)[None, :],
                        mask=n_ok[:, None], other=0.0).to(tl.float32)
            # [BN, HALF_K]: the code values of columns 2j, and of columns 2j + 1 (a load from the table per
            # weight ran 3x slower here; the other two kernels load them)
            v_hi, v_lo = _lookup(c >> 4, table), _lookup(c & 15, table)
            x_even = tl.load(x_ptr + rm[:, None] * stride_xm + 2 * byte[None, :], mask=m_ok[:, None], other=0.0)
            x_odd = tl.load(x_ptr + rm[:, None] * stride_xm + 2 * byte[None, :] + 1, mask=m_ok[:, None], other=0.0)
            # scaled per element, rounded to x's dtype, as the tensor cores take it
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

    @triton.jit
    def _codebook4_gemv_kernel(x_ptr, codes_ptr, absmax_ptr, cb_ptr, y_ptr, N, K, stride_cn, stride_an,
                               BLOCKSIZE: tl.constexpr, BN: tl.constexpr, HALF_K: tl.constexpr, NB: tl.constexpr,
                               SPLIT_K: tl.constexpr):
        """One row of x on the CUDA cores: a [BN, 2 * HALF_K] tile of code values from the table (the two
        columns of each byte interleaved back in registers, so x is read contiguously), each block's sum of
        value x input scaled once. (Both values of a byte in one 8-byte load from a 256-entry table of pairs
        was slower: 183 against 150 µs a layer, H100.)"""
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        n_ok = rn < N
        rj, rk = tl.arange(0, HALF_K), tl.arange(0, 2 * HALF_K)
        acc = tl.zeros([BN], dtype=tl.float32)
        for t in range(tl.program_id(1), K // (2 * HALF_K), SPLIT_K):
            c = tl.load(codes_ptr + rn[:, None] * stride_cn + (t * HALF_K + rj)[None, :], mask=n_ok[:, None],
                        other=0).to(tl.int32)
            s = tl.load(absmax_ptr + rn[:, None] * stride_an + (2 * t * HALF_K) // BLOCKSIZE + tl.arange(0, NB)[None, :],
                        mask=n_ok[:, None], other=0.0).to(tl.float32)
            v_hi, v_lo = tl.load(cb_ptr + (c >> 4)), tl.load(cb_ptr + (c & 15))
            v = tl.reshape(tl.join(v_hi, v_lo), [BN, NB, 2 * HALF_K // NB])
            x = tl.reshape(tl.load(x_ptr + 2 * t * HALF_K + rk).to(tl.float32), [1, NB, 2 * HALF_K // NB])
            acc += tl.sum(tl.sum(v * x, axis=2) * s, axis=1)
        if SPLIT_K == 1:
            tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=n_ok)
        else:
            tl.atomic_add(y_ptr + rn, acc, mask=n_ok)

    @triton.jit
    def _dequantize_kernel(codes_ptr, absmax_ptr, cb_ptr, w_ptr, N, K, stride_cn, stride_an, stride_wn,
                           BLOCKSIZE: tl.constexpr, BN: tl.constexpr, HALF_K: tl.constexpr, NB: tl.constexpr):
        """W [N, K] in w's dtype, one [BN, 2 * HALF_K] tile a program: code values loaded from the table (the
        select tree ran 1.5x slower here), the two columns of each byte interleaved back in registers so the
        tile is stored in one contiguous run."""
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        byte = tl.program_id(1) * HALF_K + tl.arange(0, HALF_K)
        n_ok = rn < N
        c = tl.load(codes_ptr + rn[:, None] * stride_cn + byte[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
        s = tl.load(absmax_ptr + rn[:, None] * stride_an + (2 * tl.program_id(1) * HALF_K) // BLOCKSIZE
                    + tl.arange(0, NB)[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)
        v_hi, v_lo = tl.load(cb_ptr + (c >> 4)), tl.load(cb_ptr + (c & 15))
        w = tl.reshape(tl.join(v_hi, v_lo), [BN, NB, 2 * HALF_K // NB]) * s[:, :, None]
        cols = 2 * tl.program_id(1) * HALF_K + tl.arange(0, 2 * HALF_K)
        tl.store(w_ptr + rn[:, None] * stride_wn + cols[None, :], tl.reshape(w, [BN, 2 * HALF_K]).to(
            w_ptr.dtype.element_ty), mask=n_ok[:, None])


def _fits(bk: int, k: int, blocksize: int) -> bool:
    """A K tile of bk columns divides K and holds whole blocks or lies inside one (block sizes are powers of 2)."""
    return k % bk == 0 and (bk % blocksize == 0 or blocksize % bk == 0)


def _block_k(k: int, blocksize: int, wanted: int = 128) -> int | None:
    """The K tile: `wanted` columns, else the largest of 128 and 64 that fits; None if none does (then the
    reference runs)."""
    return next((bk for bk in (wanted, 128, 64) if _fits(bk, k, blocksize)), None)


def _gemm_config(m: int, n: int, k: int, blocksize: int, sms: int, config: dict | None = None) -> dict:
    """BM, BN, BK, warps and SPLIT_K (K split across programs until about `waves` waves of programs run). H100
    sweeps, µs a Llama-3-8B layer (RESULTS.md, forty-fifth session): M = 1 the GEMV kernel, 256 rows, 8 warps,
    16 waves 126 (128 rows, 8 waves 150; the first version 213); M = 4 / 16 the tree with 128-row tiles 364 / 384
    (table loads ~1036 / 1131). Above 16 rows the kernel is not tuned (dequantize + cuBLAS runs there)."""
    cfg = dict(BM=1, BN=256, BK=128, warps=8, waves=16) if m == 1 else dict(
        BM=16 if m <= 16 else 64, BN=128, BK=128, warps=4, waves=2)
    cfg |= config or {}
    cfg["BK"] = _block_k(k, blocksize, cfg["BK"])
    tiles = triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"])
    cfg["SPLIT_K"] = max(1, min(k // cfg["BK"], int(cfg["waves"] * sms) // max(tiles, 1)))
    return cfg


def _dequant_config(k: int, blocksize: int, config: dict | None = None) -> dict:
    """H100 sweep at M = 64, µs a layer with cuBLAS: table loads, 32 x 256 tiles 380 (the tree 556)."""
    cfg = dict(BN=32, BK=256, warps=4) | (config or {})
    cfg["BK"] = _block_k(k, blocksize, cfg["BK"])
    return cfg


def _check_shape(K: int, codes, blocksize: int) -> None:
    if codes.shape[1] * 2 != K or _block_k(K, blocksize) is None:
        raise ValueError(f"codebook4 GEMM: K = {K} must be a multiple of 64, match codes {tuple(codes.shape)} and "
                         f"hold whole blocks of {blocksize} (or lie in them)")


def dequantize_codebook4_triton(codes, absmax, codebook, blocksize: int, dtype=torch.bfloat16,
                                config: dict | None = None) -> torch.Tensor:
    """The Triton twin of dequantize_codebook4: W [N, K] in `dtype` (scaled in float32, then rounded)."""
    N, K = codes.shape[0], codes.shape[1] * 2
    _check_shape(K, codes, blocksize)
    cfg = _dequant_config(K, blocksize, config)
    w = torch.empty(N, K, device=codes.device, dtype=dtype)
    _dequantize_kernel[(triton.cdiv(N, cfg["BN"]), K // cfg["BK"])](
        codes, absmax, codebook, w, N, K, codes.stride(0), absmax.stride(0), w.stride(0), BLOCKSIZE=blocksize,
        BN=cfg["BN"], HALF_K=cfg["BK"] // 2, NB=max(cfg["BK"] // blocksize, 1), num_warps=cfg["warps"])
    return w


# From this many rows of x on, the weight is dequantized to x's dtype and multiplied by cuBLAS (bitsandbytes'
# own way): the in-kernel lookup costs per weight per row tile, the dequantization once. H100, µs a
# Llama-3-8B layer, kernel / dequantize + cuBLAS, each tuned: M = 4 364 / ~377, M = 16 384 / ~378, M = 64
# 1448 (untuned) / 380 (RESULTS.md, forty-fifth session): a tie at 16, where the kernel needs no extra memory.
DEQUANT_FROM_M = 17


def codebook4_gemm_triton(x, codes, absmax, codebook, blocksize: int, path: str = "auto",
                          config: dict | None = None):
    """path: "auto" (the kernel below DEQUANT_FROM_M rows, else "dequant"), "kernel" or "dequant" (W dequantized
    by a Triton kernel, then torch.mm); config: overrides of the chosen path's config (benchmarks)."""
    M, K = x.shape
    N = codes.shape[0]
    _check_shape(K, codes, blocksize)
    if path == "dequant" or (path == "auto" and M >= DEQUANT_FROM_M):
        return x @ dequantize_codebook4_triton(codes, absmax, codebook, blocksize, x.dtype, config).t()
    cfg = _gemm_config(M, N, K, blocksize, num_sms(device_index(x)), config)
    split = 1 if deterministic() else cfg["SPLIT_K"]  # atomics sum in arrival order: one program per tile
    y = torch.zeros(M, N, device=x.device, dtype=torch.float32) if split > 1 else torch.empty(
        M, N, device=x.device, dtype=x.dtype)
    bk = cfg["BK"]
    if cfg["BM"] == 1:
        _codebook4_gemv_kernel[(triton.cdiv(N, cfg["BN"]), split)](
            x, codes, absmax, codebook, y, N, K, codes.stride(0), absmax.stride(0), BLOCKSIZE=blocksize, BN=cfg["BN"],
            HALF_K=bk // 2, NB=max(bk // blocksize, 1), SPLIT_K=split, num_warps=cfg["warps"])
        return y.to(x.dtype) if split > 1 else y
    grid = (triton.cdiv(M, cfg["BM"]), triton.cdiv(N, cfg["BN"]), split)
    _codebook4_kernel[grid](x, codes, absmax, codebook, y, M, N, K, x.stride(0), codes.stride(0), absmax.stride(0),
                            y.stride(0), BLOCKSIZE=blocksize, BM=cfg["BM"], BN=cfg["BN"], HALF_K=bk // 2,
                            NB=max(bk // blocksize, 1), SPLIT_K=split, UPCAST=interpreting(), num_warps=cfg["warps"])
    return y.to(x.dtype) if split > 1 else y


def codebook4_gemm(x, codes, absmax, codebook, blocksize: int):
    """y [M, N] = x [M, K] @ W^T: the Triton kernel on CUDA (or FITLLM_KERNEL_BACKEND=triton), else the reference."""
    if backend_for(x) == "triton" and triton is not None and _block_k(x.shape[1], blocksize) is not None:
        return codebook4_gemm_triton(x.contiguous(), codes, absmax, codebook, blocksize)
    return codebook4_gemm_ref(x, codes, absmax, codebook, blocksize)
