"""W4A16 (and W8A16) for large M on Hopper: a warp-specialised Gluon kernel over the tiled layout.

The tiled layout (fitllm.kernels.w4a16_tiled) makes a thread's unpacked words exactly its wgmma A
registers. The Triton tensor-core kernel built on it walks K with cp.async loads and a CTA-wide
barrier every tile, so its two warpgroups unpack and multiply in lockstep; at M >= 512 it ties
dequantize-then-cuBLAS at ~0.75x of bf16 cuBLAS (benchmarks/RESULTS.md). Here the roles are split the
way CUTLASS's mixed-input Hopper GEMMs split them:

  * one producer warp fills a ring of STAGES shared-memory stages by TMA: the x tile [BM, 128] (two
    [BM, 64] boxes, 128-byte swizzled, the wgmma B operand as is) and the words of ROWS weight rows
    (per stored block of 128 rows one contiguous 8 KB run of the tile-major storage, [128, 16] int32;
    8-bit weights: [128, 32], 16 KB, whose two 16-word sections are the K tile's two halves);
  * two consumer warpgroups take ROWS / 2 weight rows each (64, or 128 as two wgmma row blocks in
    each async group). Per K tile a consumer waits for the stage's
    mbarrier (its scale and zero rows it loaded itself, two tiles before), loads its words, unpacks
    each 64-column half into the A registers as (q - z) * s in 16 bits (one packed FMA a pair, the
    same rounding as the reference's dequantization) and issues an async wgmma (64 x BM x 64)
    against x in shared memory. One wgmma group stays in flight while
    the other half unpacks; the stage goes back to the producer by an mbarrier arrive once the last
    wgmma reading it has retired. Nothing waits on the whole CTA in the main loop.

y tile [ROWS, BM] = W tile x^T, so tokens are the wgmma's N (BM = 16 .. 256). No split-K: the grid is
one program per (BM tokens, ROWS weight rows), so it is built for M large enough to fill the GPU (the
sm90 tile tables pick it for M = 65..3072 at 4 bits, 65..2048 at 8), or for weights so wide that 256-row
programs alone nearly fill it: gate|up (N > 16384) at M = 2..64 (8 bits: M = 1..64), 112 programs for
Llama-3-8B's 28672 rows, each consumer with two row blocks' wgmma in flight (4 bits: gate_up 15-25 %
faster than the Triton tile; 8 bits 6-12 %, at M = 1 5 %; thirty-fifth and thirty-sixth sessions; 8-bit
weights too narrow for 256-row programs take 128-row ones from M = 33, where the tile's heavier 8-bit
unpack loses, thirty-third session). With 128-row programs it is slower
than the Triton kernel at M <= 64, and splitting K or rings of up to 16 stages did not change that
(twenty-seventh session; 256-row programs split over K for qkv / o / down lost too, thirty-sixth).
Sm90 only (wgmma, setmaxnreg); weights N a multiple of ROWS, groups of 128·j or per-channel, x 16-bit
with a 16-byte-aligned row pitch; anything else keeps the Triton kernels. Gluon has no interpreter:
the CPU path and oracle is w4a16_tiled's reference; tests compile this kernel for sm_90 offline,
benchmarks/bench_w4_tiled.py (4 bits) and w8_table_check.py (8 bits) check it on the GPU.

8-bit weights: a K tile is two sections of 16 words, one per 64 columns, so each half of the tile is
one section's fields 0 and 1 where 4 bits take fields 2 j, 2 j + 1 of the same words. Under fp16 a
code is the same 1024-magic pair; under bf16 it goes through fp32 (2**23 + q by one PRMT, minus
2**23 + z exactly), and one cvt packs the pair before the scale multiply: 6 instructions a pair.
"""
from __future__ import annotations

import math

import torch

from ._utils import capability, device_index, interpreting, pdl_args
from .w4a16_tiled import TILE_N, _magic2, words_per_tile

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma, warpgroup_mma_init,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import constexpr_function

    from ._pdl import let_next_launch, wait_for_previous
    from .w4a16_tiled import _code, _group_cols, _minus_magic_zero_times_scale, _pack_times_scale
except ImportError:  # CPU-only installs, or a triton without Gluon: callers keep the Triton kernels
    gluon = None

ROWS = 128  # weight rows per program by default: two consumer warpgroups of 64 (256 runs too)


def _word_layout(rows: int, warps: int):
    """Where a consumer's words [rows, 16] of one K tile live so that, unpacked, they are its wgmma A
    registers: warp w holds rows 16 w + g and 16 w + g + 8 (g = lane // 4) and word positions
    4 c .. 4 c + 3 (c = lane % 4, one 16-byte load), whose fields are the k pairs the A fragment of
    thread (g, c) needs (w4a16_tiled's docstring gives the word order)."""
    rep = rows // (16 * warps)
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]] + [[16 * warps << i, 0] for i in range(int(math.log2(rep)))],
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16 << i, 0] for i in range(int(math.log2(warps)))],
        block_bases=[], shape=[rows, 16])


if gluon is not None:
    word_layout = constexpr_function(_word_layout)
    _BLOCK = gl.constexpr(TILE_N)  # rows of a stored block of words: one TMA box

    @gluon.jit
    def _fields(qw, f: gl.constexpr, nz, zf, s2, MAGIC2, BITS: gl.constexpr, F16: gl.constexpr):
        """Pair field f of every word (fields f and f + 16 / BITS: the neighbours k, k + 1) as
        (q - z) * s in 16 bits: [R, 16, 2] (last axis: h). 8-bit codes under bf16 go through fp32
        (bf16 holds 128 + q exactly only below q = 128): 2**23 + q, minus 2**23 + z, exact."""
        if BITS == 8 and not F16:
            lo, hi = _pack_times_scale(_code(qw, f, MAGIC2, True) - zf, _code(qw, f + 2, MAGIC2, True) - zf, s2)
        else:
            MASK: gl.constexpr = 0x000F000F if BITS == 4 else 0x00FF00FF
            lo, hi = _minus_magic_zero_times_scale(((qw >> (BITS * f)) & MASK) | MAGIC2, nz, s2, F16)
        return gl.join(lo, hi)

    @gluon.jit
    def _a_half(qw, f0: gl.constexpr, nz, zf, s2, MAGIC2, A_L: gl.constexpr, BITS: gl.constexpr,
                F16: gl.constexpr):
        """64 columns of the K tile as the A operand [R, 64]: pair fields f0 and f0 + 1 of the words qw
        (4-bit: f0 = 2 j gives columns 64 j ..; 8-bit: f0 = 0 and qw section j). The join / reshape /
        permute only rename registers: convert_layout refuses any data movement."""
        R: gl.constexpr = qw.shape[0]
        t = gl.join(_fields(qw, f0, nz, zf, s2, MAGIC2, BITS, F16), _fields(qw, f0 + 1, nz, zf, s2, MAGIC2, BITS, F16))
        t = gl.reshape(t, [R, 4, 4, 2, 2])  # [n, c, t, h, f % 2]  (word position p = 4 c + t)
        t = gl.permute(t, [0, 4, 2, 1, 3])  # column = 32 (f % 2) + 8 t + 2 c + h
        return gl.convert_layout(gl.reshape(t, [R, 64]), A_L, assert_trivial=True)

    @gluon.jit
    def _producer(x_desc, q_desc, x_smem, w_smem, ready, empty, m0, qrow0, k_tiles, STAGES: gl.constexpr,
                  BLOCKS: gl.constexpr):
        """One warp: K tile i's x halves and words (BLOCKS stored blocks of 128 rows) into stage i % STAGES
        once both consumers freed it."""
        for i in range(k_tiles):
            st = i % STAGES
            mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
            mbarrier.expect(ready.index(st), 2 * x_desc.block_type.nbytes + BLOCKS * q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [m0, i * 128], ready.index(st), x_smem.index(2 * st))
            tma.async_copy_global_to_shared(x_desc, [m0, i * 128 + 64], ready.index(st), x_smem.index(2 * st + 1))
            for b in gl.static_range(BLOCKS):  # block b's K tile i: row (its first block + b) K_TILES + i, x 128
                tma.async_copy_global_to_shared(q_desc, [qrow0 + (b * k_tiles + i) * _BLOCK, 0], ready.index(st),
                                                w_smem.index(BLOCKS * st + b))

    @gluon.jit
    def _group_ahead(s_ptr, z_ptr, i, rows, N, NUM_GROUPS, GROUP_SIZE: gl.constexpr):
        """Scale and zero rows of K tile i's group, as stored (16 bits): loaded two tiles before their
        use and converted only then, so that no wait on them falls inside the tile that loads them."""
        g = gl.minimum((i * 128) // GROUP_SIZE, NUM_GROUPS - 1)
        return gl.load(s_ptr + g * N + rows), gl.load(z_ptr + g * N + rows)

    @gluon.jit
    def _consume_tile(i, acc, a1_prev, sc, zc, s_next, z_next, x_smem, w_smem, ready, empty, s_ptr, z_ptr, rows,
                      half, N, NUM_GROUPS, MAGIC2, A_L: gl.constexpr, WL: gl.constexpr,
                      GROUP_SIZE: gl.constexpr, STAGES: gl.constexpr, BITS: gl.constexpr, F16: gl.constexpr,
                      CROWS: gl.constexpr):
        """K tile i of one consumer: its scale and zero rows sc, zc (and tile i + 1's s_next, z_next) were
        loaded two tiles ahead (_group_ahead). Each wgmma wait retires the group whose A registers are written
        next; the first one also retires the last reader of stage i - 1, which then goes back to the
        producer."""
        st = i % STAGES
        s_after, z_after = _group_ahead(s_ptr, z_ptr, i + 2, rows, N, NUM_GROUPS, GROUP_SIZE)
        mbarrier.wait(ready.index(st), (i // STAGES) & 1)
        if CROWS == 64:  # [64, 16 * sections]: this consumer's half of the stage's block
            words = w_smem.index(st).slice(64 * half, 64)
        else:  # [128, 16 * sections]: its own block
            words = w_smem.index(2 * st + half)
        qw = words.slice(0, 16, dim=1).load(WL)
        _, nz, zf, s2, _ = _group_cols(sc.to(gl.float32), zc.to(gl.float32), F16, BITS)
        nz = gl.broadcast(nz, qw)[0]
        zf = gl.broadcast(zf, qw)[0]
        s2 = gl.broadcast(s2, qw)[0]
        a0 = _a_half(qw, 0, nz, zf, s2, MAGIC2, A_L, BITS, F16)
        acc = warpgroup_mma(a0, x_smem.index(2 * st).permute((1, 0)), acc, use_acc=i > 0, is_async=True)
        a1_prev = warpgroup_mma_wait(num_outstanding=1, deps=(a1_prev, ))
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
        if BITS == 8:  # the second 64 columns are section 1's fields 0, 1
            a1 = _a_half(words.slice(16, 16, dim=1).load(WL), 0, nz, zf, s2, MAGIC2, A_L, BITS, F16)
        else:  # ... the same words' fields 2, 3
            a1 = _a_half(qw, 2, nz, zf, s2, MAGIC2, A_L, BITS, F16)
        acc = warpgroup_mma(a1, x_smem.index(2 * st + 1).permute((1, 0)), acc, is_async=True)
        a0 = warpgroup_mma_wait(num_outstanding=1, deps=(a0, ))
        return acc, a1, s_next, z_next, s_after, z_after

    @gluon.jit
    def _consumer(x_smem, w_smem, ready, empty, s_ptr, z_ptr, bias_ptr, y_ptr, half: gl.constexpr, n0, m0, M, N,
                  NUM_GROUPS, stride_ym, k_tiles, MAGIC2, GROUP_SIZE: gl.constexpr, BM: gl.constexpr,
                  STAGES: gl.constexpr, HAS_BIAS: gl.constexpr, BITS: gl.constexpr, F16: gl.constexpr,
                  PDL: gl.constexpr, CROWS: gl.constexpr):
        """Weight rows n0 + CROWS half .. + CROWS - 1 (CROWS = 64 or 128: one or two wgmma row blocks)
        against BM tokens: y[m0:m0+BM, those rows]."""
        DT: gl.constexpr = gl.float16 if F16 else gl.bfloat16
        WL: gl.constexpr = word_layout(CROWS, 4)
        ACC_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BM, 16])
        A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_L, k_width=2)
        rows = n0 + CROWS * half + gl.arange(0, CROWS, layout=gl.SliceLayout(1, WL))
        sc, zc = _group_ahead(s_ptr, z_ptr, 0, rows, N, NUM_GROUPS, GROUP_SIZE)
        s_next, z_next = _group_ahead(s_ptr, z_ptr, 1, rows, N, NUM_GROUPS, GROUP_SIZE)
        # Tile 0 is peeled off the loop: with a zero-trip path that zero-fills the accumulator, ptxas
        # serialises every wgmma (advisory C7515). Tile 0's first MMA starts the sum (use_acc=False).
        acc, a1, sc, zc, s_next, z_next = _consume_tile(
            0, warpgroup_mma_init(gl.zeros([CROWS, BM], gl.float32, ACC_L)), gl.zeros([CROWS, 64], DT, A_L), sc, zc,
            s_next, z_next, x_smem, w_smem, ready, empty, s_ptr, z_ptr, rows, half, N, NUM_GROUPS, MAGIC2, A_L, WL,
            GROUP_SIZE, STAGES, BITS, F16, CROWS)
        for i in range(1, k_tiles):
            acc, a1, sc, zc, s_next, z_next = _consume_tile(
                i, acc, a1, sc, zc, s_next, z_next, x_smem, w_smem, ready, empty, s_ptr, z_ptr, rows, half, N,
                NUM_GROUPS, MAGIC2, A_L, WL, GROUP_SIZE, STAGES, BITS, F16, CROWS)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        let_next_launch(PDL)  # only the epilogue is left: the next kernel's programs may come in
        if HAS_BIAS:
            acc += gl.load(bias_ptr + n0 + CROWS * half + gl.arange(0, CROWS, layout=gl.SliceLayout(1, ACC_L))
                           ).to(gl.float32)[:, None]
        # out through a layout with 8 neighbouring weight rows a thread: 16-byte stores along y's rows
        # (converted in 16 bits: half the shared-memory scratch, which sits beside the stages)
        OUT_L: gl.constexpr = gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[8, 4],
                                               warps_per_cta=[1, 4], order=[0, 1])
        out = gl.convert_layout(acc.to(DT), OUT_L)
        on = n0 + CROWS * half + gl.arange(0, CROWS, layout=gl.SliceLayout(1, OUT_L))
        om = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, OUT_L))
        gl.store(y_ptr + om[None, :] * stride_ym + on[:, None], out, mask=(om < M)[None, :])

    @gluon.jit(do_not_specialize=["M"])  # else M % 16 == 0 compiles again, mid-serving
    def _w4a16_ws_kernel(x_desc, q_desc, s_ptr, z_ptr, bias_ptr, y_ptr, M, N, NUM_GROUPS, stride_ym, K_TILES, MAGIC2,
                         GROUP_SIZE: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr,
                         F16: gl.constexpr, BITS: gl.constexpr = 4, CONSUMER_REGS: gl.constexpr = 232,
                         PDL: gl.constexpr = False, ROWS: gl.constexpr = 128):
        """Program (BM tokens, ROWS = 128 or 256 weight rows: one or two stored blocks), M fastest so the
        programs sharing a weight tile run together. The default partition (this kernel's 4 warps) is
        the low consumer; the high consumer (4 warps) and the producer (1 warp, 40 registers) are
        worker partitions."""
        BLOCKS: gl.constexpr = ROWS // _BLOCK
        pid = gl.program_id(0)
        num_pid_m = gl.cdiv(M, BM)
        m0 = (pid % num_pid_m) * BM
        n0 = (pid // num_pid_m) * ROWS
        qrow0 = n0 * K_TILES  # row of [N * K_TILES, 4 * BITS] words where this block's K tile 0 starts
        x_smem = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES] + x_desc.block_type.shape, x_desc.layout)
        w_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCKS * STAGES] + q_desc.block_type.shape, q_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)  # the producer's expect; TMA bytes complete it
            mbarrier.init(empty.index(i), count=2)  # one arrive per consumer
        # (PDL) everything above overlapped the previous kernel's tail; x is its output, y may be memory
        # it still reads: every thread waits here, before the partitions touch global memory
        wait_for_previous(PDL)
        gl.warp_specialize([  # (the argument lists are written out: constexprs do not survive a tuple)
            (_consumer, (x_smem, w_smem, ready, empty, s_ptr, z_ptr, bias_ptr, y_ptr, 0, n0, m0, M, N, NUM_GROUPS,
                         stride_ym, K_TILES, MAGIC2, GROUP_SIZE, BM, STAGES, HAS_BIAS, BITS, F16, PDL, ROWS // 2)),
            (_consumer, (x_smem, w_smem, ready, empty, s_ptr, z_ptr, bias_ptr, y_ptr, 1, n0, m0, M, N, NUM_GROUPS,
                         stride_ym, K_TILES, MAGIC2, GROUP_SIZE, BM, STAGES, HAS_BIAS, BITS, F16, PDL, ROWS // 2)),
            (_producer, (x_desc, q_desc, x_smem, w_smem, ready, empty, m0, qrow0, K_TILES, STAGES, BLOCKS)),
        ], [4, 1], [CONSUMER_REGS, 40])


def descriptor_layouts(bm: int, dtype: torch.dtype):
    """The shared layouts of the kernel's two TMA descriptors: x's [bm, 64] boxes (128-byte swizzle,
    read as the wgmma B operand) and the words' [128, 4 bits] runs (no swizzle: a consumer's 16-byte loads
    of 8 neighbouring rows are conflict-free as stored at 4 bits; at 8 bits a section's rows are 128
    bytes apart, a 2-way conflict on a few loads a tile). The offline compiles in tests/ use them too."""
    x_dtype = gl.float16 if dtype == torch.float16 else gl.bfloat16
    return (gl.NVMMASharedLayout.get_default_for([bm, 64], x_dtype),
            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))


def ws_shape_ok(N: int, group_size: int, K: int, dtype: torch.dtype, row_pitch_bytes: int, address: int,
                rows: int = ROWS) -> bool:
    """The shapes the kernel takes: whole programs of `rows` weight rows, one group per K tile (groups of
    128·j or per-channel), 16-bit x whose rows TMA can address (pitch and base 16-byte aligned)."""
    return (N % rows == 0 and (group_size >= K or group_size % 128 == 0) and dtype in (torch.bfloat16, torch.float16)
            and row_pitch_bytes % 16 == 0 and address % 16 == 0)


def ws_supported(x: torch.Tensor, N: int, group_size: int, K: int, rows: int = ROWS) -> bool:
    """Whether w4a16_ws_triton can take this GEMM on x's device (else the caller keeps its Triton
    kernels): an sm90 GPU (wgmma and setmaxnreg; not under the interpreter) and ws_shape_ok."""
    dev = device_index(x)
    if gluon is None or interpreting() or dev is None or capability(dev)[0] != 9:
        return False
    return x.stride(-1) == 1 and ws_shape_ok(N, group_size, K, x.dtype, x.stride(0) * x.element_size(), x.data_ptr(),
                                             rows)


def w4a16_ws_triton(x, qtile, scales, zeros, group_size, K, bias=None, out=None, BM=128, STAGES=3, bits=4, rows=ROWS):
    """y = x W^T (+ bias) on the warp-specialised kernel, 4- or 8-bit weights in the tiled layout; the
    caller checked ws_supported(..., rows). rows: weight rows a program (128 or 256). Columns of x past
    K (the last K tile) are TMA's zero fill, as its rows past M are."""
    M, N = x.shape[0], qtile.shape[0]
    y = out if out is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    x_layout, q_layout = descriptor_layouts(BM, x.dtype)
    x_desc = TensorDescriptor.from_tensor(x, [BM, 64], x_layout)
    # the tile-major storage seen as [N * K_TILES, W] (W = 4 bits words a row's K tile): K tile kt of
    # row block b is rows (b K_TILES + kt) 128 ..
    W = words_per_tile(bits)
    q_desc = TensorDescriptor.from_tensor(qtile.view(-1, W), [TILE_N, W], q_layout)
    grid = (-(-M // BM) * (N // rows),)
    _w4a16_ws_kernel[grid](x_desc, q_desc, scales, zeros, bias if bias is not None else scales, y, M, N,
                           scales.shape[0], y.stride(0), qtile.shape[1] // W, _magic2(x.dtype, bits),
                           GROUP_SIZE=min(group_size, K), BM=BM, STAGES=STAGES, HAS_BIAS=bias is not None,
                           F16=x.dtype == torch.float16, BITS=bits, ROWS=rows, num_warps=4, **pdl_args(x))
    return y
