"""W4A16 on the tensor cores from a tiled 4-bit layout whose unpacked registers ARE the MMA operand.

The standard layout (fitllm.kernels.w4a16: qweight [K/8, N], element k of a column at bits 4(k % 8)
of word k // 8) is what every checkpoint format is repacked into. A tensor-core kernel reading it has
to shuffle every unpacked weight through shared memory into the operand layout of the MMA, which
costs more instructions than the weight saves. This module repacks 4-bit weights once more, at load
time, into a layout built for one thing: a thread's unpacked values land directly in the registers
its wgmma A fragment needs (the weights are the A operand: y^T = W x^T).

Tiled layout, `qtile` int32 [N, Kp / 8] (Kp = K rounded up to 128, padding zero words), K-major:
  * K is cut into tiles of 128; a tile of row n is 16 words, word r holding 8 fields;
  * field f + 4h (f = 0..3, h = 0..1) of word r is k = 32 f + 2 r + h: the two halves of
    `(w >> 4f) & 0x000F000F` are the neighbours k, k + 1, i.e. one 32-bit pair of the MMA operand,
    and `| magic` makes them two 16-bit floats 128 + q (bf16) or 1024 + q (fp16) in one LOP3;
  * word r = c + 4 t is stored at position p = 4 c + t, so the four words one thread needs
    (c = its lane % 4, t = 0..3) are one 16-byte load;
  * storage is tile-major in blocks of TILE_N = 128 rows: block b (rows 128 b .., R = min(128,
    N - 128 b) of them) holds its K tiles one after another, each as R rows x 16 words, so word p
    of row n in tile kt sits at 128 b Kp/8 + (kt R + n - 128 b) 16 + p. A program's tile is then
    one contiguous run (8 KB for 128 rows) instead of 64-byte pieces one row (Kp/2 bytes) apart:
    the batch-1 GEMV is ~9 % faster on it (RESULTS.md, eleventh session). The tensor keeps the
    shape [N, Kp/8], but a row of it is not row n's words: use tile_unpack.
scales / zeros stay [G, N] as in the standard layout (zeros as float integers).

The kernel loads the word tile as [8, ROW_WARPS, 2, REP, 16] (lane group, warp, row half, repeat,
word) so Triton's load layout, pushed through the unpack's join / permute / reshape, is exactly the
MMA operand layout: no shared-memory round trip for the weights (benchmarks/sass_offline.py shows
the SASS: no STS/LDSM in the main loop). Per word: 3 shifts, 4 LOP3, 4 packed FMAs (q - z, exact),
about 1.4 instructions per weight before the MMA, which then does the math for any M up to the tile.
Group sizes 32, 64, multiples of 128 and per-channel; 16-bit activations; no g_idx (act-order
weights get their rows sorted by group first, fitllm.quant.layers.gpu_form).

8-bit weights (GPTQ int8) use the same layout with twice the words, `qtile` [N, Kp / 4]: a row's K
tile is two sections of 16 words (section u holds k = 64 u ..), each word four 8-bit fields, field
f + 2h (f = 0..1) of word r of section u being k = 64 u + 32 f + 2 r + h; positions, tile-major blocks
and scales as above (a tile is 32 words, section u at p = 16 u + 4 c + t). With fp16 activations
`(w >> 8f) & 0x00FF00FF | magic` is again a pair 1024 + q; bf16 cannot hold 128 + q exactly past
q = 127, so its codes go through fp32 (2**23 + q, one subtraction, one packing convert a pair: ~2.5
instructions a weight; the byte goes under the magic in one PRMT). The GEMV takes them in fp32 (q - z
exact, one FFMA a weight), the tensor-core and dequant kernels as above; the warp-specialised kernel
(fitllm.kernels.w4a16_ws) reads a section per 64 columns and rounds (q - z) * s in one packed multiply.
"""

from __future__ import annotations

import torch

from ._utils import (backend_for, by_width, config_for, defer_splitk, device_index, gpu_arch, interpreting, num_sms,
                     packed_math_ok, pdl_args, pending_or_y, pick_config, row_bounds, split_k_for, split_waves,
                     splitk_buffers)

try:
    import triton
    import triton.language as tl

    from ._pdl import let_next_launch, wait_for_previous
    from .w4a16 import (_MAGIC, _dot, _dot_pairs, _half, _one_row_dot, _rows_out, _store_tile, _tile_program,
                        _unpack_q_minus_z)
except ImportError:  # CPU-only installs without triton still get the reference
    triton = None

TILE_K = 128
TILE_N = 128  # rows per stored block (tile-major storage, see the module docstring)


# --------------------------------------------------------------------------- layout (torch)

def _geometry(bits: int) -> tuple[int, int]:
    """(sections, pair fields): a row's K tile of 128 is `sections` runs of 16 words (4-bit: 1,
    8-bit: 2), each word holding `pair fields` pairs (4-bit: 4, 8-bit: 2) of neighbouring k."""
    if bits not in (4, 8):
        raise ValueError(f"tiled layout: bits must be 4 or 8, got {bits}")
    return bits // 4, 16 // bits


def words_per_tile(bits: int) -> int:
    """int32 words of one row's K tile of 128."""
    return 4 * bits


def _field_shifts(device, bits: int = 4) -> torch.Tensor:
    """[f, h] -> bit offset of field f + F h (F pair fields) in a word."""
    _, F = _geometry(bits)
    return (bits * (torch.arange(F).view(F, 1) + F * torch.arange(2).view(1, 2))).to(device)


def tile_pack(qweight: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Standard qweight [K*bits/32, N] -> qtile [N, Kp*bits/32] (see the module docstring)."""
    U, F = _geometry(bits)
    q = torch.stack([(qweight >> (bits * j)) & ((1 << bits) - 1) for j in range(32 // bits)], dim=1)
    q = q.reshape(-1, qweight.shape[1])  # [K, N]
    K, N = q.shape
    kp = -(-K // TILE_K) * TILE_K
    if kp != K:
        q = torch.cat([q, q.new_zeros(kp - K, N)])
    # k = 128 tile + 32 F u + 32 f + 8 t + 2 c + h  ->  [N, tile, u, f, t, c, h]
    q = q.t().reshape(N, kp // TILE_K, U, F, 4, 4, 2).to(torch.int64)
    words = (q << _field_shifts(q.device, bits).view(1, 1, 1, F, 1, 1, 2)).sum(dim=(3, 6))  # [N, tile, u, t, c]
    words = words.permute(0, 1, 2, 4, 3)  # word r = c + 4t of section u stored at p = 16 u + 4c + t
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # the same 32 bits as int32
    return _to_blocks(words.reshape(N, kp // TILE_K, words_per_tile(bits)).to(torch.int32))


def permute_tile_rows(qtile: torch.Tensor, idx: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """qtile of the weight whose output row j is row idx[j] of qtile's weight."""
    return _to_blocks(_from_blocks(qtile, words_per_tile(bits))[idx])


def _to_blocks(words: torch.Tensor) -> torch.Tensor:
    """[N, tiles, W] row-major words -> qtile [N, tiles * W] stored tile-major per TILE_N rows."""
    N, tiles, W = words.shape
    full = N // TILE_N * TILE_N
    head = words[:full].reshape(-1, TILE_N, tiles, W).permute(0, 2, 1, 3).reshape(-1)
    tail = words[full:].permute(1, 0, 2).reshape(-1)  # the last, shorter block
    return torch.cat([head, tail]).view(N, tiles * W)


def _from_blocks(qtile: torch.Tensor, W: int = 16) -> torch.Tensor:
    """Inverse of _to_blocks: qtile [N, tiles * W] -> [N, tiles, W] words of each row."""
    N, tiles = qtile.shape[0], qtile.shape[1] // W
    full = N // TILE_N * TILE_N
    flat = qtile.reshape(-1)
    head = flat[: full * tiles * W].view(-1, tiles, TILE_N, W).permute(0, 2, 1, 3).reshape(full, tiles, W)
    tail = flat[full * tiles * W:].view(tiles, N - full, W).permute(1, 0, 2)
    return torch.cat([head, tail])


def tile_unpack(qtile: torch.Tensor, K: int, bits: int = 4) -> torch.Tensor:
    """Inverse of tile_pack: qtile [N, Kp*bits/32] -> q [K, N] int32 (tests, the reference path)."""
    U, F = _geometry(bits)
    N = qtile.shape[0]
    w = _from_blocks(qtile, words_per_tile(bits)).to(torch.int64) & 0xFFFFFFFF
    w = w.reshape(N, -1, U, 4, 4).permute(0, 1, 2, 4, 3)  # [N, tile, u, t, c]
    shifts = _field_shifts(w.device, bits).view(1, 1, 1, F, 1, 1, 2)
    q = (w[:, :, :, None, :, :, None] >> shifts) & ((1 << bits) - 1)  # [N, tile, u, f, t, c, h]
    return q.reshape(N, -1)[:, :K].t().to(torch.int32).contiguous()


def tiled_supported(bits: int, group_size: int, K: int, g_idx, dtype: torch.dtype) -> bool:
    """Whether a weight can use this layout (otherwise it stays in the standard one)."""
    chunk_ok = group_size >= K or group_size % TILE_K == 0 or group_size in (32, 64)
    return bits in (4, 8) and g_idx is None and chunk_ok and dtype in (torch.bfloat16, torch.float16)


def dequantize_tiled_ref(qtile, scales, zeros, group_size, K, dtype, bits=4):
    """Torch reference of dequantize_tiled (same signature): W [N, K] in `dtype`, computed in fp32."""
    q = tile_unpack(qtile, K, bits)
    g = torch.arange(K, device=q.device) // min(group_size, K)
    return ((q.float() - zeros.float()[g]) * scales.float()[g]).t().to(dtype)


def w4a16_tiled_ref(x, qtile, scales, zeros, group_size, K, bias=None, bits=4):
    """Torch reference of w4a16_tiled_gemm (same signature): untile, dequantize to x's dtype, matmul."""
    y = x @ dequantize_tiled_ref(qtile, scales, zeros, group_size, K, x.dtype, bits).t()
    return y if bias is None else y + bias.to(y.dtype)


# --------------------------------------------------------------------------- Triton

if triton is not None:

    def _sub_asm(kind, one, scaled):
        """$0, $1 <- halves of $2 * 1 + $3 [then * $4]: (magic + q) - (magic + z), exact [times s]."""
        mul = f"mov.b32 nzero, 0x80008000;\nfma.rn.{kind} t, t, $4, nzero;\n" if scaled else ""
        return ("{\n.reg .b32 t, one, nzero;\nmov.b32 one, " + one + ";\nfma.rn." + kind
                + " t, $2, one, $3;\n" + mul + "mov.b32 {$0, $1}, t;\n}")

    _SUB_BF16 = tl.constexpr(_sub_asm("bf16x2", "0x3F803F80", False))
    _SUB_F16 = tl.constexpr(_sub_asm("f16x2", "0x3C003C00", False))
    _SUB_MUL_BF16 = tl.constexpr(_sub_asm("bf16x2", "0x3F803F80", True))
    _SUB_MUL_F16 = tl.constexpr(_sub_asm("f16x2", "0x3C003C00", True))

    _TILE_N: tl.constexpr = tl.constexpr(TILE_N)

    @triton.jit
    def _word_offsets(n, kt, N, stride_q, WORDS: tl.constexpr = 16):
        """Offset of word 0 of K tile kt (WORDS words a row) for rows n (any shape) in the
        tile-major storage; rows past N get offsets that must stay masked. (The row terms are
        loop-invariant: per K tile this is one multiply-add per row.)"""
        blk = n // _TILE_N
        rows = tl.minimum(_TILE_N, N - blk * _TILE_N)
        return blk * _TILE_N * stride_q + (kt * rows + n - blk * _TILE_N) * WORDS

    @triton.jit
    def _load_tile_words(q_ptr, n0, N, stride_q, kt, BN: tl.constexpr, ROW_WARPS: tl.constexpr,
                         EVEN_N: tl.constexpr = False, BITS: tl.constexpr = 4, SECTION: tl.constexpr = 0):
        """Words [BN, 16] of K tile kt (8-bit weights: of its SECTION 0 or 1). Loaded as [8, ROW_WARPS,
        2, REP, 16]: Triton spreads the dims after the contiguous word axis over lanes then warps in
        index order, so thread (warp w, lane l) holds rows 16 w + l // 4 (+ 8) and words 4 (l % 4) ..
        + 3, which is the A-fragment ownership of the MMA (row = REP index * 16 ROW_WARPS + 16 w + 8 a
        + g). EVEN_N: every row exists (unmasked)."""
        REP: tl.constexpr = BN // (16 * ROW_WARPS)
        g = tl.arange(0, 8)[:, None, None, None, None]
        w = tl.arange(0, ROW_WARPS)[None, :, None, None, None]
        a = tl.arange(0, 2)[None, None, :, None, None]
        rep = tl.arange(0, REP)[None, None, None, :, None]
        p = tl.arange(0, 16)[None, None, None, None, :]
        n = n0 + rep * (16 * ROW_WARPS) + w * 16 + a * 8 + g
        ptrs = q_ptr + _word_offsets(n, kt, N, stride_q, 4 * BITS) + 16 * SECTION + p
        if EVEN_N:
            qw = tl.load(ptrs)
        else:
            qw = tl.load(ptrs, mask=n < N, other=0)
        return tl.reshape(tl.permute(qw, (3, 1, 2, 0, 4)), (BN, 16))

    @triton.jit
    def _load_tile_sections(q_ptr, n0, N, stride_q, kt, BN: tl.constexpr, ROW_WARPS: tl.constexpr,
                            EVEN_N: tl.constexpr, BITS: tl.constexpr):
        """_load_tile_words of K tile kt's sections: (section 0, section 1) for 8-bit weights,
        (the words, the same words) for 4-bit ones (see _tile_field)."""
        qw = _load_tile_words(q_ptr, n0, N, stride_q, kt, BN, ROW_WARPS, EVEN_N, BITS)
        qw1 = qw
        if BITS == 8:
            qw1 = _load_tile_words(q_ptr, n0, N, stride_q, kt, BN, ROW_WARPS, EVEN_N, BITS, 1)
        return qw, qw1

    @triton.jit
    def _round_to(v, F16: tl.constexpr, BY_HAND: tl.constexpr = True):
        """fp32 -> the 16-bit dtype, round to nearest even done BY_HAND for bf16 (triton 3.6's
        interpreter truncates that cast; on the GPU both give the same bits)."""
        if F16:
            return v.to(tl.float16)
        if not BY_HAND:
            return v.to(tl.bfloat16)
        b = v.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        return b.to(tl.float32, bitcast=True).to(tl.bfloat16)

    @triton.jit
    def _minus_magic_zero(v, nz, F16: tl.constexpr):
        """Pairs v of 16-bit floats magic + q, plus nz = -(magic + z) twice: the two halves of (q - z),
        exact, in one packed FMA (the tensor-core kernels here)."""
        if F16:
            lo, hi = tl.inline_asm_elementwise(_SUB_F16, "=h,=h,r,r", [v, nz], dtype=(tl.float16, tl.float16),
                                               is_pure=True, pack=1)
        else:
            lo, hi = tl.inline_asm_elementwise(_SUB_BF16, "=h,=h,r,r", [v, nz], dtype=(tl.bfloat16, tl.bfloat16),
                                               is_pure=True, pack=1)
        return lo, hi

    @triton.jit
    def _minus_magic_zero_times_scale(v, nz, s2, F16: tl.constexpr):
        """(q - z) * s for both halves of the pairs v (magic + q), nz and s2 as in _minus_magic_zero,
        rounded once to the 16-bit dtype (as the reference dequantizes): one packed FMA and multiply."""
        if F16:
            lo, hi = tl.inline_asm_elementwise(_SUB_MUL_F16, "=h,=h,r,r,r", [v, nz, s2], dtype=(tl.float16, tl.float16),
                                               is_pure=True, pack=1)
        else:
            lo, hi = tl.inline_asm_elementwise(_SUB_MUL_BF16, "=h,=h,r,r,r", [v, nz, s2],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
        return lo, hi

    # $0, $1 <- bf16 halves of ($3 : $2) * $4: two fp32 values exact in bf16 (8-bit q - z) packed by one
    # cvt, then one packed multiply by the scale pair, rounded once as the reference rounds (q - z) * s
    _PACK_MUL_BF16 = tl.constexpr("{\n.reg .b32 t, nzero;\ncvt.rn.bf16x2.f32 t, $3, $2;\nmov.b32 nzero, 0x80008000;\n"
                                  "fma.rn.bf16x2 t, t, $4, nzero;\nmov.b32 {$0, $1}, t;\n}")

    @triton.jit
    def _pack_times_scale(lo, hi, s2):
        """(lo * s, hi * s) in bf16 for fp32 lo, hi that bf16 holds exactly and s2 = s twice as a bf16 pair
        (the warp-specialised kernel's 8-bit codes: a cvt and a packed multiply a pair, one instruction
        fewer than two fp32 multiplies and the cvt)."""
        return tl.inline_asm_elementwise(_PACK_MUL_BF16, "=h,=h,f,f,r", [lo, hi, s2], dtype=(tl.bfloat16, tl.bfloat16),
                                         is_pure=True, pack=1)

    @triton.jit
    def _tile_field(qw0, qw1, j: tl.constexpr, MAGIC2, nz, zf, s2, sf, F16: tl.constexpr, ASM: tl.constexpr,
                    SCALE_IN_W: tl.constexpr, BITS: tl.constexpr = 4, UPCAST: tl.constexpr = True):
        """[BN, 32]: columns 32 j .. 32 j + 31 of the K tile whose words are qw0 (8-bit: sections
        qw0, qw1) as _field_tile makes them."""
        F: tl.constexpr = 16 // BITS
        return _field_tile(qw1 if j >= F else qw0, j % F, MAGIC2, nz, zf, s2, sf, F16, ASM, SCALE_IN_W, BITS, UPCAST)

    @triton.jit
    def _code(qw, byte: tl.constexpr, MAGIC, ASM: tl.constexpr):
        """Byte `byte` of every word under MAGIC's upper bytes (2**23 + q as fp32): one PRMT (ASM)
        instead of a shift or byte extract and a LOP3."""
        if ASM:
            if byte == 0:
                sel: tl.constexpr = "prmt.b32 $0, $1, $2, 0x7650;"
            elif byte == 1:
                sel: tl.constexpr = "prmt.b32 $0, $1, $2, 0x7651;"
            elif byte == 2:
                sel: tl.constexpr = "prmt.b32 $0, $1, $2, 0x7652;"
            else:
                sel: tl.constexpr = "prmt.b32 $0, $1, $2, 0x7653;"
            v = tl.inline_asm_elementwise(sel, "=r,r,r", [qw, MAGIC], dtype=tl.int32, is_pure=True, pack=1)
        else:
            v = ((qw >> (8 * byte)) & 0xFF) | MAGIC
        return v.to(tl.float32, bitcast=True)

    @triton.jit
    def _field_tile(qw, f: tl.constexpr, MAGIC2, nz, zf, s2, sf, F16: tl.constexpr, ASM: tl.constexpr,
                    SCALE_IN_W: tl.constexpr, BITS: tl.constexpr = 4, UPCAST: tl.constexpr = True):
        """[BN, 32]: pair field f of every word (fields f, f + 16 / BITS) as q - z (SCALE_IN_W:
        (q - z) * s rounded once to the 16-bit dtype, as the reference dequantizes), column
        8 t + 2 c + h (= k - 32 f). 8-bit codes with bf16 activations take fp32 (bf16 holds
        magic + q exactly only for q < 128): MAGIC2 = 2**23 as fp32, zf = 2**23 + z, one cvt a pair."""
        BN: tl.constexpr = qw.shape[0]
        WIDE: tl.constexpr = BITS == 8 and not F16
        if WIDE:  # the byte under a fp32 2**23
            lo = _code(qw, f, MAGIC2, ASM)
            hi = _code(qw, f + 2, MAGIC2, ASM)
        else:
            MASK: tl.constexpr = 0x000F000F if BITS == 4 else 0x00FF00FF
            v = ((qw >> (BITS * f)) & MASK) | MAGIC2  # two 16-bit floats magic + q
        if ASM and not WIDE:  # packed FMAs on the pair; its halves stay one register for the MMA
            nzb = tl.broadcast_to(nz, v.shape)
            if SCALE_IN_W:
                lo, hi = _minus_magic_zero_times_scale(v, nzb, tl.broadcast_to(s2, v.shape), F16)
            else:
                lo, hi = _minus_magic_zero(v, nzb, F16)
        else:  # fp32 ((q - z) * s is exact in fp32 before the one rounding)
            if not WIDE:
                lo = _half(v, False, F16)
                hi = _half(v, True, F16)
            lo = lo - zf
            hi = hi - zf
            if SCALE_IN_W:
                lo = lo * sf
                hi = hi * sf
            lo = _round_to(lo, F16, UPCAST)
            hi = _round_to(hi, F16, UPCAST)
        t = tl.reshape(tl.join(lo, hi), (BN, 4, 4, 2))  # [BN, c, t, h] (storage p = 4 c + t)
        return tl.reshape(tl.permute(t, (0, 2, 1, 3)), (BN, 32))

    @triton.jit
    def _cat_k(a, b):
        """[BN, K1] ++ [BN, K1] along K, kept in registers (the join is a register axis)."""
        t = tl.permute(tl.join(a, b), (0, 2, 1))
        return tl.reshape(t, (a.shape[0], 2 * a.shape[1]))

    @triton.jit
    def _pair16(v, DT: tl.constexpr):
        """fp32 [BN] (exact in DT) -> [BN, 1] int32 holding it twice as a 16-bit pair."""
        h = v.to(DT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return (h | (h << 16))[:, None]

    @triton.jit
    def _group_raw(s_ptr, z_ptr, k, N, NUM_GROUPS, offs_n, n_mask, GROUP_SIZE: tl.constexpr, ok):
        """Scale and zero rows [BN] (fp32) of the group holding column k (zeros where not `ok`;
        n_mask None: every row exists)."""
        g = tl.minimum(k // GROUP_SIZE, NUM_GROUPS - 1)  # padded tail tiles use the last group
        if n_mask is None:
            mask = ok
        else:
            mask = n_mask & ok
        s = tl.load(s_ptr + g * N + offs_n, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * N + offs_n, mask=mask, other=0.0).to(tl.float32)
        return s, z

    @triton.jit
    def _group_cols(s, z, F16: tl.constexpr, BITS: tl.constexpr):
        """What the unpack needs of a group: s (fp32 [BN]), -(magic + zero) and s as 16-bit pairs,
        magic + zero and s as fp32 columns [BN, 1]. The magic is _magic2's as a float: 1024 (fp16),
        128 (bf16), 2**23 for 8-bit codes under bf16 (they go through fp32, see _field_tile)."""
        DT: tl.constexpr = tl.float16 if F16 else tl.bfloat16
        MAGICF: tl.constexpr = 1024.0 if F16 else (8388608.0 if BITS == 8 else 128.0)
        zf = z + MAGICF
        return s, _pair16(-zf, DT), zf[:, None], _pair16(s, DT), s[:, None]

    @triton.jit
    def _group_rows(s_ptr, z_ptr, k, N, NUM_GROUPS, offs_n, n_mask, GROUP_SIZE: tl.constexpr, F16: tl.constexpr,
                    BITS: tl.constexpr):
        """_group_cols of the group holding column k."""
        s, z = _group_raw(s_ptr, z_ptr, k, N, NUM_GROUPS, offs_n, n_mask, GROUP_SIZE, True)
        return _group_cols(s, z, F16, BITS)

    @triton.jit
    def _chunk_dot(x_ptr, offs_m, m_mask, stride_xm, k0, K, w, acc, s, UPCAST: tl.constexpr,
                   SCALE_IN_W: tl.constexpr, EVEN_K: tl.constexpr = False):
        """One group's share of the tile: acc += w [BN, CK] @ x[:, k0:k0+CK]^T (times s unless the
        weights already carry it). EVEN_K: no column of the tile is past K."""
        CK: tl.constexpr = w.shape[1]
        offs_k = k0 + tl.arange(0, CK)
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
        else:
            xt = tl.load(x_ptrs, mask=m_mask[None, :] & (offs_k < K)[:, None], other=0.0)
        if SCALE_IN_W:
            return _dot(w, xt, acc, UPCAST)
        part = _dot(w, xt, tl.zeros((w.shape[0], xt.shape[1]), dtype=tl.float32), UPCAST)
        return acc + part * s[:, None]

    @triton.jit(do_not_specialize=["M"])  # else M % 16 == 0 compiles again, mid-serving
    def _w4a16_tiled_kernel(
        x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
        M, N, K, NUM_GROUPS, stride_q, stride_xm, stride_ym, K_ITERS, SPLIT, MAGIC2,
        GROUP_SIZE: tl.constexpr, CHUNK: tl.constexpr, HAS_BIAS: tl.constexpr, USE_WS: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, ROW_WARPS: tl.constexpr, F16: tl.constexpr, ASM: tl.constexpr,
        SCALE_IN_W: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr = False,
        ORDERED: tl.constexpr = False, EVEN_N: tl.constexpr = False, EVEN_K: tl.constexpr = False,
        DEFER: tl.constexpr = False, BITS: tl.constexpr = 4,
    ):
        """y = x W^T for the tiled layout (BITS 4 or 8): program (tile of BM rows x BN columns, K split) walks
        K_ITERS tiles of 128; per tile one dot per group chunk (CHUNK = 128, 64 or 32 columns),
        weights on the MMA's M side (acc is [BN, BM]). Scales are applied to the fp32 partial sum
        of each chunk (small M: BN x BM multiplies per chunk), or with SCALE_IN_W folded into the
        unpacked weights (large M: one more packed multiply per weight pair, and the MMA
        accumulates in place). EVEN_N (BN divides N) and EVEN_K (K a multiple of 128) drop the
        weight-row and x-column masks; the loop stops at the last K tile, so nothing else is
        masked but the rows of x."""
        pid_mn, pid_k, n0, offs_m, offs_n, m_mask, n_mask = _tile_program(M, N, BM, BN)
        wait_for_previous(PDL)
        n_load = None if EVEN_N else n_mask
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        k_iters = tl.minimum(K_ITERS, stride_q // (4 * BITS) - pid_k * K_ITERS)  # the last split may be shorter
        if CHUNK == 128:  # one group per tile: its scale and zero rows are loaded a tile ahead (their
            # load latency was the main stall: ncu, 46% of the cycles between issues at M=16)
            s_next, z_next = _group_raw(s_ptr, z_ptr, pid_k * K_ITERS * 128, N, NUM_GROUPS, offs_n, n_load,
                                        GROUP_SIZE, True)
        for it in range(0, k_iters):
            kt = pid_k * K_ITERS + it
            k0 = kt * 128
            qw, qw1 = _load_tile_sections(q_ptr, n0, N, stride_q, kt, BN, ROW_WARPS, EVEN_N, BITS)
            if CHUNK == 128:
                s, nz, zf, s2, sf = _group_cols(s_next, z_next, F16, BITS)
                s_next, z_next = _group_raw(s_ptr, z_ptr, k0 + 128, N, NUM_GROUPS, offs_n, n_load, GROUP_SIZE,
                                            it + 1 < k_iters)
                w = _cat_k(_cat_k(_tile_field(qw, qw1, 0, MAGIC2, nz, zf, s2, sf, F16, ASM, SCALE_IN_W, BITS, UPCAST),
                                  _tile_field(qw, qw1, 1, MAGIC2, nz, zf, s2, sf, F16, ASM, SCALE_IN_W, BITS, UPCAST)),
                           _cat_k(_tile_field(qw, qw1, 2, MAGIC2, nz, zf, s2, sf, F16, ASM, SCALE_IN_W, BITS, UPCAST),
                                  _tile_field(qw, qw1, 3, MAGIC2, nz, zf, s2, sf, F16, ASM, SCALE_IN_W, BITS, UPCAST)))
                acc = _chunk_dot(x_ptr, offs_m, m_mask, stride_xm, k0, K, w, acc, s, UPCAST, SCALE_IN_W, EVEN_K)
            elif CHUNK == 64:
                for j in tl.static_range(2):
                    s, nz, zf, s2, sf = _group_rows(s_ptr, z_ptr, k0 + 64 * j, N, NUM_GROUPS, offs_n, n_load,
                                                    GROUP_SIZE, F16, BITS)
                    w = _cat_k(_tile_field(qw, qw1, 2 * j, MAGIC2, nz, zf, s2, sf, F16, ASM, SCALE_IN_W, BITS, UPCAST),
                               _tile_field(qw, qw1, 2 * j + 1, MAGIC2, nz, zf, s2, sf, F16, ASM, SCALE_IN_W, BITS,
                                           UPCAST))
                    acc = _chunk_dot(x_ptr, offs_m, m_mask, stride_xm, k0 + 64 * j, K, w, acc, s, UPCAST,
                                     SCALE_IN_W, EVEN_K)
            else:
                for j in tl.static_range(4):
                    s, nz, zf, s2, sf = _group_rows(s_ptr, z_ptr, k0 + 32 * j, N, NUM_GROUPS, offs_n, n_load,
                                                    GROUP_SIZE, F16, BITS)
                    w = _tile_field(qw, qw1, j, MAGIC2, nz, zf, s2, sf, F16, ASM, SCALE_IN_W, BITS, UPCAST)
                    acc = _chunk_dot(x_ptr, offs_m, m_mask, stride_xm, k0 + 32 * j, K, w, acc, s, UPCAST,
                                     SCALE_IN_W, EVEN_K)
        let_next_launch(PDL)
        _store_tile(tl.trans(acc), bias_ptr, y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask, N, stride_ym,
                    pid_mn, SPLIT, HAS_BIAS, USE_WS, ORDERED, pid_k, M * N, DEFER)

    @triton.jit
    def _tiled_dequant_kernel(q_ptr, s_ptr, z_ptr, w_ptr, N, K, NUM_GROUPS, stride_q, MAGIC2,
                              GROUP_SIZE: tl.constexpr, BN: tl.constexpr, F16: tl.constexpr, ASM: tl.constexpr,
                              BITS: tl.constexpr = 4, UPCAST: tl.constexpr = True):
        """qtile -> W [N, K] in the activation dtype, one 128-column tile per program (large M)."""
        kt = tl.program_id(0)
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        n_mask = offs_n < N
        qw, qw1 = _load_tile_sections(q_ptr, tl.program_id(1) * BN, N, stride_q, kt, BN, 4, False, BITS)
        for f in tl.static_range(4):
            k0 = kt * 128 + 32 * f
            s, nz, zf, s2, sf = _group_rows(s_ptr, z_ptr, k0, N, NUM_GROUPS, offs_n, n_mask, GROUP_SIZE, F16, BITS)
            w = _tile_field(qw, qw1, f, MAGIC2, nz, zf, s2, sf, F16, ASM, True, BITS, UPCAST)
            offs_k = k0 + tl.arange(0, 32)
            tl.store(w_ptr + offs_n[:, None] * K + offs_k[None, :], w, mask=n_mask[:, None] & (offs_k < K)[None, :])


    @triton.jit
    def _x_pair(base, idx, ok, KP, EVEN_K: tl.constexpr):
        return tl.load(base, mask=ok if EVEN_K else ok & (idx < KP), other=0)

    @triton.jit
    def _x_pairs(x_ptr, row, M, stride_xw, kt, xoff, KP, EVEN_K: tl.constexpr):
        """x of one row as the four 16-bit pairs (f = 0..3) each word position of tile kt needs,
        [1, 16] int32 each: pair index 64 kt + 16 f + 4 t + c for position p = 4 c + t (0 past K)."""
        idx = kt * 64 + xoff
        base = x_ptr + row * stride_xw + idx
        ok = row < M
        return (_x_pair(base, idx, ok, KP, EVEN_K), _x_pair(base + 16, idx + 16, ok, KP, EVEN_K),
                _x_pair(base + 32, idx + 32, ok, KP, EVEN_K), _x_pair(base + 48, idx + 48, ok, KP, EVEN_K))

    @triton.jit
    def _tile_operands(q_ptr, s_ptr, z_ptr, kt, N, NUM_GROUPS, stride_q, offs_n, n_mask, w_mask, p_ar,
                       GROUP_SIZE: tl.constexpr, F16: tl.constexpr):
        """A GEMV's weights for K tile kt: the words [BN, 16], -(magic + zero) as 16-bit pairs
        broadcast to them, and the scale column [BN, 1] (fp32). w_mask masks the word rows (None:
        every row exists). The scale and zero loads keep n_mask even then: unmasked, ptxas issued
        some of a tile's loads after its math (offline SASS) and the GEMV was 2-5 % slower
        (RESULTS.md, twelfth session)."""
        q_ptrs = q_ptr + _word_offsets(offs_n, kt, N, stride_q)[:, None] + p_ar
        if w_mask is None:
            qw = tl.load(q_ptrs)
        else:
            qw = tl.load(q_ptrs, mask=w_mask[:, None], other=0)
        s, z = _group_raw(s_ptr, z_ptr, kt * 128, N, NUM_GROUPS, offs_n, n_mask, GROUP_SIZE, True)
        _, nz, _, _, sf = _group_cols(s, z, F16, 4)
        return qw, tl.broadcast_to(nz, qw.shape), sf

    @triton.jit
    def _load_words(q_ptr, offs, w_mask):
        """Words at offs [BN, 16], rows masked by w_mask [BN] (None: every row exists)."""
        if w_mask is None:
            qw = tl.load(q_ptr + offs)
        else:
            qw = tl.load(q_ptr + offs, mask=w_mask[:, None], other=0)
        return qw

    @triton.jit
    def _codes_minus_z(qw, zf, MAGIC, ASM: tl.constexpr):
        """An 8-bit word's four codes as fp32 q - z ((2**23 + q) - (2**23 + z), exact): fields 0 and 2
        (the pair k, k + 1 of x pair j = 2 u), then 1 and 3 (pair j + 1)."""
        return (_code(qw, 0, MAGIC, ASM) - zf, _code(qw, 2, MAGIC, ASM) - zf,
                _code(qw, 1, MAGIC, ASM) - zf, _code(qw, 3, MAGIC, ASM) - zf)

    @triton.jit
    def _pair_dot(lo, hi, xp, t, F16: tl.constexpr):
        """t + lo x[k] + hi x[k + 1] for the x pair xp (one FFMA chain)."""
        t += lo * _half(xp, False, F16)
        return t + hi * _half(xp, True, F16)

    @triton.jit
    def _gemv_tile8(x_ptr, q_ptr, s_ptr, z_ptr, kt, m0, M, N, K, NUM_GROUPS, stride_q, stride_xw, offs_n, n_mask,
                    w_mask, p_ar, xoff, acc0, acc1, acc2, acc3, MAGIC, GROUP_SIZE: tl.constexpr, BM: tl.constexpr,
                    F16: tl.constexpr, ASM: tl.constexpr, EVEN_K: tl.constexpr):
        """_gemv_tile for 8-bit weights, fp32 math: a tile's two sections of words [BN, 16] each, the
        codes unpacked once for all rows (x pairs j = 0, 1 meet section 0, j = 2, 3 section 1)."""
        offs = _word_offsets(offs_n, kt, N, stride_q, 32)[:, None] + p_ar
        qa = _load_words(q_ptr, offs, w_mask)
        qb = _load_words(q_ptr, offs + 16, w_mask)
        s, z = _group_raw(s_ptr, z_ptr, kt * 128, N, NUM_GROUPS, offs_n, n_mask, GROUP_SIZE, True)
        zf = (z + 8388608.0)[:, None]
        s = s[:, None]
        a0, a1, a2, a3 = _codes_minus_z(qa, zf, MAGIC, ASM)
        b0, b1, b2, b3 = _codes_minus_z(qb, zf, MAGIC, ASM)
        KP = K // 2
        for m in tl.static_range(BM):
            if BM == 1:  # M == 1: the row mask folds away
                x0, x1, x2, x3 = _x_pairs(x_ptr, 0, 1, stride_xw, kt, xoff, KP, EVEN_K)
            else:
                x0, x1, x2, x3 = _x_pairs(x_ptr, m0 + m, M, stride_xw, kt, xoff, KP, EVEN_K)
            t = _pair_dot(a0, a1, x0, tl.zeros_like(a0), F16)
            t = _pair_dot(a2, a3, x1, t, F16)
            t = _pair_dot(b0, b1, x2, t, F16)
            t = _pair_dot(b2, b3, x3, t, F16) * s
            if m == 0:
                acc0 += t
            elif m == 1:
                acc1 += t
            elif m == 2:
                acc2 += t
            else:
                acc3 += t
        return acc0, acc1, acc2, acc3

    @triton.jit
    def _gemv_tile(x_ptr, q_ptr, s_ptr, z_ptr, kt, m0, M, N, K, NUM_GROUPS, stride_q, stride_xw, offs_n, n_mask, w_mask,
                   p_ar, xoff, acc0, acc1, acc2, acc3, GROUP_SIZE: tl.constexpr, BM: tl.constexpr,
                   F16: tl.constexpr, ASM: tl.constexpr, EVEN_K: tl.constexpr):
        """The GEMV's work on K tile kt: acc_m [BN, 16] += (word dot x pairs) * scale, rows m0..
        (w_mask: see _tile_operands)."""
        qw, nz, s = _tile_operands(q_ptr, s_ptr, z_ptr, kt, N, NUM_GROUPS, stride_q, offs_n, n_mask, w_mask, p_ar,
                                   GROUP_SIZE, F16)
        KP = K // 2
        if BM == 1:  # M == 1: the row mask folds away
            x0, x1, x2, x3 = _x_pairs(x_ptr, 0, 1, stride_xw, kt, xoff, KP, EVEN_K)
            acc0 += _one_row_dot(qw, nz, x0, x1, x2, x3, F16, ASM) * s
        else:
            a, b, c, d = _unpack_q_minus_z(qw, nz, F16, ASM)
            x0, x1, x2, x3 = _x_pairs(x_ptr, m0, M, stride_xw, kt, xoff, KP, EVEN_K)
            acc0 += _dot_pairs(a, b, c, d, x0, x1, x2, x3, F16, ASM) * s
            x0, x1, x2, x3 = _x_pairs(x_ptr, m0 + 1, M, stride_xw, kt, xoff, KP, EVEN_K)
            acc1 += _dot_pairs(a, b, c, d, x0, x1, x2, x3, F16, ASM) * s
            if BM > 2:
                x0, x1, x2, x3 = _x_pairs(x_ptr, m0 + 2, M, stride_xw, kt, xoff, KP, EVEN_K)
                acc2 += _dot_pairs(a, b, c, d, x0, x1, x2, x3, F16, ASM) * s
                x0, x1, x2, x3 = _x_pairs(x_ptr, m0 + 3, M, stride_xw, kt, xoff, KP, EVEN_K)
                acc3 += _dot_pairs(a, b, c, d, x0, x1, x2, x3, F16, ASM) * s
        return acc0, acc1, acc2, acc3

    @triton.jit
    def _tiled_gemv_kernel(
        x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
        M, N, K, NUM_GROUPS, stride_q, stride_xw, stride_ym, K_ITERS, SPLIT, MAGIC,
        GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, USE_WS: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, UNROLL: tl.constexpr, F16: tl.constexpr, ASM: tl.constexpr,
        EVEN_K: tl.constexpr, EVEN_N: tl.constexpr = False, PDL: tl.constexpr = False,
        ORDERED: tl.constexpr = False, DEFER: tl.constexpr = False, BITS: tl.constexpr = 4,
    ):
        """y = x W^T for 1..4 rows of x (BM in 1, 2, 4; more rows: grid axis 2), CUDA cores, packed
        16-bit math (w4a16's _unpack_q_minus_z / _dot_pairs / _one_row_dot). Program (n, k, m) owns
        BN weight rows and K_ITERS K tiles of 128 (UNROLL tiles per loop step). In the tiled layout
        the four x pairs a word needs are plain int32 loads of x (each pair is two neighbouring k),
        shared by the rows. One group per tile (group sizes that are multiples of 128, or
        per-channel): each word's fp32 sum is scaled once. x_ptr: x as int32 pairs.
        EVEN_N (BN divides N) loads the words unmasked, and BM == 1 (the launcher's M == 1) reads
        row 0 of x unmasked: at M = 1 those masks cost ~8 % of the layer (RESULTS.md, twelfth
        session). BITS = 8: _gemv_tile8 (fp32 math; MAGIC = 2**23 as fp32 bits, from a register so
        the mask and OR are one LOP3)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        if BM == 1:
            m0 = 0
        else:
            m0 = tl.program_id(2) * BM
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_mask = offs_n < N
        w_mask = None if EVEN_N else n_mask
        p_ar = tl.arange(0, 16)[None, :]
        xoff = (p_ar % 4) * 4 + p_ar // 4  # pair f = 0 of position p = 4 c + t: 4 t + c
        acc0 = tl.zeros((BN, 16), dtype=tl.float32)
        acc1 = tl.zeros((BN, 16), dtype=tl.float32)
        acc2 = tl.zeros((BN, 16), dtype=tl.float32)
        acc3 = tl.zeros((BN, 16), dtype=tl.float32)
        kt_end = tl.minimum((pid_k + 1) * K_ITERS, stride_q // (4 * BITS))  # the last split may be shorter
        wait_for_previous(PDL)  # x is the previous kernel's output
        for kt in range(pid_k * K_ITERS, kt_end, UNROLL):
            for u in tl.static_range(UNROLL):
                if (UNROLL == 1 or kt + u < kt_end) and BITS == 8:
                    acc0, acc1, acc2, acc3 = _gemv_tile8(
                        x_ptr, q_ptr, s_ptr, z_ptr, kt + u, m0, M, N, K, NUM_GROUPS, stride_q, stride_xw, offs_n,
                        n_mask, w_mask, p_ar, xoff, acc0, acc1, acc2, acc3, MAGIC, GROUP_SIZE, BM, F16, ASM, EVEN_K)
                elif UNROLL == 1 or kt + u < kt_end:
                    acc0, acc1, acc2, acc3 = _gemv_tile(
                        x_ptr, q_ptr, s_ptr, z_ptr, kt + u, m0, M, N, K, NUM_GROUPS, stride_q, stride_xw, offs_n,
                        n_mask, w_mask, p_ar, xoff, acc0, acc1, acc2, acc3, GROUP_SIZE, BM, F16, ASM, EVEN_K)
        let_next_launch(PDL)
        out, offs_m, m_mask = _rows_out(tl.trans(acc0), tl.trans(acc1), tl.trans(acc2), tl.trans(acc3), m0, M, BM)
        _store_tile(out, bias_ptr, y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask, N, stride_ym,
                    tl.program_id(2) * tl.num_programs(0) + pid_n, SPLIT, HAS_BIAS, USE_WS, ORDERED, pid_k, M * N, DEFER)


# --------------------------------------------------------------------------- configs and dispatch

def _tiled(bm, bn, warps, stages, waves=0.0, scale_in_w=False, backend="tiled"):
    """The tensor-core kernel."""
    return dict(BM=bm, BN=bn, num_warps=warps, num_stages=stages, waves=waves, SCALE_IN_W=scale_in_w,
                backend=backend)


def _ws(bm, stages, fallback=None, rows=128):
    """The warp-specialised Hopper kernel (fitllm.kernels.w4a16_ws): BM tokens x `rows` (128 or 256) weight
    rows a program. GEMMs it cannot take (w4a16_ws.ws_supported) run `fallback` (default: dequant + cuBLAS)."""
    return dict(BM=bm, BN=rows, num_warps=4, num_stages=stages, waves=0.0, backend="ws",
                fallback=fallback or _tiled(0, 0, 4, 1, backend="dequant"))


def _gemv(bn, unroll, warps, waves=4.0, stages=1, maxnreg=None, wide=None):
    """The CUDA-core GEMV (M <= 4; groups of 128*j or per-channel, else the tensor-core path).
    maxnreg caps registers per thread (more programs per SM); wide=(min_n, waves): the split-K
    waves for N >= min_n."""
    return dict(BM=4, BN=bn, UNROLL=unroll, num_warps=warps, num_stages=stages, waves=waves, backend="gemv",
                maxnreg=maxnreg, wide=wide)


# rows (max M, config), first match wins; 'waves' sets split-K (programs ~= SMs * waves).
# sm90: H200 sweeps (benchmarks/bench_w4_tiled.py, RESULTS.md 2026-12-01, second session), µs per
# Llama-3-8B layer: M=1 GEMV 60 (BN 128, 4 tiles per step; tc 75); M=2..8 tc BM16 at 6 waves 67-69
# (8 waves 73-75); M=16 tc with the scale in the weights at 4 waves 75 (8 waves 86); M=32 tc BM32 85;
# M=64 tc BM64/BN64/4 warps 109 (BN128/8 warps 134); M=128 tc BM128/BN64, scale in weights 176;
# M=256 tc BM128/BN128 282 (dequant + cuBLAS 330); M > 256 dequant + cuBLAS. Eleventh session, on the
# tile-major storage: M=1 59.6 (65.7 before it), M=16 without the scale in the weights 70.6 (with it 85.7;
# 74.7 before), M=64 112 (125), M=128 183 (204). Twelfth session, words and x unmasked where the shape
# allows (EVEN_N, EVEN_K, row 0): M=1 GEMV 1 tile a step 52.7 (4 tiles 54.5; 55.6 with the scales unmasked
# too, 60.1 before); M=32 at 4 waves 78 (3 waves 82); M=128 the M=256 tile 179 (BM128/BN64 198).
# Thirteenth session: at 4 waves gate_up's 224 row blocks make 2 splits, 448 programs for 528 slots;
# 6 waves (4 splits) take it from 25.3 to 23.1 µs (the other linears are best at 4). Eighteenth session
# (benchmarks/w4_mid_probe.py, each linear alone): the wide gate_up takes wider weight tiles, which read
# x from L2 half / a quarter as often (its time did not follow those bytes: the kernel is latency-bound,
# ncu: 16 % occupancy, stalls on fixed-latency waits and CTA barriers): M=48 / 64 BN128 / 4 warps 39.7-40.4
# vs 49.6-50.2 µs over four runs (layer M=64 111 -> 101); M=96 / 128 / 256 BN256 / 8 warps 61.8 / 62.6 /
# 122.6 vs 69.0 / 67.9 / 134.8 (the other linears lose with either: qkv at M=256 76 vs 35).
# Twenty-sixth session, M = 257..3072 on the warp-specialised kernel (fitllm.kernels.w4a16_ws), each linear
# alone, µs per layer against dequant + cuBLAS / bf16 cuBLAS: M=320 BM128 4 stages 309 / 369 / 221; M=512
# BM128 (N <= 4096) and BM256 (wider) 342 / 470 / 329; M=768 BM256 559 / 630 / 502; M=1024 656 / 779 / 656;
# M=2048 1339 / 1437 / 1324; M=3072 2066 / 2064 / 1999; M=4096 2789 / 2754 / 2653 (so dequant above 3072).
# BM256 needs M >= 512: at M=320 its second token tile is mostly empty (gate_up 242 vs 154 µs). M=96..256,
# µs per linear (qkv / o / gate_up / down), tiled table vs best: M=128 42.3 / 25.6 / 62.6 / 45.9 vs ws BM64
# 18.7 / - / ws BM128 52.6 / - (o and down share N = 4096, and down has no split-K on ws: the tiled tile keeps
# both); M=256 40.3 / 33.8 / 123.3 / 73.8 vs ws BM128 24.4 / BM64 18.7 / BM128 104.4 / BM64 68.4 (271 -> 216).
# Thirty-third session (as the twenty-seventh): o_proj alone on ws BM64 at M = 65..128, down_proj on the tile, is
# 2-11 µs a layer faster (H200 M=128 136.5 vs 143.8) but 1 % slower in the engine at batch 128: not kept.
def _wide_on_ws(row: dict, bm: int, fallback: dict | None = None, stages: int = 4) -> dict:
    """A small-M row whose widest weights (gate|up, N > 16384) take the warp-specialised kernel with
    256-row programs (fallback: the Triton tile, `row` by default). Thirty-fifth session, gate_up alone,
    H100, µs, the row's tile -> ws: M = 8 35.3 -> 27.1 (BM 16), 16 31.9 -> 27.8, 17..32 33.8-34.2 -> 28.2-28.4
    (BM 32), 40..64 39.0-40.8 -> 31.8-34.2 (BM 64); the tile's 224-448 programs of 64-128 rows ran 2-3 an SM
    on their CTA barriers, the ws kernel's 112 one an SM, two 128-row consumers each (RESULTS.md). 8-bit
    (3 stages), the row's config -> ws: M = 8 46.0 -> 43.3, 16 46.7 -> 43.8, 32 49.6 -> 44.5, 48 / 64 (ws
    with 128-row programs) 51.7 / 52.4 -> 45.7 / 46.9; M = 1 45.5 (the tile; the GEMV 47.7) -> 43.0 (thirty-sixth
    session). M = 1..4 at 4 bits: a tie with the GEMV (26.4 vs 26.7), which keeps M = 1."""
    return by_width(row, (16384, 1 << 62, _ws(bm, stages, fallback or row, rows=256)))


_M256 = _tiled(128, 128, 8, 3, waves=1, scale_in_w=True)  # the tiled kernel's M <= 256 tile (fallbacks below)
_M256_WIDE = _tiled(128, 256, 8, 3, waves=1, scale_in_w=True)  # ... and its wide-weight (gate_up) tile
TILED_CONFIGS = {
    "sm90": [
        (1, _gemv(128, 1, 8, waves=4, wide=(16384, 6))),
        (8, _wide_on_ws(_tiled(16, 64, 4, 3, waves=6), 16)),
        (16, _wide_on_ws(_tiled(16, 64, 4, 3, waves=4), 16)),
        (32, _wide_on_ws(_tiled(32, 64, 4, 3, waves=4), 32)),
        (64, _wide_on_ws(_tiled(64, 64, 4, 3, waves=3), 64, _tiled(64, 128, 4, 3, waves=2))),
        (128, by_width(_M256, (4096, 16384, _ws(64, 4, _M256)), (16384, 1 << 62, _ws(128, 4, _M256_WIDE)))),
        (256, by_width(_ws(64, 4, _M256), (4096, 1 << 62, _ws(128, 4, _M256_WIDE)))),
        (384, _ws(128, 4)),
        (640, by_width(_ws(128, 3), (4096, 1 << 62, _ws(256, 3)))),
        (3072, _ws(256, 3)),
        (1 << 62, _tiled(0, 0, 4, 1, backend="dequant")),
    ],
    "default": [
        (2, _gemv(64, 1, 4, waves=4)),
        (16, _tiled(16, 64, 4, 2, waves=4)),
        (64, _tiled(64, 64, 4, 2, waves=2)),
        (1 << 62, _tiled(0, 0, 4, 1, backend="dequant")),
    ],
}


# 8-bit weights in the tiled layout (GPTQ int8): the GEMV at M = 1 (but for the widest weights), the
# tensor-core kernel up to M = 64 (the widest weights from M = 1 on the warp-specialised kernel), the
# warp-specialised kernel up to M = 2048, then dequant + cuBLAS. sm90: H100 sweeps (RESULTS.md, thirty-first
# and thirty-second sessions), µs per Llama-3-8B layer against the standard layout's W8A16 table / bf16 cuBLAS:
# M=1 93 (97) / 157 (GEMV qkv / o / down 13.3 / 8.3 / 26.1, tc 15.3 / 10.1 / 27.5; gate_up tc 45.7, GEMV 48.3);
# M=2 99 (113) / 158 (the GEMV 4-15 % slower than tc on every linear); M=4 98 (143) / 159; M=16 110 (143) / 168;
# M=32 117 (198) / 169; M=64 148 (226) / 171. Thirty-second session, each linear alone on the ws kernel (qkv /
# o / gate_up / down) against the tensor-core tile: M=128 ws BM64 22.9 / 21.6 / BM128 65.6 / 69.2 vs 27.6 /
# 30.5 / 83.9 / 55.8 (down, K = 14336, has no split-K on ws and keeps the tile, and so does o, of the same width:
# o alone on ws is 5-9 µs faster, but not in the engine at batch 128, thirty-third session; layer 198 -> ~175,
# bf16 181); M=256 ws BM128 29.6 / BM64 22.4 / BM128 128.5 / BM64 75.2 vs 46.5 / 42.3 / 191.9 / 111.8 (393 ->
# 256, bf16 206); M=384 ws BM128 (3 stages) 369 vs dequant 531 (bf16 263); M=512 BM128 for N = 4096, BM256 wider
# 405 vs 588 (bf16 314); M=768..2048 BM256 625 / 716 / 1412 vs dequant 744 / 904 / 1553 (bf16 473 / 621 / 1218);
# M=4096 dequant 2784 vs ws 3361 (bf16 2403). Thirty-third session, H200: gate_up at M=40..64 on ws BM64
# 48.0-48.3 vs the tile's 67.1-67.7 (at M <= 32 the tile wins, 41-45 vs 45-63; qkv / o / down lose on ws at every
# M <= 64); whole table M=64 143 -> 124 (bf16 126); the engine's offline steps of 64 sequences +7 % (H100).
_W8_M128 = _tiled(128, 128, 8, 3, waves=1, scale_in_w=True)
TILED8_CONFIGS = {
    "sm90": [
        (1, _wide_on_ws(_gemv(128, 1, 8, waves=4), 16, _tiled(16, 64, 4, 3, waves=4), stages=3)),
        (16, _wide_on_ws(_tiled(16, 64, 4, 3, waves=4), 16, stages=3)),
        (32, _wide_on_ws(_tiled(32, 64, 4, 3, waves=4), 32, stages=3)),
        (64, _wide_on_ws(_tiled(64, 64, 4, 3, waves=3), 64, _ws(64, 4, _tiled(64, 64, 4, 3, waves=2)), stages=3)),
        (128, by_width(_W8_M128, (4096, 16384, _ws(64, 4, _W8_M128)), (16384, 1 << 62, _ws(128, 3, _W8_M128)))),
        (256, by_width(_ws(64, 4, _W8_M128), (4096, 1 << 62, _ws(128, 4, _W8_M128)))),
        (384, _ws(128, 3)),
        (512, by_width(_ws(128, 3), (4096, 1 << 62, _ws(256, 2)))),
        (2048, _ws(256, 2)),
        (1 << 62, _tiled(0, 0, 4, 1, backend="dequant")),
    ],
    "default": [
        (16, _tiled(16, 64, 4, 2, waves=4)),
        (64, _tiled(64, 64, 4, 2, waves=2)),
        (1 << 62, _tiled(0, 0, 4, 1, backend="dequant")),
    ],
}


def tile_table(bits: int) -> dict:
    return TILED_CONFIGS if bits == 4 else TILED8_CONFIGS


def dequant_from_tokens(arch: str, N: int, K: int, group_size: int, bits: int = 4) -> int:
    """The fewest tokens for which w4a16_tiled_triton dequantizes this [N, K] weight whole to 16 bits
    and calls cuBLAS (a transient copy fitllm.budget reserves), as the tile table for `arch` picks:
    ws rows count as their fallback where the ws kernel refuses the shape (w4a16_ws.ws_shape_ok;
    sm90 only, 16-bit x of K contiguous elements)."""
    from .w4a16_ws import ws_shape_ok

    table = tile_table(bits)

    def ws_ok(rows: int) -> bool:
        return arch == "sm90" and ws_shape_ok(N, group_size, K, torch.bfloat16, 2 * K, 0, rows)

    def backend(m: int) -> str:
        return _unless_ws_refuses(config_for(pick_config(table, arch, m), N), ws_ok)["backend"]

    starts = sorted({1} | {b + 1 for b in row_bounds(table, arch)})  # nothing changes inside a row
    return next((m for m in starts if backend(m) == "dequant"), 1 << 62)


def _unless_ws_refuses(cfg: dict, ws_ok) -> dict:
    """The config that runs: a ws row falls back (maybe to a ws config with 128-row programs, then to a
    Triton one) while the ws kernel refuses the GEMM with the config's programs: ws_ok(rows) is
    w4a16_ws.ws_supported's answer (the budget's dequant_from_tokens asks the same)."""
    while cfg["backend"] == "ws" and not ws_ok(cfg["BN"]):
        cfg = cfg["fallback"]
    return cfg


def _chunk_for(group_size: int, K: int) -> int:
    if group_size >= K or group_size % TILE_K == 0:
        return TILE_K
    if group_size in (32, 64):
        return group_size
    raise ValueError(f"tiled layout: group size {group_size} is not 32, 64 or a multiple of 128")


def _check(x, qtile, scales, zeros, group_size, K, bits):
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"tiled W4A16 needs bf16/fp16 activations, got {x.dtype}")
    kp = -(-K // TILE_K) * TILE_K
    words = kp // TILE_K * words_per_tile(bits)
    if qtile.dtype != torch.int32 or qtile.shape[1] != words or x.shape[1] != K:
        raise ValueError(f"qtile must be int32 [N, {words}] for K={K} at {bits} bits, "
                         f"got {tuple(qtile.shape)} {qtile.dtype}")
    G = -(-K // group_size)
    if scales.shape != (G, qtile.shape[0]) or zeros.shape != scales.shape:
        raise ValueError(f"scales/zeros must be [{G}, N]: got {tuple(scales.shape)}, {tuple(zeros.shape)}")


def _magic2(dtype, bits: int = 4) -> int:
    """The bits the unpack ORs over a code: 1024 (fp16) / 128 (bf16) twice; 8-bit codes under bf16
    go through fp32, 2**23 (see _field_tile)."""
    if dtype == torch.float16:
        return 0x64006400
    return _MAGIC if bits == 8 else 0x43004300


def dequantize_tiled(qtile, scales, zeros, group_size, K, dtype, out=None, bits=4):
    """W [N, K] in `dtype` by the Triton dequant kernel (the large-M path's first step); `out`, a
    contiguous [N, K] tensor of that dtype, receives it (benchmarks reuse buffers)."""
    N = qtile.shape[0]
    w = out if out is not None else torch.empty((N, K), dtype=dtype, device=qtile.device)
    _tiled_dequant_kernel[(qtile.shape[1] // words_per_tile(bits), triton.cdiv(N, 64))](
        qtile, scales, zeros, w, N, K, scales.shape[0], qtile.shape[1], _magic2(dtype, bits),
        GROUP_SIZE=min(group_size, K), BN=64, F16=dtype == torch.float16,
        ASM=packed_math_ok(device_index(qtile), dtype), BITS=bits, UPCAST=interpreting(), num_warps=4)
    return w


def w4a16_tiled_triton(x, qtile, scales, zeros, group_size, K, bias=None, config=None, out=None, defer=False, bits=4):
    """The Triton path; `config` overrides the table, `out` receives y (benchmarks, tests). defer:
    a split-K launch returns a PendingSum instead of y (see _utils.PendingSum; not with `out`).
    8-bit weights (bits=8) take every path (GEMV, tensor-core, warp-specialised, dequant)."""
    _check(x, qtile, scales, zeros, group_size, K, bits)
    x = x.contiguous() if x.stride(-1) != 1 else x
    M, N = x.shape[0], qtile.shape[0]
    dev = device_index(x)
    cfg = config_for(dict(config) if config is not None else pick_config(tile_table(bits), gpu_arch(dev), M), N)
    y = out if out is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    defer = defer_splitk(defer, out, bias)
    if cfg["backend"] == "gemv" and _chunk_for(group_size, K) == TILE_K:
        return _launch_gemv(cfg, x, qtile, scales, zeros, group_size, K, bias, y, dev, defer, bits)
    if cfg["backend"] == "gemv":  # groups of 32/64 change inside a word: the tensor-core path
        cfg = _tiled(16, 64, cfg["num_warps"], 3, waves=cfg["waves"])
    if cfg["backend"] == "ws":
        from .w4a16_ws import w4a16_ws_triton, ws_supported

        cfg = _unless_ws_refuses(cfg, lambda rows: ws_supported(x, N, group_size, K, rows))
        if cfg["backend"] == "ws":
            return w4a16_ws_triton(x, qtile, scales, zeros, group_size, K, bias, y, cfg["BM"], cfg["num_stages"], bits,
                                   cfg["BN"])
    if cfg["backend"] == "dequant":  # large M: one dequant pass, then cuBLAS
        torch.mm(x, dequantize_tiled(qtile, scales, zeros, group_size, K, x.dtype, bits=bits).t(), out=y)
        return y if bias is None else y.add_(bias.to(y.dtype))
    BM, BN, warps = cfg["BM"], cfg["BN"], cfg["num_warps"]
    tiles_mn = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    split, k_iters = split_k_for(tiles_mn, qtile.shape[1] // words_per_tile(bits), num_sms(dev), split_waves(cfg, N, K))
    use_ws = split > 1
    ws, cnt, order = splitk_buffers(x.device, M * N, tiles_mn, split) if use_ws else (y, y, {})
    defer = defer and use_ws
    _w4a16_tiled_kernel[(tiles_mn, split)](
        x, qtile, scales, zeros, bias if bias is not None else scales, y, ws, cnt,
        M, N, K, scales.shape[0], qtile.shape[1], x.stride(0), y.stride(0), k_iters, split, _magic2(x.dtype, bits),
        GROUP_SIZE=min(group_size, K), CHUNK=_chunk_for(group_size, K), HAS_BIAS=bias is not None, USE_WS=use_ws,
        BM=BM, BN=BN, ROW_WARPS=min(warps, BN // 16), F16=x.dtype == torch.float16, ASM=packed_math_ok(dev, x.dtype),
        SCALE_IN_W=cfg.get("SCALE_IN_W", False), UPCAST=interpreting(), EVEN_N=N % BN == 0, EVEN_K=K % TILE_K == 0,
        DEFER=defer, BITS=bits, num_warps=warps, num_stages=cfg["num_stages"], **pdl_args(x), **order)
    return pending_or_y(y, ws, defer)


def _reg_cap(cfg) -> dict:
    """The launch option capping registers, where the config sets one (not under the interpreter)."""
    return {} if cfg.get("maxnreg") is None or interpreting() else {"maxnreg": cfg["maxnreg"]}


def _launch_gemv(cfg, x, qtile, scales, zeros, group_size, K, bias, y, dev, defer=False, bits=4):
    M, N = x.shape[0], qtile.shape[0]
    if x.stride(0) % 2 or x.storage_offset() % 2:  # viewed as int32 pairs below
        x = x.clone(memory_format=torch.contiguous_format)
    BM, BN = min(triton.next_power_of_2(M), 4), cfg["BN"]
    m_blocks, n_blocks = triton.cdiv(M, BM), triton.cdiv(N, BN)
    split, k_iters = split_k_for(m_blocks * n_blocks, qtile.shape[1] // words_per_tile(bits), num_sms(dev),
                                 split_waves(cfg, N, K))
    use_ws = split > 1
    ws, cnt, order = splitk_buffers(x.device, M * N, m_blocks * n_blocks, split) if use_ws else (y, y, {})
    defer = defer and use_ws
    _tiled_gemv_kernel[(n_blocks, split, m_blocks)](
        x.view(torch.int32), qtile, scales, zeros, bias if bias is not None else scales, y, ws, cnt,
        M, N, K, scales.shape[0], qtile.shape[1], x.stride(0) // 2, y.stride(0), k_iters, split, _MAGIC,
        GROUP_SIZE=min(group_size, K), HAS_BIAS=bias is not None, USE_WS=use_ws, BM=BM, BN=BN, UNROLL=cfg["UNROLL"],
        F16=x.dtype == torch.float16, ASM=packed_math_ok(dev, x.dtype), EVEN_K=K % TILE_K == 0, EVEN_N=N % BN == 0,
        DEFER=defer, BITS=bits, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **_reg_cap(cfg),
        **pdl_args(x), **order)
    return pending_or_y(y, ws, defer)


def w4a16_tiled_gemm(x, qtile, scales, zeros, group_size, K, bias=None, defer=False, bits=4):
    """y = x @ W^T (+ bias) for a weight (4 or 8 bits) in the tiled layout; x [M, K] bf16/fp16.
    Triton on CUDA tensors, the torch reference on CPU (FITLLM_KERNEL_BACKEND forces either).
    defer: may return a PendingSum instead of y (a split-K launch on the Triton path)."""
    if backend_for(x) == "triton" and triton is not None:
        return w4a16_tiled_triton(x, qtile, scales, zeros, group_size, K, bias, defer=defer, bits=bits)
    return w4a16_tiled_ref(x, qtile, scales, zeros, group_size, K, bias, bits)
