"""FP8 (e4m3) GEMM: y = x @ W^T with W float8_e4m3fn [N, K] and a per-channel [N] or per-tensor
scale, in two modes:
  * w8a8: x is quantized to e4m3 (dynamic per-token scales by default, or a static per-tensor
    input_scale) and the dot runs on FP8 tensor cores (sm89+); y = (xq @ Wq^T) * sx[m] * sw[n].
  * w8a16: W is upcast to x's dtype inside the kernel (exact: every e4m3 value is a bf16/fp16
    value) and the per-channel scale is applied to the output tile; runs anywhere.
Small M splits K over programs (serial reduction, see _utils) and can swap the operands (SWAP:
the weight tile becomes the dot's M side, which the tensor cores want >= 64 wide, and the tokens
the narrow N side). Large M (w8a8) runs a second tensor-core kernel whose tiles arrive by TMA
(_fp8_tma_kernel, "tma" rows: persistent or one program a tile), or could use torch._scaled_mm
("scaled_mm" backend) where that measured faster on the card (benchmarks/bench_gemm.py).
"""

from __future__ import annotations

import os

import torch

from ._utils import (Fp8Activations, backend_for, by_width, config_for, defer_splitk, device_index, gpu_arch,
                     interpreting, max_shared_memory, num_sms, pdl_args, pending_or_y, pick_config, split_k_for,
                     split_waves, splitk_buffers)

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    triton = None

FP8_MAX = 448.0
_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # keeps all-zero rows finite


# --------------------------------------------------------------------------- references

def quantize_fp8_per_token_ref(x: torch.Tensor):
    """x [M, K] -> (x_fp8 [M, K] float8_e4m3fn, scale [M, 1] fp32) with x ~= x_fp8 * scale."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    scale = torch.clamp(amax / FP8_MAX, min=_MIN_SCALE)
    q = torch.clamp(x.float() / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_fp8_static_ref(x: torch.Tensor, scale: torch.Tensor):
    s = scale.float().reshape(1)
    return torch.clamp(x.float() / s, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _codes_of(x, mode: str):
    """(codes, scales) of activations their producer quantized (Fp8Activations; w8a8 only), else None."""
    if not isinstance(x, Fp8Activations):
        return None
    if mode != "w8a8":
        raise ValueError("fp8 GEMM: quantized activations need mode 'w8a8'")
    return x.q, x.scale


def fp8_gemm_ref(x, weight_fp8, weight_scale, input_scale=None, bias=None, mode="w8a8"):
    """x: [M, K] in the activation dtype, or Fp8Activations (w8a8: already quantized)."""
    ws = weight_scale.float().reshape(-1)  # [N] or [1]
    codes = _codes_of(x, mode)
    if mode == "w8a8":
        if codes is not None:
            xq, xs = codes
        elif input_scale is None:
            xq, xs = quantize_fp8_per_token_ref(x)
        else:
            xq, xs = quantize_fp8_static_ref(x, input_scale), input_scale
        y = (xq.float() @ weight_fp8.float().t()) * xs.float().reshape(-1, 1) * ws
    elif mode == "w8a16":
        y = (x.float() @ weight_fp8.to(x.dtype).float().t()) * ws
    else:
        raise ValueError(f"mode must be 'w8a8' or 'w8a16', got {mode!r}")
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# --------------------------------------------------------------------------- Triton kernels

if triton is not None:
    from ._pdl import let_next_launch, pdl_start, prefetch_to_l2, wait_for_previous
    from .w4a16 import _store_tile, _tile_program

    @triton.jit
    def _round_to_e4m3_grid(v):
        # RTNE onto the e4m3 grid in fp32 ((v + c) - c with c = 1.5 * 2**23 * ulp), so the cast
        # after it is exact. Only for the interpreter, whose fp32->fp8 cast loses the carry into
        # the exponent (124.3 -> 64); the GPU's cvt.rn.satfinite is right by itself.
        e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        e = tl.maximum(e, -6)  # below 2**-6 the spacing is fixed (subnormals): 2**-9
        ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
        c = ulp * 12582912.0
        return (v + c) - c

    @triton.jit
    def _token_scale(amax):
        """A token's e4m3 scale from its absolute max (all-zero rows stay finite)."""
        return tl.maximum(amax / 448.0, 1.0 / (448.0 * 512.0))

    @triton.jit
    def _e4m3_values(v, scale, EXACT_ROUND: tl.constexpr):
        """v / scale clamped to e4m3's range, as fp32 values the cast to e4m3 takes exactly where it
        must (EXACT_ROUND: the interpreter)."""
        v = tl.minimum(tl.maximum(v * (1.0 / scale), -448.0), 448.0)
        if EXACT_ROUND:
            v = _round_to_e4m3_grid(v)
        return v

    @triton.jit
    def quantize_row(v, mask, q_ptrs, s_ptr, row, STATIC: tl.constexpr, EXACT_ROUND: tl.constexpr):
        """A whole row v (fp32, already rounded to the activation dtype; masked lanes ignored) to e4m3
        codes at q_ptrs, as _quant_fp8_kernel quantizes it: the producers' epilogue (fused.rms_norm,
        fused.silu_mul). Dynamic: the row's scale is stored at s_ptr + row; STATIC: read at s_ptr."""
        if STATIC:
            scale = tl.load(s_ptr).to(tl.float32)
        else:
            scale = _token_scale(tl.max(tl.where(mask, tl.abs(v), 0.0), axis=0))
            tl.store(s_ptr + row, scale)
        tl.store(q_ptrs, _e4m3_values(v, scale, EXACT_ROUND).to(q_ptrs.dtype.element_ty), mask=mask)

    @triton.jit
    def _quant_fp8_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, STATIC: tl.constexpr, BLOCK: tl.constexpr,
                          EXACT_ROUND: tl.constexpr, PDL: tl.constexpr = False):
        """One program per row. A row that fits one BLOCK is read once and kept in registers; a longer
        one takes an amax pass, then a scale-and-round pass (the row is in L1/L2 by then)."""
        pdl_start(PDL)
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        if BLOCK >= K:
            m = offs < K
            v = tl.load(x_ptr + row * stride_xm + offs, mask=m, other=0.0).to(tl.float32)
            quantize_row(v, m, q_ptr + row * stride_qm + offs, s_ptr, row, STATIC, EXACT_ROUND)
            return
        if STATIC:
            scale = tl.load(s_ptr).to(tl.float32)
        else:
            amax = tl.zeros((BLOCK,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                v = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(v))
            scale = _token_scale(tl.max(amax, axis=0))
            tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            m = k0 + offs < K
            v = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=m, other=0.0).to(tl.float32)
            tl.store(q_ptr + row * stride_qm + k0 + offs, _e4m3_values(v, scale, EXACT_ROUND).to(q_ptr.dtype.element_ty),
                     mask=m)

    @triton.jit(do_not_specialize=["M"])  # else M % 16 == 0 compiles again, mid-serving
    def _fp8_kernel(
        x_ptr, xs_ptr, w_ptr, wsc_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
        M, N, K, stride_xm, stride_wn, stride_ym, K_ITERS,
        W8A8: tl.constexpr, XS_PER_ROW: tl.constexpr, WS_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
        SWAP: tl.constexpr, SPLIT_K: tl.constexpr, UPCAST: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = False,
        ORDERED: tl.constexpr = False, DEFER: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
    ):
        """y = x W^T on the tensor cores (SWAP: as (W x^T)^T, for small M); program (mn, k) owns a
        BM x BN tile and K_ITERS K tiles of BK. PREFETCH: asks L2 for its first PREFETCH weight tiles
        before the PDL wait (weights: _pdl.py's rule), so the pipeline's first loads hit L2."""
        pid_mn, pid_k, _, offs_m, offs_n, m_mask, n_mask = _tile_program(M, N, BM, BN)
        if SWAP:
            acc = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        if PREFETCH:
            lines = (pid_k * K_ITERS * BK + tl.arange(0, PREFETCH * BK // 128) * 128)[None, :]
            prefetch_to_l2(w_ptr + offs_n[:, None] * stride_wn + lines, n_mask[:, None] & (lines < K))
        wait_for_previous(PDL)
        for it in range(0, K_ITERS):
            offs_k = (pid_k * K_ITERS + it) * BK + tl.arange(0, BK)
            k_mask = offs_k < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            if not W8A8:
                w = w.to(x.dtype)
            if UPCAST:  # interpreter: no fp8/bf16 matmul there, same function in fp32
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            if SWAP:
                acc = tl.dot(w, tl.trans(x), acc)
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        let_next_launch(PDL)
        if SWAP:
            acc = tl.trans(acc)
        acc = _scaled(acc, xs_ptr, wsc_ptr, offs_m, offs_n, m_mask, n_mask, W8A8, XS_PER_ROW, WS_PER_CHANNEL)
        _store_tile(acc, bias_ptr, y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask, N, stride_ym,
                    pid_mn, SPLIT_K, HAS_BIAS, SPLIT_K > 1, ORDERED, pid_k, M * N, DEFER)

    @triton.jit
    def _scaled(acc, xs_ptr, wsc_ptr, offs_m, offs_n, m_mask, n_mask, W8A8: tl.constexpr, XS_PER_ROW: tl.constexpr,
                WS_PER_CHANNEL: tl.constexpr):
        """An output tile of codes' dot products times the weight scales (and, W8A8, the token scales)."""
        if WS_PER_CHANNEL:
            acc = acc * tl.load(wsc_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        else:
            acc = acc * tl.load(wsc_ptr)
        if W8A8:
            if XS_PER_ROW:
                acc = acc * tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
            else:
                acc = acc * tl.load(xs_ptr)
        return acc

    @triton.jit
    def _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
        """(pid_m, pid_n) of output tile number `tile`: GROUP_M row tiles walk the N tiles together, so
        the programs running at once share their x rows and weight tiles in L2."""
        width = GROUP_M * num_pid_n
        first_m = (tile // width) * GROUP_M
        rows = tl.minimum(num_pid_m - first_m, GROUP_M)
        return first_m + (tile % width) % rows, (tile % width) // rows

    @triton.jit(do_not_specialize=["M", "PROGRAMS"])  # both follow M: one compiled kernel for every M
    def _fp8_tma_kernel(
        x_desc, w_desc, xs_ptr, wsc_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, stride_ym, K_ITERS, PROGRAMS,
        XS_PER_ROW: tl.constexpr, WS_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
        SWAP: tl.constexpr, SPLIT_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPEC: tl.constexpr,
        PDL: tl.constexpr = False, ORDERED: tl.constexpr = False, DEFER: tl.constexpr = False,
    ):
        """_fp8_kernel's function (w8a8) with TMA loads: the copy engine moves whole tiles, no address
        math or masks in the main loop (tiles past the tensor's edge read zeros). Program (p, k) walks
        output tiles p, p + PROGRAMS, ... (persistent when PROGRAMS is about the SM count; FLATTEN lets
        the pipeline run on into the next tile's loads while this one's epilogue runs) over its
        K_ITERS K tiles. The descriptors come from the host (encoded at launch, by value in CUDA
        graphs): made on the device instead, they cut the host's launch time from 124 to 77 µs but cost
        the GPU 1-15 % a linear (H200, sixteenth session)."""
        pid_k = tl.program_id(1)
        num_pid_m = tl.cdiv(M, BM)
        num_pid_n = tl.cdiv(N, BN)
        wait_for_previous(PDL)
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, PROGRAMS, flatten=FLATTEN,
                             warp_specialize=WARP_SPEC):
            pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
            if SWAP:
                acc = tl.zeros((BN, BM), dtype=tl.float32)
            else:
                acc = tl.zeros((BM, BN), dtype=tl.float32)
            for it in range(K_ITERS):
                k = (pid_k * K_ITERS + it) * BK
                x = x_desc.load([pid_m * BM, k])
                w = w_desc.load([pid_n * BN, k])
                if UPCAST:
                    x = x.to(tl.float32)
                    w = w.to(tl.float32)
                if SWAP:
                    acc = tl.dot(w, x.T, acc)
                else:
                    acc = tl.dot(x, w.T, acc)
            if SWAP:
                acc = tl.trans(acc)
            offs_m = pid_m * BM + tl.arange(0, BM)
            offs_n = pid_n * BN + tl.arange(0, BN)
            m_mask = offs_m < M
            n_mask = offs_n < N
            acc = _scaled(acc, xs_ptr, wsc_ptr, offs_m, offs_n, m_mask, n_mask, True, XS_PER_ROW, WS_PER_CHANNEL)
            _store_tile(acc, bias_ptr, y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask, N, stride_ym,
                        tile, SPLIT_K, HAS_BIAS, SPLIT_K > 1, ORDERED, pid_k, M * N, DEFER)
        let_next_launch(PDL)

    @triton.jit
    def _fp8_gemv_weights(w_ptr, offs_n, n_mask, kt, K, stride_wn, BK: tl.constexpr):
        offs_k = kt * BK + tl.arange(0, BK)
        return tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                       mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)

    @triton.jit
    def _fp8_gemv_step(acc, w, x_ptr, kt, K, BK: tl.constexpr):
        offs_k = kt * BK + tl.arange(0, BK)
        x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        return acc + w.to(tl.float32) * x[None, :]

    @triton.jit
    def _fp8_gemv_kernel(
        x_ptr, xs_ptr, w_ptr, wsc_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr, N, K, stride_wn, K_ITERS, SPLIT,
        W8A8: tl.constexpr, WS_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, USE_WS: tl.constexpr,
        BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = False, ORDERED: tl.constexpr = False,
        DEFER: tl.constexpr = False, EARLY_W: tl.constexpr = 0,
    ):
        """Batch-1 GEMV on CUDA cores: program (n, k) owns BN weight rows and K_ITERS tiles of BK.
        Products of e4m3 values (and of an e4m3 and a bf16) are exact in fp32, so this computes the
        tensor-core kernel's function; at M=1 the dot's tile would be 1/16 full, and this reads the
        weights at full width instead. EARLY_W: the first tile's weights are loaded before the PDL
        wait (_pdl.py: +1 % fp8 batch-1 decode on the H200; the same in the int4 GEMV lost 1.4 %)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_mask = offs_n < N
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        first = 0
        if EARLY_W:
            w = _fp8_gemv_weights(w_ptr, offs_n, n_mask, pid_k * K_ITERS, K, stride_wn, BK)
        wait_for_previous(PDL)
        if EARLY_W:
            acc = _fp8_gemv_step(acc, w, x_ptr, pid_k * K_ITERS, K, BK)
            first = 1
        for it in range(first, K_ITERS):
            w = _fp8_gemv_weights(w_ptr, offs_n, n_mask, pid_k * K_ITERS + it, K, stride_wn, BK)
            acc = _fp8_gemv_step(acc, w, x_ptr, pid_k * K_ITERS + it, K, BK)
        let_next_launch(PDL)
        out = tl.sum(acc, axis=1)
        if WS_PER_CHANNEL:
            out = out * tl.load(wsc_ptr + offs_n, mask=n_mask, other=0.0)
        else:
            out = out * tl.load(wsc_ptr)
        if W8A8:
            out = out * tl.load(xs_ptr)
        offs_m = tl.arange(0, 1)
        _store_tile(out[None, :], bias_ptr, y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, offs_m < 1, n_mask, N, N,
                    pid_n, SPLIT, HAS_BIAS, USE_WS, ORDERED, pid_k, N, DEFER)


def quantize_fp8_per_token(x: torch.Tensor):
    """Dynamic per-token e4m3 quantization: (x_fp8 [M, K], scale [M, 1] fp32). Triton on CUDA."""
    if backend_for(x) != "triton" or triton is None:
        return quantize_fp8_per_token_ref(x)
    return _quantize_triton(x, None)


def _quantize_triton(x, static_scale):
    x = x if x.stride(-1) == 1 else x.contiguous()
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    if static_scale is None:
        s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    else:
        s = static_scale.float().reshape(1)
    # A row of up to 16384 values is read once, in registers (H200, µs a launch, against the
    # two-pass loop over 4096-wide blocks: K = 4096 M = 1 / 64 / 4096 1.51 / 1.70 / 14.7 -> 1.22 /
    # 1.44 / 14.1; K = 14336 2.90 / 2.96 / 49.8 -> 2.08 / 2.22 / 46.1 on 16 warps; RESULTS.md,
    # twenty-fifth session).
    block = min(triton.next_power_of_2(K), 16384)
    if M:
        _quant_fp8_kernel[(M,)](x, q, s, K, x.stride(0), q.stride(0), STATIC=static_scale is not None, BLOCK=block,
                                EXACT_ROUND=interpreting(), num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16,
                                **pdl_args(x))
    return q, s


# --------------------------------------------------------------------------- configs and dispatch

def _cfg(bm, bn, bk, warps, stages, waves=0.0, swap=False, backend="triton", deep=None):
    """A config of the pointer tensor-core kernel (or, backend="gemv", the GEMV); deep=(min_k, waves):
    the split-K waves for K >= min_k (_utils.split_waves; down_proj shares o_proj's width but has 3.5x
    its K)."""
    cfg = dict(BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages, waves=waves, SWAP=swap, backend=backend)
    return dict(cfg, deep=deep) if deep else cfg


def _tma_cfg(bm, bn, bk, warps, stages, waves=0.0, swap=False, persistent=True, group_m=8, flatten=True,
             warp_spec=False):
    """A config of the TMA kernel (w8a8; w8a16 runs it on the pointer kernel): persistent = one program
    an SM walking the tiles, else one program a tile (and split-K where waves ask for it); group_m:
    row tiles that walk the N tiles together (_grouped_tile)."""
    return dict(_cfg(bm, bn, bk, warps, stages, waves, swap, backend="tma"), persistent=persistent and not waves,
                group_m=group_m, flatten=flatten, warp_spec=warp_spec)


def shared_memory_need(cfg: dict, x_bytes: int) -> int:
    """Bytes of shared memory _fp8_kernel takes with `cfg`: its pipeline holds num_stages x and weight
    tiles; with 16-bit x (w8a16) the upcast weight tile takes up to one more BN x BK bytes (Triton's
    own figure for sm_90, compiled offline: exact for w8a8, an upper bound for w8a16). The TMA kernel
    (w8a8) adds its barriers and, flattened, 2 x BM x BK bytes (the same, for a tma config on the
    pointer kernel's fallback: an upper bound)."""
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    need = cfg["num_stages"] * bk * (bm * x_bytes + bn) + (bn * bk if x_bytes == 2 else 0)
    if cfg.get("backend") == "tma" and x_bytes == 1:
        need += 64 + (2 * bm * bk if cfg["flatten"] else 0)
    return need


def _fit_shared_memory(cfg: dict, x_bytes: int, limit: int | None) -> dict:
    """cfg with fewer pipeline stages where its tiles would not fit `limit` bytes: the sm90 rows are
    tuned for w8a8, and w8a16 holds x in 16 bits (at 4-6 stages some rows need 240-340 KB of 227)."""
    stages = cfg["num_stages"]
    while limit is not None and stages > 1 and shared_memory_need(dict(cfg, num_stages=stages), x_bytes) > limit:
        stages -= 1
    return cfg if stages == cfg["num_stages"] else dict(cfg, num_stages=stages)


def _prefetching(row: dict, tiles: int = 2) -> dict:
    """A table row (and its per-width configs) whose tensor-core kernel asks L2 for its first `tiles`
    weight tiles before the PDL wait (_fp8_kernel's PREFETCH)."""
    by_n = tuple((lo, hi, dict(c, prefetch=tiles) if c["backend"] == "triton" else c)
                 for lo, hi, c in row.get("by_n", ()))
    return dict(row, prefetch=tiles, **({"by_n": by_n} if by_n else {}))


# Rows (max M, config), first match wins; a row may pick per weight width (_utils.by_width). sm90: H200
# sweeps, each Llama-3-8B linear alone, its input already quantized (benchmarks/fp8_sweep.py --more,
# RESULTS.md 2026-12-03 fourteenth session), µs: M=16 qkv/o/down BN64 BK256 6 stages one split
# 8.3/8.5/18.7, gate_up BN128 BK128 31.0 (layer 66.5; the old single row 79.2); M=64 o/down BN32
# 8.1/23.0, qkv BN64 5 stages 9.2, gate_up BN128 BK128 33.3 (73.6, was 104.8); M=256 o/down BM64 BN128
# BK256 10.9/30.4, qkv BM128 BN128 14.4, gate_up BN256 57.1 (112.8, was 137.7; _scaled_mm 122.1);
# M=1024 qkv BN128 44.9 against 52.6 with BN256, whose 192 tiles fill 1.45 waves (340.1, was 387.5);
# M=4096 BN256 everywhere. Fifteenth session: up to M = 64 the kernel asks L2 for its first two
# weight tiles before the PDL wait (one layer's linears in a graph, A/B in the same graph, three runs:
# M = 16 74 -> 72, 73 -> 71, 71 vs 73 with 1 or 4 tiles; M = 64 78 -> 76, 77 -> 76; fp8 batch-1
# decode +0.5 %). Not at M = 256 (that A/B favoured whichever column came second) nor M >= 1024
# (387 -> 391, 1501 -> 1518). Sixteenth session: from M = 65 on, the TMA kernel for the wide gate_up,
# and for every linear from M = 257 on (fp8_sweep.py --only-tma, µs, pointer row -> TMA): M = 256
# gate_up 56.8 -> 50.2; M = 1024 qkv 44.7 -> 41.4, o 25.8 -> 25.6, gate_up 197.1 -> 169.5-173.9, down
# 87.6 -> 83.9-85.3 (layer 355 -> 320, _scaled_mm 349); M = 4096 one program a tile beat persistent:
# qkv 170.7 -> 150.2, o 113.2 -> 104.9, gate_up 791.2 -> 698.0, down 366.0 -> 352.2 (layer 1441 -> 1305,
# _scaled_mm 1477). Twenty-sixth session: at M = 257..640 the BM128 BN256 tiles of N = 4096 number 48-80,
# half the SMs idle (fp8_sweep.py --m 384,512,768 --only-tma, µs, qkv / o / gate_up / down): M = 384 table
# 25.9 / 23.0 / 77.8 / 74.3 (201.0, _scaled_mm 170.0) -> BM64 BN256 4 warps for N <= 4096 14.1 / 43.4
# (161.2); M = 512 26.5 / 23.9 / 106.5 / 81.7 (238.7, _scaled_mm 193.9) -> qkv BM128 BN256 24.2, the others
# BM64 BN256 14.7 / 101.8 / 46.0 (186.7). From M = 768 the old row holds (its tiles fill the SMs).
# Thirty-fifth session, after the split-K ticket's read-back stopped fencing every 16 bytes: down_proj at M
# = 64 splits in two (`deep`; H200 20.7 vs 22.8 µs, H100 25.1-25.6 vs 26.0); o_proj, as wide but 3.5x
# shallower, loses with it (H200 9.1 vs 7.9), and so does down_proj at M = 256 (H100 44.9 vs 31.7; at M =
# 1024 a split BM64 TMA tile 94.3 vs 80.3).
_TMA_WIDE = _tma_cfg(128, 256, 128, 8, 4)
_TMA_NARROW = _tma_cfg(64, 256, 128, 4, 4)
_INF = 1 << 62
FP8_CONFIGS = {
    "sm90": [
        # M=1: the CUDA-core GEMV up to N=16384 (qkv 11.3 vs 16.6 µs, down 23.4 vs 24.8), swap-AB
        # tensor cores for the wide gate_up (33.8 vs 37.2); second session's gemv_explore.
        (1, _prefetching(by_width(_cfg(16, 64, 256, 4, 4, waves=4, swap=True),
                                  (0, 16384, _cfg(1, 16, 512, 8, 1, waves=4, backend="gemv"))))),
        (16, _prefetching(by_width(_cfg(16, 64, 256, 4, 6, waves=1, swap=True),
                                   (16384, _INF, _cfg(16, 128, 128, 4, 4, waves=2, swap=True))))),
        (64, _prefetching(by_width(_cfg(64, 32, 256, 4, 4, waves=1, deep=(8192, 2)),
                                   (4096, 16384, _cfg(64, 64, 256, 4, 5, waves=1)),
                                   (16384, _INF, _cfg(64, 128, 128, 4, 4, waves=1))))),
        (256, by_width(_cfg(64, 128, 256, 4, 4), (4096, 16384, _cfg(128, 128, 128, 8, 5)), (16384, _INF, _TMA_WIDE))),
        (384, by_width(_TMA_WIDE, (0, 4096, _TMA_NARROW))),
        (640, by_width(_TMA_NARROW, (4096, 16384, _TMA_WIDE))),
        (2048, by_width(_TMA_WIDE, (4096, 16384, _TMA_NARROW))),
        (_INF, _tma_cfg(128, 256, 128, 8, 4, persistent=False)),
    ],
    "default": [
        (16, _cfg(16, 64, 128, 4, 2, waves=4)),
        (64, _cfg(32, 64, 128, 4, 2, waves=2)),
        (_INF, _cfg(64, 64, 64, 4, 2)),
    ],
}


def fp8_gemm_triton(x, weight_fp8, weight_scale, input_scale=None, bias=None, mode="w8a8", config=None, x_quant=None,
                     out=None, defer=False):
    """Triton path. x_quant=(x_fp8, scale), or x given as Fp8Activations, skips the activation
    quantization; config, out, defer: as w4a16_tiled_triton."""
    if mode not in ("w8a8", "w8a16"):
        raise ValueError(f"mode must be 'w8a8' or 'w8a16', got {mode!r}")
    dtype, codes = x.dtype, _codes_of(x, mode)
    if codes is not None:
        x_quant, x = codes, x.q
    M, K = x.shape
    N = weight_fp8.shape[0]
    if weight_fp8.shape[1] != K:
        raise ValueError(f"weight must be [N, K={K}], got {tuple(weight_fp8.shape)}")
    dev = device_index(x)
    cfg = config_for(dict(config) if config is not None else pick_config(FP8_CONFIGS, gpu_arch(dev), M), N)
    y = out if out is not None else torch.empty((M, N), dtype=dtype, device=x.device)
    if M == 0:
        return y
    wsc = weight_scale.float().reshape(-1)
    if mode == "w8a8":
        xq, xs = x_quant if x_quant is not None else _quantize_triton(x, input_scale)
    else:
        xq, xs = (x if x.stride(-1) == 1 else x.contiguous()), wsc

    if mode == "w8a8" and cfg.get("backend") == "scaled_mm":  # cuBLASLt FP8 for large M
        sa = xs.reshape(-1, 1).expand(M, 1).contiguous() if xs.numel() > 1 else xs.reshape(1, 1).expand(M, 1).contiguous()
        sb = wsc.reshape(1, -1).expand(1, N).contiguous()
        r = torch._scaled_mm(xq, weight_fp8.t(), scale_a=sa, scale_b=sb, out_dtype=dtype,
                             bias=bias.to(dtype) if bias is not None else None)
        if out is not None:
            out.copy_(r)
            return out
        return r

    defer = defer_splitk(defer, out, bias)
    if cfg.get("backend") == "gemv":
        if M == 1:
            return _fp8_gemv(cfg, xq, xs, weight_fp8, wsc, bias, y, mode, dev, defer)
        cfg = _cfg(16, 64, 128, 4, 2, waves=4)  # a GEMV config given for M > 1: tensor cores

    cfg = _fit_shared_memory(cfg, xq.element_size(), max_shared_memory(dev))
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    tiles_mn = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    k_tiles = triton.cdiv(K, BK)
    split, k_iters = split_k_for(tiles_mn, k_tiles, num_sms(dev), split_waves(cfg, N, K))
    ws, cnt, order = splitk_buffers(x.device, M * N, tiles_mn, split) if split > 1 else (y, y, {})
    defer = defer and split > 1
    pdl = pdl_args(x)
    common = dict(XS_PER_ROW=xs.numel() > 1, WS_PER_CHANNEL=wsc.numel() > 1, HAS_BIAS=bias is not None,
                  SWAP=cfg.get("SWAP", False), SPLIT_K=split, UPCAST=interpreting(), BM=BM, BN=BN, BK=BK, DEFER=defer,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl, **order)
    bias_or_any = bias if bias is not None else wsc
    if mode == "w8a8" and cfg["backend"] == "tma" and _tma_ok(xq, weight_fp8) and _tma_pays(M, xq):
        programs = min(tiles_mn, num_sms(dev)) if cfg["persistent"] else tiles_mn
        _fp8_tma_kernel[(programs, split)](
            TensorDescriptor.from_tensor(xq, [BM, BK]), TensorDescriptor.from_tensor(weight_fp8, [BN, BK]),
            xs, wsc, bias_or_any, y, ws, cnt, M, N, y.stride(0), k_iters, programs, GROUP_M=cfg["group_m"],
            FLATTEN=cfg["flatten"], WARP_SPEC=cfg["warp_spec"], **common)
    else:
        _fp8_kernel[(tiles_mn, split)](
            xq, xs, weight_fp8, wsc, bias_or_any, y, ws, cnt, M, N, K, xq.stride(0), weight_fp8.stride(0), y.stride(0),
            k_iters, W8A8=mode == "w8a8", **common, **_prefetch(pdl, cfg))
    return pending_or_y(y, ws, defer)


def _tma_ok(*ts: torch.Tensor) -> bool:
    """What a TMA descriptor needs of a 2-D tensor: rows of unit stride, 16-byte aligned base and row pitch."""
    return all(t.stride(1) == 1 and t.stride(0) * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0 for t in ts)


# Encoding the two descriptors at launch costs the host 20-40 µs more than a pointer-kernel launch (H200
# box, sixteenth session: 124 vs 104, 108 vs 68 µs a call). A CUDA graph pays it once, at capture; an
# eager step of fewer tokens than this is bound by the host's launches anyway (32 layers x 4 GEMMs), so
# it keeps the pointer kernel, same tiles.
TMA_EAGER_MIN_M = 1024


def _tma_pays(M: int, x: torch.Tensor) -> bool:
    """Whether a TMA row launches the TMA kernel: in CUDA graphs, eager from TMA_EAGER_MIN_M tokens,
    always under the interpreter; never with FITLLM_FP8_TMA=0 (A/B runs: the pointer kernel, same tiles)."""
    if os.environ.get("FITLLM_FP8_TMA", "1") == "0":
        return False
    return not x.is_cuda or M >= TMA_EAGER_MIN_M or torch.cuda.is_current_stream_capturing()


def _prefetch(pdl: dict, cfg: dict) -> dict:
    """How many weight tiles the tensor-core kernel asks L2 for before the PDL wait: the config's
    `prefetch` (the sm90 rows up to M = 64), or FITLLM_FP8_PREFETCH=N (A/B runs; 0 turns it off)."""
    n = int(os.environ.get("FITLLM_FP8_PREFETCH", cfg.get("prefetch", 0)))
    return {"PREFETCH": n} if pdl and n else {}


def _early_weights(pdl: dict) -> dict:
    """The batch-1 GEMV loads its first weight tile before the PDL wait (EARLY_W; _pdl.py says why
    that is safe, and where it lost): under PDL, unless FITLLM_EARLY_WEIGHTS=0 (A/B runs)."""
    return {"EARLY_W": 1} if pdl and os.environ.get("FITLLM_EARLY_WEIGHTS", "1") != "0" else {}


def _fp8_gemv(cfg, xq, xs, weight_fp8, wsc, bias, y, mode, dev, defer=False):
    N, K = weight_fp8.shape
    BN, BK = cfg["BN"], cfg["BK"]
    n_blocks, k_tiles = triton.cdiv(N, BN), triton.cdiv(K, BK)
    split, k_iters = split_k_for(n_blocks, k_tiles, num_sms(dev), split_waves(cfg, N, K))
    ws, cnt, order = splitk_buffers(y.device, N, n_blocks, split) if split > 1 else (y, y, {})
    defer = defer and split > 1
    pdl = pdl_args(y)
    _fp8_gemv_kernel[(n_blocks, split)](
        xq, xs, weight_fp8, wsc, bias if bias is not None else wsc, y, ws, cnt, N, K, weight_fp8.stride(0), k_iters, split,
        W8A8=mode == "w8a8", WS_PER_CHANNEL=wsc.numel() > 1, HAS_BIAS=bias is not None, USE_WS=split > 1,
        BN=BN, BK=BK, DEFER=defer, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl,
        **_early_weights(pdl), **order)
    return pending_or_y(y, ws, defer)


def fp8_gemm(x, weight_fp8, weight_scale, input_scale=None, bias=None, mode="w8a8", defer=False):
    """y = x @ (W * scale)^T (+ bias) with e4m3 weights; mode 'w8a8' (sm89+) or 'w8a16' (any card).
    x: [M, K] in the activation dtype, or (w8a8) Fp8Activations its producer quantized.

    Triton on CUDA tensors, the torch reference on CPU (FITLLM_KERNEL_BACKEND forces either).
    defer: may return a PendingSum instead of y (a split-K launch on the Triton path)."""
    if backend_for(x.q if isinstance(x, Fp8Activations) else x) == "triton" and triton is not None:
        return fp8_gemm_triton(x, weight_fp8, weight_scale, input_scale, bias, mode, defer=defer)
    return fp8_gemm_ref(x, weight_fp8, weight_scale, input_scale, bias, mode)
