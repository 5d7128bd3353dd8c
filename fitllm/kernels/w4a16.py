"""W4A16 (and W8A16) GEMM: y = x @ W^T with W stored packed, dequantized inside the kernel.

Packed layout (the one contract every 4/8-bit checkpoint format is repacked into):
  qweight int32 [K // pack, N], pack = 32 // bits; element k of column n sits in row k // pack at
          bits (k % pack) * bits .. +bits-1 (low to high, the GPTQ order); values are unsigned.
  scales  [num_groups, N] in the activation dtype; zeros [num_groups, N], same dtype, integer zero
          points stored as floats (symmetric schemes store 2**(bits-1)).
  w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n], g = k // group_size, or g_idx[k] (act-order).
  fitllm.quant.formats.packing.pack_dim0 / unpack_dim0 write and read qweight.

One Triton kernel covers every M. Two ways to unpack a tile (constexpr SPLIT_J):
  * split-j: load a [BK/pack, BN] block of words once and run `pack` small dots, dot j pairing
    nibble j of every word with x[:, pack*r + j]; no word is loaded twice, x is gathered with a
    stride (cheap: the x tile is tiny when M is small). Used for small M, where bytes are the cost.
  * full: expand to a [BK, BN] tile by loading each word `pack` times (L1 hits) and one dot; x stays
    contiguous. Used for large M, where the dot dominates.
Scales are applied per element, per K tile (when a group spans whole K tiles: the dot runs on the
exact integers q - z and the [BM, BN] result is scaled, BK/BM times fewer multiplies), or once at
the end (per-channel). Small M also splits K across programs (serial reduction, see _utils).
Large M can instead dequantize to a bf16 buffer and call cuBLAS ("dequant" backend), if that
measured faster (benchmarks/bench_gemm.py sweeps both).
"""

from __future__ import annotations

import torch

from fitllm.quant.formats.packing import unpack_dim0

from ._utils import (backend_for, device_index, interpreting, gpu_arch, num_sms, packed_math_ok, pick_config,
                     split_k_for, splitk_buffers)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton still get the reference
    triton = None


# --------------------------------------------------------------------------- torch reference

def _group_index(K: int, group_size: int, g_idx, device) -> torch.Tensor:
    if g_idx is not None:
        return g_idx.to(device=device, dtype=torch.long)
    return torch.arange(K, device=device) // group_size


def dequantize_packed(qweight, scales, zeros, group_size, bits=4, g_idx=None, dtype=None):
    """-> W^T [K, N] in `dtype` (default: scales' dtype), computed in float32."""
    q = unpack_dim0(qweight, bits)
    g = _group_index(q.shape[0], group_size, g_idx, q.device)
    w = (q.float() - zeros.float()[g]) * scales.float()[g]
    return w.to(dtype or scales.dtype)


def w4a16_gemm_ref(x, qweight, scales, zeros, group_size, bits=4, g_idx=None, bias=None):
    """Torch reference and CPU path. Dequantizes to the activation dtype, as the kernel does."""
    w = dequantize_packed(qweight, scales, zeros, group_size, bits, g_idx, dtype=x.dtype)
    y = x @ w
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


# --------------------------------------------------------------------------- Triton kernels

if triton is not None:

    @triton.jit
    def _dequant_tile(qj, z, s, SCALE_PER_ELEMENT: tl.constexpr, OUT: tl.constexpr):
        # int -> float without a slow I2F: OR the value into the mantissa of 2**23 and subtract
        # 2**23 + zero in one exact FADD (z must be an integer, as the layout promises).
        f = (qj | 0x4B000000).to(tl.float32, bitcast=True) - (z + 8388608.0)
        if SCALE_PER_ELEMENT:
            f = f * s
        return f.to(OUT)

    @triton.jit
    def _dequant_rows(qj, offs_k, k_mask, s_ptr, z_ptr, gidx_ptr, z_row, offs_n, n_mask, N,
                      GROUP_SIZE: tl.constexpr, HAS_GIDX: tl.constexpr, SCALE_MODE: tl.constexpr, OUT: tl.constexpr):
        """Codes qj [rows k, BN] dequantized: per element with their group's scale and zero (SCALE_MODE
        0; the group from g_idx with act-order), else minus the zero row only (the scale comes later)."""
        if SCALE_MODE == 0:
            if HAS_GIDX:
                g = tl.load(gidx_ptr + offs_k, mask=k_mask, other=0)
            else:
                g = offs_k // GROUP_SIZE
            sz_off = g[:, None] * N + offs_n[None, :]
            sz_mask = k_mask[:, None] & n_mask[None, :]
            s = tl.load(s_ptr + sz_off, mask=sz_mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + sz_off, mask=sz_mask, other=0.0).to(tl.float32)
            return _dequant_tile(qj, z, s, True, OUT)
        return _dequant_tile(qj, z_row[None, :], 1.0, False, OUT)

    @triton.jit
    def _dot(a, b, acc, UPCAST: tl.constexpr):
        # triton 3.6's interpreter multiplies bf16 bit patterns as integers; there, upcast the
        # (already rounded) operands to fp32 so it computes the same function as the GPU.
        if UPCAST:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _tile_program(M, N, BM: tl.constexpr, BN: tl.constexpr):
        """Tile grid (mn, k), M fastest so the programs reading one weight tile run together: this
        program's flat tile index, K split, first column n0, and the tile's offsets and masks."""
        pid_mn = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BM)
        n0 = (pid_mn // num_pid_m) * BN
        offs_m = (pid_mn % num_pid_m) * BM + tl.arange(0, BM)
        offs_n = n0 + tl.arange(0, BN)
        return pid_mn, tl.program_id(1), n0, offs_m, offs_n, offs_m < M, offs_n < N

    @triton.jit(do_not_specialize=["M"])  # else M % 16 == 0 compiles again, mid-serving
    def _w4a16_kernel(
        x_ptr, q_ptr, s_ptr, z_ptr, gidx_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
        M, N, K, stride_xm, stride_ym, K_ITERS,
        BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_GIDX: tl.constexpr, HAS_BIAS: tl.constexpr,
        SCALE_MODE: tl.constexpr,  # 0 per element, 1 per K tile, 2 once at the end
        SPLIT_J: tl.constexpr, SPLIT_K: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr, ORDERED: tl.constexpr = False,
    ):
        PACK: tl.constexpr = 32 // BITS
        QMASK: tl.constexpr = (1 << BITS) - 1
        BKP: tl.constexpr = BK // PACK
        DT = x_ptr.dtype.element_ty
        pid_mn, pid_k, _, offs_m, offs_n, m_mask, n_mask = _tile_program(M, N, BM, BN)
        KP = K // PACK

        acc = tl.zeros((BM, BN), dtype=tl.float32)
        z_row = tl.zeros((BN,), dtype=tl.float32)  # SCALE_MODE 1 and 2 load it in the loop; 0 has none
        for it in range(0, K_ITERS):
            k0 = (pid_k * K_ITERS + it) * BK
            if SCALE_MODE == 1:  # one group covers this whole K tile
                g = tl.minimum(k0 // GROUP_SIZE, K // GROUP_SIZE - 1)  # tail tiles past K are masked
                s_row = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                z_row = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            elif SCALE_MODE == 2:
                z_row = tl.load(z_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            if SPLIT_J:
                offs_r = k0 // PACK + tl.arange(0, BKP)
                r_mask = offs_r < KP
                qw = tl.load(q_ptr + offs_r[:, None] * N + offs_n[None, :],
                             mask=r_mask[:, None] & n_mask[None, :], other=0)
                part = tl.zeros((BM, BN), dtype=tl.float32)
                for j in tl.static_range(PACK):
                    offs_k = offs_r * PACK + j
                    xj = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                                 mask=m_mask[:, None] & r_mask[None, :], other=0.0)
                    w = _dequant_rows((qw >> (j * BITS)) & QMASK, offs_k, r_mask, s_ptr, z_ptr, gidx_ptr, z_row,
                                      offs_n, n_mask, N, GROUP_SIZE, HAS_GIDX, SCALE_MODE, DT)
                    part = _dot(xj, w, part, UPCAST)
            else:
                offs_k = k0 + tl.arange(0, BK)
                k_mask = offs_k < K
                qw = tl.load(q_ptr + (offs_k // PACK)[:, None] * N + offs_n[None, :],
                             mask=k_mask[:, None] & n_mask[None, :], other=0)
                w = _dequant_rows((qw >> ((offs_k % PACK) * BITS)[:, None]) & QMASK, offs_k, k_mask, s_ptr, z_ptr,
                                  gidx_ptr, z_row, offs_n, n_mask, N, GROUP_SIZE, HAS_GIDX, SCALE_MODE, DT)
                xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                             mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                part = _dot(xt, w, tl.zeros((BM, BN), dtype=tl.float32), UPCAST)
            if SCALE_MODE == 1:
                acc += part * s_row[None, :]
            else:
                acc += part
        if SCALE_MODE == 2:
            acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]

        _store_tile(acc, bias_ptr, y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask, N, stride_ym,
                    pid_mn, SPLIT_K, HAS_BIAS, SPLIT_K > 1, ORDERED, pid_k, M * N)

    _RNE_OUT = tl.constexpr(interpreting())  # triton 3.6's interpreter truncates fp32 -> bf16 casts

    @triton.jit
    def _to_out(v, DT: tl.constexpr):
        """fp32 -> the output dtype, rounded to nearest even as on the GPU (by hand for bf16 under the
        interpreter, so that its results are the GPU's function, e.g. a PendingSum's consumer's)."""
        if _RNE_OUT:
            if DT == tl.bfloat16:
                b = v.to(tl.int32, bitcast=True)
                v = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        return v.to(DT)

    @triton.jit
    def _store_split_ordered(acc, bias_ptr, y_ptrs, ws_ptr, cnt_ptr, offs_m, offs_n, mask, n_mask, N, tile_id,
                             split, split_id, slot, HAS_BIAS: tl.constexpr):
        """Deterministic split-K (FITLLM_DETERMINISTIC=1): each split stores its partial in its own
        slice of the workspace (split_id * slot floats in), and the program that arrives last
        sums the slices in split order, so the fp32 rounding is the same whichever program came
        last (the atomic adds' order is not: greedy outputs then vary from run to run). Four
        slices are read per step; reads bypass L1 (other programs wrote them in this launch)."""
        ws_ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws_ptrs + split_id * slot, acc, mask=mask)
        tl.debug_barrier()  # all threads' stores are issued before the release below
        arrived = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel")
        if arrived == split - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in range(0, split, 4):
                p0 = tl.load(ws_ptrs + s * slot, mask=mask, other=0.0, cache_modifier=".cg")
                p1 = tl.load(ws_ptrs + (s + 1) * slot, mask=mask & (s + 1 < split), other=0.0, cache_modifier=".cg")
                p2 = tl.load(ws_ptrs + (s + 2) * slot, mask=mask & (s + 2 < split), other=0.0, cache_modifier=".cg")
                p3 = tl.load(ws_ptrs + (s + 3) * slot, mask=mask & (s + 3 < split), other=0.0, cache_modifier=".cg")
                total = (((total + p0) + p1) + p2) + p3  # missing slices add an exact 0
            tl.atomic_xchg(cnt_ptr + tile_id, 0, sem="relaxed")
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, _to_out(total, y_ptrs.dtype.element_ty), mask=mask)

    @triton.jit
    def _dequant_kernel(q_ptr, s_ptr, z_ptr, gidx_ptr, w_ptr, N, K,
                        BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_GIDX: tl.constexpr,
                        BK: tl.constexpr, BN: tl.constexpr):
        """Packed -> W^T [K, N] in the scales' dtype (the 'dequant' backend for large M)."""
        PACK: tl.constexpr = 32 // BITS
        offs_k = tl.program_id(0) * BK + tl.arange(0, BK)
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = (offs_k < K)[:, None] & (offs_n < N)[None, :]
        qw = tl.load(q_ptr + (offs_k // PACK)[:, None] * N + offs_n[None, :], mask=mask, other=0)
        qj = (qw >> ((offs_k % PACK) * BITS)[:, None]) & ((1 << BITS) - 1)
        if HAS_GIDX:
            g = tl.load(gidx_ptr + offs_k, mask=offs_k < K, other=0)
        else:
            g = offs_k // GROUP_SIZE
        off = g[:, None] * N + offs_n[None, :]
        s = tl.load(s_ptr + off, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + off, mask=mask, other=0.0).to(tl.float32)
        w = _dequant_tile(qj, z, s, True, w_ptr.dtype.element_ty)
        tl.store(w_ptr + offs_k[:, None] * N + offs_n[None, :], w, mask=mask)

    # ----------------------------------------------------------------------- small-M kernels
    #
    # Both unpack a [BK/pack, BN] block of words with one broadcast shift-and-mask into a
    # [BK/pack, pack, BN] tile (element k = row * pack + i, so x is read in its natural order)
    # and turn the integers into floats with the 2**23 trick: OR the field into the mantissa of
    # 2**23 and subtract 2**23 + zero in one exact FADD. With SHIFT16 the field is not shifted
    # down to bit 0: only `w >> 16` is formed (one shift per word), field i keeps its position
    # 2**(bits * (i % (pack/2))) inside the low half, the zero is scaled by the same power of two
    # and x by its inverse (all exact), which saves a shift on most elements.

    @triton.jit
    def _unpack_minus_zero(qw, z, MAGIC, BITS: tl.constexpr, SHIFT16: tl.constexpr):
        """qw int32 [R, BN], z fp32 [BN] -> (f fp32 [R, PACK, BN] with f = (q - z) * up[i], up[i])."""
        PACK: tl.constexpr = 32 // BITS
        HALF: tl.constexpr = PACK // 2
        QMASK: tl.constexpr = (1 << BITS) - 1
        i = tl.arange(0, PACK)
        if SHIFT16:
            lsh = BITS * (i % HALF)
            sh = (i // HALF) * 16
            msk = QMASK << lsh
            up = (1 << lsh).to(tl.float32)
            w = ((qw[:, None, :] >> sh[None, :, None]) & msk[None, :, None]) | MAGIC
            zc = z[None, :] * up[:, None] + 8388608.0  # exact: z * 2**lsh < 2**20
        else:
            up = tl.full((PACK,), 1.0, tl.float32)
            w = ((qw[:, None, :] >> (BITS * i)[None, :, None]) & QMASK) | MAGIC
            zc = tl.broadcast_to(z[None, :] + 8388608.0, (PACK, z.shape[0]))
        f = w.to(tl.float32, bitcast=True) - zc[None, :, :]
        return f, up

    @triton.jit
    def _store_tile(acc, bias_ptr, y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask, N, stride_ym,
                    tile_id, split, HAS_BIAS: tl.constexpr, USE_WS: tl.constexpr, ORDERED: tl.constexpr = False,
                    split_id=0, slot=0, DEFER: tl.constexpr = False):
        """y = acc (+ bias) for one output tile, or, split over K (USE_WS), this split's share: by
        default added into the fp32 workspace, and the program that arrives last (per-tile counter)
        reads the total, writes y and zeroes its slice and counter for the next launch; in split
        order with ORDERED (_store_split_ordered); with DEFER only added (no counter, no y: the
        consumer reads the sum and zeroes it, _utils.PendingSum). `split` may be a runtime value
        (one compiled kernel for every split count)."""
        mask = m_mask[:, None] & n_mask[None, :]
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        ws_ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        if not USE_WS:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, _to_out(acc, y_ptr.dtype.element_ty), mask=mask)
        elif DEFER:
            tl.atomic_add(ws_ptrs, acc, mask=mask, sem="relaxed")
        elif ORDERED:
            _store_split_ordered(acc, bias_ptr, y_ptrs, ws_ptr, cnt_ptr, offs_m, offs_n, mask, n_mask, N, tile_id,
                                 split, split_id, slot, HAS_BIAS)
        else:
            tl.atomic_add(ws_ptrs, acc, mask=mask, sem="relaxed")
            tl.debug_barrier()  # all threads' adds are issued before the release below
            arrived = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel")
            if arrived == split - 1:
                # Read at L2 by atomics in the register layout of the adds and of the zeroing stores
                # below, so each address is added, read and zeroed by one thread, in that order
                # (plain loads took another layout and read wrong sums on the H200, 4-34 % off).
                # Relaxed: the default acq_rel put a fence and a round trip before each 16 bytes,
                # one after another at the end of the kernel (W4A16 layer at M = 64 106 -> 88 µs on
                # an H100; RESULTS.md, thirty-fourth session).
                zero = tl.zeros(acc.shape, dtype=tl.float32)
                total = tl.atomic_add(ws_ptrs, zero, mask=mask, sem="relaxed")
                tl.store(ws_ptrs, zero, mask=mask)
                tl.atomic_xchg(cnt_ptr + tile_id, 0, sem="relaxed")  # for the next launch: no fence
                if HAS_BIAS:
                    total += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
                tl.store(y_ptrs, _to_out(total, y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gemv_program(N, BM: tl.constexpr, BN: tl.constexpr, BKP: tl.constexpr):
        """GEMV grid (n, k, m): this program's column block, K split, first row, and tile offsets."""
        pid_n = tl.program_id(0)
        offs_n = pid_n * BN + tl.arange(0, BN)
        return pid_n, tl.program_id(1), tl.program_id(2) * BM, offs_n, offs_n < N, tl.arange(0, BKP)

    @triton.jit
    def _word_tile(q_ptr, s_ptr, z_ptr, kt, offs_r0, offs_n, n_mask, N, K,
                   PACK: tl.constexpr, BK: tl.constexpr, GROUP_SIZE: tl.constexpr):
        """K tile kt of the small-M kernels: its packed words [BK/pack, BN] (rows past K read as 0)
        and the scale and zero rows (fp32) of its one group (per-channel weights: one group)."""
        offs_r = kt * (BK // PACK) + offs_r0
        r_mask = offs_r < K // PACK
        qw = tl.load(q_ptr + offs_r[:, None] * N + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0)
        g = tl.minimum((kt * BK) // GROUP_SIZE, K // GROUP_SIZE - 1)  # fully masked tail tiles
        s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        return qw, s, z, offs_r, r_mask

    @triton.jit
    def _gemv_rows(xj_ptr, m_off, ok, f, t, LSH: tl.constexpr, ROW_OK: tl.constexpr):
        """t += x[m, k(r, j)] * 2**-LSH (as [BKP, 1]) * f for one row m of x (no-op for padding rows)."""
        if ROW_OK:
            xj = tl.load(xj_ptr + m_off, mask=ok, other=0.0).to(tl.float32)
            if LSH > 0:
                xj = xj * (1.0 / (1 << LSH))
            t += xj[:, None] * f
        return t

    @triton.jit
    def _rows_out(acc0, acc1, acc2, acc3, m0, M, BM: tl.constexpr):
        """Per-row [BK/pack, BN] partial sums -> the [BM, BN] output rows m0.. (rows past M masked)."""
        offs_m = m0 + tl.arange(0, BM)
        rows = offs_m[:, None] + tl.zeros((1, acc0.shape[1]), dtype=tl.int32)
        out = tl.where(rows == m0, tl.sum(acc0, axis=0)[None, :], 0.0)
        if BM > 1:
            out = tl.where(rows == m0 + 1, tl.sum(acc1, axis=0)[None, :], out)
        if BM > 2:
            out = tl.where(rows == m0 + 2, tl.sum(acc2, axis=0)[None, :], out)
            out = tl.where(rows == m0 + 3, tl.sum(acc3, axis=0)[None, :], out)
        return out, offs_m, offs_m < M

    @triton.jit
    def _w4a16_gemv_kernel(
        x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
        M, N, K, stride_xm, stride_ym, K_ITERS, SPLIT, MAGIC,
        BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
        USE_WS: tl.constexpr, SHIFT16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        ORDERED: tl.constexpr = False,
    ):
        """CUDA-core GEMV for M <= 4 (BM in 1, 2, 4; more rows: grid axis 2): program (n, k) owns BN
        columns and K_ITERS K tiles; each weight word is loaded once and its `pack` fields are
        unpacked one at a time on the [BK/pack, BN] word tile (every tensor keeps the load's
        layout: no shared-memory shuffles), FMA'd with the matching x values of every row. Per-row
        partial sums stay [BK/pack, BN] across the loop (scaled per group tile when groups are
        used) and are reduced over K once at the end."""
        PACK: tl.constexpr = 32 // BITS
        HALF: tl.constexpr = PACK // 2
        QMASK: tl.constexpr = (1 << BITS) - 1
        BKP: tl.constexpr = BK // PACK
        pid_n, pid_k, m0, offs_n, n_mask, offs_r0 = _gemv_program(N, BM, BN, BKP)
        acc0 = tl.zeros((BKP, BN), dtype=tl.float32)
        acc1 = tl.zeros((BKP, BN), dtype=tl.float32)
        acc2 = tl.zeros((BKP, BN), dtype=tl.float32)
        acc3 = tl.zeros((BKP, BN), dtype=tl.float32)
        for it in range(0, K_ITERS):
            qw, s, z, offs_r, r_mask = _word_tile(q_ptr, s_ptr, z_ptr, pid_k * K_ITERS + it, offs_r0, offs_n, n_mask,
                                                  N, K, PACK, BK, GROUP_SIZE)
            if SHIFT16:
                qhi = qw >> 16
            t0 = tl.zeros((BKP, BN), dtype=tl.float32)
            t1 = tl.zeros((BKP, BN), dtype=tl.float32)
            t2 = tl.zeros((BKP, BN), dtype=tl.float32)
            t3 = tl.zeros((BKP, BN), dtype=tl.float32)
            for j in tl.static_range(PACK):
                if SHIFT16:  # field j stays at bit BITS*(j % HALF) of the low/high half: one shift per word
                    src = qw if j < HALF else qhi
                    wj = (src & (QMASK << (BITS * (j % HALF)))) | MAGIC
                    zj = z * (1 << (BITS * (j % HALF))) + 8388608.0
                else:
                    wj = ((qw >> (BITS * j)) & QMASK) | MAGIC
                    zj = z + 8388608.0
                f = wj.to(tl.float32, bitcast=True) - zj[None, :]  # (q - z) * 2**(BITS*(j % HALF)), exact
                xj_ptr = x_ptr + m0 * stride_xm + offs_r * PACK + j
                t0 = _gemv_rows(xj_ptr, 0, r_mask & (m0 < M), f, t0, BITS * (j % HALF) * SHIFT16, True)
                t1 = _gemv_rows(xj_ptr, stride_xm, r_mask & (m0 + 1 < M), f, t1, BITS * (j % HALF) * SHIFT16, BM > 1)
                t2 = _gemv_rows(xj_ptr, 2 * stride_xm, r_mask & (m0 + 2 < M), f, t2, BITS * (j % HALF) * SHIFT16, BM > 2)
                t3 = _gemv_rows(xj_ptr, 3 * stride_xm, r_mask & (m0 + 3 < M), f, t3, BITS * (j % HALF) * SHIFT16, BM > 3)
            acc0 += t0 * s[None, :]
            if BM > 1:
                acc1 += t1 * s[None, :]
            if BM > 2:
                acc2 += t2 * s[None, :]
                acc3 += t3 * s[None, :]
        out, offs_m, m_mask = _rows_out(acc0, acc1, acc2, acc3, m0, M, BM)
        _store_tile(out, bias_ptr, y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask, N, stride_ym,
                    tl.program_id(2) * tl.num_programs(0) + pid_n, SPLIT, HAS_BIAS, USE_WS, ORDERED, pid_k, M * N)

    # Small-M GEMV with packed 16-bit math. One word holds fields 0..7 (4 bits each); `(w >> 4i) &
    # 0x000F000F | magic` turns fields i and i + 4 into two 16-bit floats magic + q in one LOP3
    # (magic 128 in bf16, 1024 in fp16: q lands in the mantissa exactly), and one packed FMA
    # subtracts magic + z (exact): _UNPACK_ASM, once per word for all rows of x. Per row, four
    # packed FMAs multiply by the matching x pairs and add (_DOT_ASM), so two weights cost about one
    # instruction instead of three fp32 ones. The four-term 16-bit sum (relative rounding 2**-9 in
    # bf16, 2**-12 in fp16) goes to fp32 once per word and row.
    def _ptx_unpack(word, nz, outs, kind, one, magic):
        """Fields i, i+4 of `word` -> outs[i] = 16-bit pair (q - z) (nz holds -(magic + z) twice)."""
        lines = [f"mov.b32 one, {one};"]
        for i, r in enumerate(outs):
            if i:
                lines.append(f"shr.u32 t, {word}, {4 * i};")
            lines.append(f"lop3.b32 {r}, {'t' if i else word}, 0x000F000F, {magic}, 0xEA;")  # (a & b) | c
        return lines + [f"fma.rn.{kind} {r}, {r}, one, {nz};" for r in outs]

    def _ptx_dot(pairs, xs, dst, kind):
        """dst (fp32) = Σ of the products of four 16-bit pairs with four x pairs."""
        lines = ["mov.b32 nzero, 0x80008000;", f"fma.rn.{kind} acc, {pairs[0]}, {xs[0]}, nzero;"]
        lines += [f"fma.rn.{kind} acc, {p}, {x}, acc;" for p, x in zip(pairs[1:], xs[1:])]
        if kind == "f16x2":
            return lines + ["mov.b32 {lo, hi}, acc;", "cvt.f32.f16 flo, lo;", "cvt.f32.f16 fhi, hi;",
                            f"add.f32 {dst}, flo, fhi;"]
        return lines + ["shl.b32 t, acc, 16;", "and.b32 acc, acc, 0xFFFF0000;", f"add.f32 {dst}, t, acc;"]

    def _ptx(lines):
        return ("{\n.reg .b32 a, b, c, d, t, one, nzero, acc;\n.reg .f16 lo, hi;\n.reg .f32 flo, fhi;\n"
                + "\n".join(lines) + "\n}")

    _BF16 = ("bf16x2", "0x3F803F80", "0x43004300")  # packed op, 1.0 twice, magic 128 twice
    _F16 = ("f16x2", "0x3C003C00", "0x64006400")  # magic 1024
    # one word, all rows: $0..$3 <- ($4 = word, $5 = nz); one row: $0 <- ($1..$4 pairs, $5..$8 x pairs)
    _UNPACK_BF16 = tl.constexpr(_ptx(_ptx_unpack("$4", "$5", ["$0", "$1", "$2", "$3"], *_BF16)))
    _UNPACK_F16 = tl.constexpr(_ptx(_ptx_unpack("$4", "$5", ["$0", "$1", "$2", "$3"], *_F16)))
    _DOT_BF16 = tl.constexpr(_ptx(_ptx_dot(["$1", "$2", "$3", "$4"], ["$5", "$6", "$7", "$8"], "$0", _BF16[0])))
    _DOT_F16 = tl.constexpr(_ptx(_ptx_dot(["$1", "$2", "$3", "$4"], ["$5", "$6", "$7", "$8"], "$0", _F16[0])))
    # batch 1, both in one block: $0 <- ($1 = word, $2 = nz, $3..$6 x pairs)
    _ONE_ROW_BF16 = tl.constexpr(_ptx(_ptx_unpack("$1", "$2", ["a", "b", "c", "d"], *_BF16)
                                      + _ptx_dot(["a", "b", "c", "d"], ["$3", "$4", "$5", "$6"], "$0", _BF16[0])))
    _ONE_ROW_F16 = tl.constexpr(_ptx(_ptx_unpack("$1", "$2", ["a", "b", "c", "d"], *_F16)
                                     + _ptx_dot(["a", "b", "c", "d"], ["$3", "$4", "$5", "$6"], "$0", _F16[0])))

    @triton.jit
    def _half(v, HIGH: tl.constexpr, F16: tl.constexpr):
        """One 16-bit float of an int32 pair, as fp32."""
        if F16:
            h = ((v >> 16) if HIGH else v) & 0xFFFF
            return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return ((v & -65536) if HIGH else (v << 16)).to(tl.float32, bitcast=True)

    @triton.jit
    def _pair(lo, hi, DT: tl.constexpr):
        """Two fp32 values (exact in DT) -> their 16-bit pair in one int32."""
        lo16 = lo.to(DT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi16 = hi.to(DT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return lo16 | (hi16 << 16)

    @triton.jit
    def _unpack_q_minus_z(qw, nz, F16: tl.constexpr, ASM: tl.constexpr):
        """Word -> four int32 pairs (q_i - z, q_{i+4} - z) in 16-bit floats, i = 0..3. nz: the pair
        (-(magic + z), same). ASM=False computes the same values with plain ops (the interpreter,
        and cards without packed bf16 math)."""
        if ASM:
            # early-clobber outputs: they are written while the inputs are still read
            return tl.inline_asm_elementwise(_UNPACK_F16 if F16 else _UNPACK_BF16, "=&r,=&r,=&r,=&r,r,r", [qw, nz],
                                             dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
        DT: tl.constexpr = tl.float16 if F16 else tl.bfloat16
        magic: tl.constexpr = 0x64006400 if F16 else 0x43004300
        lo_z = _half(nz, False, F16)
        hi_z = _half(nz, True, F16)
        p0 = ((qw >> 0) & 0x000F000F) | magic
        p1 = ((qw >> 4) & 0x000F000F) | magic
        p2 = ((qw >> 8) & 0x000F000F) | magic
        p3 = ((qw >> 12) & 0x000F000F) | magic
        return (_pair(_half(p0, False, F16) + lo_z, _half(p0, True, F16) + hi_z, DT),
                _pair(_half(p1, False, F16) + lo_z, _half(p1, True, F16) + hi_z, DT),
                _pair(_half(p2, False, F16) + lo_z, _half(p2, True, F16) + hi_z, DT),
                _pair(_half(p3, False, F16) + lo_z, _half(p3, True, F16) + hi_z, DT))

    @triton.jit
    def _dot_pairs(a, b, c, d, x0, x1, x2, x3, F16: tl.constexpr, ASM: tl.constexpr):
        """Σ of the 8 products of one word's (q - z) pairs with the x pairs (x[i], x[i + 4]), fp32."""
        if ASM:
            r = tl.inline_asm_elementwise(_DOT_F16 if F16 else _DOT_BF16, "=r,r,r,r,r,r,r,r,r",
                                          [a, b, c, d, x0, x1, x2, x3], dtype=tl.int32, is_pure=True, pack=1)
            return r.to(tl.float32, bitcast=True)
        total = _half(a, False, F16) * _half(x0, False, F16) + _half(a, True, F16) * _half(x0, True, F16)
        total += _half(b, False, F16) * _half(x1, False, F16) + _half(b, True, F16) * _half(x1, True, F16)
        total += _half(c, False, F16) * _half(x2, False, F16) + _half(c, True, F16) * _half(x2, True, F16)
        total += _half(d, False, F16) * _half(x3, False, F16) + _half(d, True, F16) * _half(x3, True, F16)
        return total

    @triton.jit
    def _x_pairs(x_ptr, row, M, stride_xw, offs_r, r_mask, BKP: tl.constexpr, BN: tl.constexpr):
        """One row of x (int32 view: 16-bit pairs) as the pairs (x[8r+i], x[8r+i+4]), i = 0..3, [BK/8, BN]."""
        base = x_ptr + row * stride_xw + offs_r * 4
        ok = r_mask & (row < M)
        # the four int32 words of x for word row r hold (x0,x1) (x2,x3) (x4,x5) (x6,x7)
        xa = tl.load(base, mask=ok, other=0)
        xb = tl.load(base + 1, mask=ok, other=0)
        xc = tl.load(base + 2, mask=ok, other=0)
        xd = tl.load(base + 3, mask=ok, other=0)
        x0 = tl.broadcast_to(((xa & 0xFFFF) | (xc << 16))[:, None], (BKP, BN))  # (x0, x4)
        x1 = tl.broadcast_to((((xa >> 16) & 0xFFFF) | (xc & -65536))[:, None], (BKP, BN))  # (x1, x5)
        x2 = tl.broadcast_to(((xb & 0xFFFF) | (xd << 16))[:, None], (BKP, BN))  # (x2, x6)
        x3 = tl.broadcast_to((((xb >> 16) & 0xFFFF) | (xd & -65536))[:, None], (BKP, BN))  # (x3, x7)
        return x0, x1, x2, x3

    @triton.jit
    def _one_row_dot(qw, nz, x0, x1, x2, x3, F16: tl.constexpr, ASM: tl.constexpr):
        """Batch 1: unpack and dot in one PTX block (fewer live registers than the two-step path)."""
        if ASM:
            r = tl.inline_asm_elementwise(_ONE_ROW_F16 if F16 else _ONE_ROW_BF16, "=r,r,r,r,r,r,r",
                                          [qw, nz, x0, x1, x2, x3], dtype=tl.int32, is_pure=True, pack=1)
            return r.to(tl.float32, bitcast=True)
        a, b, c, d = _unpack_q_minus_z(qw, nz, F16, ASM)
        return _dot_pairs(a, b, c, d, x0, x1, x2, x3, F16, ASM)

    @triton.jit
    def _row_dot(x_ptr, row, M, stride_xw, offs_r, r_mask, a, b, c, d, F16: tl.constexpr, ASM: tl.constexpr,
                 BKP: tl.constexpr, BN: tl.constexpr):
        x0, x1, x2, x3 = _x_pairs(x_ptr, row, M, stride_xw, offs_r, r_mask, BKP, BN)
        return _dot_pairs(a, b, c, d, x0, x1, x2, x3, F16, ASM)

    @triton.jit
    def _w4a16_gemv_pairs_kernel(
        x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xw, stride_ym, K_ITERS, SPLIT,
        GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, USE_WS: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F16: tl.constexpr, ASM: tl.constexpr,
        ORDERED: tl.constexpr = False,
    ):
        """y = x w for up to 4 rows of x (BM in 1, 2, 4; more rows: grid axis 2), 4-bit weights,
        bf16/fp16. x_ptr is x viewed as int32 (pairs of 16-bit values), stride_xw its row stride in
        words. Program (n, k, m) owns BN columns and K_ITERS tiles of BK (one group per tile); each
        word is unpacked once for all BM rows; split-K as in the other small-M kernels."""
        BKP: tl.constexpr = BK // 8
        MAGICF: tl.constexpr = 1024.0 if F16 else 128.0
        DT: tl.constexpr = tl.float16 if F16 else tl.bfloat16
        pid_n, pid_k, m0, offs_n, n_mask, offs_r0 = _gemv_program(N, BM, BN, BKP)
        acc0 = tl.zeros((BKP, BN), dtype=tl.float32)
        acc1 = tl.zeros((BKP, BN), dtype=tl.float32)
        acc2 = tl.zeros((BKP, BN), dtype=tl.float32)
        acc3 = tl.zeros((BKP, BN), dtype=tl.float32)
        for it in range(0, K_ITERS):
            qw, s, z, offs_r, r_mask = _word_tile(q_ptr, s_ptr, z_ptr, pid_k * K_ITERS + it, offs_r0, offs_n, n_mask,
                                                  N, K, 8, BK, GROUP_SIZE)
            h = (-(z + MAGICF)).to(DT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            nz = tl.broadcast_to((h | (h << 16))[None, :], (BKP, BN))
            if BM == 1:
                x0, x1, x2, x3 = _x_pairs(x_ptr, m0, M, stride_xw, offs_r, r_mask, BKP, BN)
                acc0 += _one_row_dot(qw, nz, x0, x1, x2, x3, F16, ASM) * s[None, :]
            else:
                a, b, c, d = _unpack_q_minus_z(qw, nz, F16, ASM)
                acc0 += _row_dot(x_ptr, m0, M, stride_xw, offs_r, r_mask, a, b, c, d, F16, ASM, BKP, BN) * s[None, :]
                acc1 += _row_dot(x_ptr, m0 + 1, M, stride_xw, offs_r, r_mask, a, b, c, d, F16, ASM, BKP, BN) * s[None, :]
                if BM > 2:
                    acc2 += _row_dot(x_ptr, m0 + 2, M, stride_xw, offs_r, r_mask, a, b, c, d, F16, ASM, BKP,
                                     BN) * s[None, :]
                    acc3 += _row_dot(x_ptr, m0 + 3, M, stride_xw, offs_r, r_mask, a, b, c, d, F16, ASM, BKP,
                                     BN) * s[None, :]
        out, offs_m, m_mask = _rows_out(acc0, acc1, acc2, acc3, m0, M, BM)
        _store_tile(out, bias_ptr, y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask, N, stride_ym,
                    tl.program_id(2) * tl.num_programs(0) + pid_n, SPLIT, HAS_BIAS, USE_WS, ORDERED, pid_k, M * N)

    @triton.jit
    def _unpack_pairs16(qw, MAGIC2, BITS: tl.constexpr, DT: tl.constexpr, INTERLEAVE: tl.constexpr):
        """qw int32 [R, BN] -> [R * PACK, BN] in DT holding MAGICF + q exactly (MAGICF = 128 for
        bf16, 1024 for fp16): one shift and one AND|OR per PAIR of fields (fields i and i + PACK/2
        land in the two 16-bit halves of one word, each with the 16-bit float's magic exponent)."""
        PACK: tl.constexpr = 32 // BITS
        HALFP: tl.constexpr = PACK // 2
        QMASK: tl.constexpr = (1 << BITS) - 1
        PAIRMASK: tl.constexpr = QMASK | (QMASK << 16)
        i = tl.arange(0, HALFP)
        v = ((qw[:, None, :] >> (BITS * i)[None, :, None]) & PAIRMASK) | MAGIC2
        lo = v.to(tl.int16).to(DT, bitcast=True)  # fields i
        hi = (v >> 16).to(tl.int16).to(DT, bitcast=True)  # fields i + HALFP
        w4 = tl.join(lo, hi)  # [R, HALFP, BN, 2]
        if INTERLEAVE:  # tile row r * PACK + 2 * i + h holds field i + h * HALFP: the two halves of
            # one word stay neighbours (one 32-bit register of the dot operand); x is permuted to match
            w4 = tl.permute(w4, (0, 1, 3, 2))  # [R, HALFP, 2, BN]
        else:
            w4 = tl.permute(w4, (0, 3, 1, 2))  # [R, 2, HALFP, BN]: field h * HALFP + i
        return tl.reshape(w4, (qw.shape[0] * PACK, qw.shape[1]))

    @triton.jit(do_not_specialize=["M"])  # else M % 16 == 0 compiles again, mid-serving
    def _w4a16_tc_kernel(
        x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
        M, N, K, stride_xm, stride_ym, K_ITERS, SPLIT, MAGIC, MAGIC2, MAGICF,
        BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
        USE_WS: tl.constexpr, UNPACK: tl.constexpr, SWAP: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr, ORDERED: tl.constexpr = False,
    ):
        """Tensor-core tile for small/medium M: the whole [BK, BN] weight tile is unpacked in
        registers, one dot per K tile, the group scale applied to the [BM, BN] result. UNPACK:
          0: (q - z) via the fp32 2**23 trick, rounded (exactly) to the activation dtype;
          1: the same with SHIFT16 (x scaled by powers of two; bf16 only);
          2: MAGICF + q straight in the 16-bit dtype (two fields per shift and AND|OR), the
             MAGICF + z part removed from the [BM, BN] result with the row sums of x;
          3: as 2 with the tile's K order interleaved so each word's two halves are neighbours
             (x is gathered in the same order).
        SWAP computes the transposed tile (weights on the dot's wide M side, tokens on N)."""
        PACK: tl.constexpr = 32 // BITS
        BKP: tl.constexpr = BK // PACK
        DT: tl.constexpr = x_ptr.dtype.element_ty
        pid_mn, pid_k, _, offs_m, offs_n, m_mask, n_mask = _tile_program(M, N, BM, BN)
        offs_r0 = tl.arange(0, BKP)
        offs_k0 = tl.arange(0, BK)
        HALF: tl.constexpr = PACK // 2
        if UNPACK == 1:  # x is scaled by 2**-(bits * (k % (pack/2))) to undo the unshifted fields
            x_fac = 1.0 / (1 << (BITS * (offs_k0 % HALF))).to(tl.float32)
        if UNPACK == 3:  # tile row kk holds field (kk % PACK) // 2 + HALF * (kk % 2) of word kk // PACK
            offs_kx0 = (offs_k0 // PACK) * PACK + (offs_k0 % PACK) // 2 + HALF * (offs_k0 % 2)
        else:
            offs_kx0 = offs_k0
        if SWAP:
            acc = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        for it in range(0, K_ITERS):
            kt = pid_k * K_ITERS + it
            qw, s, z, offs_r, r_mask = _word_tile(q_ptr, s_ptr, z_ptr, kt, offs_r0, offs_n, n_mask, N, K, PACK, BK,
                                                  GROUP_SIZE)
            if UNPACK >= 2:
                w = _unpack_pairs16(qw, MAGIC2, BITS, DT, UNPACK == 3)
            else:
                f, up = _unpack_minus_zero(qw, z, MAGIC, BITS, UNPACK == 1)
                w = tl.reshape(f.to(DT), (BK, BN))
            offs_k = kt * BK + offs_kx0
            k_mask = offs_k < K
            if SWAP:
                xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None],
                             mask=m_mask[None, :] & k_mask[:, None], other=0.0)
                if UNPACK == 1:
                    xt = (xt.to(tl.float32) * x_fac[:, None]).to(DT)
                part = _dot(tl.trans(w), xt, tl.zeros((BN, BM), dtype=tl.float32), UPCAST)
                if UNPACK >= 2:
                    xsum = tl.sum(xt.to(tl.float32), axis=0)
                    part -= (z + MAGICF)[:, None] * xsum[None, :]
                acc += part * s[:, None]
            else:
                xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                             mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                if UNPACK == 1:
                    xt = (xt.to(tl.float32) * x_fac[None, :]).to(DT)
                part = _dot(xt, w, tl.zeros((BM, BN), dtype=tl.float32), UPCAST)
                if UNPACK >= 2:
                    xsum = tl.sum(xt.to(tl.float32), axis=1)
                    part -= xsum[:, None] * (z + MAGICF)[None, :]
                acc += part * s[None, :]
        if SWAP:
            acc = tl.trans(acc)
        _store_tile(acc, bias_ptr, y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask, N, stride_ym,
                    pid_mn, SPLIT, HAS_BIAS, USE_WS, ORDERED, pid_k, M * N)

# --------------------------------------------------------------------------- configs and dispatch

def _cfg(bm, bn, bk, split_j, warps, stages, waves=0.0, backend="triton", **extra):
    return dict(BM=bm, BN=bn, BK=bk, SPLIT_J=split_j, num_warps=warps, num_stages=stages, waves=waves,
                backend=backend, **extra)


def _gemv(bn, bk, warps, stages=1, waves=4.0, shift16=True, bm=4):
    """CUDA-core GEMV (tiny M); bm = most rows of x per program (M is split into blocks beyond)."""
    return _cfg(bm, bn, bk, False, warps, stages, waves, "gemv", SHIFT16=shift16)


def _pairs(bn, bk, warps, waves=4.0, bm=4):
    """GEMV with packed 16-bit math (4-bit weights, bf16/fp16); bm = most rows of x per program."""
    return _cfg(bm, bn, bk, False, warps, 1, waves, "pairs")


def _tc(bm, bn, bk, warps, stages, waves=0.0, swap=False, unpack=2):
    """Tensor-core tile with the full [BK, BN] weight tile unpacked in registers, one dot per K tile.
    unpack: 0 fp32 trick, 1 fp32 trick + SHIFT16, 2 16-bit magic pairs (see _w4a16_tc_kernel)."""
    return _cfg(bm, bn, bk, False, warps, stages, waves, "tc", SWAP=swap, UNPACK=unpack)


# Tile configs per GPU generation, rows (max M, config), first match wins. 'waves' sets split-K
# (programs ~= SMs * waves). 'gemv' / 'tc' rows only apply without g_idx, with group sizes that are
# a multiple of 16 (or per-channel), and ('tc') bf16/fp16 activations; anything else uses the
# LEGACY rows (split-j kernel for small M, dequant + cuBLAS beyond). 'default' is a safe guess for
# other cards and the interpreter.
W4A16_CONFIGS = {
    # H200 sweep 2026-11-29 (small-M follow-up, benchmarks/RESULTS.md), µs per Llama-3-8B layer:
    # M=1 GEMV 85 (tc 126-137); M=16 tc swap/magic16 128 (split-j 213); M=33 214 and M=64 195 with
    # BM64 tc (dequant + cuBLAS 351; BM32 tiles 690). The tc kernel does the same work for every
    # M <= 16, so 2..16 use it (GEMV with 4 rows measured 173-212 at M=3).
    "sm90": [
        # M <= 4: packed-pairs GEMV, µs per layer (gemv_explore.py): 60-63 at M=1 (fp32-math GEMV 85,
        # tinygemm 70), 95 at M=2, 116-118 at M=3/4 (tc tile 127; tinygemm 73/83/96)
        (4, _pairs(64, 128, 4, waves=8)),
        (16, _tc(16, 64, 128, 4, 3, waves=4, swap=True, unpack=2)),
        (64, _tc(64, 64, 128, 4, 3, waves=2, unpack=2)),
        (1 << 62, _cfg(128, 128, 64, False, 8, 4, backend="dequant")),
    ],
    "default": [
        (4, _pairs(128, 64, 4, waves=4)),
        (64, _tc(16, 64, 64, 4, 2, waves=2)),
        (1 << 62, _cfg(64, 64, 64, False, 4, 2)),
    ],
}

# 8-bit weights (GPTQ int8): twice the bytes of a K tile, no packed-pairs GEMV. sm90 rows: an H100
# sweep of ~35-110 random configs per M (RESULTS.md, thirtieth session), µs per Llama-3-8B layer
# against the 4-bit table's rows: M=1 GEMV 99 (106), M=4 tc 142 (GEMV 195), M=16 146, M=32 196 (216),
# M=64 225 (230), M=128 tc BM128 395 (dequant + cuBLAS 464); from M=256 dequant + cuBLAS stays best.
# Thirty-first session, the table through the launcher (w8_table_check.py): M=2 on the tc row 142, on
# the 4-bit table's (GEMV) row 114. Most 8-bit weights now run the tiled layout (w4a16_tiled,
# TILED8_CONFIGS); this table serves those it refuses (groups that are not 32, 64 or 128·j).
W8A16_CONFIGS = {
    "sm90": [
        (1, _gemv(64, 256, 4, waves=4)),
        (2, _gemv(64, 128, 4, waves=8)),
        (16, _tc(16, 64, 128, 4, 3, waves=4, swap=True, unpack=0)),
        (32, _tc(32, 128, 128, 8, 4, waves=2, unpack=1)),
        (64, _tc(64, 64, 64, 4, 4, waves=2, unpack=0)),
        (128, _tc(128, 128, 64, 8, 4, waves=1, unpack=0)),
        (1 << 62, _cfg(128, 128, 64, False, 8, 4, backend="dequant")),
    ],
    "default": W4A16_CONFIGS["default"],
}

# Where the small-M kernels do not apply (g_idx, odd group sizes, fp32 activations). The sm90 rows
# are the 2026-11-29 H200 sweep (benchmarks/RESULTS.md): split-j Triton for M <= 16, then one
# dequant pass + cuBLAS.
W4A16_LEGACY = {
    "sm90": [
        (16, _cfg(16, 64, 128, True, 4, 4, waves=4)),
        (1 << 62, _cfg(128, 128, 64, False, 8, 4, backend="dequant")),
    ],
    "default": [
        (16, _cfg(16, 64, 128, True, 4, 2, waves=4)),
        (64, _cfg(32, 64, 128, True, 4, 2, waves=2)),
        (1 << 62, _cfg(64, 64, 64, False, 4, 2)),
    ],
}


def _check(x, qweight, scales, zeros, group_size, bits, g_idx):
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    pack = 32 // bits
    M, K = x.shape
    if qweight.dtype != torch.int32 or qweight.shape[0] * pack != K:
        raise ValueError(f"qweight must be int32 [K/{pack}, N] for K={K}, got {tuple(qweight.shape)} {qweight.dtype}")
    if K % group_size or scales.shape != (K // group_size, qweight.shape[1]) or zeros.shape != scales.shape:
        raise ValueError(f"scales/zeros must be [K/group_size, N]: got {tuple(scales.shape)}, {tuple(zeros.shape)}")
    if g_idx is not None and g_idx.shape != (K,):
        raise ValueError("g_idx must be [K]")


# 0x4B000000 (2**23) as a runtime argument: as an immediate, ptxas cannot merge `(w & mask) | 2**23`
# into one LOP3 (one immediate slot); from a register it can.
_MAGIC = 0x4B000000


def _small_m_block_k(cfg, kind, x, K, group_size, num_groups, bits, g_idx):
    """BK for the gemv/tc kernels (one group per K tile), or None where they do not apply."""
    pack = 32 // bits
    if g_idx is not None or (kind == "tc" and x.dtype not in (torch.bfloat16, torch.float16)):
        return None
    bk = cfg["BK"]
    if num_groups > 1:
        while bk > pack and group_size % bk:
            bk //= 2
        if group_size % bk:
            return None
    if bk < (16 if kind == "tc" else pack) or bk % pack:
        return None
    return bk


def _launch_small_m(cfg, x, qweight, scales, zeros, group_size, bits, g_idx, bias, y, dev) -> bool:
    kind = cfg["backend"]
    M, K = x.shape
    N = qweight.shape[1]
    num_groups = scales.shape[0]
    if kind == "pairs" and (bits != 4 or x.dtype not in (torch.bfloat16, torch.float16)):
        kind = "gemv"  # the packed-pairs GEMV is for 4-bit weights and 16-bit activations
    bk = _small_m_block_k(cfg, kind, x, K, group_size, num_groups, bits, g_idx)
    if bk is None:
        return False
    BN = cfg["BN"]
    BM = min(triton.next_power_of_2(M), cfg["BM"] or 4, 4) if kind in ("gemv", "pairs") else cfg["BM"]
    m_blocks, n_blocks = triton.cdiv(M, BM), triton.cdiv(N, BN)
    tiles_mn = m_blocks * n_blocks
    k_tiles = triton.cdiv(K, bk)
    split, k_iters = split_k_for(tiles_mn, k_tiles, num_sms(dev), cfg.get("waves", 0.0))
    use_ws = split > 1
    ws, cnt, order = splitk_buffers(x.device, M * N, tiles_mn, split) if use_ws else (y, y, {})
    args = (x, qweight, scales, zeros, bias if bias is not None else scales, y, ws, cnt,
            M, N, K, x.stride(0), y.stride(0), k_iters, split, _MAGIC)
    common = dict(BITS=bits, GROUP_SIZE=group_size, HAS_BIAS=bias is not None,
                  USE_WS=use_ws, BM=BM, BN=BN, BK=bk, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **order)
    if kind == "pairs":
        if x.stride(0) % 2 or x.storage_offset() % 2:  # viewed as int32 pairs below
            x = x.clone(memory_format=torch.contiguous_format)
        _w4a16_gemv_pairs_kernel[(n_blocks, split, m_blocks)](
            x.view(torch.int32), qweight, scales, zeros, args[4], y, ws, cnt, M, N, K, x.stride(0) // 2, y.stride(0),
            k_iters, split, GROUP_SIZE=group_size, HAS_BIAS=bias is not None, USE_WS=use_ws,
            BM=BM, BN=BN, BK=bk, F16=x.dtype == torch.float16, ASM=packed_math_ok(dev, x.dtype),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **order)
    elif kind == "gemv":
        _w4a16_gemv_kernel[(n_blocks, split, m_blocks)](*args, SHIFT16=cfg.get("SHIFT16", True), **common)
    else:
        unpack = cfg.get("UNPACK", 2)
        if unpack == 1 and x.dtype != torch.bfloat16:  # fp16 x * 2**-12 could go subnormal
            unpack = 0
        if unpack >= 2 and x.dtype == torch.bfloat16 and bits == 8:  # 128 + q is exact only for q < 128
            unpack = 0
        magic2, magicf = (0x43004300, 128.0) if x.dtype == torch.bfloat16 else (0x64006400, 1024.0)
        _w4a16_tc_kernel[(tiles_mn, split)](*args, magic2, magicf, UNPACK=unpack, SWAP=cfg.get("SWAP", False),
                                            UPCAST=interpreting(), **common)
    return True


def w4a16_gemm_triton(x, qweight, scales, zeros, group_size, bits=4, g_idx=None, bias=None, config=None, out=None):
    """The Triton path; `config` overrides the table, `out` receives y (benchmarks, tests)."""
    _check(x, qweight, scales, zeros, group_size, bits, g_idx)
    x = x.contiguous() if x.stride(-1) != 1 else x
    M, K = x.shape
    N = qweight.shape[1]
    dev = device_index(x)
    table = W4A16_CONFIGS if bits == 4 else W8A16_CONFIGS
    cfg = dict(config) if config is not None else pick_config(table, gpu_arch(dev), M)
    y = out if out is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y

    if cfg.get("backend") in ("gemv", "tc", "pairs"):
        if _launch_small_m(cfg, x, qweight, scales, zeros, group_size, bits, g_idx, bias, y, dev):
            return y
        cfg = dict(pick_config(W4A16_LEGACY, gpu_arch(dev), M))  # g_idx, odd groups, fp32: older paths

    if cfg.get("backend") == "dequant":  # large M: one dequant pass, then cuBLAS
        w = torch.empty((K, N), dtype=x.dtype, device=x.device)
        grid = (triton.cdiv(K, 64), triton.cdiv(N, 128))
        _dequant_kernel[grid](qweight, scales, zeros, g_idx if g_idx is not None else qweight, w, N, K,
                              BITS=bits, GROUP_SIZE=group_size, HAS_GIDX=g_idx is not None, BK=64, BN=128,
                              num_warps=4)
        torch.mm(x, w, out=y)
        if bias is not None:
            y += bias.to(y.dtype)
        return y

    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    pack = 32 // bits
    split_j = cfg["SPLIT_J"] and BK // pack >= 16  # tl.dot needs K >= 16 per small dot
    num_groups = scales.shape[0]
    if num_groups == 1:
        scale_mode = 2
    elif g_idx is None and group_size % BK == 0:
        scale_mode = 1
    else:
        scale_mode = 0
    tiles_mn = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    k_tiles = triton.cdiv(K, BK)
    split, k_iters = split_k_for(tiles_mn, k_tiles, num_sms(dev), cfg.get("waves", 0.0))
    ws, cnt, order = splitk_buffers(x.device, M * N, tiles_mn, split) if split > 1 else (y, y, {})
    # Per-element scales put `pack` extra [BK/pack, BN] scale and zero tiles in every pipeline
    # stage; two stages keep that inside shared memory (3 stages of BK=256 needed 272 KB on sm90).
    stages = min(cfg["num_stages"], 2) if scale_mode == 0 else cfg["num_stages"]
    _w4a16_kernel[(tiles_mn, split)](
        x, qweight, scales, zeros, g_idx if g_idx is not None else qweight,
        bias if bias is not None else scales, y, ws, cnt,
        M, N, K, x.stride(0), y.stride(0), k_iters,
        BITS=bits, GROUP_SIZE=group_size, HAS_GIDX=g_idx is not None, HAS_BIAS=bias is not None,
        SCALE_MODE=scale_mode, SPLIT_J=split_j, SPLIT_K=split, BM=BM, BN=BN, BK=BK, UPCAST=interpreting(),
        num_warps=cfg["num_warps"], num_stages=stages, **order,
    )
    return y


def w4a16_gemm(x, qweight, scales, zeros, group_size, bits=4, g_idx=None, bias=None):
    """y = x @ dequant(W)^T (+ bias); x [M, K] fp16/bf16/fp32 -> y [M, N] in x.dtype.

    Triton on CUDA tensors, the torch reference on CPU (FITLLM_KERNEL_BACKEND forces either)."""
    if backend_for(x) == "triton" and triton is not None:
        return w4a16_gemm_triton(x, qweight, scales, zeros, group_size, bits, g_idx, bias)
    return w4a16_gemm_ref(x, qweight, scales, zeros, group_size, bits, g_idx, bias)
