"""The attention/KV-cache interface the decoder runs on, and the paged KV cache (torch path).

The decoder sees one method: `ctx.attend(layer, q, k, v) -> out` over a flat batch of tokens (q, k
rotated by RoPE first, or, where the context says `fuses_rope`, `attend(..., rope=(cos, sin))`: the
paged cache then rotates them in its write's launch).
`ForwardContext` binds a cache to one step's `AttentionMetadata` (which tokens belong to which
sequence, where their K/V go, which blocks hold each sequence's past). Prefill, chunked prefill
and decode are the same call: a step is just tokens.

KV layout: per layer `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V (head_dim / 2
bytes for int4), plus fp16 scales `[..., num_kv_heads, groups]` beside them for int8/int4. The kernels
(Triton on CUDA, torch reference elsewhere) live in fitllm/kernels/paged_attention.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from fitllm.kernels._utils import PendingSum
from fitllm.kernels.fused import apply_rope, head_affine, head_affine_ref
from fitllm.models.config import layer_window


@dataclass
class AttentionMetadata:
    """One step's batch layout. Tensors live on the model's device; *_list copies on the host."""

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset) per new token
    query_start: torch.Tensor  # [B + 1] int32: cumulative new-token counts (cu_seqlens_q)
    seq_lens: torch.Tensor  # [B] int32: context length of each sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_list: list[int]
    seq_lens_list: list[int]
    max_query_len: int
    # A bound on seq_lens that sizes the decode kernel's splits and tiles; engine steps pass
    # max_model_len (graphs and eager steps alike), so those depend on the batch size alone
    max_seq_len: int
    # [T] int64, where the step gives it (the engine: max(the token's position, its prompt's last)):
    # the position each token's LongRoPE factors go by (decoder.rope_long_context); without it,
    # its sequence's last position in the step (last_positions)
    rope_last_positions: Optional[torch.Tensor] = None
    # A SplitKVCache's sliding layers: the same step in their own block tables (their slot_mapping
    # and block_tables; the other fields shared)
    window: Optional["AttentionMetadata"] = None
    # SplitKVCache.translate's: each group of layers' metadata, [kind][page of the block]
    groups: Optional[list[list["AttentionMetadata"]]] = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1

    def last_positions(self, num_tokens: int) -> torch.Tensor:
        """[num_tokens] int64: the last position (seq_len - 1) of each new token's sequence, found on
        the device (a CUDA graph replays it); tokens past the last sequence (padding) take its.
        rope_last_positions, where the step gives them, instead."""
        if self.rope_last_positions is not None:
            return self.rope_last_positions
        tokens = torch.arange(num_tokens, dtype=torch.int32, device=self.query_start.device)
        seq = torch.searchsorted(self.query_start[1:], tokens, right=True).clamp_(max=self.seq_lens.shape[0] - 1)
        return self.seq_lens.long()[seq] - 1

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device | str) -> "AttentionMetadata":
        """Metadata for sequences whose new tokens are the last `query_lens[i]` of `seq_lens[i]`."""
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        width = max((len(t) for t in block_tables), default=1) or 1
        tables = torch.zeros(len(block_tables), width, dtype=torch.int32)
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=tables.to(device),
            query_start_list=starts,
            seq_lens_list=list(seq_lens),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )


KV_DTYPES = ("auto", "bf16", "fp16", "fp32", "fp8", "int8", "int4")
_FLOAT_KV = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def check_kv_dtype(kv_dtype: str) -> None:
    """A KV dtype this cache stores (the engine asks before it loads the model, the cache when it is made)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")


def hadamard(n: int) -> torch.Tensor:
    """An orthonormal [n, n] Hadamard matrix (symmetric, its own inverse). For an n that is not a
    power of two: block-diagonal with the largest power-of-two block that divides n."""
    b = n & -n  # largest power of two dividing n
    h = torch.ones(1, 1)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return torch.block_diag(*[h / math.sqrt(b)] * (n // b))


@dataclass
class KVCalibration:
    """Per-channel statistics of every layer's keys and values (after RoPE): [L, kv_heads, D] each.
    From them the cache derives fp8 scales and the smoothing of keys/values (see PagedKVCache).
    The rot_* fields are the min/max of the same keys/values rotated by hadamard(D) (the basis the
    fp8 cache stores); None when unknown (checkpoint scales), which turns the rotation off."""

    k_mean: torch.Tensor
    k_min: torch.Tensor
    k_max: torch.Tensor
    v_mean: torch.Tensor
    v_min: torch.Tensor
    v_max: torch.Tensor
    k_rot_min: Optional[torch.Tensor] = None
    k_rot_max: Optional[torch.Tensor] = None
    v_rot_min: Optional[torch.Tensor] = None
    v_rot_max: Optional[torch.Tensor] = None

    @property
    def has_rotated(self) -> bool:
        return all(t is not None for t in (self.k_rot_min, self.k_rot_max, self.v_rot_min, self.v_rot_max))

    def state_dict(self) -> dict:
        return {k: t for k, t in vars(self).items() if t is not None}

    @classmethod
    def from_state_dict(cls, d: dict) -> "KVCalibration":
        return cls(**{k: t.float().cpu() for k, t in d.items() if k in cls.__dataclass_fields__})

    @classmethod
    def from_scales(cls, k_scales, v_scales, num_kv_heads: int, head_dim: int) -> "KVCalibration":
        """From a checkpoint's fp8 scales (vLLM's k_scale/v_scale: amax / 448, one per layer or per
        layer and head). No means: keys and values are then stored unsmoothed and unrotated."""
        def bounds(s):
            s = torch.as_tensor(s, dtype=torch.float32).reshape(len(s), -1)
            return (s * 448.0).expand(-1, num_kv_heads)[..., None].expand(-1, -1, head_dim).contiguous()
        ka, va = bounds(k_scales), bounds(v_scales)
        zero = torch.zeros_like(ka)
        return cls(zero, -ka, ka, zero.clone(), -va, va)


class _Stats:
    """A NoCacheContext that records per-channel K/V statistics on the way, in the model's basis
    and rotated by hadamard(D)."""

    def __init__(self, inner: "NoCacheContext", store: dict):
        self.inner, self.store = inner, store
        self.last_positions = inner.last_positions

    def attend(self, layer, q, k, v, scale):
        s = self.store.setdefault(layer, {"n": 0})
        rot = hadamard(k.shape[-1]).to(k.device, torch.float64)
        for name, x in (("k", k), ("v", v)):
            x = x.double()
            s[name + "_sum"] = s.get(name + "_sum", 0) + x.sum(0)
            for tag, y in ((name, x), (name + "_rot", x @ rot)):
                lo, hi = y.amin(0), y.amax(0)
                s[tag + "_min"] = torch.minimum(s[tag + "_min"], lo) if tag + "_min" in s else lo
                s[tag + "_max"] = torch.maximum(s[tag + "_max"], hi) if tag + "_max" in s else hi
        s["n"] += k.shape[0]
        return self.inner.attend(layer, q, k, v, scale)


@torch.inference_mode()
def calibrate_kv_scales(model, token_batches: Optional[list[list[int]]] = None) -> KVCalibration:
    """Run token sequences through the model and record each layer's per-channel key/value mean,
    min and max (also in the rotated basis). A few thousand tokens of ordinary text suffice.
    Without `token_batches` the model samples its own text from BOS (data-free; real text from
    the target domain is better)."""
    if token_batches is None:
        token_batches = _self_generated(model)
    store: dict = {}
    for ids in token_batches:
        t = torch.tensor(ids, dtype=torch.long, device=model.device)
        ctx = NoCacheContext([len(ids)], model.config.attention_windows)
        model(t, torch.arange(len(ids), device=model.device), _Stats(ctx, store))
    layers = [store[i] for i in range(model.config.num_layers)]

    def stack(key):
        return torch.stack([s[key] for s in layers]).float().cpu()

    def mean(name):
        return torch.stack([s[name + "_sum"] / s["n"] for s in layers]).float().cpu()

    return KVCalibration(mean("k"), stack("k_min"), stack("k_max"), mean("v"), stack("v_min"), stack("v_max"),
                         stack("k_rot_min"), stack("k_rot_max"), stack("v_rot_min"), stack("v_rot_max"))


def _self_generated(model, num_seqs: int = 4, length: int = 256, seed: int = 0) -> list[list[int]]:
    from fitllm.models.generate import generate

    bos = getattr(model.config, "bos_token_id", None)
    bos = 1 if bos is None else int(bos)
    return [[bos] + out for out in generate(model, [[bos]] * num_seqs, length - 1, temperature=1.0, seed=seed)]


def _consecutive_heads(*parts: torch.Tensor) -> Optional[torch.Tensor]:
    """[T, H_i, D] views that are consecutive heads of one buffer (same token stride, heads D apart,
    each part starting where the previous ends) as one [T, sum H_i, D] view; else None."""
    first = parts[0]
    t, _, d = first.shape
    at = first.data_ptr()
    for p in parts:
        if (p.dim() != 3 or p.shape[0] != t or p.shape[2] != d or p.dtype != first.dtype or p.stride(1) != d
                or p.stride(2) != 1 or (t > 1 and p.stride(0) != first.stride(0)) or p.data_ptr() != at):
            return None
        at += p.shape[1] * d * p.element_size()
    return first.as_strided((t, sum(p.shape[1] for p in parts), d), (first.stride(0), d, 1))


class PagedKVCache:
    """K/V blocks for every layer, optionally quantized. The decoder only calls
    `ForwardContext.attend`, which calls `write` then `attention`.

    kv_dtype: "auto" (the `dtype` argument), "bf16", "fp16", "fp32", "fp8" (e4m3), "int8"
    (symmetric, one fp16 scale per token and head), "int4" (asymmetric, fp16 scale and zero per
    `int4_key_group` values of a token's key head and per `int4_group` values of its value head).

    Quantized caches store keys and values *smoothed* by per-channel statistics from `calibration`
    (required for fp8 and int4; see calibrate_kv_scales) and, for fp8 and int4, *rotated* by an
    orthonormal Hadamard matrix R (`rotate`; default on for int4, and for fp8 when the calibration
    has statistics in the rotated basis):
      k' = ((k - k_mean) @ R) * k_mul      v' = ((v - v_mean) @ R) * v_mul
    Attention is unchanged by this: q.(k - k_mean) differs from q.k by a constant per query, which
    softmax ignores; (q @ R / k_mul).k' = q.(k - k_mean) since R R^T = I; the weights sum to one, so
    out = (out' / v_mul) @ R^T + v_mean restores the values. The queries and the output are
    transformed here, around the kernels, so every backend computes the same thing and the
    kernels only ever see cache space. Subtracting the mean removes the large constant offsets
    keys carry in a few channels; the rotation spreads the remaining outlier channels over the
    whole head, so one scale per token group (int4) or per tensor (fp8) fits every channel.
    k_mul/v_mul: fp8 divides by a calibrated scale per tensor (fp8_scales="tensor") or per kv
    head ("head"), measured in the basis it stores; unrotated int4 keys divide by lam = per-channel
    range ** 0.5 (the static form of KIVI's per-channel keys); otherwise 1.

    bytes_per_token = num_layers * num_kv_heads * (K row + V row), where a row is
      float: head_dim * element size;  fp8: head_dim;  int8: head_dim + 2 (fp16 scale);
      int4: head_dim / 2 + 4 * head_dim / g (fp16 scale and zero per group), g = the key or value
            group capped at head_dim (head_dim 128, groups 16/32: K 96 + V 80 bytes; 64: 48 + 40).
    That is every byte the per-token storage uses; the per-layer constants (means, lam, fp8
    scales, the rotation: a few KB) are not per token and not counted.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 sliding_window: Optional[int] | list[Optional[int]] = None, kv_dtype: str = "auto",
                 calibration: Optional[KVCalibration] = None, fp8_scales: str = "tensor",
                 int4_group: int = 32, int4_key_group: int = 16, smooth: bool = True,
                 rotate: Optional[bool] = None, planes: Optional[list[int]] = None):
        from fitllm.kernels import paged_attention as pa

        check_kv_dtype(kv_dtype)
        if kv_dtype in ("fp8", "int4") and calibration is None:
            raise ValueError(f"kv_dtype={kv_dtype} needs calibrated K/V statistics (never a silent scale of 1.0): "
                             "pass calibration=calibrate_kv_scales(model, token_batches) or KVCalibration.from_scales(...)")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        # Layer i's K/V live in storage plane planes[i] (default: its own); SplitKVCache lets layers
        # that never use the same block at once share a plane.
        self.planes = list(range(num_layers)) if planes is None else list(planes)
        num_planes = max(self.planes) + 1
        self.num_kv_heads, self.head_dim, self.sliding_window = num_kv_heads, head_dim, sliding_window
        self.kv_dtype = kv_dtype
        self.compute_dtype = dtype
        self.device = torch.device(device)
        self.kind = {"fp8": pa.KIND_FP8, "int8": pa.KIND_INT8, "int4": pa.KIND_INT4}.get(kv_dtype, pa.KIND_FLOAT)
        # (key group, value group): values per scale; int4 keys get smaller groups (they carry most
        # of int4's error), int8 one scale per token and head.
        self.group = (head_dim, head_dim)
        if self.kind == pa.KIND_INT4:
            self.group = (min(int4_key_group, head_dim), min(int4_group, head_dim))
            for name, g in (("int4_key_group", int4_key_group), ("int4_group", int4_group)):
                if head_dim % min(g, head_dim) or g % 2 or g & (g - 1):
                    raise ValueError(f"{name}={g} must be a power of two >= 2 dividing head_dim={head_dim}")
        storage = {pa.KIND_FP8: torch.float8_e4m3fn, pa.KIND_INT8: torch.int8, pa.KIND_INT4: torch.uint8}.get(
            self.kind, _FLOAT_KV.get(kv_dtype, dtype))
        self.dtype = storage
        # Zero-filled: for fp8 that starts the kernels' invariant that every stored byte is finite.
        k_shape, v_shape = (pa.cache_shape(num_blocks, block_size, num_kv_heads, head_dim, self.kind, values)
                            for values in (False, True))
        self.k = torch.zeros((num_planes, *k_shape), dtype=storage, device=device)
        self.v = torch.zeros((num_planes, *v_shape), dtype=storage, device=device)
        self.k_scales = self.v_scales = self.k_zeros = self.v_zeros = None
        if self.kind in (pa.KIND_INT8, pa.KIND_INT4):
            k_meta, v_meta = ((num_planes, *pa.scales_shape(num_blocks, block_size, num_kv_heads, head_dim, g))
                              for g in self.group)
            self.k_scales = torch.zeros(k_meta, dtype=torch.float16, device=device)
            self.v_scales = torch.zeros(v_meta, dtype=torch.float16, device=device)
            if self.kind == pa.KIND_INT4:
                self.k_zeros = torch.zeros(k_meta, dtype=torch.float16, device=device)
                self.v_zeros = torch.zeros(v_meta, dtype=torch.float16, device=device)
        self._setup_transform(calibration if self.kind != pa.KIND_FLOAT else None, smooth, fp8_scales, rotate)
        self.supports_cuda_graphs = self.device.type == "cuda"

    def _setup_transform(self, cal: Optional[KVCalibration], smooth: bool, fp8_scales: str,
                         rotate: Optional[bool]) -> None:
        """Per-layer maps between model space and cache space (shifts and muls [L, kv_heads, D] fp32,
        R = self.rotation or the identity): stored k' = ((k - k_shift) @ R) * k_mul and
        v' = ((v - v_shift) @ R) * v_mul; attention uses q' = (q @ R) / k_mul and
        out = (out' / v_mul) @ R^T + v_shift."""
        from fitllm.kernels import paged_attention as pa

        self.transformed, self.rotation, self.rotation16 = cal is not None, None, None
        if cal is None:
            return
        shape = cal.k_mean.shape
        if tuple(shape) != (self.num_layers, self.num_kv_heads, self.head_dim):
            raise ValueError(f"calibration shape {tuple(shape)} does not match the cache's "
                             f"{(self.num_layers, self.num_kv_heads, self.head_dim)}")
        if fp8_scales not in ("tensor", "head"):
            raise ValueError(f"fp8_scales must be 'tensor' or 'head', not {fp8_scales!r}")
        fp8, int4 = self.kind == pa.KIND_FP8, self.kind == pa.KIND_INT4
        if rotate is None:  # where it pays: int4 always, fp8 when its scales can be set in the rotated basis
            rotate = int4 or (fp8 and cal.has_rotated)
        if rotate and fp8 and not cal.has_rotated:
            raise ValueError("rotate=True for fp8 needs calibration statistics in the rotated basis "
                             "(calibrate_kv_scales records them; checkpoint scales do not)")
        zero = torch.zeros(shape)
        k_shift = cal.k_mean if smooth else zero
        v_shift = cal.v_mean if smooth else zero
        rot = hadamard(self.head_dim) if rotate else None
        k_mul, v_mul = torch.ones(shape), torch.ones(shape)
        if int4 and smooth and not rotate:
            lam = _amax(cal.k_min, cal.k_max, k_shift).sqrt()
            k_mul = 1 / lam
        if fp8:
            if rotate:
                k_amax = _amax(cal.k_rot_min, cal.k_rot_max, k_shift @ rot)
                v_amax = _amax(cal.v_rot_min, cal.v_rot_max, v_shift @ rot)
            else:
                k_amax = _amax(cal.k_min, cal.k_max, k_shift)
                v_amax = _amax(cal.v_min, cal.v_max, v_shift)
            # Scale so the calibrated range maps to half of e4m3's 448: headroom for unseen
            # outliers costs fp8 nothing but a little range at the bottom.
            dims = (1, 2) if fp8_scales == "tensor" else (2,)
            self.k_scale = (2 * k_amax.amax(dim=dims, keepdim=True) / pa.FP8_MAX).expand(shape)[..., 0].contiguous()
            self.v_scale = (2 * v_amax.amax(dim=dims, keepdim=True) / pa.FP8_MAX).expand(shape)[..., 0].contiguous()
            k_mul, v_mul = k_mul / self.k_scale[..., None], v_mul / self.v_scale[..., None]
        dev = self.device
        self.k_shift, self.k_mul = k_shift.float().to(dev), k_mul.float().to(dev)
        self.v_shift, self.v_mul = v_shift.float().to(dev), v_mul.float().to(dev)
        self.rotation = None if rot is None else rot.to(dev)
        half = self.compute_dtype in (torch.float16, torch.bfloat16)
        self.rotation16 = None if rot is None or not half else rot.to(dev, self.compute_dtype)  # _hot_rotation
        self.k_mul_inv, self.v_mul_inv = 1 / self.k_mul, 1 / self.v_mul
        self._qkv_cache = None  # _qkv_params

    @property
    def block_tensors(self) -> list[torch.Tensor]:
        """Every tensor with per-slot storage, each [planes, num_blocks, ...]: codes, scales, zeros."""
        return [t for t in (self.k, self.v, self.k_scales, self.v_scales, self.k_zeros, self.v_zeros)
                if t is not None]

    @property
    def bytes_per_token(self) -> int:
        per_block = sum(t[0, 0].numel() * t.element_size() for t in self.block_tensors)
        return self.k.shape[0] * per_block // self.block_size  # every plane's

    def storage(self, layer: int) -> tuple:
        """Layer's (K, V, K scales, V scales, K zeros, V zeros): its plane of each (None where the cache has none)."""
        p = self.planes[layer]
        return self.k[p], self.v[p], *(None if t is None else t[p]
                                       for t in (self.k_scales, self.v_scales, self.k_zeros, self.v_zeros))

    # ---- model space <-> cache space --------------------------------------------------------------
    def _hot_rotation(self, inverse: bool = False) -> Optional[torch.Tensor]:
        """R (R^T, a view) as the step's maps use it: in the model's dtype when that is 16-bit. The
        rotated values are rounded to fp8/int8/int4 (or, for q, to fp16) right after, so 16-bit
        operands cost nothing measurable, while fp32 products were slow (cuBLAS picked a split-K
        path for these [32, 128] x [128, 128] products: 52 µs each on an H200, 3.3 ms of a 7.6 ms
        int4 decode step)."""
        r = self.rotation16 if self.rotation16 is not None else self.rotation
        return None if r is None else (r.mT if inverse else r)

    # Each map is one head_affine launch (fitllm.kernels.fused) on the GPU: (x - shift) * pre, the
    # rotation, * post + add, with the parameters of the head's kv head. The torch reference does the
    # same on the CPU. (Before: ~6 elementwise kernels and a matmul per map, ~20 launches per layer.)
    def _to_cache_space(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if not self.transformed:
            return k, v
        r = self._hot_rotation()
        return (head_affine(k, r, self.k_shift[layer], None, self.k_mul[layer], None, torch.float32),
                head_affine(v, r, self.v_shift[layer], None, self.v_mul[layer], None, torch.float32))

    @property
    def _query_dtype(self) -> torch.dtype:
        # Quantized K/V are dequantized to fp16 inside the kernels (fp8 and int codes convert to it
        # exactly or nearly; on the GPU fp8 -> fp16 is one instruction, fp8 -> bf16 is several),
        # so queries go in as fp16 with half-precision models and as fp32 otherwise.
        return torch.float16 if self.compute_dtype in (torch.float16, torch.bfloat16) else torch.float32

    def _query_to_cache_space(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        if not self.transformed:
            return q if self.kind == 0 else q.to(self._query_dtype)
        return head_affine(q, self._hot_rotation(), None, None, self.k_mul_inv[layer], None, self._query_dtype)

    def _qkv_to_cache_space(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """The three maps in one head_affine launch, when q, k and v are consecutive heads of one
        buffer (the qkv projection's output: no copy to join them); else None. Head rows of the
        parameters: q (no shift, post 1 / k_mul of its kv head), k, then v."""
        joined = _consecutive_heads(q, k, v)
        if joined is None:
            return None
        hq = q.shape[1]
        shift, post = self._qkv_params(hq)
        qc, kv = head_affine(joined, self._hot_rotation(), shift[layer], None, post[layer], None, self._query_dtype,
                             split=(hq, torch.float32))
        return qc, kv[:, : k.shape[1]], kv[:, k.shape[1]:]

    def _qkv_params(self, hq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(shift, post) [L, hq + 2 kv_heads, D] for _qkv_to_cache_space, built once per query head count."""
        if self._qkv_cache is None or self._qkv_cache[0] != hq:
            g = hq // self.num_kv_heads
            shift = torch.cat([torch.zeros_like(self.k_shift).repeat_interleave(g, 1), self.k_shift, self.v_shift], 1)
            post = torch.cat([self.k_mul_inv.repeat_interleave(g, 1), self.k_mul, self.v_mul], 1)
            self._qkv_cache = (hq, shift.contiguous(), post.contiguous())
        return self._qkv_cache[1], self._qkv_cache[2]

    def _output_to_model_space(self, layer: int, out: torch.Tensor) -> torch.Tensor:
        if not self.transformed:
            return out
        return head_affine(out, self._hot_rotation(inverse=True), None, self.v_mul_inv[layer], None,
                           self.v_shift[layer], self.compute_dtype)

    def _use_triton(self) -> bool:
        from fitllm.kernels._utils import backend_for

        return backend_for(self.k) == "triton"

    # ---- the two operations the decoder's step needs ----------------------------------------------
    @property
    def fuses_rope(self) -> bool:
        """Whether `attend` takes the step's RoPE (rope=(cos, sin)) into its cache write's launch:
        the Triton path of an unquantized cache."""
        from fitllm.kernels import paged_attention as pa

        return not self.transformed and self.kind == pa.KIND_FLOAT and self._use_triton()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
               scale: float, rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
               out_cols: Optional[torch.Tensor] = None) -> torch.Tensor:
        """write, then attention; with the three maps into cache space in one launch when it can.
        rope=(cos, sin): q and k are rotated first (fused into the write where `fuses_rope`; q, k
        and v may then be views of the qkv GEMM's PendingSum, which that launch takes). out_cols:
        each token's output row in that column order (paged_attention's; the kernels store it so,
        a transformed cache scatters after its map back)."""
        if rope is not None:
            if self.fuses_rope and 2 * rope[0].shape[-1] == q.shape[-1]:  # (partial RoPE: apart)
                from fitllm.kernels import paged_attention as pa

                q = pa.rope_cache_write(q, k, v, *rope, *self.storage(layer)[:2], meta.slot_mapping)
                return self.attention(layer, q, meta, scale, out_cols)
            if isinstance(q, PendingSum):  # (the decoder defers only where fuses_rope: a fallback)
                q, k, v = q.materialize(), k.materialize(), v.materialize()
            q, k = apply_rope(q, k, *rope)
        maps = self._qkv_to_cache_space(layer, q, k, v) if self.transformed else None
        if maps is None:
            self.write(layer, k, v, meta.slot_mapping)
            return self.attention(layer, q, meta, scale, out_cols)
        qc, kc, vc = maps
        self._store(layer, kc, vc, meta.slot_mapping)
        return self._attend_in_model_space(layer, qc, meta, scale, q.dtype, out_cols)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store the step's new K/V [T, kv_heads, D] at their slots (quantizing on the way)."""
        self._store(layer, *self._to_cache_space(layer, k, v), slot_mapping)

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """K/V already in cache space (any token and head strides, unit stride along head_dim)."""
        from fitllm.kernels import paged_attention as pa

        fn = pa.cache_write if self._use_triton() else pa.cache_write_ref
        k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
        fn(k, v, *self.storage(layer), slot_mapping, self.kind, self.group)

    def attention(self, layer: int, q: torch.Tensor, meta: AttentionMetadata, scale: float,
                  out_cols: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Each sequence's new queries over its cached keys (including this step's), causal."""
        return self._attend_in_model_space(layer, self._query_to_cache_space(layer, q), meta, scale, q.dtype, out_cols)

    def _attend_in_model_space(self, layer: int, qc: torch.Tensor, meta: AttentionMetadata, scale: float,
                               model_dtype: torch.dtype, out_cols: Optional[torch.Tensor]) -> torch.Tensor:
        if not self.transformed:
            return self._attend_cache_space(layer, qc, meta, scale, model_dtype, out_cols)
        from fitllm.kernels._utils import scatter_columns

        out = self._output_to_model_space(layer, self._attend_cache_space(layer, qc, meta, scale, model_dtype))
        return out if out_cols is None else scatter_columns(out, out_cols)

    def _attend_cache_space(self, layer: int, qc: torch.Tensor, meta: AttentionMetadata, scale: float,
                            model_dtype: torch.dtype, out_cols: Optional[torch.Tensor] = None) -> torch.Tensor:
        from fitllm.kernels import paged_attention as pa

        out_dtype = model_dtype if not self.transformed else torch.float32
        args = (qc, *self.storage(layer), meta.block_tables)
        if self._use_triton():
            # Device tensors only (graph-capturable); the host maxima pick tile sizes and splits.
            out = pa.paged_attention(*args, meta.query_start, meta.seq_lens, scale, self.kind, self.group,
                                     layer_window(self.sliding_window, layer), out_dtype,
                                     max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
                                     out_cols=out_cols)
        else:
            out = pa.paged_attention_ref(*args, meta.query_start_list, meta.seq_lens_list, scale, self.kind,
                                         self.group, layer_window(self.sliding_window, layer), out_dtype,
                                         out_cols=out_cols)
        return out

    def decode_batch_classes(self, max_batch: int, max_seq_len: int) -> list[int]:
        """Batch sizes up to max_batch whose decode steps, one each, compile every variant of the
        Triton decode kernel this cache can launch (none off that path)."""
        from fitllm.kernels import paged_attention as pa
        from fitllm.kernels._utils import device_index, num_sms

        if not self._use_triton():
            return []
        return pa.decode_batch_classes(self.kind, self.k.element_size(), self.num_kv_heads, max_seq_len, max_batch,
                                       num_sms(device_index(self.k)), self.head_dim)

    def gather(self, layer: int, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's first `length` keys and values in model space (dequantized, smoothing
        undone): [length, kv_heads, head_dim] float32 (the cache's dtype when unquantized)."""
        from fitllm.kernels import paged_attention as pa

        kc, vc, ks, vs, kz, vz = self.storage(layer)
        k = pa.gather_ref(kc, ks, kz, table, length, self.kind, self.group[0])
        v = pa.gather_ref(vc, vs, vz, table, length, self.kind, self.group[1], values=True)
        if self.transformed:  # the inverse maps, in float32 (the torch reference: not the step's path)
            r_t = None if self.rotation is None else self.rotation.mT
            k = head_affine_ref(k, r_t, None, self.k_mul_inv[layer], None, self.k_shift[layer], torch.float32)
            v = head_affine_ref(v, r_t, None, self.v_mul_inv[layer], None, self.v_shift[layer], torch.float32)
        elif self.kind == pa.KIND_FLOAT:
            k, v = k.to(self.dtype), v.to(self.dtype)
        return k, v


def _amax(lo: torch.Tensor, hi: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Largest |x - shift| per channel for x in [lo, hi]."""
    return torch.maximum(hi - shift, shift - lo).clamp_min(1e-6)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     sliding_window: Optional[int] = None) -> torch.Tensor:
    """q [Lq, Hq, D] are the last Lq positions of a sequence whose keys are k/v [Lk, Hkv, D]."""
    lq, lk, hq, hkv = q.shape[0], k.shape[0], q.shape[1], k.shape[1]
    q_pos = torch.arange(lk - lq, lk, device=q.device)[:, None]
    k_pos = torch.arange(lk, device=q.device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


class SplitKVCache:
    """The KV cache of a model with both full-attention and sliding-window layers (Gemma 3: five
    layers of six slide over 1,024 tokens), on one pool of pages that serve.block_manager's
    SplitBlockManager hands out. A page holds block_size tokens of `page_layers` layers, one storage
    plane each; a block of the full layers is widths[0] pages and one of the sliding layers
    widths[1] (the t-th full or sliding layer lives in page t // page_layers of its block, plane
    t % page_layers). The sliding blocks behind each sequence's window go back to the pool, so
    the full layers' long contexts take most of the memory while short sequences hold what one
    pool would.
    Each kind has its own block tables (`meta` for the full layers, `meta.window` for the sliding
    ones) naming a block by its first page; `pages[kind]` [width - 1, pages] is each block's other
    pages (set_pages, from the block manager before each step), and `translate(meta)` gives each
    group of layers (kind, page t) its tables and slots on the device (inside the step's CUDA
    graph). Everything else is one PagedKVCache, `arena`."""

    def __init__(self, num_layers: int, num_pages: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, sliding_window: list[Optional[int]],
                 page_layers: int, calibration: Optional[KVCalibration] = None, **cache_kwargs):
        windows = [layer_window(sliding_window, i) for i in range(num_layers)]
        kinds = ([i for i, w in enumerate(windows) if w is None], [i for i, w in enumerate(windows) if w is not None])
        if not all(kinds):
            raise ValueError("a split KV cache needs both full-attention and sliding-window layers")
        self.widths = tuple(-(-len(layers) // page_layers) for layers in kinds)
        planes, self.group_of = [0] * num_layers, [(0, 0)] * num_layers
        for kind, layers in enumerate(kinds):
            for j, layer in enumerate(layers):
                planes[layer], self.group_of[layer] = j % page_layers, (kind, j // page_layers)
        self.arena = PagedKVCache(num_layers, num_pages, block_size, num_kv_heads, head_dim, dtype, device,
                                  sliding_window=sliding_window, calibration=calibration, planes=planes,
                                  **cache_kwargs)
        first = torch.arange(num_pages, dtype=torch.int32, device=device)
        self.pages = [first.repeat(w - 1, 1) for w in self.widths]  # (until set: any page; never read)
        for name in ("kind", "kv_dtype", "dtype", "transformed", "supports_cuda_graphs", "fuses_rope", "block_size",
                     "num_kv_heads", "head_dim", "num_blocks", "device", "k", "v", "bytes_per_token"):
            setattr(self, name, getattr(self.arena, name))
        self._attend = self.routed(self.arena.attend)

    def set_pages(self, kind: int, first: torch.Tensor, rest: torch.Tensor) -> None:
        """Blocks of `kind` (0: full, 1: sliding) given new pages: their first pages [n] (int64) and
        their other pages [width - 1, n] (int32), on the device."""
        self.pages[kind][:, first] = rest

    def translate(self, meta: AttentionMetadata) -> None:
        """meta.groups[kind][t]: the step's metadata for the layers in page t of each block of `kind`."""
        bs = self.block_size
        meta.groups = []
        for kind, base in enumerate((meta, meta.window)):
            group = [base]
            if len(self.pages[kind]):  # every other page of the kind's blocks at once: 4 launches, not 4 a page
                pages, slots = self.pages[kind], base.slot_mapping
                tables = pages[:, base.block_tables.long()]
                slots = pages[:, slots // bs].long() * bs + slots % bs
                group += [replace(base, block_tables=t, slot_mapping=s, window=None) for t, s in zip(tables, slots)]
            meta.groups.append(group)

    def routed(self, attend_layer: Callable) -> Callable:
        """An `attend(layer, q, k, v, meta, ...)` that calls `attend_layer` (the arena's own attend, or a
        stand-in) with the metadata of the layer's group (`translate`)."""
        def attend(layer: int, q, k, v, meta: AttentionMetadata, *args, **kwargs):
            kind, t = self.group_of[layer]
            return attend_layer(layer, q, k, v, meta.groups[kind][t], *args, **kwargs)
        return attend

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
               scale: float, rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
               out_cols: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self._attend(layer, q, k, v, meta, scale, rope, out_cols)

    def decode_batch_classes(self, max_batch: int, max_seq_len: int) -> list[int]:
        return self.arena.decode_batch_classes(max_batch, max_seq_len)


class ForwardContext:
    """A cache bound to one step's metadata: what the decoder's attention layers call."""

    def __init__(self, cache: PagedKVCache, meta: AttentionMetadata):
        self.cache, self.meta = cache, meta

    @property
    def fuses_rope(self) -> bool:  # then the decoder hands RoPE to attend (see PagedKVCache.attend)
        return self.cache.fuses_rope

    # attend takes out_cols (PagedKVCache.attend): the decoder asks it for o_proj's input order
    writes_columns = True

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
               out_cols: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.cache.attend(layer, q, k, v, self.meta, scale, rope, out_cols)

    def last_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return self.meta.last_positions(positions.shape[0])


class NoCacheContext:
    """Attention without a cache: each sequence of a flat batch attends causally to itself.
    For calibration passes (quant) and scoring whole sequences; same math as the paged path."""

    def __init__(self, seq_lens: list[int], sliding_window: Optional[int] | list[Optional[int]] = None):
        self.starts = [0]
        for n in seq_lens:
            self.starts.append(self.starts[-1] + n)
        self.sliding_window = sliding_window

    def last_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Each token's sequence's last position (the sequences are whole here)."""
        lens = torch.tensor([hi - lo for lo, hi in zip(self.starts[:-1], self.starts[1:])])
        return torch.repeat_interleave(lens - 1, lens).to(positions.device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        for lo, hi in zip(self.starts[:-1], self.starts[1:]):
            out[lo:hi] = causal_attention(q[lo:hi], k[lo:hi], v[lo:hi], scale, layer_window(self.sliding_window, layer))
        return out
