"""The batch-1 W4A16 GEMV on integer dot products (dp4a), for 4-bit weights in the tiled layout.
On by default where it applies (dp4a_wanted; FITLLM_W4_DP4A=0 turns it off): H100, int4 batch-1
decode 433.3 -> 447.5 tok/s (RESULTS.md, forty-ninth session).

Why: the 16-bit GEMV (w4a16_tiled._tiled_gemv_kernel) spends ~27 instructions on each 8-weight word
(unpack to 16-bit floats, subtract the zero, packed FMAs, fold into fp32); with x as integers a word
is two masks and a shift (its eight codes as two words of four bytes) and four dp4a: 133 instructions
a tile of 8 words a thread instead of 216 (offline sm_90 SASS), and the registers this frees hold the
next tile's words while this one's math runs. H100, Llama-3-8B shapes at M = 1, µs (RESULTS.md,
forty-ninth session, GEMV_CONFIG): qkv 7.9 -> 7.1, o 6.3 -> 5.8, gate_up 28.8 -> 23.8, down 14.6 ->
13.2; a layer's four linears with their split-K sums pending 49.6 -> 46.6 (o_proj on the 16-bit GEMV).

x as 16-bit integers (X16): each 128-column tile of a row gets one fp32 step d, the smallest power of
two >= max|x| / 32639, and v = round(x / d) in [-32639, 32639], stored as v = 256 hi + lo with
hi = floor((v + 128) / 256) in [-127, 127] and lo in [-128, 127], both int8: lo's byte is v's low byte
and hi's the next, after adding 128, so the producer splits v with a shift and a mask. d is a power of
two so that x / d is exact: the GPU compiler fuses a multiply and the rounding's add into one FMA, the
interpreter does not, and with an exact product both round alike (with d = max|x| / TOP itself the
H100 and the torch reference disagreed on a few codes in every row).
A word's dot product with x is 256 dp4a(codes, hi) + dp4a(codes, lo), exact in int32; the zero point
comes off a tile as z * sum(v) (exact), and one multiply by the group's scale times d ends the tile.
The only rounding beyond the 16-bit GEMV's is x's: |x - d v| <= d / 2, 1 / 65278 to 1 / 32639 of the
tile's largest |x| (bf16 rounds each x by up to 2^-9 of its own size); against float64 the four linears are
at 1.65e-3 where the 16-bit GEMV is at 3.0-3.3e-3 (H100).

The producer of x writes X16 instead of x when the GEMM asks (FusedLinear.input_quant -> X16Input;
fused.rms_norm and fused.silu_mul, one row only): quantizing in a launch of its own costs ~2.4 µs a
launch against the GEMV's ~1 µs a linear. o_proj, whose input the attention writes, stays on the
16-bit GEMV. The epilogue is what the engine pays for, so it must be cheap: H100, RMSNorm + residual at
K = 4096 plain / fp8 / X16 1.4 / 1.8 / 1.9 µs, SiLU·mul at 14336 1.1 / 3.3 / 1.5 (SiLU·mul in programs
of 1024 columns: X16 needs a tile's max, not a row's). The forty-eighth session's first forms (a byte
store and an IEEE division a value) took the engine from 424 to 234-368 tok/s.

Layout, per row and tile: `codes` int32 [M, T, 4, 16], entry e, word position p (the tiled layout's
position p = 4c + t holds word r = c + 4t), byte j the k (within the tile) of one of the word's
fields: the low nibbles `w & 0x0F0F0F0F` are fields 0, 2, 4, 6 (k = 2r, 64 + 2r, 2r + 1, 65 + 2r),
the high ones `(w >> 4) & 0x0F0F0F0F` fields 1, 3, 5, 7 (the same k + 32). Entries 0 / 1 hold hi for
the low / high nibbles, 2 / 3 lo. `stats` fp32 [M, T, 2]: d, and sum(v) (an integer below 2^23,
exact in fp32).
"""

from __future__ import annotations

import os

import torch

from ._utils import (X16, capability, defer_splitk, interpreting, num_sms, pdl_args, pending_or_y, split_k_for,
                     split_waves, splitk_buffers)

try:
    import triton
    import triton.language as tl

    from ._pdl import let_next_launch, wait_for_previous
    from .w4a16 import _store_tile
    from .w4a16_tiled import _group_raw, _load_words, _word_offsets
except ImportError:  # CPU-only installs without triton still get the reference
    triton = None

HALF_BITS = 8
HALF = 1 << HALF_BITS  # v = HALF * hi + lo
TOP = 127 * HALF + 127  # the largest |v|
LOW = 2.0 ** (1 - TOP.bit_length())  # 2^-14: a power of two 2^E times LOW times TOP lies in [2^E, 2^(E + 1))
TINY = 2.0 ** -100  # the smallest step (an all-zero tile)
EXPONENT = 0x7F800000  # an fp32's exponent bits
GEMV_CONFIG = dict(BN=128, num_warps=4, waves=4.0, wide=(16384, 6.0), deep=(8192, 6.0))  # H100 sweep (RESULTS.md, 49th)


def dp4a_wanted(bits: int, group_size: int, K: int, perm, device: torch.device) -> bool:
    """Whether a weight's batch-1 GEMM takes X16 (FusedLinear.input_quant): 4-bit codes in the tiled layout,
    one group a 128-tile, no act-order gather, a CUDA card with dp4a (sm61+), unless FITLLM_W4_DP4A=0
    (the 16-bit GEMV: A/B runs)."""
    if os.environ.get("FITLLM_W4_DP4A", "1") == "0" or triton is None or device.type != "cuda":
        return False
    if bits != 4 or perm is not None or not (group_size % 128 == 0 or group_size >= K):
        return False
    return capability(device.index if device.index is not None else torch.cuda.current_device()) >= (6, 1)


def _byte_ks(device) -> torch.Tensor:
    """[2 nibble halves, 16 positions, 4 bytes]: the k (within a tile) of each byte of an X16 word."""
    p = torch.arange(16)
    r = p // 4 + 4 * (p % 4)
    low = torch.stack([2 * r, 64 + 2 * r, 2 * r + 1, 65 + 2 * r], 1)
    return torch.stack([low, low + 32]).to(device)


def quantize_x16_ref(x: torch.Tensor) -> X16:
    """x [M, K] (any float dtype) -> X16: the torch reference of quantize_row_x16."""
    M, K = x.shape
    T = -(-K // 128)
    xf = torch.nn.functional.pad(x.float(), (0, T * 128 - K)).view(M, T, 128)
    amax = xf.abs().amax(-1)
    step = _pow2_step(amax)
    v = torch.round(xf / step[..., None]).to(torch.int32)  # exact quotients; |v| <= TOP: step >= amax / TOP
    hi = torch.div(v + HALF // 2, HALF, rounding_mode="floor")
    ks = _byte_ks(x.device)
    words = []
    for part in (hi, v - HALF * hi):
        b = (part[:, :, ks] & 255).to(torch.int64)  # [M, T, 2, 16, 4]
        w = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
        words.append(torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32))
    stats = torch.stack([step, v.sum(-1).float()], -1)
    return X16(torch.cat(words, 2).contiguous(), stats.contiguous(), K, x.dtype)


def _pow2_step(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= amax / TOP (fp32, at least TINY), without a division, as the kernel
    computes it: with 2^E amax's leading power, 2^E <= TOP LOW 2^E < 2^(E + 1), and whether amax <= TOP
    LOW 2^E (exact: TOP has 15 bits) decides between LOW 2^E and 2 LOW 2^E."""
    two_e = (amax.view(torch.int32) & EXPONENT).view(torch.float32)
    low = two_e * LOW
    return torch.where(amax <= low * TOP, low, 2 * low).clamp_min(TINY)


def unpack_x16(x16: X16) -> torch.Tensor:
    """v int32 [M, T * 128] from the packed codes (tests and the reference)."""
    M, T = x16.stats.shape[:2]
    ks = _byte_ks(x16.codes.device)
    v = torch.zeros(M, T, 128, dtype=torch.int32, device=x16.codes.device)
    for e, weight in ((0, HALF), (2, 1)):
        for half in range(2):
            w = x16.codes[:, :, e + half]  # [M, T, 16]
            for j in range(4):
                v[:, :, ks[half, :, j]] += weight * ((w << (24 - 8 * j)) >> 24)
    return v.view(M, T * 128)


def w4a16_dp4a_ref(x16: X16, qtile, scales, zeros, group_size: int) -> torch.Tensor:
    """The GEMV's exact math in float64: sum over tiles of s d (codes . v - z sum(v)) -> [M, N]."""
    from .w4a16_tiled import tile_unpack

    M, T = x16.stats.shape[:2]
    q = tile_unpack(qtile, T * 128).double().t()  # [N, T * 128]
    N = q.shape[0]
    g = torch.clamp(torch.arange(T, device=q.device) * 128 // min(group_size, x16.K), max=scales.shape[0] - 1)
    dots = torch.einsum("ntk,mtk->mnt", q.view(N, T, 128), unpack_x16(x16).double().view(M, T, 128))
    s, z = scales.double()[g].t(), zeros.double()[g].t()  # [N, T]
    st = x16.stats.double()
    return ((dots - z[None] * st[:, None, :, 1]) * s[None] * st[:, None, :, 0]).sum(-1)


if triton is not None:
    # the module's constants as the kernels see them (the torch reference reads the plain ones)
    _HALF_BITS, _HALF_ROUND = tl.constexpr(HALF_BITS), tl.constexpr(HALF // 2)
    _TOP, _LOW = tl.constexpr(float(TOP)), tl.constexpr(LOW)
    _TINY, _EXPONENT = tl.constexpr(TINY), tl.constexpr(EXPONENT)

    @triton.jit
    def _rint(v):
        """Round half to even for |v| < 2**22 (the fp32 magic 1.5 * 2**23; no libdevice under the
        interpreter)."""
        return (v + 12582912.0) - 12582912.0

    @triton.jit
    def quantize_row_x16(v, col0, codes_ptr, stats_ptr, row, K):
        """Row `row` of x, its values v (fp32 [B], already rounded to the activation dtype) at columns
        col0 .. col0 + B - 1 (B and col0 multiples of 128), into X16 (codes_ptr, stats_ptr: X16's
        tensors): the producers' epilogue (fused.rms_norm, fused.silu_mul). Columns past K count as 0.
        x is multiplied by the tile's 1 / step, a power of two found from bits, not divisions (a
        division a value cost the engine more than the GEMV gained), and each word's four bytes are put
        together in registers (a permute, two splits), so each word is one 32-bit store: byte by byte,
        one program's 8-28 K scattered stores took longer than the GEMV they feed."""
        B: tl.constexpr = v.shape[0]
        NT: tl.constexpr = B // 128
        T = (K + 127) // 128
        tile = col0 // 128 + tl.arange(0, NT)
        c2 = tile[:, None] * 128 + tl.arange(0, 128)[None, :]
        v2 = tl.where(c2 < K, tl.reshape(v, (NT, 128)), 0.0)
        amax = tl.max(tl.abs(v2), 1)
        low = (amax.to(tl.int32, bitcast=True) & _EXPONENT).to(tl.float32, bitcast=True) * _LOW
        step = tl.maximum(tl.where(amax <= low * _TOP, low, 2 * low), _TINY)  # _pow2_step
        # 1 / step, exact: a power of two's exponent field e becomes 254 - e (254 << 23 = 0x7F000000)
        inv = (0x7F000000 - step.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
        q = _rint(v2 * inv[:, None])
        ok = tile < T
        tl.store(stats_ptr + (row * T + tile) * 2, step, mask=ok)
        tl.store(stats_ptr + (row * T + tile) * 2 + 1, tl.sum(q, 1), mask=ok)
        # k = 64 a + 32 h + 8 t + 2 c + b -> word h * 16 + (4 c + t) of the entries, byte j = 2 b + a
        q = tl.reshape(tl.permute(tl.reshape(q.to(tl.int32), (NT, 2, 2, 4, 4, 2)), (0, 2, 4, 3, 5, 1)),
                       (NT, 32, 2, 2))
        q_a0, q_a1 = tl.split(q)  # a = 0, 1: [NT, 32, 2 (b)]
        words = codes_ptr + (row * T + tile[:, None]) * 64 + tl.arange(0, 32)[None, :]
        hi_w, lo_w = _x16_words(tl.split(q_a0), tl.split(q_a1))
        tl.store(words, hi_w, mask=ok[:, None])
        tl.store(words + 32, lo_w, mask=ok[:, None])

    @triton.jit
    def _x16_hilo(v):
        """v (int32) -> the bytes of (hi, lo), v = HALF hi + lo: hi = floor((v + HALF / 2) / HALF), lo v's low
        byte."""
        return ((v + _HALF_ROUND) >> _HALF_BITS) & 255, v & 255

    @triton.jit
    def _x16_words(a0, a1):
        """Bytes j = 2 b + a of the words as the pairs a0 = (b = 0, b = 1) for a = 0 and a1 for a = 1 ->
        the hi word and the lo word."""
        h0, l0 = _x16_hilo(a0[0])
        h1, l1 = _x16_hilo(a1[0])
        h2, l2 = _x16_hilo(a0[1])
        h3, l3 = _x16_hilo(a1[1])
        return h0 | (h1 << 8) | (h2 << 16) | (h3 << 24), l0 | (l1 << 8) | (l2 << 16) | (l3 << 24)

    @triton.jit
    def _dp4a(a, b, c, ASM: tl.constexpr):
        """c + the dot product of a's four unsigned bytes with b's four signed ones."""
        if ASM:
            return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        for j in tl.static_range(4):  # the interpreter runs no PTX: the same sum byte by byte
            c += ((a >> (8 * j)) & 255) * ((b << (24 - 8 * j)) >> 24)
        return c

    @triton.jit
    def _tile_words(q_ptr, s_ptr, z_ptr, kt, offs_n, n_mask, N, NUM_GROUPS, stride_q, p_ar,
                    GROUP_SIZE: tl.constexpr, EVEN_N: tl.constexpr):
        """K tile kt's words [BN, 16], and its group's scales (fp32) and zeros (int32) [BN]."""
        qw = _load_words(q_ptr, _word_offsets(offs_n, kt, N, stride_q)[:, None] + p_ar, None if EVEN_N else n_mask)
        s, z = _group_raw(s_ptr, z_ptr, kt * 128, N, NUM_GROUPS, offs_n, n_mask, GROUP_SIZE, True)
        return qw, s, z.to(tl.int32)

    @triton.jit
    def _tile_dot(qw, s, z, kt, codes_ptr, stats_ptr, p_ar, ASM: tl.constexpr):
        """The rows' [BN] dot products with x over K tile kt, in fp32."""
        xw = codes_ptr + kt * 64 + p_ar
        low = qw & 0x0F0F0F0F
        high = (qw >> 4) & 0x0F0F0F0F
        zero = tl.zeros_like(qw)
        hi = _dp4a(high, tl.load(xw + 16), _dp4a(low, tl.load(xw), zero, ASM), ASM)
        lo = _dp4a(high, tl.load(xw + 48), _dp4a(low, tl.load(xw + 32), zero, ASM), ASM)
        dots = tl.sum((hi << _HALF_BITS) + lo, 1) - z * tl.load(stats_ptr + 2 * kt + 1).to(tl.int32)
        return dots.to(tl.float32) * (s * tl.load(stats_ptr + 2 * kt))

    @triton.jit(do_not_specialize=["K_ITERS", "SPLIT"])
    def _dp4a_gemv_kernel(codes_ptr, stats_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
                          N, NUM_GROUPS, stride_q, K_ITERS, SPLIT, T, GROUP_SIZE: tl.constexpr,
                          HAS_BIAS: tl.constexpr, USE_WS: tl.constexpr, BN: tl.constexpr, ASM: tl.constexpr,
                          EVEN_N: tl.constexpr = False, PDL: tl.constexpr = False, ORDERED: tl.constexpr = False,
                          DEFER: tl.constexpr = False):
        """y = x W^T for one row x given as X16: program (n, k) owns BN weight rows and K_ITERS K tiles.
        The next tile's words are loaded before this tile's math (two tiles' loads in flight: qkv and
        gate_up 8-10 % faster on an H100, the others a tie)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_mask = offs_n < N
        p_ar = tl.arange(0, 16)[None, :]
        acc = tl.zeros((BN,), dtype=tl.float32)
        kt0 = pid_k * K_ITERS
        kt_end = tl.minimum(kt0 + K_ITERS, T)
        wait_for_previous(PDL)  # x is the previous kernel's output
        qn, sn, zn = _tile_words(q_ptr, s_ptr, z_ptr, kt0, offs_n, n_mask, N, NUM_GROUPS, stride_q, p_ar,
                                 GROUP_SIZE, EVEN_N)
        for kt in range(kt0, kt_end):
            qw, s, z = qn, sn, zn
            qn, sn, zn = _tile_words(q_ptr, s_ptr, z_ptr, tl.minimum(kt + 1, kt_end - 1), offs_n, n_mask, N,
                                     NUM_GROUPS, stride_q, p_ar, GROUP_SIZE, EVEN_N)
            acc += _tile_dot(qw, s, z, kt, codes_ptr, stats_ptr, p_ar, ASM)
        let_next_launch(PDL)
        offs_m = tl.arange(0, 1)
        _store_tile(acc[None, :], bias_ptr, y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, offs_m < 1, n_mask, N, N,
                    pid_n, SPLIT, HAS_BIAS, USE_WS, ORDERED, pid_k, N, DEFER)

    @triton.jit
    def _quant_x16_kernel(x_ptr, codes_ptr, stats_ptr, K, stride_x, BLOCK: tl.constexpr):
        """One program a row (tests and benchmarks: the engine quantizes in the producers)."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        quantize_row_x16(v, 0, codes_ptr, stats_ptr, row, K)


def quantize_x16(x: torch.Tensor) -> X16:
    """x [M, K] -> X16 in one launch (Triton on CUDA and under the interpreter, else the reference)."""
    if triton is None or not (x.is_cuda or interpreting()):
        return quantize_x16_ref(x)
    M, K = x.shape
    x16 = X16.empty(M, K, x.dtype, x.device)
    if M:
        _quant_x16_kernel[(M,)](x, x16.codes, x16.stats, K, x.stride(0), BLOCK=max(128, triton.next_power_of_2(K)))
    return x16


def dp4a_gemv(x16: X16, qtile, scales, zeros, group_size: int, bias=None, out=None, defer: bool = False,
              config: dict | None = None):
    """y [1, N] = x W^T on dp4a, x one row as X16, in x's dtype; config (benchmarks)
    overrides GEMV_CONFIG. defer: as w4a16_tiled_triton (a split-K launch may return a PendingSum)."""
    if x16.codes.shape[0] != 1:
        raise ValueError(f"dp4a_gemv: one row of x, got {x16.codes.shape[0]}")
    cfg = dict(GEMV_CONFIG, **(config or {}))
    N, dev, K = qtile.shape[0], qtile.device, x16.K
    y = out if out is not None else torch.empty(1, N, dtype=x16.dtype, device=dev)
    T = x16.stats.shape[1]
    n_blocks = triton.cdiv(N, cfg["BN"])
    split, k_iters = split_k_for(n_blocks, T, num_sms(dev.index), split_waves(cfg, N, K))
    use_ws = split > 1
    ws, cnt, order = splitk_buffers(dev, N, n_blocks, split) if use_ws else (y, y, {})
    defer = defer_splitk(defer, out, bias) and use_ws
    _dp4a_gemv_kernel[(n_blocks, split)](
        x16.codes, x16.stats, qtile, scales, zeros, bias if bias is not None else scales, y, ws, cnt,
        N, scales.shape[0], qtile.shape[1], k_iters, split, T, GROUP_SIZE=min(group_size, K),
        HAS_BIAS=bias is not None, USE_WS=use_ws, BN=cfg["BN"], ASM=not interpreting(), EVEN_N=N % cfg["BN"] == 0,
        DEFER=defer, num_warps=cfg["num_warps"], **pdl_args(qtile), **order)
    return pending_or_y(y, ws, defer)
