"""The model runner: one flat batch per step over the paged KV cache.

A step is a list of `StepSeq`s (new tokens, where they start, the sequence's block table, how
many logits it needs). All new tokens of all sequences go through the model as one flat batch;
only the rows that need logits go through the lm_head.

On a GPU, decode-only steps (one new token per sequence) replay CUDA graphs captured for a set
of batch sizes: a decode step of a small model is mostly kernel-launch overhead otherwise. The
batch is padded up to the next captured size; padded rows read and write only a reserved
scratch block, so they cannot disturb real sequences. On the CPU everything runs eagerly.

KV cache sizing also lives here (it needs the model on the device): on a GPU from the memory
left after loading, minus what fitllm.budget says steps and graphs will take; on the CPU a
fixed budget.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from fitllm.models.decoder import CausalLM
from fitllm.models.kv_cache import (AttentionMetadata, ForwardContext, KVCalibration, PagedKVCache,
                                    calibrate_kv_scales)

log = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # the CPU default: 1 GiB of KV (~23k tokens of SmolLM2 in fp32)
FALLBACK_GRAPH_GATHER_BYTES = 512 << 20
NEEDS_CALIBRATION = ("fp8", "int4")  # PagedKVCache refuses these without K/V statistics
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


@dataclass
class StepSeq:
    token_ids: list[int]  # the tokens whose K/V this step computes
    start: int  # position of the first of them (= tokens already in the cache)
    block_table: list[int]
    num_logits: int = 1  # logits for the last `num_logits` new tokens (0: none)


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
        self.graphs: Optional[DecodeGraphs] = None

    # ---- setup ---------------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        probe = self._new_cache(1)
        per_token = probe.bytes_per_token
        del probe
        return per_token * self.block_size

    def choose_num_blocks(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                          gpu_memory_utilization: float, cuda_graphs: bool) -> int:
        """How many KV blocks to allocate (the scratch block comes on top)."""
        per_block = self.bytes_per_block()
        if self.device.type != "cuda":  # enough for every sequence at full length, within a budget
            wanted = max_num_seqs * math.ceil(max_model_len / self.block_size)
            return max(1, min(wanted, CPU_KV_CACHE_BYTES // per_block))
        free_bytes = self._cuda_kv_budget(max_num_seqs, max_model_len, max_num_batched_tokens,
                                          gpu_memory_utilization, cuda_graphs)
        if free_bytes < per_block:
            raise RuntimeError(
                f"no GPU memory left for the KV cache after the weights and step buffers "
                f"({free_bytes / 2**20:.0f} MiB); raise --gpu-memory-utilization, lower --max-num-seqs, "
                "or use a smaller model or --kv-dtype")
        return free_bytes // per_block  # all of it: spare blocks keep more prefixes cached

    def _cuda_kv_budget(self, max_num_seqs, max_model_len, max_num_batched_tokens, utilization, cuda_graphs) -> int:
        """Usable card memory minus what is in use now (context, weights) and what steps will need."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # memory torch holds but does not use is not "in use"
        free, total = torch.cuda.mem_get_info(self.device)
        try:
            from fitllm import budget

            settings = budget.Settings(scheme=budget.detect_scheme(self.model.config), max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                       max_batched_tokens=max_num_batched_tokens, block_size=self.block_size,
                                       gpu_memory_utilization=utilization, cuda_graphs=cuda_graphs)
            terms = budget.estimate(self.model.config, settings, total, num_kv_blocks=0).terms
            # Weights and the CUDA context are already in `total - free`: count them as measured.
            reserve = sum(v for k, v in terms.items() if k not in ("weights", "cuda_context"))
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

    def allocate_cache(self, num_blocks: int) -> None:
        """`num_blocks` usable blocks plus one scratch block (the last) for padded graph rows."""
        self.cache = self._new_cache(num_blocks + 1)
        self.scratch_block = num_blocks

    def _new_cache(self, num_blocks: int) -> PagedKVCache:
        c = self.model.config
        return PagedKVCache(c.num_layers, num_blocks, self.block_size, c.num_kv_heads, c.head_dim,
                            dtype=self.model.dtype, device=self.device, sliding_window=c.sliding_window,
                            kv_dtype=self.kv_dtype, calibration=self.kv_calibration)

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, emulate_on_cpu: bool = False) -> bool:
        """Capture decode graphs (GPU only; `emulate_on_cpu` runs the graph path's padding and
        buffers eagerly, for tests). False when the cache's attention cannot be captured."""
        if self.device.type != "cuda" and not emulate_on_cpu:
            return False
        attention = graph_safe_attention(self.cache)
        if attention is None:
            log.warning("CUDA graphs off: %s has no capturable decode attention", type(self.cache).__name__)
            return False
        sizes = [b for b in GRAPH_BATCH_SIZES if b < max_num_seqs] + [max_num_seqs]
        if not getattr(self.cache, "supports_cuda_graphs", False):
            # The padded torch fallback gathers every sequence's whole table: keep that within
            # a bounded graph pool (larger decode batches run eagerly).
            per_seq = 2 * max_model_len * self.cache.num_kv_heads * self.cache.head_dim * self.model.dtype.itemsize
            sizes = [b for b in sizes if b * per_seq <= FALLBACK_GRAPH_GATHER_BYTES] or [1]
        self.graphs = DecodeGraphs(self.model, self.cache, attention, sizes, max_model_len, self.scratch_block)
        return True

    # ---- steps ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, seqs: list[StepSeq]) -> torch.Tensor:
        """Run one step; float32 logits [sum(num_logits), vocab], in the order of `seqs`."""
        if self.graphs is not None and self.graphs.fits(seqs):
            hidden = self.graphs.run(seqs)
        else:
            hidden = self._run_eager(seqs)
        rows, end = [], 0
        for s in seqs:
            end += len(s.token_ids)
            rows.extend(range(end - s.num_logits, end))
        if not rows:
            return torch.empty(0, self.model.config.vocab_size, device=self.device)
        index = torch.tensor(rows, device=self.device)
        return self.model.compute_logits(hidden[index]).float()

    def _run_eager(self, seqs: list[StepSeq]) -> torch.Tensor:
        seq_lens = [s.start + len(s.token_ids) for s in seqs]
        meta = AttentionMetadata.build([len(s.token_ids) for s in seqs], seq_lens, [s.block_table for s in seqs],
                                       self.block_size, self.device)
        ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.long, device=self.device)
        pos = torch.tensor([p for s in seqs for p in range(s.start, s.start + len(s.token_ids))],
                           dtype=torch.long, device=self.device)
        return self.model(ids, pos, ForwardContext(self.cache, meta))

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write copies queued by the block manager, before the step writes."""
        if not pairs:
            return
        if hasattr(self.cache, "copy_blocks"):
            self.cache.copy_blocks(pairs)
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        # Every per-slot tensor of the cache ([layers, blocks, block_size, ...]: K, V, scales, zeros).
        c = self.cache
        for t in vars(c).values():
            if isinstance(t, torch.Tensor) and t.dim() >= 4 and t.shape[:3] == (c.num_layers, c.num_blocks, c.block_size):
                t[:, dst] = t[:, src]


# ---- CUDA graphs -------------------------------------------------------------------------------
def graph_safe_attention(cache: PagedKVCache) -> Optional[Callable]:
    """Decode attention that reads only device tensors, so a captured graph stays valid when the
    batch's lengths and block tables change (the torch reference loops over host lengths:
    capturing it would freeze them). The Triton path says so with `supports_cuda_graphs`; for
    an unquantized cache without it (CPU emulation in tests) a padded torch version stands in."""
    if getattr(cache, "supports_cuda_graphs", False):
        return cache.attention
    if cache.k.dtype in (torch.float32, torch.float16, torch.bfloat16) and not getattr(cache, "transformed", False):
        return partial(padded_decode_attention, cache)
    return None


def padded_decode_attention(cache: PagedKVCache, layer: int, q: torch.Tensor, meta: AttentionMetadata,
                            scale: float) -> torch.Tensor:
    """One query per sequence over all blocks of its table, masked by length: [B, Hq, D].
    The query heads that share a KV head ride along the query-length axis, so K/V are never
    repeated per query head (a decode query has no causal mask to get wrong)."""
    b, hq, d = q.shape
    tables = meta.block_tables.long()  # [B, W]
    k = cache.k[layer][tables].flatten(1, 2).transpose(1, 2)  # [B, Hkv, W * block, D]
    v = cache.v[layer][tables].flatten(1, 2).transpose(1, 2)
    hkv = k.shape[1]
    pos = torch.arange(k.shape[2], device=q.device)[None, :]
    lens = meta.seq_lens.long()[:, None]
    valid = pos < lens
    if cache.sliding_window is not None:
        valid &= pos >= lens - cache.sliding_window
    out = F.scaled_dot_product_attention(q.reshape(b, hkv, hq // hkv, d), k.to(q.dtype), v.to(q.dtype),
                                         attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(b, hq, d)


class GraphContext(ForwardContext):
    def __init__(self, cache: PagedKVCache, meta: AttentionMetadata, attention: Callable):
        super().__init__(cache, meta)
        self.attention = attention

    def attend(self, layer, q, k, v, scale):
        self.cache.write(layer, k, v, self.meta.slot_mapping)
        return self.attention(layer, q, self.meta, scale)


class DecodeGraphs:
    """Static input buffers and one graph per batch size, sharing one memory pool."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, attention: Callable, sizes: list[int],
                 max_model_len: int, scratch_block: int):
        self.model, self.cache, self.sizes = model, cache, sorted(set(sizes))
        self.block_size, self.max_model_len = cache.block_size, max_model_len
        self.width = math.ceil(max_model_len / cache.block_size)
        self.scratch_block = scratch_block
        n, dev = self.sizes[-1], model.device
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), scratch_block * cache.block_size, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.tables = torch.full((n, self.width), scratch_block, dtype=torch.int32, device=dev)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}  # batch size -> run the graph
        self._capture(attention)

    def _meta(self, b: int) -> AttentionMetadata:
        # Host-side fields are fixed at capture: the worst case (kernels may size grids from them).
        return AttentionMetadata(
            slot_mapping=self.slots[:b], query_start=self.query_start[: b + 1], seq_lens=self.seq_lens[:b],
            block_tables=self.tables[:b], query_start_list=list(range(b + 1)), seq_lens_list=[self.max_model_len] * b,
            max_query_len=1, max_seq_len=self.max_model_len)

    @torch.inference_mode()
    def _capture(self, attention: Callable) -> None:
        pool = None
        for b in reversed(self.sizes):  # largest first: the smaller graphs fit in its pool
            ctx = GraphContext(self.cache, self._meta(b), attention)
            run = partial(self.model, self.ids[:b], self.pos[:b], ctx)
            if self.model.device.type != "cuda":
                self.replays[b] = run  # CPU: the same buffers and padding, run eagerly (tests)
                continue
            run()  # warm-up: lazy initialisation and autotuning stay out of the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = run()
            pool = graph.pool()
            self.replays[b] = partial(_replay, graph, out)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()

    def fits(self, seqs: list[StepSeq]) -> bool:
        return (len(seqs) <= self.sizes[-1] and all(len(s.token_ids) == 1 and s.num_logits <= 1 for s in seqs)
                and all(len(s.block_table) <= self.width for s in seqs))

    def run(self, seqs: list[StepSeq]) -> torch.Tensor:
        b = len(seqs)
        size = next(s for s in self.sizes if s >= b)
        bs = self.block_size
        tables = torch.full((size, self.width), self.scratch_block, dtype=torch.int32)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
        ids = [s.token_ids[0] for s in seqs] + [0] * (size - b)
        pos = [s.start for s in seqs] + [0] * (size - b)
        slots = [s.block_table[s.start // bs] * bs + s.start % bs for s in seqs]
        slots += [self.scratch_block * bs] * (size - b)
        lens = [s.start + 1 for s in seqs] + [1] * (size - b)
        self.ids[:size].copy_(torch.tensor(ids), non_blocking=True)
        self.pos[:size].copy_(torch.tensor(pos), non_blocking=True)
        self.slots[:size].copy_(torch.tensor(slots), non_blocking=True)
        self.seq_lens[:size].copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)
        self.tables[:size].copy_(tables, non_blocking=True)
        return self.replays[size]()[:b]


def _replay(graph: "torch.cuda.CUDAGraph", out: torch.Tensor) -> torch.Tensor:
    graph.replay()
    return out
