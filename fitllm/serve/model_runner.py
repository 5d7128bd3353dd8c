"""The model runner: one flat batch per step over the paged KV cache.

A step is a list of `StepSeq`s (new tokens, where they start, the sequence's block table, how
many logits it needs). All new tokens of all sequences go through the model as one flat batch;
only the rows that need logits go through the lm_head.

On a GPU, steps where every sequence feeds only a few tokens replay CUDA graphs (a decode step
is mostly kernel-launch overhead otherwise). A graph is captured per (q, batch size): every
sequence feeds exactly q tokens. q = 1 is decode; q = k + 1 is speculative verification (the
last real token plus k drafts); q = 2 a draft model's catch-up. A step runs on the smallest
captured q that holds its longest sequence and the next captured batch size: shorter sequences
are padded up to q tokens and the batch up to the size with whole padded sequences. Padded
tokens write their K/V only to a reserved scratch block and come after the real tokens of
their sequence, so causal attention keeps them out of every real token's view. On the CPU
everything runs eagerly (`capture_graphs(emulate_on_cpu=True)` runs the graph path's padding
and buffers eagerly, for tests).

Host synchronisation: a step's inputs reach the device by non-blocking copies from pinned
memory; nothing here waits for the GPU (the engine waits once per step, for the sampled tokens).

KV cache sizing also lives here (it needs the model on the device): on a GPU from the memory
left after loading, minus what fitllm.budget says steps and graphs will take; on the CPU a
fixed budget.
"""
from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from fitllm.kernels._utils import scatter_columns
from fitllm.kernels.fused import apply_rope
from fitllm.models.config import layer_window
from fitllm.models.decoder import CausalLM
from fitllm.models.kv_cache import (AttentionMetadata, ForwardContext, KVCalibration, PagedKVCache,
                                    SplitKVCache, calibrate_kv_scales)
from fitllm.serve.sampling import to_device

log = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # the CPU default: 1 GiB of KV (~23k tokens of SmolLM2 in fp32)
FALLBACK_GRAPH_GATHER_BYTES = 512 << 20
NEEDS_CALIBRATION = ("fp8", "int4")  # PagedKVCache refuses these without K/V statistics
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
TABLE_WIDTH_MULTIPLE = 16  # eager steps' block tables: see _run_eager
MULTI_TOKEN_GRAPH_MAX_BATCH = 64  # q > 1 graphs (speculation): speculation pays at small batches


@dataclass
class StepSeq:
    token_ids: list[int]  # the tokens whose K/V this step computes
    start: int  # position of the first of them (= tokens already in the cache)
    block_table: list[int]
    num_logits: int = 1  # logits for the last `num_logits` new tokens (0: none)
    prompt_len: int = 0  # the request's prompt length: LongRoPE chooses a prompt's factors by all of it
    window_table: Optional[list[int]] = None  # a split cache's: the sequence's table of sliding-layer blocks


class ModelRunner:
    def __init__(self, model: CausalLM, block_size: int, kv_dtype: str = "auto",
                 kv_calibration: Optional[KVCalibration] = None):
        self.model, self.block_size, self.kv_dtype = model, block_size, kv_dtype
        self.device = model.device
        if kv_dtype in NEEDS_CALIBRATION and kv_calibration is None:
            # Never a silent scale of 1.0: without statistics from the checkpoint or the caller,
            # measure the model's own K/V on text it generates (data-free, a few seconds on a GPU).
            log.warning("kv_dtype %s: no K/V calibration given; calibrating on self-generated text", kv_dtype)
            kv_calibration = calibrate_kv_scales(model)
        self.kv_calibration = kv_calibration
        self.cache: Optional[PagedKVCache] = None
        self.graphs: Optional[StepGraphs] = None

    # ---- setup ---------------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        probe = self._new_cache(1)
        per_token = probe.bytes_per_token
        del probe
        return per_token * self.block_size

    def page_bytes(self, page_layers: int) -> int:
        """Bytes of one page of a split cache (block_size tokens of `page_layers` layers; every layer
        stores the same bytes a token)."""
        return self.bytes_per_block() * page_layers // self.model.config.num_layers

    def kv_cache_bytes(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                       gpu_memory_utilization: float, cuda_graphs: bool) -> int:
        """The memory the KV cache may take: on a GPU what is left after the weights and what steps
        will need; on the CPU enough for every sequence at full length, within a fixed budget."""
        if self.device.type != "cuda":
            wanted = max_num_seqs * math.ceil(max_model_len / self.block_size) * self.bytes_per_block()
            return min(wanted, CPU_KV_CACHE_BYTES)
        return self._cuda_kv_budget(max_num_seqs, max_model_len, max_num_batched_tokens,
                                    gpu_memory_utilization, cuda_graphs)

    def choose_num_blocks(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                          gpu_memory_utilization: float, cuda_graphs: bool) -> int:
        """How many KV blocks to allocate (the scratch block comes on top)."""
        per_block = self.bytes_per_block()
        free_bytes = self.kv_cache_bytes(max_num_seqs, max_model_len, max_num_batched_tokens,
                                         gpu_memory_utilization, cuda_graphs)
        if free_bytes < per_block and self.device.type == "cuda":
            raise RuntimeError(
                f"no GPU memory left for the KV cache after the weights and step buffers "
                f"({free_bytes / 2**20:.0f} MiB); raise --gpu-memory-utilization, lower --max-num-seqs, "
                "or use a smaller model or --kv-dtype")
        return max(1, free_bytes // per_block)  # all of it: spare blocks keep more prefixes cached

    def _cuda_kv_budget(self, max_num_seqs, max_model_len, max_num_batched_tokens, utilization, cuda_graphs) -> int:
        """Usable card memory minus what is in use now (context, weights) and what steps will need."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # memory torch holds but does not use is not "in use"
        free, total = torch.cuda.mem_get_info(self.device)
        try:
            from fitllm import budget
            from fitllm.kernels._utils import gpu_arch

            settings = budget.Settings(scheme=budget.detect_scheme(self.model.config), max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                       max_batched_tokens=max_num_batched_tokens, block_size=self.block_size,
                                       gpu_memory_utilization=utilization, cuda_graphs=cuda_graphs,
                                       group_size=budget.checkpoint_group_size(self.model.config),
                                       bits=budget.checkpoint_bits(self.model.config),
                                       gpu_arch=gpu_arch(self.device.index))
            terms = budget.estimate(self.model.config, settings, total, num_kv_blocks=0).terms
            # Weights and the CUDA context are already in `total - free`: count them as measured, but keep room
            # for the kernel images the warm-up and the first steps will still load outside torch.
            reserve = sum(v for k, v in terms.items() if k not in ("weights", "cuda_context"))
            outside_torch = total - free - torch.cuda.memory_reserved(self.device)
            reserve += max(0, terms["cuda_context"] - outside_torch)
        except ImportError:  # no memory model: measure one full step instead
            reserve = self._measure_step_peak(max_num_batched_tokens, max_num_seqs)
        return max(0, int(total * utilization) - (total - free) - reserve)

    def _measure_step_peak(self, num_tokens: int, num_logits: int) -> int:
        from fitllm.models.kv_cache import NoCacheContext

        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        lens = [min(256, num_tokens - i) for i in range(0, num_tokens, 256)]
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            hidden = self.model(ids, torch.arange(num_tokens, device=self.device) % 256, NoCacheContext(lens))
            torch.softmax(self.model.compute_logits(hidden[:num_logits]).float(), -1)
        del hidden
        return int(1.25 * (torch.cuda.max_memory_allocated(self.device) - before))  # 25%: allocator slack

    def allocate_cache(self, num_blocks: int, max_model_len: int, page_layers: Optional[int] = None) -> None:
        """`num_blocks` usable blocks plus one scratch block (the last) for padded graph rows;
        with `page_layers`, a split cache of that many pages of `page_layers` layers (SplitKVCache;
        both kinds of blocks pad on the scratch page).
        Every step then tells attention that its sequences may be `max_model_len` long: the decode
        kernel's tiles and splits (each sequence still cuts its own span) depend on the batch size
        alone, in eager steps as in the graphs, so a warm-up can compile all of them
        (`warm_up_decode`)."""
        self.cache = self._new_cache(num_blocks + 1, page_layers)
        self.scratch_block = num_blocks
        self.max_model_len = max_model_len

    def _new_cache(self, num_blocks: int, page_layers: Optional[int] = None) -> PagedKVCache | SplitKVCache:
        c = self.model.config
        args = (c.num_kv_heads, c.head_dim, self.model.dtype, self.device)
        options = dict(sliding_window=c.attention_windows, kv_dtype=self.kv_dtype, calibration=self.kv_calibration)
        if page_layers is not None:
            return SplitKVCache(c.num_layers, num_blocks, self.block_size, *args, page_layers=page_layers, **options)
        return PagedKVCache(c.num_layers, num_blocks, self.block_size, *args, **options)

    def capture_graphs(self, max_num_seqs: int, emulate_on_cpu: bool = False,
                       query_lens: tuple[int, ...] = (1,), max_batched_tokens: Optional[int] = None) -> bool:
        """Capture step graphs for every q in `query_lens` (1: decode; more for speculation), GPU
        only, sized for the cache's max_model_len (`allocate_cache`, the bound eager steps pass too);
        `emulate_on_cpu` runs the graph path's padding and buffers eagerly, for tests. False when
        the cache's attention cannot be captured."""
        max_model_len = self.max_model_len
        if self.device.type != "cuda" and not emulate_on_cpu:
            return False
        attend = graph_safe_attention(self.cache)
        if attend is None:
            log.warning("CUDA graphs off: %s has no capturable attention", type(self.cache).__name__)
            return False
        sizes = [b for b in GRAPH_BATCH_SIZES if b < max_num_seqs] + [max_num_seqs]
        if not getattr(self.cache, "supports_cuda_graphs", False):
            # The padded torch fallback gathers every sequence's whole table: keep that within
            # a bounded graph pool (larger decode batches run eagerly).
            per_seq = 2 * max_model_len * self.cache.num_kv_heads * self.cache.head_dim * self.model.dtype.itemsize
            sizes = [b for b in sizes if b * per_seq <= FALLBACK_GRAPH_GATHER_BYTES] or [1]
        shapes = {1: sizes}
        for q in sorted(set(query_lens) - {1}):  # speculation: small batches, within the step budget
            shapes[q] = [b for b in sizes if b <= MULTI_TOKEN_GRAPH_MAX_BATCH
                         and (max_batched_tokens is None or b * q <= max_batched_tokens)] or [1]
        self.graphs = StepGraphs(self.model, self.cache, attend, shapes, max_model_len, self.scratch_block)
        return True

    # ---- steps ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, seqs: list[StepSeq], input_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run one step; float32 logits [sum(num_logits), vocab], in the order of `seqs`.
        `input_ids`: a decode step's input tokens already on the device (one per sequence; the
        engine's look-ahead feeds the previous step's sampled tokens): they replace the
        sequences' own token_ids, which are then placeholders."""
        if input_ids is not None and not all(len(s.token_ids) == 1 for s in seqs):
            raise ValueError("input_ids on the device are for decode steps (one token per sequence)")
        if self.graphs is not None and self.graphs.fits(seqs) and not self._inside_long_prompt(seqs):
            hidden, rows = self.graphs.run(seqs, input_ids) if input_ids is not None else self.graphs.run(seqs)
        else:
            hidden, rows = self._run_eager(seqs, input_ids)
        hidden = hidden[rows]
        if hidden.shape[0] == 0:
            return torch.empty(0, self.model.config.vocab_size, device=self.device)
        return self.model.compute_logits(hidden).float()

    def _run_eager(self, seqs: list[StepSeq], input_ids: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor | slice]:
        """(hidden [T, H] of the flat batch, the rows that need logits: a slice when contiguous)."""
        b = len(seqs)
        n = np.fromiter((len(s.token_ids) for s in seqs), np.int64, b)
        starts = np.fromiter((s.start for s in seqs), np.int64, b)
        first = np.cumsum(n) - n  # each sequence's first row in the flat batch
        owner = np.repeat(np.arange(b), n)
        pos = np.arange(int(n.sum())) - first[owner] + starts[owner]
        tables, slots = self._tables_and_slots([s.block_table for s in seqs], owner, pos)
        seq_lens, query_start = starts + n, np.concatenate([[0], np.cumsum(n)])
        dev = self.device
        rope_last = None
        if self.model.long_inv_freq is not None:  # LongRoPE: see rope_last_positions
            prompt_lens = np.fromiter((s.prompt_len for s in seqs), np.int64, b)
            rope_last = to_device(np.maximum(pos, prompt_lens[owner] - 1), torch.long, dev)
        meta = AttentionMetadata(
            slot_mapping=to_device(slots, torch.long, dev), query_start=to_device(query_start, torch.int32, dev),
            seq_lens=to_device(seq_lens, torch.int32, dev), block_tables=to_device(tables, torch.int32, dev),
            query_start_list=query_start.tolist(), seq_lens_list=seq_lens.tolist(),
            max_query_len=int(n.max(initial=0)), max_seq_len=self.max_model_len, rope_last_positions=rope_last)
        if isinstance(self.cache, SplitKVCache):  # the sliding layers' blocks: their own tables and slots
            tables, slots = self._tables_and_slots([s.window_table for s in seqs], owner, pos)
            meta.window = replace(meta, slot_mapping=to_device(slots, torch.long, dev),
                                  block_tables=to_device(tables, torch.int32, dev))
            self.cache.translate(meta)
        ids = input_ids if input_ids is not None else to_device(
            np.fromiter(itertools.chain.from_iterable(s.token_ids for s in seqs), np.int64), torch.long, dev)
        hidden = self.model(ids, to_device(pos, torch.long, dev), ForwardContext(self.cache, meta))
        rows = logit_rows(n, np.fromiter((s.num_logits for s in seqs), np.int64, b), first)
        if len(rows) == 0 or rows[-1] == len(rows) - 1:  # decode-like: every row, in order (no index to copy)
            return hidden, slice(0, len(rows))
        return hidden, to_device(rows, torch.long, dev)

    def _tables_and_slots(self, rows: list[list[int]], owner: np.ndarray, pos: np.ndarray
                          ) -> tuple[np.ndarray, np.ndarray]:
        """The step's block tables [B, W] and each new token's cache slot. The table width is
        rounded up to 16: Triton keys a compile on an integer argument (the table's row stride)
        being 1 or a multiple of 16, and the width changes from step to step."""
        width = max((len(r) for r in rows), default=1)
        tables = np.zeros((len(rows), -(-max(width, 1) // TABLE_WIDTH_MULTIPLE) * TABLE_WIDTH_MULTIPLE), np.int32)
        _fill_rows(tables, rows)
        slots = tables[owner, pos // self.block_size].astype(np.int64) * self.block_size + pos % self.block_size
        return tables, slots

    @torch.inference_mode()
    def warm_up_decode(self, max_num_seqs: int) -> None:
        """Eager decode steps (no graphs, which compile theirs at capture) at one batch size per
        compiled variant of the decode attention kernel, so that no step meets a new one: empty
        sequences of one token on the scratch block."""
        for b in self.cache.decode_batch_classes(max_num_seqs, self.max_model_len):
            self.execute([StepSeq([0], 0, [self.scratch_block], window_table=self._window_scratch_table)
                          for _ in range(b)])

    @property
    def _window_scratch_table(self) -> Optional[list[int]]:
        """A split cache's sliding-layer table of the scratch block (both kinds pad on the same page)."""
        return [self.scratch_block] if isinstance(self.cache, SplitKVCache) else None

    def _inside_long_prompt(self, seqs: list[StepSeq]) -> bool:
        """A LongRoPE step with prompt tokens before their prompt's last: their factors go by that
        last position, which only the eager path passes (the graphs go by each token's own)."""
        return self.model.long_inv_freq is not None and any(s.start < s.prompt_len - 1 for s in seqs)

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write copies queued by the block manager, before the step writes: (src, dst)
        block pairs (a split cache's: page pairs, every plane)."""
        _copy_blocks(self.cache.arena if isinstance(self.cache, SplitKVCache) else self.cache, pairs)

    def sync_blocks(self, block_manager) -> None:
        """What the block manager changed that the step's kernels must see, before the step: a split
        cache's new pages (SplitKVCache.set_pages), then the copies."""
        if isinstance(self.cache, SplitKVCache):
            # (copies that do not wait: the look-ahead step may be queued behind a running one)
            for kind, blocks in enumerate(block_manager.take_new_pages()):
                if blocks:  # (only blocks of more than one page are listed)
                    self.cache.set_pages(kind, to_device([b for b, _ in blocks], torch.long, self.device),
                                         to_device([p[1:] for _, p in blocks], torch.int32, self.device).T)
        self.copy_blocks(block_manager.take_copies())


def _copy_blocks(cache: PagedKVCache, pairs: list[tuple[int, int]]) -> None:
    if not pairs:
        return
    src = to_device([s for s, _ in pairs], torch.long, cache.device)
    dst = to_device([d for _, d in pairs], torch.long, cache.device)
    for t in cache.block_tensors:  # [layers, blocks, ...]: K, V, scales, zeros
        t[:, dst] = t[:, src]


# ---- CUDA graphs -------------------------------------------------------------------------------
def graph_safe_attention(cache: PagedKVCache | SplitKVCache) -> Optional[Callable]:
    """The step's write + attention, `attend(layer, q, k, v, meta, scale, rope=None)`, reading only device
    tensors, so a captured graph stays valid when the batch's lengths and block tables change (the
    torch reference loops over host lengths: capturing it would freeze them). The Triton path says
    so with `supports_cuda_graphs` (then the cache's own `attend`, whose q/k/v maps share one
    launch); for an unquantized cache without it (CPU emulation in tests) a padded torch attention
    stands in after the cache's write. A split cache routes each layer to its group's metadata."""
    if isinstance(cache, SplitKVCache):
        attend = graph_safe_attention(cache.arena)
        return None if attend is None else cache.routed(attend)
    if getattr(cache, "supports_cuda_graphs", False):
        return cache.attend
    if cache.k.dtype in (torch.float32, torch.float16, torch.bfloat16) and not getattr(cache, "transformed", False):
        return partial(padded_attend, cache)
    return None


def padded_attend(cache: PagedKVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  meta: AttentionMetadata, scale: float, rope=None, out_cols=None) -> torch.Tensor:
    if rope is not None:
        q, k = apply_rope(q, k, *rope)
    cache.write(layer, k, v, meta.slot_mapping)
    out = padded_attention(cache, layer, q, meta, scale)
    return out if out_cols is None else scatter_columns(out, out_cols)


def padded_attention(cache: PagedKVCache, layer: int, q: torch.Tensor, meta: AttentionMetadata,
                     scale: float) -> torch.Tensor:
    """The same number of queries per sequence (the last positions of each), over all blocks of
    its table, masked causally by length: q [B * Q, Hq, D]. The query heads that share a KV head
    ride along the query axis, so K/V are never repeated per query head."""
    t, hq, d = q.shape
    b = meta.block_tables.shape[0]
    nq = t // b
    tables = meta.block_tables.long()  # [B, W]
    k_cache, v_cache = cache.storage(layer)[:2]
    k = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [B, Hkv, W * block, D]
    v = v_cache[tables].flatten(1, 2).transpose(1, 2)
    hkv, g = k.shape[1], hq // k.shape[1]
    pos = torch.arange(k.shape[2], device=q.device)[None, None, :]
    q_pos = meta.seq_lens.long()[:, None, None] - nq + torch.arange(nq, device=q.device)[None, :, None]  # [B, Q, 1]
    valid = pos <= q_pos  # [B, Q, P]
    window = layer_window(cache.sliding_window, layer)
    if window is not None:
        valid &= pos > q_pos - window
    qq = q.view(b, nq, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, nq * g, d)
    mask = valid[:, None, :, None, :].expand(b, 1, nq, g, valid.shape[-1]).reshape(b, 1, nq * g, -1)
    out = F.scaled_dot_product_attention(qq, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)
    return out.view(b, hkv, nq, g, d).permute(0, 2, 1, 3, 4).reshape(t, hq, d)


class GraphContext(ForwardContext):
    def __init__(self, cache: PagedKVCache, meta: AttentionMetadata, attend: Callable):
        super().__init__(cache, meta)
        self.attend_fn = attend  # graph_safe_attention's

    def attend(self, layer, q, k, v, scale, rope=None, out_cols=None):
        return self.attend_fn(layer, q, k, v, self.meta, scale, rope, out_cols)


class StepGraphs:
    """One graph per (q, batch size), sharing one memory pool, and their input buffers.

    Inputs live in two device buffers, each filled by one non-blocking copy from a pinned host
    mirror per step: int64 [ids | positions | slots | logit rows] and int32 [seq_lens | block
    tables]. Each graph reads its own views at the front of the buffers (for q tokens x b
    sequences: ids = longs[:T], positions = longs[T:2T], ...), so a step copies only what its
    graph reads. A split cache's sliding layers add their slots after the slots and their tables after
    the tables (`pools`: 2; both kinds of blocks pad on the scratch page)."""

    def __init__(self, model: CausalLM, cache: PagedKVCache | SplitKVCache, attend: Callable,
                 shapes: dict[int, list[int]], max_model_len: int, scratch_block: int):
        self.model, self.cache = model, cache
        self.shapes = {q: sorted(set(sizes)) for q, sizes in sorted(shapes.items())}
        self.block_size, self.max_model_len = cache.block_size, max_model_len
        # Padded tokens sit up to q - 1 positions past a sequence's end: room in the table for them.
        self.width = math.ceil((max_model_len + max(self.shapes)) / cache.block_size)
        self.scratch_block = scratch_block
        self.pools = 2 if isinstance(cache, SplitKVCache) else 1  # block tables (and slots) per sequence
        max_tokens = max(q * sizes[-1] for q, sizes in self.shapes.items())
        max_seqs = max(sizes[-1] for sizes in self.shapes.values())
        dev = model.device
        self.longs = torch.zeros((3 + self.pools) * max_tokens, dtype=torch.long, device=dev)
        self.ints = torch.zeros(max_seqs * (1 + self.pools * self.width), dtype=torch.int32, device=dev)
        pin = dev.type == "cuda"
        self.host_longs = torch.zeros(self.longs.shape, dtype=torch.long, pin_memory=pin)
        self.host_ints = torch.zeros(self.ints.shape, dtype=torch.int32, pin_memory=pin)
        self.copied = torch.cuda.Event() if pin else None  # the host mirrors may be rewritten after it
        self._host_longs, self._host_ints = self.host_longs.numpy(), self.host_ints.numpy()  # same memory
        # Block tables by pool and batch row, kept across steps (`_update_tables`), and where each row came from.
        self._tables = [np.full((max_seqs, self.width), scratch_block, np.int32) for _ in range(self.pools)]
        self._table_rows: list[list[tuple[Optional[list[int]], int]]] = [[(None, 0)] * max_seqs
                                                                         for _ in range(self.pools)]
        self.query_starts = {q: torch.arange(0, q * (max_seqs + 1), q, dtype=torch.int32, device=dev)
                             for q in self.shapes}
        self.replays: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}  # (q, batch size) -> run the graph
        self._capture(attend)

    def _views(self, q: int, b: int, buf: Optional[torch.Tensor] = None, ints: Optional[torch.Tensor] = None):
        """(ids, positions, [slots per pool], seq_lens, [tables per pool]) of the (q, b) graph, in
        the device buffers or in the given (host) ones."""
        longs = self.longs if buf is None else buf
        ints = self.ints if ints is None else ints
        t, w = q * b, self.width
        slots = [longs[(2 + p) * t: (3 + p) * t] for p in range(self.pools)]
        tables = [ints[b + p * b * w: b + (p + 1) * b * w].view(b, w) for p in range(self.pools)]
        return longs[:t], longs[t: 2 * t], slots, ints[:b], tables

    def _rows_offset(self, t: int) -> int:
        """Where the logit rows start in the longs buffer of a graph of t tokens."""
        return (2 + self.pools) * t

    def _meta(self, q: int, b: int) -> AttentionMetadata:
        _, pos, slots, seq_lens, tables = self._views(q, b)
        # Host-side fields are fixed at capture: the worst case (kernels may size grids from them).
        # A LongRoPE model's graph steps hold no prompt token but a prompt's last
        # (ModelRunner._inside_long_prompt), so each token's own position is the one its factors go by.
        meta = AttentionMetadata(
            slot_mapping=slots[0], query_start=self.query_starts[q][: b + 1], seq_lens=seq_lens,
            block_tables=tables[0], query_start_list=list(range(0, q * (b + 1), q)),
            seq_lens_list=[self.max_model_len] * b, max_query_len=q, max_seq_len=self.max_model_len,
            rope_last_positions=pos if self.model.long_inv_freq is not None else None)
        if self.pools == 2:
            meta.window = replace(meta, slot_mapping=slots[1], block_tables=tables[1])
        return meta

    @torch.inference_mode()
    def _capture(self, attend: Callable) -> None:
        pool = None
        shapes = sorted(((q, b) for q, sizes in self.shapes.items() for b in sizes), key=lambda s: -s[0] * s[1])
        for q, b in shapes:  # most tokens first: the smaller graphs fit in its pool
            ids, pos, slots, seq_lens, tables = self._views(q, b)
            # Capture on a padded batch (only the scratch blocks are touched).
            for pool_slots, pool_tables in zip(slots, tables):
                pool_slots.fill_(self.scratch_block * self.block_size)
                pool_tables.fill_(self.scratch_block)
            seq_lens.fill_(q)
            pos.copy_(torch.arange(q, device=pos.device).repeat(b))
            run = partial(self._forward, ids, pos, self._meta(q, b), attend)
            if self.model.device.type != "cuda":
                self.replays[q, b] = run  # CPU: the same buffers and padding, run eagerly (tests)
                continue
            run()  # warm-up: lazy initialisation and autotuning stay out of the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = run()
            pool = graph.pool()
            self.replays[q, b] = partial(_replay, graph, out)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata, attend: Callable) -> torch.Tensor:
        """The captured step: a split cache's tables and slots for each group of layers first, on
        the device, from the buffers' (SplitKVCache.translate), then the model."""
        if isinstance(self.cache, SplitKVCache):
            self.cache.translate(meta)
        return self.model(ids, pos, GraphContext(self.cache, meta, attend))

    def _shape(self, seqs: list[StepSeq]) -> Optional[tuple[int, int]]:
        longest = max((len(s.token_ids) for s in seqs), default=1)
        for q, sizes in self.shapes.items():
            if q >= longest and sizes[-1] >= len(seqs):
                return q, next(b for b in sizes if b >= len(seqs))
        return None

    def fits(self, seqs: list[StepSeq]) -> bool:
        return (bool(seqs) and self._shape(seqs) is not None
                and all(len(s.block_table) <= self.width for s in seqs))

    def run(self, seqs: list[StepSeq], input_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the graph for this step: (hidden [q * size, H], the rows that need logits).
        `input_ids` (decode only): the sequences' tokens, on the device."""
        q, size = self._shape(seqs)
        b, t, width, pools = len(seqs), q * size, self.width, self.pools
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's inputs have left the host mirrors
        # Fill the host mirrors in place (numpy views of the pinned tensors), one sequence per row.
        seq_lens = self._host_ints[:size]
        ids, pos = (self._host_longs[i * t: (i + 1) * t].reshape(size, q) for i in range(2))
        n = np.fromiter((len(s.token_ids) for s in seqs), np.int64, b)
        starts = np.fromiter((s.start for s in seqs), np.int64, b)
        real = np.arange(q) < n[:, None]  # [b, q]: padded tokens come after the real ones
        ids.fill(0)
        if q == 1:  # decode: one token each
            ids[:b, 0] = np.fromiter((s.token_ids[0] for s in seqs), np.int64, b)
        else:
            _fill_rows(ids[:b], [s.token_ids for s in seqs], real)
        pos[:b] = starts[:, None] + np.arange(q)  # padded tokens: any valid position
        pos[b:] = np.arange(q)  # whole padded sequences: positions 0..q-1 in the scratch block
        seq_lens[:b], seq_lens[b:] = starts + q, q
        self._update_tables(seqs)
        scratch = self.scratch_block
        for i in range(pools):  # each kind's tables and slots
            tables = self._host_ints[size * (1 + i * width): size * (1 + (i + 1) * width)].reshape(size, width)
            tables[:b], tables[b:] = self._tables[i][:b], scratch
            slots = self._host_longs[(2 + i) * t: (3 + i) * t].reshape(size, q)
            slots.fill(scratch * self.block_size)
            p = pos[:b]
            block = np.take_along_axis(tables[:b], p // self.block_size, axis=1)
            slots[:b] = np.where(real, block * self.block_size + p % self.block_size, scratch * self.block_size)
        rows = logit_rows(n, np.fromiter((s.num_logits for s in seqs), np.int64, b), np.arange(b) * q)
        at = self._rows_offset(t)
        self._host_longs[at: at + len(rows)] = rows
        n_longs, n_ints = at + len(rows), size * (1 + pools * width)
        self.longs[:n_longs].copy_(self.host_longs[:n_longs], non_blocking=True)
        self.ints[:n_ints].copy_(self.host_ints[:n_ints], non_blocking=True)
        if input_ids is not None:  # after the host copy, in stream order
            self.longs[:b].copy_(input_ids)
        if self.copied is not None:
            self.copied.record()
        return self.replays[q, size](), self.longs[at: at + len(rows)]

    def _update_tables(self, seqs: list[StepSeq]) -> None:
        """Row i of `_tables[pool]` := seqs[i]'s table in that pool (scratch-padded), writing only
        what changed: the block manager grows a table list in place and replaces it on any other
        change, so the same list object at the same row needs only its new tail."""
        for pool in range(self.pools):
            rows, known = self._tables[pool], self._table_rows[pool]
            for i, s in enumerate(seqs):
                table, (cached, written) = s.block_table if pool == 0 else s.window_table, known[i]
                if cached is table:
                    if len(table) != written:
                        rows[i, written: len(table)] = table[written:]
                        known[i] = (table, len(table))
                    continue
                rows[i, : len(table)] = table
                rows[i, len(table):] = self.scratch_block
                known[i] = (table, len(table))


def _fill_rows(out: np.ndarray, rows: list[list[int]], mask: Optional[np.ndarray] = None) -> None:
    """out[i, :len(rows[i])] = rows[i] for every i, in one numpy assignment (`mask`: where the
    values go, row-major, when the caller has it already)."""
    if mask is None:
        lens = np.fromiter(map(len, rows), np.int64, len(rows))
        mask = np.arange(out.shape[1]) < lens[:, None]
    out[mask] = np.fromiter(itertools.chain.from_iterable(rows), out.dtype)


def logit_rows(num_tokens: np.ndarray, num_logits: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Rows of the flat batch whose logits are needed: sequence i's last num_logits[i] tokens,
    its tokens starting at row first[i]."""
    total = int(num_logits.sum())
    before = np.cumsum(num_logits) - num_logits  # logit rows of the sequences before i
    return np.repeat(first + num_tokens - num_logits - before, num_logits) + np.arange(total)


def _replay(graph: "torch.cuda.CUDAGraph", out: torch.Tensor) -> torch.Tensor:
    graph.replay()
    return out
