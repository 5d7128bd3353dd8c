"""Paged KV cache kernels: quantizing cache write, split-K decode attention, prefill/extend attention.

Each Triton kernel has a torch reference with the same signature (`*_ref`), which is the CPU path
and the test oracle. Kernels know tensors only; the cache (fitllm/models/kv_cache.py) owns layout.

Cache layout, per layer (`codes`): `[num_blocks, block_size, kv_heads, codes_per_head]`; a flat slot
is `block * block_size + offset`. fp8 and int8 *values* are the exception, stored transposed within each
block, `[num_blocks, kv_heads, head_dim, block_size]` (see `values_transposed`; `cache_shape` gives both).
`kind` says how a stored row decodes (see `KIND_*`):
  float: codes are the values (fp32/fp16/bf16), codes_per_head = head_dim
  fp8:   e4m3 codes; any per-tensor/per-head scale is folded into q and the output by the caller.
         NaN is never stored (written as 0), so every byte of an fp8 cache is finite: the kernels
         may read a block's unwritten slots, weighted by exactly 0 (see _load_values_t)
  int8:  symmetric, one fp16 scale per `group` values: x = code * scale
  int4:  asymmetric, two codes per byte (element 2j in the low nibble, 2j+1 in the high one),
         fp16 scale and zero per `group` values: x = code * scale + zero
Scales/zeros: `[num_blocks, block_size, kv_heads, head_dim // group]` fp16 (None for float/fp8;
`scales_shape`).
`group` is one int for keys and values, or a pair (key group, value group): int4 keys use
smaller groups than values (keys carry most of int4's error; see kv_cache.py).

Attention kernels take queries already transformed into the cache's space (see kv_cache.py: the
calibrated key mean/scale, the value mean and the Hadamard rotation are folded into q and the
output) and return the raw attention output (fp32 for quantized caches). `out_cols` (act-order
o_proj weights, fitllm.models.decoder.Attention) writes each token's output row with head h's value d
at column out_cols[h * head_dim + d], the next GEMM's input order, which spares it a gather launch.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from fitllm.kernels._fused_triton import (_as_stored, _cast, _rope_heads, _rotate_half, _rotated, _sum_words,
                                          _zero_words)
from fitllm.kernels._pdl import let_next_launch, pdl_start, wait_for_previous
from fitllm.kernels._utils import (PendingSum, device_index, interpreting, num_sms, patch_interpreter_for_numpy_2_4,
                                   pdl_args, scatter_columns, splitk_workspace)

KIND_FLOAT, KIND_FP8, KIND_INT8, KIND_INT4 = 0, 1, 2, 3
FP8_MAX = 448.0
LOG2E = 1.4426950408889634


# This module may be imported after _utils was, once TRITON_INTERPRET is set: patch here too.
if interpreting():
    patch_interpreter_for_numpy_2_4()


def values_transposed(kind: int) -> bool:
    """Whether the value cache stores each block transposed, `[kv_heads, head_dim, block_size]`.
    P.V sums over tokens, and a tensor-core operand must hold consecutive tokens in each register;
    16-bit values get that transpose free on load (ldmatrix.trans), bytes do not: read row-major,
    fp8 values cost one shared-memory load per byte plus the repacking, 1.6x the instructions of the
    whole decode loop (benchmarks/RESULTS.md). int8 likewise (its scales stay in rows beside the
    blocks: one per token and head, or per group of a row); int4 keeps rows (two codes a byte)."""
    return kind in (KIND_FP8, KIND_INT8)


def cache_shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, kind: int,
                values: bool = False) -> tuple[int, ...]:
    """The shape of one layer's key (values=False) or value codes."""
    codes = head_dim // 2 if kind == KIND_INT4 else head_dim
    if values and values_transposed(kind):
        return (num_blocks, kv_heads, codes, block_size)
    return (num_blocks, block_size, kv_heads, codes)


def scales_shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, group: int) -> tuple[int, ...]:
    """The shape of one layer's int8/int4 scales (and int4 zeros): one per `group` values of a row."""
    return (num_blocks, block_size, kv_heads, head_dim // group)


# ----------------------------------------------------------------------------------------------
# torch references
# ----------------------------------------------------------------------------------------------

def quantize_ref(x: torch.Tensor, kind: int, group: int, dtype: torch.dtype):
    """x [N, H, D] float -> (codes, scales, zeros) in the cache's storage format."""
    if kind == KIND_FLOAT:
        return x.to(dtype), None, None
    if kind == KIND_FP8:
        return x.float().nan_to_num(0.0).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), None, None
    n, h, d = x.shape
    g = x.float().reshape(n, h, d // group, group)
    if kind == KIND_INT8:
        # Quantize with the fp16-rounded scale so that dequantization reproduces it exactly.
        scale = (g.abs().amax(-1) / 127).clamp_min(1e-5).half()
        codes = torch.floor(g / scale.float()[..., None] + 0.5).clamp(-127, 127).to(torch.int8)
        return codes.reshape(n, h, d), scale, None
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-5).half()
    zero = lo.half()
    codes = torch.floor((g - zero.float()[..., None]) / scale.float()[..., None] + 0.5).clamp(0, 15).to(torch.uint8)
    codes = codes.reshape(n, h, d)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scale, zero


def dequantize_ref(codes: torch.Tensor, scales: Optional[torch.Tensor], zeros: Optional[torch.Tensor],
                   kind: int, group: int) -> torch.Tensor:
    """Inverse of quantize_ref on rows [..., H, codes_per_head] -> float32 [..., H, D]."""
    if kind in (KIND_FLOAT, KIND_FP8):
        return codes.float()
    if kind == KIND_INT4:
        c = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2).float()
    else:
        c = codes.float()
    shape = c.shape
    c = c.reshape(*shape[:-1], shape[-1] // group, group) * scales.float()[..., None]
    if zeros is not None:
        c = c + zeros.float()[..., None]
    return c.reshape(shape)


def split_group(group) -> tuple[int, int]:
    """`group` as (key group, value group): an int means the same for both."""
    return (group, group) if isinstance(group, int) else (int(group[0]), int(group[1]))


def cache_write_ref(k, v, k_cache, v_cache, k_scales, v_scales, k_zeros, v_zeros, slot_mapping, kind, group):
    """Quantize k/v [T, H, D] and store them at their slots (negative slots are skipped: padding)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    kg, vg = split_group(group)
    for x, cache, scales, zeros, g, transposed in ((k[keep], k_cache, k_scales, k_zeros, kg, False),
                                                   (v[keep], v_cache, v_scales, v_zeros, vg, values_transposed(kind))):
        codes, s, z = quantize_ref(x, kind, g, cache.dtype)
        if codes.dtype == torch.float8_e4m3fn:  # no index_copy_ for fp8 on CPU: copy the bytes
            cache, codes = cache.view(torch.uint8), codes.view(torch.uint8)
        if transposed:
            bs = cache.shape[-1]
            cache[slots // bs, :, :, slots % bs] = codes
        else:
            h = cache.shape[-2]
            cache.view(-1, h, cache.shape[-1]).index_copy_(0, slots, codes)
        for meta, m in ((scales, s), (zeros, z)):
            if m is not None:
                meta.view(-1, meta.shape[-2], meta.shape[-1]).index_copy_(0, slots, m)


def rope_cache_write_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
    """RoPE and the cache write of an unquantized (float) cache in one step: q [T, Hq, D] rotated IN
    PLACE, k [T, H, D] rotated into the cache at its slots with v (k itself is left as it was:
    after the write nothing reads it). Rounding as apply_rope then cache_write: the rotation in
    fp32, rounded to k's dtype, then to the cache's. Returns the rotated queries. q, k, v may be
    views of a GEMM's PendingSum (the qkv projection's), taken here."""
    from fitllm.kernels.fused import apply_rope_ref

    if isinstance(q, PendingSum):  # views of the qkv GEMM's unfinished sum: finish them here
        q, k, v = q.materialize(), k.materialize(), v.materialize()
    k_rot = k.clone()
    apply_rope_ref(q, k_rot, cos, sin)
    cache_write_ref(k_rot, v, k_cache, v_cache, None, None, None, None, slot_mapping, KIND_FLOAT, k.shape[-1])
    return q


def gather_ref(cache, scales, zeros, table, length, kind, group, values: bool = False) -> torch.Tensor:
    """A sequence's first `length` rows of keys (or values), dequantized: [length, H, D] float32."""
    transposed = values and values_transposed(kind)
    bs = cache.shape[-1] if transposed else cache.shape[1]
    blocks = table[: math.ceil(length / bs)].long()

    def rows(t):
        return None if t is None else t[blocks].flatten(0, 1)[:length]

    codes = cache[blocks].permute(0, 3, 1, 2).flatten(0, 1)[:length] if transposed else rows(cache)
    return dequantize_ref(codes, rows(scales), rows(zeros), kind, group)


def _check_out_cols(cols: Optional[torch.Tensor], q: torch.Tensor) -> None:
    if cols is not None and (cols.dim() != 1 or cols.numel() != q.shape[1] * q.shape[2] or cols.dtype != torch.int32
                             or cols.device != q.device):
        raise ValueError(f"paged_attention: out_cols must be int32 [{q.shape[1] * q.shape[2]}] on {q.device}, "
                         f"got {cols.dtype} {tuple(cols.shape)} on {cols.device}")


def paged_attention_ref(q, k_cache, v_cache, k_scales, v_scales, k_zeros, v_zeros, block_tables,
                        query_start: list[int], seq_lens: list[int], scale: float, kind: int, group,
                        sliding_window: Optional[int] = None, out_dtype=None, *,
                        out_cols: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [T, Hq, D]: each sequence's new queries over its cached keys (causal). Output [T, Hq, D]
    (its rows in out_cols' order where given)."""
    _check_out_cols(out_cols, q)
    from fitllm.models.kv_cache import causal_attention  # the one definition of the math

    out = torch.zeros(q.shape, dtype=out_dtype or q.dtype, device=q.device)
    kg, vg = split_group(group)
    for i, length in enumerate(seq_lens):
        lo, hi = query_start[i], query_start[i + 1]
        if hi == lo:
            continue
        k = gather_ref(k_cache, k_scales, k_zeros, block_tables[i], length, kind, kg)
        v = gather_ref(v_cache, v_scales, v_zeros, block_tables[i], length, kind, vg, values=True)
        qf = q[lo:hi].float()
        out[lo:hi] = causal_attention(qf, k, v, scale, sliding_window).to(out.dtype)
    return out if out_cols is None else scatter_columns(out, out_cols)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _store_quantized(X, x_row, CODES, SCALES, ZEROS, row_c, row_s, ok,
                     D: tl.constexpr, KIND: tl.constexpr, GROUP: tl.constexpr, STRIDE: tl.constexpr = 1):
    """Quantize one head's D values (at X + x_row) into the codes row at CODES + row_c (element i
    at + i * STRIDE: a transposed block's column) and the scale/zero row at SCALES/ZEROS + row_s.
    Groups of GROUP values share a scale."""
    NG: tl.constexpr = D // GROUP
    g = tl.arange(0, NG)
    if KIND == 3:
        # Even and odd elements as two tiles, so that each code pair lands in one byte.
        j = tl.arange(0, GROUP // 2)
        off = g[:, None] * GROUP + 2 * j[None, :]
        xe = tl.load(X + x_row + off).to(tl.float32)
        xo = tl.load(X + x_row + off + 1).to(tl.float32)
        lo = tl.minimum(tl.min(xe, 1), tl.min(xo, 1))
        hi = tl.maximum(tl.max(xe, 1), tl.max(xo, 1))
        s = tl.maximum((hi - lo) / 15.0, 1e-5).to(tl.float16)
        z = lo.to(tl.float16)
        # Quantize with the fp16-rounded scale/zero: dequantization then reproduces them exactly.
        sf = s.to(tl.float32)[:, None]
        zf = z.to(tl.float32)[:, None]
        ce = tl.minimum(tl.maximum(tl.floor((xe - zf) / sf + 0.5), 0.0), 15.0).to(tl.int32)
        co = tl.minimum(tl.maximum(tl.floor((xo - zf) / sf + 0.5), 0.0), 15.0).to(tl.int32)
        tl.store(CODES + row_c + g[:, None] * (GROUP // 2) + j[None, :], (ce | (co << 4)).to(tl.uint8), mask=ok)
        tl.store(SCALES + row_s + g, s, mask=ok)
        tl.store(ZEROS + row_s + g, z, mask=ok)
    else:
        d = tl.arange(0, GROUP)
        off = g[:, None] * GROUP + d[None, :]
        x = tl.load(X + x_row + off).to(tl.float32)
        if KIND == 2:
            s = tl.maximum(tl.max(tl.abs(x), 1) / 127.0, 1e-5).to(tl.float16)
            c = tl.floor(x / s.to(tl.float32)[:, None] + 0.5)
            c = tl.minimum(tl.maximum(c, -127.0), 127.0)
            tl.store(CODES + row_c + off * STRIDE, c.to(tl.int8), mask=ok)
            tl.store(SCALES + row_s + g, s, mask=ok)
        else:
            if KIND == 1:  # e4m3 has no infinity: saturate, and store NaN as 0 (see the module doc)
                x = tl.minimum(tl.maximum(tl.where(x == x, x, 0.0), -448.0), 448.0)
            tl.store(CODES + row_c + off * STRIDE, x.to(CODES.dtype.element_ty), mask=ok)


@triton.jit
def _cache_write_kernel(K, V, KC, VC, KS, VS, KZ, VZ, SLOTS, s_kt, s_kh, s_vt, s_vh,
                        H: tl.constexpr, D: tl.constexpr, DC: tl.constexpr, PAGE: tl.constexpr,
                        KIND: tl.constexpr, KGROUP: tl.constexpr, VGROUP: tl.constexpr, VT: tl.constexpr,
                        PDL: tl.constexpr = False):
    pdl_start(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(SLOTS + t).to(tl.int64)
    ok = slot >= 0  # a negative slot marks a padding token: nothing is written
    slot = tl.maximum(slot, 0)
    row_c = (slot * H + h) * DC
    _store_quantized(K, t * s_kt + h * s_kh, KC, KS, KZ, row_c, (slot * H + h) * (D // KGROUP), ok, D, KIND, KGROUP)
    row_v = row_c
    if VT:  # value column `slot % PAGE` of block `slot // PAGE`, [H, D, PAGE]
        row_v = ((slot // PAGE * H + h) * D) * PAGE + slot % PAGE
    _store_quantized(V, t * s_vt + h * s_vh, VC, VS, VZ, row_v, (slot * H + h) * (D // VGROUP), ok, D, KIND, VGROUP,
                     PAGE if VT else 1)


@triton.jit
def _rope_write_kernel(Q, K, V, QO, COS, SIN, KC, VC, SLOTS, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ct, s_st, HALF,
                       H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BH: tl.constexpr,
                       RNE: tl.constexpr, RNE_C: tl.constexpr, X_SUM: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (token t, kv head h): RoPE on h's key, which goes to the float cache at t's slot
    with h's value, and on the G query heads sharing h, rotated in place. One launch instead of
    the RoPE kernel's and the cache write's. RNE / RNE_C: round to bf16 by hand (the interpreter
    truncates) for q and k's dtype / the cache's. X_SUM: Q, K, V are views of the qkv GEMM's
    pending fp32 sum (_utils.PendingSum), taken here; the rotated queries go to QO. cos, sin and
    the slots are read before waiting for the previous kernel (PDL: the step made them before its
    layers, _pdl.py)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BH)[None, :]
    dm = d < HALF
    c = tl.load(COS + t * s_ct + d, mask=dm, other=0.0).to(tl.float32)
    s = tl.load(SIN + t * s_st + d, mask=dm, other=0.0).to(tl.float32)
    slot = tl.load(SLOTS + t).to(tl.int64)
    pdl_start(PDL)
    ok = slot >= 0  # a negative slot marks a padding token: nothing is written
    row = (tl.maximum(slot, 0) * H + h) * D
    CT = KC.dtype.element_ty
    dv = tl.arange(0, 2 * BH)
    vm = dv < D
    if X_SUM:
        k1, k2, v = _rope_taking_sum(Q, K, V, QO, t, h, c, s, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, HALF, H, G, GP, D,
                                     BH, RNE)
    else:
        _rope_heads(Q + h * G * s_qh, t, G, s_qt, s_qh, 1, c, s, HALF, RNE, GP, BH)  # q stays where it is
        kp = K + t * s_kt + h * s_kh + d
        k1, k2 = _rotate_half(kp, kp + HALF, c, s, dm, RNE)
        v = tl.load(V + t * s_vt + h * s_vh + dv, mask=vm, other=0.0)
    tl.store(KC + row + d, _cast(k1.to(tl.float32), CT, RNE_C), mask=dm & ok)
    tl.store(KC + row + HALF + d, _cast(k2.to(tl.float32), CT, RNE_C), mask=dm & ok)
    tl.store(VC + row + dv, _cast(v.to(tl.float32), CT, RNE_C), mask=vm & ok)


@triton.jit
def _rope_taking_sum(Q, K, V, QO, t, h, c, s, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, HALF, H: tl.constexpr,
                     G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, RNE: tl.constexpr):
    """_rope_write_kernel's X_SUM side: reads the program's q, k and v words of the pending sum,
    rounded as the GEMM would have stored y, zeroes them after a CTA barrier (see
    _fused_triton._take_sum: the zeros may be stored in another register layout than the loads'),
    writes the rotated queries to QO [T, H * G, D] and returns the rotated key halves and v."""
    DT = QO.dtype.element_ty
    gi = tl.arange(0, GP)[:, None]
    d = tl.arange(0, BH)[None, :]
    dm = d < HALF
    qm = (gi < G) & dm
    dv = tl.arange(0, 2 * BH)
    vm = dv < D
    qp = Q + t * s_qt + (h * G + gi) * s_qh + d
    kp = K + t * s_kt + h * s_kh + d
    vp = V + t * s_vt + h * s_vh + dv
    q1, q2 = _sum_words(qp, qm), _sum_words(qp + HALF, qm)
    k1, k2 = _sum_words(kp, dm), _sum_words(kp + HALF, dm)
    v = _sum_words(vp, vm)
    tl.debug_barrier()
    _zero_words(qp, qm)
    _zero_words(qp + HALF, qm)
    _zero_words(kp, dm)
    _zero_words(kp + HALF, dm)
    _zero_words(vp, vm)
    q1, q2 = _as_stored(q1, DT, RNE), _as_stored(q2, DT, RNE)
    k1, k2 = _as_stored(k1, DT, RNE), _as_stored(k2, DT, RNE)
    qo = QO + (t * H * G + h * G + gi) * D + d
    q1, q2 = _rotated(q1, q2, c, s, DT, RNE)  # rounded as apply_rope rounds
    tl.store(qo, q1, mask=qm)
    tl.store(qo + HALF, q2, mask=qm)
    k1, k2 = _rotated(k1, k2, c, s, DT, RNE)
    return k1, k2, _cast(v, DT, RNE)


@triton.jit
def _load_rows(CODES, SCALES, ZEROS, slot, head, valid, offs_d,
               H: tl.constexpr, D: tl.constexpr, DC: tl.constexpr, KIND: tl.constexpr, GROUP: tl.constexpr):
    """Rows `slot` [N] of one kv head, dequantized: [N, D] (float32, or the stored float dtype).
    Scales are loaded once per group and broadcast (a load per element costs more than the codes)."""
    row = slot * H + head
    N: tl.constexpr = slot.shape[0]
    NG: tl.constexpr = D // GROUP
    if KIND == 3:
        # Byte j holds elements 2j (low nibble) and 2j+1: join the nibbles, interleave by reshape.
        j = tl.arange(0, D // 2)
        b = tl.load(CODES + row[:, None] * DC + j[None, :], mask=valid[:, None], other=0).to(tl.int32)
        x = tl.reshape(tl.join(b & 15, b >> 4), (N, D)).to(tl.float32)
    else:
        x = tl.load(CODES + row[:, None] * DC + offs_d[None, :], mask=valid[:, None], other=0.0)
    if KIND >= 2:
        x = _times_scales(x, SCALES, row, valid, D, GROUP)
        if KIND == 3:
            sp = row[:, None] * NG + tl.arange(0, NG)[None, :]
            x += tl.load(ZEROS + sp, mask=valid[:, None], other=0.0).to(tl.float32)[:, :, None]
        x = tl.reshape(x, (N, D))
    return x


@triton.jit
def _times_scales(x, SCALES, row, valid, D: tl.constexpr, GROUP: tl.constexpr):
    """Codes x [N, D] times the scales of rows `row` [N] (one per GROUP values; 0 where not `valid`),
    as [N, D // GROUP, GROUP] fp32."""
    NG: tl.constexpr = D // GROUP
    s = tl.load(SCALES + row[:, None] * NG + tl.arange(0, NG)[None, :], mask=valid[:, None], other=0.0)
    return tl.reshape(x.to(tl.float32), (x.shape[0], NG, GROUP)) * s.to(tl.float32)[:, :, None]


def _i8x4_to_f16x2(word: str, lo: str, hi: str) -> str:
    """PTX: four int8 codes (one 32-bit word) -> four exact fp16 values in two f16x2 registers: bias
    each byte by 128, place it under fp16's 1024 (a 0x64 high byte: 1024 + byte), subtract 1152.
    One LOP3, two PRMT, two HSUB2."""
    return (f"xor.b32 u, {word}, 0x80808080;\nprmt.b32 {lo}, u, 0x64646464, 0x5140;\n"
            f"prmt.b32 {hi}, u, 0x64646464, 0x5342;\nmov.b32 m, 0x64806480;\n"
            f"sub.f16x2 {lo}, {lo}, m;\nsub.f16x2 {hi}, {hi}, m;\n")


# on int32 words: four fp16 outputs; on an int8 tile (pack=4): four neighbouring codes a call
_I8_TO_F16 = tl.constexpr("{\n.reg .b32 u, lo, hi, m;\n" + _i8x4_to_f16x2("$4", "lo", "hi")
                          + "mov.b32 {$0, $1}, lo;\nmov.b32 {$2, $3}, hi;\n}")
_I8X4_TO_F16 = tl.constexpr("{\n.reg .b32 u, m;\n" + _i8x4_to_f16x2("$2", "$0", "$1") + "}")


@triton.jit
def _codes_f16(codes, UPCAST: tl.constexpr):
    """An int8 tile as exact fp16 (fp32 under the interpreter, which runs no PTX). Elementwise on
    the tile, so Triton converts after moving the codes into the P.V operand's layout: over the
    transposed value blocks each register's four codes are neighbouring tokens, one 32-bit
    shared-memory load (offline SASS, sm_90, a 128-token tile of 4 warps: 1105 instructions; value
    rows converted as words went through shared memory as fp16, 1303). The keys keep
    _load_codes_f16: this on key rows compiled to fewer instructions (1080) but ran 6-20 % slower
    (H200, RESULTS.md twentieth session)."""
    if UPCAST:
        return codes.to(tl.float32)
    return tl.inline_asm_elementwise(_I8X4_TO_F16, "=r,=r,r", [codes], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _load_codes_f16(CODES, SCALES, slot, head, valid, H: tl.constexpr, D: tl.constexpr, DC: tl.constexpr,
                    UPCAST: tl.constexpr):
    """int8 key rows `slot` [N] of one kv head whose one scale covers the head: the codes [N, D] as
    fp16 (exact; fp32 under the interpreter, which runs no PTX) and the scales [N] (fp32, 0 where
    not `valid`). The caller applies the scales to the [G, N] score tile, not to the [N, D] rows: a
    multiply per token instead of an fp32 round trip per value (offline SASS, sm_90, a 128-token
    tile: 1303 instructions against 1774 with the scales on the rows, values then in rows too). The
    codes are converted in the registers they were loaded into, as 32-bit words."""
    row = slot * H + head
    scale = tl.load(SCALES + row, mask=valid, other=0.0).to(tl.float32)
    if UPCAST:
        offs_d = tl.arange(0, D)
        codes = tl.load(CODES + row[:, None] * DC + offs_d[None, :], mask=valid[:, None], other=0)
        return codes.to(tl.float32), scale
    j = tl.arange(0, D // 4)
    words = tl.load(CODES.to(tl.pointer_type(tl.int32)) + row[:, None] * (DC // 4) + j[None, :],
                    mask=valid[:, None], other=0)
    a, b, c, d = tl.inline_asm_elementwise(_I8_TO_F16, "=h,=h,=h,=h,r", [words],
                                           dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True,
                                           pack=1)
    return tl.reshape(tl.join(tl.join(a, c), tl.join(b, d)), (slot.shape[0], D)), scale


@triton.jit
def _load_values_t(VC, page, pos, head, page_ok, offs_d, H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                   RUN: tl.constexpr):
    """Value rows `pos` [N] of one kv head from a transposed cache ([block, H, D, PAGE]): [N, D].
    Masked by page (`page_ok`, constant over each page), not by token, so each page's PAGE
    consecutive tokens load as one vector; the unwritten tail of a sequence's last page comes along
    (finite by the cache's invariant) and the caller weights it by exactly 0. `pos` starts at a
    multiple of RUN = min(PAGE, N): the hints say so, as the page indices came from a load."""
    off = (page * (H * D * PAGE) + head * (D * PAGE) + pos % PAGE)[:, None] + (offs_d * PAGE)[None, :]
    off = tl.max_contiguous(tl.multiple_of(off, [RUN, RUN]), [RUN, 1])
    return tl.load(VC + off, mask=page_ok[:, None], other=0.0)


@triton.jit
def _load_values(VC, VS, VZ, page, pos, slot, head, page_ok, valid, offs_d, H: tl.constexpr, D: tl.constexpr,
                 DC: tl.constexpr, PAGE: tl.constexpr, RUN: tl.constexpr, KIND: tl.constexpr, VGROUP: tl.constexpr,
                 VT: tl.constexpr):
    """A tile's value rows [N, D]: from the transposed fp8 / int8 blocks (masked by page; int8 times
    its scales, 0 past the sequence) or from rows."""
    if VT:
        v = _load_values_t(VC, page, pos, head, page_ok, offs_d, H, D, PAGE, RUN)
        if KIND == 2:
            v = tl.reshape(_times_scales(v, VS, slot * H + head, valid, D, VGROUP), (pos.shape[0], D))
        return v
    return _load_rows(VC, VS, VZ, slot, head, valid, offs_d, H, D, DC, KIND, VGROUP)


@triton.jit
def _tile_positions(n0, hi, BT, bt_row, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile's token positions (n0 is a multiple of BLOCK_N), the pages that hold them (0 past
    the sequence's last page) and which of those pages are the sequence's."""
    pos = tl.max_contiguous(tl.multiple_of(n0 + tl.arange(0, BLOCK_N), BLOCK_N), BLOCK_N)
    page_ok = pos // PAGE < tl.cdiv(hi, PAGE)
    page = tl.load(BT + bt_row + pos // PAGE, mask=page_ok, other=0).to(tl.int64)
    return pos, page, page_ok


@triton.jit
def _split_span(seq_len, window, sp, num_splits, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr):
    """Split sp's tokens [lo, hi) of a sequence, its first visible token, and how many of the
    num_splits slices hold any (at least 1: split 0 writes even an empty sequence's output). Each
    sequence cuts its own span: the grid does not depend on the lengths, so one CUDA graph serves
    every step, and a short sequence in a graph sized for long ones leaves most splits idle. Tiles
    start at multiples of BLOCK_N (tokens before `start` are masked), so each page's tokens are one
    contiguous run within a tile."""
    start = seq_len * 0
    if WINDOWED:
        start = tl.maximum(seq_len - window, 0)
    first = start // BLOCK_N * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    used = tl.maximum(tl.cdiv(seq_len - first, tl.maximum(chunk, 1)), 1)
    lo = first + sp * chunk
    return start, lo, tl.minimum(lo + chunk, seq_len), used


@triton.jit
def _mma_query(q, KIND: tl.constexpr, UPCAST: tl.constexpr):
    """q in the dtype the tile's MMAs run in. fp32 under the interpreter (its bf16/fp16 tl.dot is
    wrong). fp16 over an fp8 cache: e4m3 -> fp16 is one conversion per pair and exact, -> bf16 goes
    through fp32 (offline SASS, sm_90, a 128-token tile: 759 vs 1146 instructions); q is clamped to
    fp16's range (bf16 reaches further) and P in [0, 1] keeps more bits in fp16. The decode kernel
    asks for the same over int8 rows with one scale per head (their codes are exact fp16). Else q's
    dtype."""
    if UPCAST:
        r = q.to(tl.float32)
    elif KIND == 1:
        r = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    else:
        r = q
    return r


@triton.jit
def _out_columns(OCOLS, heads, offs_d, s_oh, mask, D: tl.constexpr, COLS: tl.constexpr):
    """Offsets within a token's output row of heads [R] x dims [D]: h * s_oh + d, or with COLS
    the columns OCOLS[h * D + d] (paged_attention's out_cols; the output rows are then contiguous)."""
    if COLS:
        return tl.load(OCOLS + heads[:, None] * D + offs_d[None, :], mask=mask, other=0)
    return heads[:, None] * s_oh + offs_d[None, :]


@triton.jit
def _decode_kernel(Q, KC, VC, KS, VS, KZ, VZ, BT, SEQ, OUT, OCOLS, PO, PML, CNT, scale, window, num_splits,
                   s_qt, s_qh, s_bt, s_ot, s_oh,
                   H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DC: tl.constexpr,
                   PAGE: tl.constexpr, BLOCK_N: tl.constexpr, KIND: tl.constexpr, KGROUP: tl.constexpr,
                   VGROUP: tl.constexpr, DIRECT: tl.constexpr, UPCAST: tl.constexpr, VT: tl.constexpr,
                   RUN: tl.constexpr, WINDOWED: tl.constexpr, FUSED: tl.constexpr, GQ: tl.constexpr,
                   SP: tl.constexpr, COMBINE_CHUNK: tl.constexpr, COLS: tl.constexpr, PDL: tl.constexpr = False):
    """One (sequence, kv head, split): the G query heads sharing that kv head against one slice of
    the sequence. Partial results (unnormalised acc, running max, sum) go to PO/PML, or straight to
    OUT when there is a single split (DIRECT). FUSED: the split that finishes last combines them
    (no reduce launch); else _reduce_kernel does. Splits past a sequence's tokens exit at once.
    The lengths are read before waiting for the previous kernel (PDL): the step's inputs, written
    before its first kernel (_pdl.py), so that round trip to memory overlaps the wait."""
    ROW_SCALED_K: tl.constexpr = KIND == 2 and KGROUP == D
    ROW_SCALED_V: tl.constexpr = KIND == 2 and VGROUP == D
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(SEQ + b)
    start, lo, hi, used = _split_span(seq_len, window, sp, num_splits, BLOCK_N, WINDOWED)
    if sp >= used:  # nothing of this sequence here: no partials, no ticket (the combine reads `used`)
        return
    wait_for_previous(PDL)  # q and this step's K/V are the previous kernel's

    offs_d = tl.arange(0, D)
    offs_g = tl.arange(0, GP)  # GQA: the group's heads are the rows of one tile (padded to >= 16)
    heads = kvh * G + offs_g
    q = _mma_query(tl.load(Q + b * s_qt + heads[:, None] * s_qh + offs_d[None, :], mask=(offs_g < G)[:, None],
                           other=0.0), 1 if ROW_SCALED_K else KIND, UPCAST)  # int8 codes as fp16, like fp8
    qk_scale = scale * 1.4426950408889634  # softmax in base 2

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos, page, page_ok = _tile_positions(n0, hi, BT, b * s_bt, PAGE, BLOCK_N)
        valid = pos < hi
        if WINDOWED:
            valid = valid & (pos >= start)
        slot = page * PAGE + pos % PAGE
        # keys masked by page (no per-token predicates): a row past the sequence feeds only its own
        # score, which the next line replaces
        if ROW_SCALED_K:  # int8, a scale per token: on the scores
            k, k_scale = _load_codes_f16(KC, KS, slot, kvh, page_ok, H, D, DC, UPCAST)
            s = tl.dot(q, tl.trans(k)) * (k_scale * qk_scale)[None, :]
        else:
            k = _load_rows(KC, KS, KZ, slot, kvh, page_ok, offs_d, H, D, DC, KIND, KGROUP).to(q.dtype)
            s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # exactly 0 where masked: the values there may be any finite
        l_i = l_i * alpha + tl.sum(p, 1)
        if ROW_SCALED_V:  # int8, a scale per token: on the probabilities (0 past the sequence),
            # divided by the tile's largest so that the fp16 operand stays in [0, 1]
            v = _codes_f16(_load_values_t(VC, page, pos, kvh, page_ok, offs_d, H, D, PAGE, RUN), UPCAST)
            v_scale = tl.load(VS + slot * H + kvh, mask=valid, other=0.0).to(tl.float32)
            top = tl.maximum(tl.max(v_scale, 0), 1e-30)
            pv = tl.dot((p * (v_scale / top)[None, :]).to(v.dtype), v)
            acc = acc * alpha[:, None] + pv * top
        else:
            v = _load_values(VC, VS, VZ, page, pos, slot, kvh, page_ok, valid, offs_d, H, D, DC, PAGE, RUN, KIND,
                             VGROUP, VT).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    let_next_launch(PDL)
    hmask = (offs_g < G)[:, None]
    if DIRECT:
        out = acc / tl.maximum(l_i, 1e-30)[:, None]  # an empty sequence (graph padding) gives 0
        tl.store(OUT + b * s_ot + _out_columns(OCOLS, heads, offs_d, s_oh, hmask, D, COLS),
                 out.to(OUT.dtype.element_ty), mask=hmask)
    else:
        part = (b * (H * G) + heads) * num_splits + sp  # PO [B, Hq, S, D], PML [B, Hq, S, 2]
        tl.store(PO + part[:, None] * D + offs_d[None, :], acc, mask=hmask)
        tl.store(PML + part * 2, m_i, mask=offs_g < G)
        tl.store(PML + part * 2 + 1, l_i, mask=offs_g < G)
        if FUSED:
            # Every thread's partials are stored before the release; the counter counts arrivals
            # per (sequence, kv head) and the last arrival resets it (a clean buffer every launch).
            tl.debug_barrier()
            arrived = tl.atomic_add(CNT + b * H + kvh, 1, sem="acq_rel")
            if arrived == used - 1:
                offs_q = tl.arange(0, GQ)
                out = _combine_partials(PO, PML, b * (H * G) + kvh * G + offs_q, offs_q < G, num_splits, used, D, SP,
                                        COMBINE_CHUNK)
                qmask = (offs_q < G)[:, None]
                tl.store(OUT + b * s_ot + _out_columns(OCOLS, kvh * G + offs_q, offs_d, s_oh, qmask, D, COLS),
                         out.to(OUT.dtype.element_ty), mask=qmask)
                tl.atomic_xchg(CNT + b * H + kvh, 0, sem="relaxed")  # for the next launch: no fence


@triton.jit
def _split_weights(m, top):
    """Each split's weight in the combine, exp2(its max - the rows' max `top` [R]); 0 for splits
    with no partials (m = -inf, masked or empty)."""
    return tl.where(m > float("-inf"), tl.exp2(m - top[:, None]), 0.0)


@triton.jit
def _combine_partials(PO, PML, rows, rmask, num_splits, used, D: tl.constexpr, SP: tl.constexpr,
                      CHUNK: tl.constexpr):
    """Normalised outputs [R, D] (fp32) of the (sequence, head) rows `rows` [R] from the partials
    of their first `used` splits (of num_splits): weights exp2(m_s - max m), empty splits 0. The
    partial outputs are read in [R, CHUNK, D] tiles over the used splits (CHUNK = SP: one tile; less,
    so that a narrow program combining up to 64 splits keeps a tile in registers).
    Loads bypass L1: in the fused combine, other programs wrote these during this launch."""
    s = tl.arange(0, SP)
    pm = rmask[:, None] & (s < used)[None, :]
    part = rows[:, None] * num_splits + s[None, :]
    m = tl.load(PML + part * 2, mask=pm, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(PML + part * 2 + 1, mask=pm, other=0.0, cache_modifier=".cg")
    top = tl.max(m, 1)
    offs_d = tl.arange(0, D)
    if CHUNK == SP:  # one tile
        w = _split_weights(m, top)
        a = tl.load(PO + part[:, :, None] * D + offs_d[None, None, :], mask=pm[:, :, None], other=0.0,
                    cache_modifier=".cg")
        acc = tl.sum(a * w[:, :, None], 1)
        denom = tl.sum(l * w, 1)
    else:  # each tile's weights computed in the loop (all of them kept live: 181 registers instead
        # of 167 in fp8's narrow program, and 1.3x slower at B = 2-4; RESULTS.md, twenty-first session)
        denom = tl.sum(l * _split_weights(m, top), 1)
        acc = tl.zeros([rows.shape[0], D], tl.float32)
        for c in range(0, used, CHUNK):
            sc = c + tl.arange(0, CHUNK)
            pc = rmask[:, None] & (sc < used)[None, :]
            partc = rows[:, None] * num_splits + sc[None, :]
            w = _split_weights(tl.load(PML + partc * 2, mask=pc, other=float("-inf"), cache_modifier=".cg"), top)
            a = tl.load(PO + partc[:, :, None] * D + offs_d[None, None, :], mask=pc[:, :, None], other=0.0,
                        cache_modifier=".cg")
            acc += tl.sum(a * w[:, :, None], 1)
    return acc / tl.maximum(denom, 1e-30)[:, None]


@triton.jit
def _reduce_kernel(PO, PML, SEQ, OUT, OCOLS, num_splits, window, s_ot, s_oh, HQ: tl.constexpr, D: tl.constexpr,
                   SP: tl.constexpr, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr, COLS: tl.constexpr):
    """Combine one (sequence, head)'s split partials (the unfused path). Launched without PDL: with
    it, decode -> reduce -> decode chains lost at batch 1 (H200, fp8 KV at 32k: 25.7 -> 29.1 µs;
    bf16 won 1 µs; RESULTS.md, sixth session; the twenty-first measured 4-6 % gains at 16k-32k and
    2-13 % losses at 8k)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    one = tl.arange(0, 1)
    used = _split_span(tl.load(SEQ + b), window, 0, num_splits, BLOCK_N, WINDOWED)[3]
    out = _combine_partials(PO, PML, b * HQ + h + one, one < 1, num_splits, used, D, SP, SP)
    cols = _out_columns(OCOLS, h + one, tl.arange(0, D), s_oh, one[:, None] < 1, D, COLS)
    tl.store(OUT + b * s_ot + cols, out.to(OUT.dtype.element_ty))


@triton.jit
def _prefill_kernel(Q, KC, VC, KS, VS, KZ, VZ, BT, SEQ, QSTART, OUT, OCOLS, scale, window,
                    s_qt, s_qh, s_bt, s_ot, s_oh,
                    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DC: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KIND: tl.constexpr, KGROUP: tl.constexpr,
                    VGROUP: tl.constexpr, UPCAST: tl.constexpr, VT: tl.constexpr, RUN: tl.constexpr,
                    COLS: tl.constexpr, PDL: tl.constexpr = False):
    """BLOCK_M new queries of one (sequence, head) against the cached prefix plus the new tokens
    (already written to the cache), causal. Query i of a chunk of q_len sits at position
    seq_len - q_len + i."""
    wait_for_previous(PDL)
    mb = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q0 = tl.load(QSTART + b)
    q_len = tl.load(QSTART + b + 1) - q0
    seq_len = tl.load(SEQ + b)
    ctx = seq_len - q_len
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    qmask = offs_m < q_len
    q_pos = ctx + offs_m
    offs_d = tl.arange(0, D)
    q = _mma_query(tl.load(Q + (q0 + offs_m)[:, None] * s_qt + h * s_qh + offs_d[None, :], mask=qmask[:, None],
                           other=0.0), KIND, UPCAST)
    kvh = h // G
    qk_scale = scale * 1.4426950408889634

    hi = tl.minimum(seq_len, ctx + (mb + 1) * BLOCK_M)
    lo = seq_len * 0
    if window > 0:
        lo = tl.maximum(ctx + mb * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    if mb * BLOCK_M >= q_len:  # a tile past this sequence's queries: nothing to do
        hi = lo
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos, page, page_ok = _tile_positions(n0, hi, BT, b * s_bt, PAGE, BLOCK_N)
        valid = pos < hi
        slot = page * PAGE + pos % PAGE
        k = _load_rows(KC, KS, KZ, slot, kvh, page_ok, offs_d, H, D, DC, KIND, KGROUP).to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        keep = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if window > 0:
            keep = keep & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row with nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_values(VC, VS, VZ, page, pos, slot, kvh, page_ok, valid, offs_d, H, D, DC, PAGE, RUN, KIND, VGROUP,
                         VT).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    let_next_launch(PDL)
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    one = tl.arange(0, 1)
    cols = _out_columns(OCOLS, h + one, offs_d, s_oh, one[:, None] < 1, D, COLS)
    tl.store(OUT + (q0 + offs_m)[:, None] * s_ot + cols, out.to(OUT.dtype.element_ty), mask=qmask[:, None])


# ----------------------------------------------------------------------------------------------
# launchers (same signatures as the references)
# ----------------------------------------------------------------------------------------------

def _dummy(t: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return like if t is None else t


def cache_write(k, v, k_cache, v_cache, k_scales, v_scales, k_zeros, v_zeros, slot_mapping, kind, group):
    t, h, d = k.shape
    if t == 0:
        return
    _cache_write_kernel[(t, h)](
        k, v, k_cache, v_cache, _dummy(k_scales, k_cache), _dummy(v_scales, v_cache),
        _dummy(k_zeros, k_cache), _dummy(v_zeros, v_cache), slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        H=h, D=d, DC=k_cache.shape[-1], PAGE=k_cache.shape[1], KIND=kind, **_group_args(kind, group, d),
        VT=values_transposed(kind), num_warps=1, **pdl_args(k))


def rope_cache_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
    """Triton rope_cache_write_ref (same signature): float caches only (v_cache of k_cache's dtype).
    q, k, v may be views of the qkv GEMM's PendingSum, taken here: the rotated queries then go to a
    new tensor. Returns the rotated queries (q itself otherwise)."""
    pending = isinstance(q, PendingSum)
    dtype = q.dtype
    if pending:
        q, k, v = q.acc, k.acc, v.acc
    t, hq, d = q.shape
    h = k.shape[1]
    if (d % 2 or k.shape != (t, h, d) or v.shape != k.shape or cos.shape != (t, d // 2) or sin.shape != cos.shape
            or k_cache.shape[-2:] != (h, d) or hq % h or k.dtype != q.dtype or q.stride(-1) != 1
            or k.stride(-1) != 1 or v.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1):
        raise ValueError(f"rope_cache_write: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"cos {tuple(cos.shape)}, cache {tuple(k_cache.shape)}")
    q_out = torch.empty((t, hq, d), dtype=dtype, device=q.device) if pending else q
    if t == 0:
        return q_out
    g = hq // h
    _rope_write_kernel[(t, h)](
        q, k, v, q_out, cos, sin, k_cache, v_cache, slot_mapping, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), cos.stride(0), sin.stride(0), d // 2, H=h, G=g, GP=triton.next_power_of_2(g),
        D=d, BH=triton.next_power_of_2(d // 2), RNE=interpreting() and dtype == torch.bfloat16,
        RNE_C=interpreting() and k_cache.dtype == torch.bfloat16, X_SUM=pending, num_warps=1, **pdl_args(q_out))
    return q_out


def _group_args(kind: int, group, d: int) -> dict:
    kg, vg = split_group(group) if kind >= KIND_INT8 else (d, d)
    return dict(KGROUP=kg, VGROUP=vg)


# The split combine runs in the decode kernel itself (its last split to finish) up to this many
# splits: one small tile to read, and only the splits that hold tokens (H200, B=1, 16 splits: 8.3
# vs 9.3 µs with the reduce kernel at 4k, 37.6 vs 39.0 at 32k; RESULTS.md, tenth session). Beyond
# it the reduce kernel takes the partials (B=1, fp8 at 16k, 33 splits of 4 warps: 15.2 µs, fused
# 15.5; int8 and int4 on 2 warps 5-11 % slower fused), except fp8's narrow programs, which still
# combine faster themselves, up to 64 splits (B=1 / 2 at 32k: 24.6-24.9 / 41.6-42.3 µs fused,
# 25.5-26.0 / 43.6-43.8 with the reduce kernel; twenty-first session), in tiles of
# FUSED_COMBINE_CHUNK splits.
FUSED_COMBINE_MAX_SPLITS = 16
FUSED_COMBINE_CHUNK = 16  # [G, 16, D] fp32 over a program's threads
# Short sequences are cut into one 128-token tile per split up to this many splits.
SHORT_SPLITS_MAX = 8


# Programs of the decode kernel an sm_90 SM holds (offline compile), wide (128-token tiles, 4 warps)
# and narrow (2 warps): fp8 wide double-buffered 75 KB of shared memory (3), one buffer 41 KB (5),
# narrow (NARROW: 64-token tiles) 39 KB and 152 registers (5); int8 wide 41 KB but 150 registers (3),
# narrow (NARROW_INT8: 128-token tiles) 41 KB and 245 registers (4). int8's 64-token narrow twin (5 an
# SM) lost to NARROW_INT8 by 1.1-1.2x at B = 32-64 (RESULTS.md, twentieth session).
WIDE_PER_SM = {(KIND_FP8, 5): 3, (KIND_FP8, 3): 5, (KIND_INT8, 3): 3}
NARROW_PER_SM = {KIND_FP8: 5, KIND_INT8: 4}
NARROW = dict(block_n=64, num_warps=2, num_stages=5)
NARROW_INT8 = dict(block_n=128, num_warps=2, num_stages=3)
# fp8 / int8 KV spread a small batch over one wave of narrow programs from this many tokens of work.
NARROW_MIN_TOKENS = 32768


def whole_combine_chunks(splits: int) -> int:
    """A split count past two FUSED_COMBINE_CHUNKs rounded down to whole chunks (fp8's narrow
    programs, which combine their own splits). The combine runs after the last split, one
    dependent round trip to memory per chunk, so a last, partial chunk costs as much as a full one
    (H200, fp8 at B = 2, all programs in one wave: 32 splits 39.6 µs at 32k and 24.2 at 16k, 33
    splits 41.6 / 24.7, 41 (the wave's 5 programs an SM) 41.6 / 26.0). Fewer than two chunks' worth
    loses the programs (B = 3: 16 splits 61.1 µs, 27 splits 55.8; RESULTS.md, twenty-second session)."""
    return splits if splits <= 2 * FUSED_COMBINE_CHUNK else splits // FUSED_COMBINE_CHUNK * FUSED_COMBINE_CHUNK


def narrow_program(kind: int) -> dict:
    """The tile, warps and stages of a quantized kind's narrow decode program."""
    return NARROW_INT8 if kind == KIND_INT8 else NARROW


def decode_config(kind: int, code_bytes: int, batch: int, kv_heads: int, max_seq_len: int,
                  sms: int = 132, head_dim: int = 128) -> dict:
    """Default split count, tile, warps and pipeline depth of the decode kernel, from the H200 sweeps
    (benchmarks/RESULTS.md, 2026-12-01 fourth session; nineteenth session for the narrow programs).
    Splits are at least 256 tokens (shorter ones cost more in the combine than they win), or one
    128-token tile each for up to SHORT_SPLITS_MAX splits, at most 64. With B sequences x H kv heads:
    - 16-bit KV, B*H <= SMs: 128-token tiles, double-buffered (Triton does that for this loop only
      from num_stages=5). That is ~128 KB of shared memory, one program per SM, so the sequence is
      split just enough for one wave (B=1 and 16 at 32k: 15 % and 4 % faster than 64-token tiles).
      Several waves of those lose to smaller programs while those fit in one wave: 64-token tiles,
      one buffer, 38 KB of shared memory, so 5 per SM (B=64 and 80: 3-15 % faster). Past that
      wave 128-token tiles with one buffer (74 KB, 3 per SM) win: B=96 1.2-1.3x, B=128 to 256
      0-8 % (RESULTS.md, ninth session). Programs of 2 warps lose for 16-bit KV at every batch.
    - quantized KV: rows are short, so 128-token tiles; about two waves of programs. fp8 double-
      buffers when the sequence is split (few programs each, latency exposed), not otherwise, and
      takes narrow programs (64-token tiles, 2 warps, double-buffered) where they fill the GPU
      better: a small batch with enough tokens gets one wave of them (B=4 at 8k 27.0 -> 25.2 µs,
      B=8 at 32k 146 -> 139, B=1 at 32k 26.2 -> 25.1; fp8 past 32 splits in whole combine chunks,
      whole_combine_chunks: B=2 at 32k 41.6 -> 39.6), and a split batch whose wide programs
      would run over into a second wave keeps its splits on narrow ones (B=32: 700 -> 499 µs at 32k);
      int8 likewise, on narrow programs of 128-token tiles (B=1 at 32k: 35.6 -> 32.0 µs; B=32 and
      64: 933 -> 793 and 1776 -> 1448 µs at 32k; twentieth session). int4 KV, whose
      unpacking bounds it, is faster on narrow programs with twice the splits at nearly every
      shape (5-28 %; B=1 at 8k 4 % slower).
    - fp32 KV (tests, parity runs): 64-token tiles, one buffer (a double-buffered 128 x 128 fp32
      K and V tile would not fit in shared memory).
    The sweeps ran at head_dim 128. Wider float heads (Gemma 3 1B-12B: 256) take tiles of as many
    bytes (fewer tokens): a double-buffered 128-token 16-bit tile of 256-wide heads needs 256 KB of
    shared memory (an H100 has 227). Quantized rows are 1 byte or less: their tiles fit as they are."""
    cfg = _decode_config_d128(kind, code_bytes, batch, kv_heads, max_seq_len, sms)
    if kind == KIND_FLOAT and head_dim > 128:
        cfg["block_n"] = max(16, cfg["block_n"] * 128 // head_dim)
    return cfg


def _decode_config_d128(kind: int, code_bytes: int, batch: int, kv_heads: int, max_seq_len: int, sms: int) -> dict:
    """decode_config at head_dim 128."""
    per_wave = batch * kv_heads
    # Splits of >= 256 tokens, or from 512 tokens on of >= 128 up to SHORT_SPLITS_MAX: one program
    # per 128-token tile beats two to eight tiles in a row (H200, B=1: 512 tokens 7.3 -> 6.3 µs, 1024
    # 7.7 -> 6.3; at 256, two splits lose: 5.5 -> 5.9; RESULTS.md, fifth session).
    by_len = max(max_seq_len // 256, min(max_seq_len // 128, SHORT_SPLITS_MAX) if max_seq_len >= 512 else 0)

    def split(programs: int, cap: int = by_len) -> int:
        return max(1, min(programs // per_wave, cap, 64))

    two_waves = split(2 * sms + per_wave - 1)
    if kind == KIND_FLOAT and code_bytes == 2:
        if per_wave <= sms:
            return dict(num_splits=split(sms), block_n=128, num_warps=4, num_stages=5)
        if per_wave > 5 * sms:
            return dict(num_splits=1, block_n=128, num_warps=4, num_stages=3)
    if kind == KIND_FLOAT:
        return dict(num_splits=two_waves, block_n=64, num_warps=4, num_stages=2)
    narrow = narrow_program(kind)
    narrow_cap = max(1, max_seq_len // narrow["block_n"])  # a split holds at least one narrow tile
    if kind == KIND_INT4:
        return dict(num_splits=split(2 * two_waves * per_wave, narrow_cap), **narrow)
    if per_wave <= 64 and batch * max_seq_len >= NARROW_MIN_TOKENS:
        splits = split(NARROW_PER_SM[kind] * sms, narrow_cap)
        return dict(num_splits=whole_combine_chunks(splits) if kind == KIND_FP8 else splits, **narrow)
    stages = 5 if kind == KIND_FP8 and two_waves > 1 else 3
    if WIDE_PER_SM[kind, stages] * sms < per_wave * two_waves <= NARROW_PER_SM[kind] * sms:
        return dict(num_splits=two_waves, **narrow)  # one wave of narrow programs, not 1.x of wide ones
    return dict(num_splits=two_waves, block_n=128, num_warps=4, num_stages=stages)


def decode_launch(kind: int, code_bytes: int, batch: int, kv_heads: int, max_seq_len: int, sms: int,
                  num_splits: Optional[int] = None, block_n: Optional[int] = None, num_warps: Optional[int] = None,
                  num_stages: Optional[int] = None, fused_reduce: Optional[bool] = None, head_dim: int = 128) -> dict:
    """decode_config with the caller's overrides, and what the split count decides: `direct` (one
    split writes the output), `fused` (the last split to finish combines; else _reduce_kernel) and
    `sp`, the combine's tile of splits."""
    cfg = decode_config(kind, code_bytes, batch, kv_heads, max_seq_len, sms, head_dim)
    splits, warps = num_splits or cfg["num_splits"], num_warps or cfg["num_warps"]
    direct = splits == 1
    if fused_reduce is None:
        fused_reduce = splits <= FUSED_COMBINE_MAX_SPLITS or (kind == KIND_FP8 and warps == NARROW["num_warps"])
    return dict(num_splits=splits, block_n=block_n or cfg["block_n"], num_warps=warps,
                num_stages=num_stages or cfg["num_stages"], direct=direct, fused=not direct and fused_reduce,
                sp=1 << (splits - 1).bit_length())


def decode_batch_classes(kind: int, code_bytes: int, kv_heads: int, max_seq_len: int, max_batch: int,
                         sms: int, head_dim: int = 128) -> list[int]:
    """The smallest batch size of each distinct compiled decode program for batches 1..max_batch
    at this max_seq_len: decoding these sizes once compiles every variant a step can meet (an eager
    step that met a new one would stall on the compiler mid-serving). Besides the launch, Triton
    keys a compile on the split count's divisibility by 16."""
    first: dict[tuple, int] = {}
    for b in range(1, max_batch + 1):
        launch = decode_launch(kind, code_bytes, b, kv_heads, max_seq_len, sms, head_dim=head_dim)
        key = tuple(sorted((k, v) for k, v in launch.items() if k != "num_splits")) + (launch["num_splits"] % 16,)
        first.setdefault(key, b)
    return sorted(first.values())


def paged_attention(q, k_cache, v_cache, k_scales, v_scales, k_zeros, v_zeros, block_tables,
                    query_start: torch.Tensor, seq_lens: torch.Tensor, scale: float, kind: int, group,
                    sliding_window: Optional[int] = None, out_dtype=None, *, max_query_len: int,
                    max_seq_len: int, num_splits: Optional[int] = None, block_n: Optional[int] = None,
                    num_warps: Optional[int] = None, num_stages: Optional[int] = None,
                    fused_reduce: Optional[bool] = None, out_cols: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton paged attention. Decode batches (every query length 1) take the split-K kernel;
    others the prefill/extend kernel. `query_start`/`seq_lens` are device tensors here. The
    keyword-only knobs after max_seq_len override tuned defaults (benchmarks, tests); out_cols
    as the reference's."""
    _check_out_cols(out_cols, q)
    t, hq, d = q.shape
    _, page, h, dc = k_cache.shape
    out = torch.empty(q.shape, dtype=out_dtype or q.dtype, device=q.device)
    batch = seq_lens.shape[0]
    if t == 0 or batch == 0:
        return out
    window = sliding_window or 0
    cols = _dummy(out_cols, seq_lens)
    groups = _group_args(kind, group, d)
    args = (k_cache, v_cache, _dummy(k_scales, k_cache), _dummy(v_scales, v_cache),
            _dummy(k_zeros, k_cache), _dummy(v_zeros, v_cache), block_tables, seq_lens)
    g = hq // h
    upcast = not q.is_cuda
    vt = values_transposed(kind)
    if max_query_len == 1 and t == batch:
        launch = decode_launch(kind, k_cache.element_size(), batch, h, max_seq_len, num_sms(device_index(q)),
                               num_splits=num_splits, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                               fused_reduce=fused_reduce, head_dim=d)
        num_splits, bn, direct, fused, sp = (launch[k] for k in ("num_splits", "block_n", "direct", "fused", "sp"))
        po = pml = cnt = out
        if not direct:
            po = torch.empty(batch, hq, num_splits, d, dtype=torch.float32, device=q.device)
            pml = torch.empty(batch, hq, num_splits, 2, dtype=torch.float32, device=q.device)
        if fused:
            cnt = splitk_workspace(q.device, 0, batch * h)[1]
        gq = triton.next_power_of_2(g)
        _decode_kernel[(batch, h, num_splits)](
            q, *args, out, cols, po, pml, cnt, scale, window, num_splits,
            q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
            H=h, G=g, GP=max(16, gq), D=d, DC=dc, PAGE=page, BLOCK_N=bn,
            KIND=kind, **groups, DIRECT=direct, UPCAST=upcast, VT=vt, RUN=min(page, bn), WINDOWED=window > 0,
            FUSED=fused, GQ=gq, SP=sp, COMBINE_CHUNK=min(sp, FUSED_COMBINE_CHUNK), COLS=out_cols is not None,
            num_warps=launch["num_warps"], num_stages=launch["num_stages"], **pdl_args(q))
        if not direct and not fused:
            _reduce_kernel[(batch, hq)](po, pml, seq_lens, out, cols, num_splits, window, out.stride(0), out.stride(1),
                                        HQ=hq, D=d, SP=sp, BLOCK_N=bn, WINDOWED=window > 0, COLS=out_cols is not None,
                                        num_warps=4)
        return out
    bm = 16 if max_query_len <= 16 else 64
    bn = block_n or 64
    grid = (triton.cdiv(max_query_len, bm), hq, batch)
    _prefill_kernel[grid](
        q, *args, query_start, out, cols, scale, window,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        H=h, G=g, D=d, DC=dc, PAGE=page, BLOCK_M=bm, BLOCK_N=bn, KIND=kind, **groups, UPCAST=upcast, VT=vt,
        RUN=min(page, bn), COLS=out_cols is not None, num_warps=num_warps or 4, num_stages=num_stages or 2,
        **pdl_args(q))
    return out
