"""The attention/KV-cache interface the decoder runs on, and the paged KV cache (torch path).

The decoder sees one method: `ctx.attend(layer, q, k, v) -> out` over a flat batch of tokens.
`ForwardContext` binds a cache to one step's `AttentionMetadata` (which tokens belong to which
sequence, where their K/V go, which blocks hold each sequence's past). Prefill, chunked prefill
and decode are the same call: a step is just tokens.

KV layout: per layer `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


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
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1

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


class PagedKVCache:
    """K/V blocks for every layer. Subclasses (quantized dtypes, Triton kernels) override
    `write` and `attention`; the decoder only ever calls `ForwardContext.attend`."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 sliding_window: Optional[int] = None):
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.sliding_window = sliding_window
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.k.element_size()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        flat_k = self.k[layer].view(-1, self.num_kv_heads, self.head_dim)
        flat_v = self.v[layer].view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, slot_mapping, k.to(self.dtype))
        flat_v.index_copy_(0, slot_mapping, v.to(self.dtype))

    def gather(self, layer: int, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's first `length` keys and values, contiguous: [length, kv_heads, head_dim]."""
        blocks = table[: math.ceil(length / self.block_size)].long()
        k = self.k[layer, blocks].reshape(-1, self.num_kv_heads, self.head_dim)[:length]
        v = self.v[layer, blocks].reshape(-1, self.num_kv_heads, self.head_dim)[:length]
        return k, v

    def attention(self, layer: int, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Reference paged attention: each sequence's queries over its cached keys, causal."""
        out = torch.empty_like(q)
        for i in range(meta.num_seqs):
            q_lo, q_hi = meta.query_start_list[i], meta.query_start_list[i + 1]
            if q_hi == q_lo:
                continue
            k, v = self.gather(layer, meta.block_tables[i], meta.seq_lens_list[i])
            out[q_lo:q_hi] = causal_attention(q[q_lo:q_hi], k.to(q.dtype), v.to(q.dtype), scale, self.sliding_window)
        return out


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


class ForwardContext:
    """A cache bound to one step's metadata: what the decoder's attention layers call."""

    def __init__(self, cache: PagedKVCache, meta: AttentionMetadata):
        self.cache, self.meta = cache, meta

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        self.cache.write(layer, k, v, self.meta.slot_mapping)
        return self.cache.attention(layer, q, self.meta, scale)


class NoCacheContext:
    """Attention without a cache: each sequence of a flat batch attends causally to itself.
    For calibration passes (quant) and scoring whole sequences; same math as the paged path."""

    def __init__(self, seq_lens: list[int], sliding_window: Optional[int] = None):
        self.starts = [0]
        for n in seq_lens:
            self.starts.append(self.starts[-1] + n)
        self.sliding_window = sliding_window

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        for lo, hi in zip(self.starts[:-1], self.starts[1:]):
            out[lo:hi] = causal_attention(q[lo:hi], k[lo:hi], v[lo:hi], scale, self.sliding_window)
        return out
