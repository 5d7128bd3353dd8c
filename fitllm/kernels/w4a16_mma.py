"""Small-M W4A16 on the tensor cores with mma.sync, written in Gluon (Triton's layout-explicit dialect).

For 1..16 rows of x the weights are the MMA's A operand (y^T = W x^T) and x is B, 8 or 16 columns
wide, so one m16n8k16 instruction does the math of 256 weights for every row of x at once; rows of
x past M are zero lanes. The weights come in the tiled layout of fitllm.kernels.w4a16_tiled, built
so that the 16 bytes one thread loads are, once unpacked, exactly its registers of the A fragment.
Triton (tl.dot) picks the warpgroup MMA on sm90, which needs x in shared memory and a barrier every
K tile; here Gluon pins every layout, so a K tile is, per thread: two 16-byte loads of words per 16
weight rows, one 4-byte load per x pair, the unpack (3 shifts, 4 LOP3, 4 packed FMAs per word), one
HMMA per word and a scale per row. Offline SASS (sm_90): 20-24 instructions per 8-weight word in the
main loop, against about 29 for the CUDA-core GEMV of w4a16_tiled.

Measured on the H200 (benchmarks/RESULTS.md, seventh session) it does not beat the table, so no
table row picks it; configs name it with backend "mma" (benchmarks/bench_w4_tiled.py sweeps it):
M = 1 60.0 µs per Llama-3-8B layer against the GEMV's 57.3 (fewer instructions did not buy time:
the GEMV is bound by its loads in flight, not by issue), M = 2..16 slower still, 77-142 µs,
because every lane with a row of x makes 16 scattered 4-byte x loads per K tile (at M = 8 all 32).

Gluon has no interpreter: on CPU, w4a16_tiled's reference is the path and the oracle (a config
naming this kernel falls back to the Triton kernels there); tests compile it for sm_90 and check
its code (HMMA in the main loop, no shared memory, PDL order), and bench_w4_tiled.py checks its
results on the GPU against float64. Gluon calls the Triton helpers that need no layout (the PDL
wait and release, w4a16_tiled's unpack FMA and zero pairs); the split-K epilogue repeats
w4a16._store_tile in Gluon because that one builds a tensor (tl.zeros) without a layout.
"""

from __future__ import annotations

import math

import torch

from ._utils import device_index, interpreting, num_sms, pdl_args, split_k_for, splitk_workspace

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.runtime.jit import constexpr_function
except ImportError:  # CPU-only installs, or a triton without Gluon: the callers keep the other paths
    gluon = None


def _x_layout(bm: int, warps: int, smem: bool, b_operand):
    """Where x's tile [128, bm] is loaded: straight into the B operand, or (X_SMEM) whole by every
    warp, 8 neighbouring k (16 bytes) per lane and load, for a move into B through shared memory."""
    if not smem:
        return b_operand
    return gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0], [4, 0]] + [[0, 2 << i] for i in range(int(math.log2(bm)) - 1)],
        lane_bases=[[8, 0], [16, 0], [32, 0], [64, 0], [0, 1]],
        warp_bases=[[0, 0]] * int(math.log2(warps)), block_bases=[], shape=[128, bm])


def _word_layout(bn: int, warps: int):
    """Where the words [bn, 16] of one K tile live: the MMA (v2, warps stacked along the weight
    rows) gives warp w rows 16 w + g (+ 8) of every 16·warps-row block, g = lane // 4, and k pairs
    2c, 2c + 1 (+ 8) of every 16 k, c = lane % 4. In the tiled layout position p = 4 c + t holds
    word c + 4 t, whose field f holds k = 32 f + 8 t + 2 c (+ 1): so a thread takes positions
    4c .. 4c + 3 (one 16-byte load) of rows 16 w + g and 16 w + g + 8, and unpacked they are its A
    registers."""
    rep = bn // (16 * warps)
    assert rep >= 1 and rep & (rep - 1) == 0 and warps & (warps - 1) == 0, (bn, warps)
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]] + [[16 * warps << i, 0] for i in range(int(math.log2(rep)))],
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16 << i, 0] for i in range(int(math.log2(warps)))],
        block_bases=[], shape=[bn, 16])


if gluon is not None:
    from ._pdl import let_next_launch, wait_for_previous
    from .w4a16_tiled import _magic2, _minus_magic_zero, _pair16

    word_layout = constexpr_function(_word_layout)  # called by the kernel at compile time
    x_layout = constexpr_function(_x_layout)

    @gluon.jit
    def _fields(qw, f: gl.constexpr, nz, MAGIC2, F16: gl.constexpr):
        """Fields f and f + 4 of every word as (q - z) in 16-bit floats: [BN, 16, 2] (last: h)."""
        lo, hi = _minus_magic_zero(((qw >> (4 * f)) & 0x000F000F) | MAGIC2, nz, F16)
        return gl.join(lo, hi)

    @gluon.jit
    def _a_operand(qw, nz, MAGIC2, A_L: gl.constexpr, F16: gl.constexpr):
        """Words [BN, 16] -> the A operand [BN, 128] (column = k within the tile), no data movement:
        the join / reshape / permute only rename registers (convert_layout asserts it)."""
        BN: gl.constexpr = qw.shape[0]
        t = gl.join(gl.join(_fields(qw, 0, nz, MAGIC2, F16), _fields(qw, 1, nz, MAGIC2, F16)),
                    gl.join(_fields(qw, 2, nz, MAGIC2, F16), _fields(qw, 3, nz, MAGIC2, F16)))
        t = gl.reshape(t, [BN, 4, 4, 2, 2, 2])  # [n, c, t, h, f % 2, f // 2]
        t = gl.permute(t, [0, 5, 4, 2, 1, 3])  # k = 64 (f // 2) + 32 (f % 2) + 8 t + 2 c + h
        return gl.convert_layout(gl.reshape(t, [BN, 128]), A_L, assert_trivial=True)

    @gluon.jit
    def _tile_loads(q_ptrs, z_ptr, s_ptr, x_ptrs, kt, wn, an, wn_mask, an_mask, x_row_ok, bk, N, K, NUM_GROUPS,
                    GROUP_SIZE: gl.constexpr, ok):
        """K tile kt's words [BN, 16], zeros (word layout) and scales (accumulator layout) of its group,
        and x [128, BM] (zeros past K, past M, and everything where not `ok`)."""
        qw = gl.load(q_ptrs + kt * 16, mask=wn_mask[:, None] & ok, other=0)
        g = gl.minimum((kt * 128) // GROUP_SIZE, NUM_GROUPS - 1)
        z = gl.load(z_ptr + g * N + wn, mask=wn_mask & ok, other=0.0).to(gl.float32)
        s = gl.load(s_ptr + g * N + an, mask=an_mask & ok, other=0.0).to(gl.float32)
        xt = gl.load(x_ptrs + kt * 128, mask=x_row_ok & ((kt * 128 + bk) < K)[:, None] & ok, other=0.0)
        return qw, z, s, xt

    @gluon.jit
    def _tile_mma(acc, qw, z, s, xt, MAGIC2, A_L: gl.constexpr, B_L: gl.constexpr, F16: gl.constexpr):
        """acc [BN, BM] += (W tile @ x tile^T) * s, the tile's sum in fp32 from one MMA chain. (x is
        already in B_L unless X_SMEM: then the conversion goes through shared memory.)"""
        MAGICF: gl.constexpr = 1024.0 if F16 else 128.0
        DT: gl.constexpr = gl.float16 if F16 else gl.bfloat16
        nz = gl.broadcast(_pair16(-(z + MAGICF), DT), qw)[0]
        part = mma_v2(_a_operand(qw, nz, MAGIC2, A_L, F16), gl.convert_layout(xt, B_L), gl.zeros_like(acc))
        return acc + part * s[:, None]

    @gluon.jit
    def _store(acc, bias_ptr, y_ptr, ws_ptr, cnt_ptr, offs_n, offs_m, n_mask, m_mask, N, stride_ym, tile_id,
               split, HAS_BIAS: gl.constexpr, USE_WS: gl.constexpr):
        """y[m, n] = acc[n, m] (+ bias); split-K through the fp32 workspace as _utils describes."""
        mask = n_mask[:, None] & m_mask[None, :]
        y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
        if not USE_WS:
            if HAS_BIAS:
                acc += gl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(gl.float32)[:, None]
            gl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            ws_ptrs = ws_ptr + offs_m[None, :] * N + offs_n[:, None]
            gl.atomic_add(ws_ptrs, acc, mask=mask, sem="relaxed")
            gl.thread_barrier()
            arrived = gl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel")
            if arrived == split - 1:
                zero = gl.zeros_like(acc)
                total = gl.atomic_add(ws_ptrs, zero, mask=mask)
                gl.store(ws_ptrs, zero, mask=mask)
                gl.atomic_xchg(cnt_ptr + tile_id, 0)
                if HAS_BIAS:
                    total += gl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(gl.float32)[:, None]
                gl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)

    @gluon.jit(do_not_specialize=["M"])
    def _w4a16_mma_kernel(
        x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
        M, N, K, NUM_GROUPS, stride_q, stride_xm, stride_ym, K_ITERS, SPLIT, MAGIC2,
        GROUP_SIZE: gl.constexpr, HAS_BIAS: gl.constexpr, USE_WS: gl.constexpr, BN: gl.constexpr,
        BM: gl.constexpr, F16: gl.constexpr, PREFETCH: gl.constexpr = False, X_SMEM: gl.constexpr = False,
        PDL: gl.constexpr = False,
    ):
        """y = x W^T for M <= BM (8 or 16): program (n block, K split) owns BN weight rows and K_ITERS
        K tiles of 128, one group per tile (group sizes that are multiples of 128, or per-channel).
        Each tile's MMA sum is scaled in fp32 (acc += part * s).
        Options not yet timed on a GPU (configs 'prefetch', 'x_smem'; bench_w4_tiled sweeps them):
        PREFETCH walks two tiles a step, ping-pong, so one tile's loads are in flight while the other
        is unpacked; X_SMEM loads x with 16-byte loads (all of the tile in every warp) and moves it
        into the B fragments through 2 KB of shared memory, instead of one 4-byte load per x pair."""
        WORDS_L: gl.constexpr = word_layout(BN, gl.num_warps())
        ACC_L: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[gl.num_warps(), 1],
                                                        instr_shape=[16, 8])
        A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_L, k_width=2)
        B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=ACC_L, k_width=2)
        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        n0 = pid_n * BN
        # words: rows and positions in the word layout
        wn = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, WORDS_L))
        wp = gl.arange(0, 16, layout=gl.SliceLayout(0, WORDS_L))
        wn_mask = wn < N
        q_ptrs = q_ptr + wn[:, None] * stride_q + wp[None, :]
        # x as the B operand [128, BM]: column m = row m of x
        X_L: gl.constexpr = x_layout(BM, gl.num_warps(), X_SMEM, B_L)
        bk = gl.arange(0, 128, layout=gl.SliceLayout(1, X_L))
        bm = gl.arange(0, BM, layout=gl.SliceLayout(0, X_L))
        x_ptrs = x_ptr + bm[None, :] * stride_xm + bk[:, None]
        x_row_ok = (bm < M)[None, :]
        # scales per weight row, in the accumulator's layout
        an = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, ACC_L))
        an_mask = an < N
        acc = gl.zeros([BN, BM], gl.float32, ACC_L)
        kt_end = gl.minimum((pid_k + 1) * K_ITERS, stride_q // 16)  # the last split may be shorter
        wait_for_previous(PDL)  # x is the previous kernel's output
        kt0 = pid_k * K_ITERS
        if PREFETCH:
            qw, z, s, xt = _tile_loads(q_ptrs, z_ptr, s_ptr, x_ptrs, kt0, wn, an, wn_mask, an_mask, x_row_ok, bk, N,
                                       K, NUM_GROUPS, GROUP_SIZE, True)
            for kt in range(kt0, kt_end, 2):
                qw2, z2, s2, xt2 = _tile_loads(q_ptrs, z_ptr, s_ptr, x_ptrs, kt + 1, wn, an, wn_mask, an_mask,
                                               x_row_ok, bk, N, K, NUM_GROUPS, GROUP_SIZE, kt + 1 < kt_end)
                acc = _tile_mma(acc, qw, z, s, xt, MAGIC2, A_L, B_L, F16)
                qw, z, s, xt = _tile_loads(q_ptrs, z_ptr, s_ptr, x_ptrs, kt + 2, wn, an, wn_mask, an_mask, x_row_ok,
                                           bk, N, K, NUM_GROUPS, GROUP_SIZE, kt + 2 < kt_end)
                acc = _tile_mma(acc, qw2, z2, s2, xt2, MAGIC2, A_L, B_L, F16)  # a tile past the end is 0: adds 0
        else:
            for kt in range(kt0, kt_end):
                qw, z, s, xt = _tile_loads(q_ptrs, z_ptr, s_ptr, x_ptrs, kt, wn, an, wn_mask, an_mask, x_row_ok, bk,
                                           N, K, NUM_GROUPS, GROUP_SIZE, True)
                acc = _tile_mma(acc, qw, z, s, xt, MAGIC2, A_L, B_L, F16)
        let_next_launch(PDL)
        offs_m = gl.arange(0, BM, layout=gl.SliceLayout(0, ACC_L))
        _store(acc, bias_ptr, y_ptr, ws_ptr, cnt_ptr, an, offs_m, an_mask, offs_m < M, N, stride_ym, pid_n,
               SPLIT, HAS_BIAS, USE_WS)


def mma_supported(x, group_size: int, K: int) -> bool:
    """Whether this kernel can serve x (at most 16 rows, CUDA sm80+, Gluon present, one group per
    K tile of 128); the caller falls back to the Triton kernels otherwise."""
    if gluon is None or not x.is_cuda or interpreting() or x.shape[0] > 16:
        return False
    if not (group_size >= K or group_size % 128 == 0):
        return False
    return torch.cuda.get_device_capability(x.device)[0] >= 8


def w4a16_mma(x, qtile, scales, zeros, group_size, K, bias, y, cfg):
    """y = x W^T (+ bias) into y for a tiled-layout weight; cfg: BN, num_warps, waves (split-K)."""
    M, N = x.shape[0], qtile.shape[0]
    BN, warps = cfg["BN"], cfg["num_warps"]
    n_blocks = -(-N // BN)
    split, k_iters = split_k_for(n_blocks, qtile.shape[1] // 16, num_sms(device_index(x)), cfg.get("waves", 0.0))
    use_ws = split > 1
    ws, cnt = splitk_workspace(x.device, M * N, n_blocks) if use_ws else (y, y)
    _w4a16_mma_kernel[(n_blocks, split)](
        x, qtile, scales, zeros, bias if bias is not None else scales, y, ws, cnt,
        M, N, K, scales.shape[0], qtile.shape[1], x.stride(0), y.stride(0), k_iters, split,
        _magic2(x.dtype),
        GROUP_SIZE=min(group_size, K), HAS_BIAS=bias is not None, USE_WS=use_ws, BN=BN, BM=8 if M <= 8 else 16,
        F16=x.dtype == torch.float16, PREFETCH=cfg.get("prefetch", False), X_SMEM=cfg.get("x_smem", False),
        num_warps=warps, num_stages=1, **pdl_args(x))
    return y
