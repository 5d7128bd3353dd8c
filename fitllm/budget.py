"""The memory model: what a served model needs on a GPU, term by term.

Shared by `quant memory` (planning, no GPU needed) and `quant serve` (sizing its KV cache, then
checking the prediction against what the card measured). Pure functions of a ModelConfig and a
few serving settings; every byte counted here has a name and a reason.

A served model's GPU memory, in the order it is allocated:
  cuda_context     driver context + kernel images (cuBLAS, Triton); outside torch's allocator
  weights          quantized linears + bf16 embeddings, lm_head (unless quantized) and norms
  workspace        cuBLAS/cuBLASLt workspaces (torch allocates them)
  activations      peak of one forward step of `max_batched_tokens` tokens, plus the logits
  cuda_graphs      the private pool the captured decode graphs keep for their activations
  allocator_slack  memory torch's caching allocator reserves but does not hand out
  kv_cache         everything left, in whole blocks
The KV cache is last on purpose: it is the one term that stretches to fill the card.

The server: `estimate(config, settings, total_bytes).num_kv_blocks` (or `kv_cache_blocks_for` on
memory it measured itself) sizes the cache; after a warm-up under full load,
`compare_with_measured(estimate(..., num_kv_blocks=allocated))` reports predicted beside measured.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

from fitllm.models.config import ModelConfig, layer_window
from fitllm.models.errors import FitLLMError

MiB = 1 << 20
GiB = 1 << 30

# ---------------------------------------------------------------- constants to calibrate on GPU
# These are the estimated terms; the lead's H200 validation run (issue 8) is what tunes them.
# CUDA context, cuBLAS/Triton kernel images: invisible to torch. Measured on an H100 (torch 2.11, a served Gemma 3
# 4B and 1B, 2026-12-07): 619 MiB in use outside torch's allocator when the engine sizes its cache, 759 MiB after
# its warm-up loaded the rest of its kernels. The server reserves what is still to load (ModelRunner._cuda_kv_budget).
CUDA_CONTEXT_BYTES = 768 * MiB
CUBLAS_WORKSPACE_BYTES = 64 * MiB  # cuBLAS/cuBLASLt workspaces (main and graph streams), split-K buffers
ALLOCATOR_SLACK_FRACTION = 0.10  # fragmentation of the step-to-step (transient) allocations
ALLOCATOR_SLACK_MIN_BYTES = 64 * MiB
BANDWIDTH_EFFICIENCY = 0.85  # share of peak HBM bandwidth a decode step reaches (H200: 4.22/4.8 TB/s copy)
SAMPLER_BYTES_PER_LOGIT = 22  # bf16 lm_head out 2 + fp32 logits 4 + probs 4 + sorted 4 + int64 order 8
ROPE_TEMP_BYTES_PER_ELEM = 8  # q and k go through float32 for RoPE: one fp32 copy + one fp32 result
CUDA_GRAPH_MAX_BATCH = 512  # decode graphs are captured for batch sizes up to this
ACT_BYTES = 2  # activations in bf16 (fp16 on T4)
ATTN_SPLIT_TOKENS = 512  # fused decode attention: context chunk per split (partials kept in fp32)

DEFAULT_BLOCK_SIZE = 16
# fp8 and int8 values are stored transposed per block (kernels/paged_attention.py, values_transposed):
# each channel's tokens of a block are one contiguous run, and decode attention reads them run by run.
# 16-byte runs cost the L2 one tag lookup per 64 bytes (the limit: 84 % busy at 67 % of DRAM
# bandwidth); 64-token blocks make the runs whole cache lines: fp8 decode attention 1.7-1.9x bf16
# on an H200 instead of 1.4x (benchmarks/RESULTS.md). Only the value layout cares.
TRANSPOSED_KV_BLOCK_SIZE = 64
DEFAULT_MAX_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 64  # = `quant serve --max-num-seqs` default
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

# ---------------------------------------------------------------- weights
SCHEMES = ("bf16", "fp16", "awq", "gptq", "fp8", "nf4")
NF4_BLOCK = 64  # bitsandbytes' default 4-bit blocksize: one absmax per 64 weights (fp16 once fitllm serves it)


def linear_shapes(config: ModelConfig) -> list[tuple[str, int, int]]:
    """One decoder layer's checkpoint matrices as (name, in_features, out_features)."""
    h, i = config.hidden_size, config.intermediate_size
    if config.fused_checkpoint:  # Phi-3
        return [("qkv_proj", h, config.q_size + 2 * config.kv_size), ("o_proj", config.q_size, h),
                ("gate_up_proj", h, 2 * i), ("down_proj", i, h)]
    return [("q_proj", h, config.q_size), ("k_proj", h, config.kv_size), ("v_proj", h, config.kv_size),
            ("o_proj", config.q_size, h), ("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)]


def default_group_size(config: ModelConfig) -> int:
    """128, unless an input width is not a multiple of it (SmolLM2's 576 -> 64)."""
    widths = {k for _, k, _ in linear_shapes(config)}
    return next((g for g in (128, 64, 32) if all(k % g == 0 for k in widths)), 32)


def linear_bytes(k: int, n: int, scheme: str, group_size: int = 128, bits: int = 4) -> int:
    """Bytes of one k->n linear as fitllm holds it on the GPU after loading. Every int4 layout
    (AWQ, GPTQ, compressed-tensors) is repacked into one runtime layout,
    fitllm.quant.formats.packing.KernelWeight: int4 (or int8) packed in int32, and per group of
    `group_size` inputs one scale and one zero point, both in the bf16 compute dtype. On the GPU
    the words are tiled (fitllm.kernels.w4a16_tiled: K padded to a multiple of 128)."""
    if scheme in ("bf16", "fp16"):
        return 2 * k * n
    if scheme in ("awq", "gptq"):
        groups = math.ceil(k / group_size) if group_size > 0 else 1  # -1: one group per channel
        k_words = -(-k // 128) * 128  # the tiled layout's padding (act-order weights too: rows sorted at load)
        return k_words * n * bits // 8 + 2 * groups * n * 2  # int4 or int8 + bf16 scales and zeros
    if scheme == "fp8":
        return k * n + 4 * n  # e4m3 weights + one fp32 scale per output channel
    if scheme == "nf4":  # fitllm.quant.scheme.CodebookWeight: 4-bit codes + fp16 absmax per block
        return k * n // 2 + 2 * math.ceil(k * n / NF4_BLOCK)
    raise FitLLMError(f"unknown weight scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")


@dataclass(frozen=True)
class Weights:
    linears: int  # all decoder-layer linears in the chosen scheme
    embeddings: int  # bf16 token table: never quantized (it is a gather, not a GEMM)
    lm_head: int  # bf16 (the most sensitive layer; 0 when tied) unless the checkpoint quantized it
    norms_biases: int  # bf16 RMSNorm weights (+ qkv biases for Qwen2)

    @property
    def total(self) -> int:
        return self.linears + self.embeddings + self.lm_head + self.norms_biases

    @property
    def read_per_step(self) -> int:
        """Bytes a decode step streams from memory: all but the embedding table, of which only
        the batch's rows are read (unless it doubles as the lm_head)."""
        return self.linears + self.lm_head + self.norms_biases + (self.embeddings if self.lm_head == 0 else 0)


def weight_bytes(config: ModelConfig, scheme: str = "bf16", group_size: Optional[int] = None, bits: int = 4) -> Weights:
    """The weights as fitllm holds them on the GPU; `bits` (4 or 8) are those of awq / gptq layers."""
    group_size = group_size or default_group_size(config)
    per_layer = sum(linear_bytes(k, n, scheme, group_size, bits) for _, k, n in linear_shapes(config))
    if scheme == "gptq":  # act-order: an int32 group index per input row of each fused GEMM (qkv, o, gate|up, down)
        per_layer += 4 * (2 * config.hidden_size + config.q_size + config.intermediate_size)
    table = 2 * config.vocab_size * config.hidden_size
    norms = 2 * config.hidden_size * ((4 if config.sandwich_norms else 2) * config.num_layers + 1)
    if config.qk_norm:
        norms += 2 * 2 * config.head_dim * config.num_layers
    if config.qkv_bias:
        norms += 2 * (config.q_size + 2 * config.kv_size) * config.num_layers
    head_bits = lm_head_bits(config)
    if head_bits and scheme in ("awq", "gptq"):
        head = linear_bytes(config.hidden_size, config.vocab_size, scheme, group_size, head_bits)
        head += 4 * config.hidden_size if scheme == "gptq" else 0  # its g_idx
    else:
        head = 0 if config.tie_word_embeddings else table
    return Weights(per_layer * config.num_layers, table, head, norms)


def with_quantized_lm_head(config: ModelConfig, bits: int) -> ModelConfig:
    """`config` as `quant convert --format gptq --quantize-lm-head --lm-head-bits BITS` would write
    it (4-bit layers; a `dynamic` rule when the head has other bits): for planning before converting."""
    if bits not in (4, 8):
        raise FitLLMError(f"--lm-head-bits: {bits} is not supported (4 or 8)")
    from fitllm.quant.formats.gptq import quantization_config
    from fitllm.quant.scheme import QuantScheme

    qc = quantization_config(QuantScheme("gptq", bits=4, group_size=default_group_size(config)), bits)
    return replace(config, quantization_config=qc, tie_word_embeddings=False)


def lm_head_bits(config: ModelConfig) -> Optional[int]:
    """The bits of a quantized lm_head (GPTQ `lm_head: true`, and its `dynamic` rule if any);
    None when it is bf16."""
    q = config.quantization_config or {}
    if str(q.get("quant_method", "")).lower() != "gptq" or not q.get("lm_head", False):
        return None
    from fitllm.quant.formats.gptq import module_config

    head = module_config(q, "lm_head")
    return None if head is None else int(head.get("bits", 4))


def detect_scheme(config: ModelConfig) -> str:
    """The scheme a checkpoint is already in, from its quantization_config (bf16 if none)."""
    if config.quantized_at_load:  # `quant serve --quantization`: int4 is RTN in AWQ's runtime layout
        return {"int4": "awq"}.get(config.quantized_at_load, config.quantized_at_load)
    q = config.quantization_config or {}
    method = str(q.get("quant_method") or q.get("format") or "").lower()
    if method in ("awq", "gptq", "fp8"):
        return method
    if method == "bitsandbytes":  # 8-bit: LLM.int8() rows, served as fitllm's int8 layout (one group per row)
        from fitllm.quant.formats.bitsandbytes import bits_of

        return "nf4" if bits_of(q) == 4 else "gptq"
    if method == "compressed-tensors":
        for w in _weight_args(q):
            if w.get("num_bits") == 8 and w.get("type") == "float":
                return "fp8"
            if _int_bits(w):
                return "awq"  # int4 / int8 with group scales: the same bytes as AWQ (checkpoint_bits says which)
    return "bf16"


def checkpoint_bits(config: ModelConfig) -> int:
    """The weight bits of an int-quantized checkpoint's layers: GPTQ's and AWQ's `bits`, or the
    `num_bits` of a compressed-tensors config's int weights; 4 when it states none."""
    q = config.quantization_config or {}
    if q.get("bits") is not None:
        return int(q["bits"])
    if q.get("quant_method") == "bitsandbytes":
        from fitllm.quant.formats.bitsandbytes import bits_of

        return bits_of(q)
    return next((bits for w in _weight_args(q) if (bits := _int_bits(w))), 4)


def _weight_args(q: dict) -> list[dict]:
    """The weight quantization args of each of a compressed-tensors config's groups."""
    return [g.get("weights") or {} for g in (q.get("config_groups") or {}).values()]


def _int_bits(w: dict) -> Optional[int]:
    """The bits of compressed-tensors weight args that are int4 or int8; None for any other."""
    return int(w["num_bits"]) if w.get("type", "int") == "int" and w.get("num_bits") in (4, 8) else None


def checkpoint_group_size(config: ModelConfig) -> Optional[int]:
    """The group size a quantized checkpoint's config states (-1: per channel): GPTQ's and AWQ's
    `group_size`, or the smallest of a compressed-tensors config's weight groups; None if none."""
    q = config.quantization_config or {}
    if q.get("group_size") is not None:
        return q["group_size"]
    if q.get("quant_method") == "bitsandbytes":
        return -1  # 8-bit rows; NF4's blocks are NF4_BLOCK
    sizes = [-1 if w.get("strategy") == "channel" else w.get("group_size") for w in _weight_args(q)]
    return min((s for s in sizes if s is not None), default=None)


# ---------------------------------------------------------------- KV cache
# Bytes per stored element, and per-(token, kv-head) metadata beside the blocks: int8 keeps an
# fp16 scale, asymmetric int4 an fp16 scale and an fp16 zero per 16 channels of a key and per 32
# channels of a value. fp8 scales are per tensor or per head (a few bytes per layer), so they
# count as zero. MUST match fitllm/models/kv_cache.py.
KV_DTYPES = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
KV_META_BYTES = {"bf16": 0, "fp16": 0, "fp8": 0, "int8": 2, "int4": 4}  # per scale group
KV_INT4_KEY_GROUP = 16  # kv_cache.py's int4_key_group
KV_INT4_GROUP = 32  # kv_cache.py's int4_group (values)


def normalize_kv_dtype(kv_dtype: str) -> str:
    kv = {"auto": "bf16", "bfloat16": "bf16", "float16": "fp16", "fp8_e4m3": "fp8"}.get(kv_dtype, kv_dtype)
    if kv not in KV_DTYPES:
        raise FitLLMError(f"unknown KV dtype {kv_dtype!r}; choose one of auto, {', '.join(KV_DTYPES)}")
    return kv


def kv_bytes_per_token(config: ModelConfig, kv_dtype: str = "bf16", num_layers: Optional[int] = None) -> int:
    """K and V, every layer (or `num_layers` of them), every KV head (not query head: grouped-query
    attention shares them)."""
    kv = normalize_kv_dtype(kv_dtype)
    d = config.head_dim

    def row(group: int) -> int:  # one head of K or of V
        groups = -(-d // min(group, d)) if kv == "int4" else 1
        return int(d * KV_DTYPES[kv]) + KV_META_BYTES[kv] * groups

    layers = config.num_layers if num_layers is None else num_layers
    return layers * config.num_kv_heads * (row(KV_INT4_KEY_GROUP) + row(KV_INT4_GROUP))


# ---------------------------------------------------------------- sliding-window layers
KV_LAYOUTS = ("auto", "split", "shared")  # = `quant serve --kv-layout`
PAGE_PADDING_MAX = 0.125  # a split cache's sliding-layer blocks may leave this share of their planes empty


def sliding_layers(config: ModelConfig) -> tuple[int, Optional[int]]:
    """(how many layers attend over a sliding window, the widest window); (0, None) without."""
    windows = [layer_window(config.attention_windows, i) for i in range(config.num_layers)]
    slid = [w for w in windows if w is not None]
    return len(slid), max(slid, default=None)


def has_sliding_and_full_layers(config: ModelConfig) -> bool:
    """Both kinds of layers (Gemma 3): a split cache can give the sliding ones blocks of their own."""
    return 0 < sliding_layers(config)[0] < config.num_layers


def keeps_windows_only(config: ModelConfig, context: int, layout: str) -> bool:
    """Every layer slides over a window shorter than the context, and `layout` lets the one pool give
    back the blocks behind each sequence's window (the server also needs no draft model's cache)."""
    num_sliding, window = sliding_layers(config)
    return num_sliding == config.num_layers and window < context and layout != "shared"


def splits_kv(config: ModelConfig, context: int, layout: str) -> bool:
    """Whether the KV cache is split (SplitKVCache): the sliding-window layers get blocks of their own,
    given back behind each sequence's window, from the pool of pages the full layers' come from. Where
    the model has both kinds of layers: always with "split", with "auto" where the context is longer
    than the window (else the split would keep the same tokens, in fuller pages)."""
    if layout not in KV_LAYOUTS:
        raise FitLLMError(f"--kv-layout {layout!r}: choose one of {', '.join(KV_LAYOUTS)}")
    if layout == "shared" or not has_sliding_and_full_layers(config):
        return False
    return layout == "split" or sliding_layers(config)[1] < context


def page_geometry(config: ModelConfig) -> tuple[int, tuple[int, int]]:
    """(layers a page holds, (pages a full-layer block takes, pages a sliding-layer block takes)) of a
    split cache: the most layers a page that divides the full layers and leaves at most
    PAGE_PADDING_MAX of the sliding blocks' planes empty (fewer pages a block: fewer tables and slot
    maps a step). Gemma 3 27B (10 full, 52 sliding layers): 5 layers, (2, 11)."""
    num_sliding = sliding_layers(config)[0]
    num_full = config.num_layers - num_sliding
    g = next(g for g in range(num_full, 0, -1)
             if num_full % g == 0 and -(-num_sliding // g) * g - num_sliding <= PAGE_PADDING_MAX * num_sliding)
    return g, (num_full // g, -(-num_sliding // g))


def longest_in_pages(num_pages: int, widths: tuple[int, int], window: int, block_size: int) -> int:
    """The longest context, in tokens, that `num_pages` pages of a split cache hold for one sequence (blocks of
    `widths` pages: full, sliding): its window of sliding blocks at most, the rest full-layer blocks."""
    full, sliding = widths
    most = window_blocks(window, block_size)
    if num_pages < most * (full + sliding):
        return num_pages // (full + sliding) * block_size
    return (num_pages - most * sliding) // full * block_size


def window_blocks(window: int, block_size: int) -> int:
    """The most blocks a sequence holds of a window's: the window behind its next token, rounded out to
    whole blocks at both ends (whole blocks go back only once wholly behind it)."""
    return blocks_for_tokens(window - 1, block_size) + 2


def window_held(window: int, context: int, block_size: int) -> int:
    """Blocks a sequence of `context` tokens holds of a window's (window_blocks, or all of its own)."""
    return min(blocks_for_tokens(context, block_size), window_blocks(window, block_size))


def default_block_size(kv_dtype: str) -> int:
    """Tokens per KV block when none is asked for: 64 for fp8 and int8 KV (TRANSPOSED_KV_BLOCK_SIZE),
    else 16."""
    return TRANSPOSED_KV_BLOCK_SIZE if kv_dtype in ("fp8", "int8") else DEFAULT_BLOCK_SIZE


def blocks_for_tokens(tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """A sequence holds whole blocks: its last block is partly empty but fully allocated."""
    return -(-tokens // block_size)


def kv_cache_bytes(config: ModelConfig, kv_dtype: str, tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    return blocks_for_tokens(tokens, block_size) * block_size * kv_bytes_per_token(config, kv_dtype)


def kv_cache_blocks_for(memory_bytes: int, config: ModelConfig, kv_dtype: str = "bf16",
                        block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """How many KV blocks fit in `memory_bytes` (what the server calls to size its cache)."""
    return max(0, int(memory_bytes) // (block_size * kv_bytes_per_token(config, kv_dtype)))


# ---------------------------------------------------------------- activations
def attention_workspace_bytes(config: ModelConfig, num_seqs: int, context: int, query_tokens: int,
                              attention: str = "fused") -> int:
    """Temporaries of one layer's attention over the paged cache.

    fused:  the Triton kernels (issue 5) read K/V blocks in place; a long decode splits the
            context into chunks of ATTN_SPLIT_TOKENS and keeps fp32 partial outputs (+ max, sum).
    padded: the torch fallback the CUDA graphs capture today (serve/model_runner.py) gathers all
            `num_seqs` sequences' K/V padded to `context`, repeated to the query heads, + a mask.
    torch:  the eager reference gathers one sequence at a time, repeated to the query heads,
            with a [query_tokens, context] mask.
    """
    c = config
    gathered = context * (2 * c.kv_size + 2 * c.q_size) * ACT_BYTES  # K, V and their per-query-head repeats
    if attention == "padded":
        return num_seqs * (gathered + context)
    if attention == "torch":
        return gathered + query_tokens * context
    splits = -(-context // ATTN_SPLIT_TOKENS)
    return num_seqs * c.num_heads * splits * (c.head_dim + 2) * 4 if splits > 1 else 0


def dequant_min_tokens(config: ModelConfig, group_size: Optional[int] = None, arch: Optional[str] = None,
                       bits: int = 4) -> int:
    """The fewest tokens in a step at which one of the model's 4-bit (or `bits`) GEMMs dequantizes
    its weight whole to bf16 for cuBLAS, as fitllm's kernel tables pick on `arch` ('sm90', 'sm89',
    ...; None, a card not known: the 'default' rows, which do it soonest). On Hopper the
    warp-specialised kernel takes 257..3072 tokens (8-bit weights: ..2048) where the shapes allow
    (whole 128-row weight blocks, groups of 128·j), else they dequantize from 257. AWQ and
    GPTQ, act-order included (its rows sorted by group at load), run the tiled layout."""
    from fitllm.kernels.w4a16_tiled import dequant_from_tokens

    arch = arch or "default"
    h, i, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    gs = default_group_size(config) if group_size is None else group_size  # <= 0: per channel
    # the runtime's fused GEMMs, (N, K): qkv, o, gate|up, down
    return min(dequant_from_tokens(arch, n, k, gs if 0 < gs < k else k, bits)
               for n, k in ((q + 2 * kv, h), (h, q), (2 * i, h), (h, i)))


def activation_bytes(config: ModelConfig, tokens: int, sampled_rows: int, scheme: str = "bf16",
                     attention_workspace: int = 0, dequant_from: Optional[int] = None) -> int:
    """Peak transient memory of one step of `tokens` tokens, of which `sampled_rows` get logits
    (0: the forward pass alone, as captured in a CUDA graph). dequant_from: the fewest tokens at
    which a 4-bit GEMM dequantizes its weight (dequant_min_tokens; None: on a card not known).

    Layers run one after another, so only one layer's temporaries are alive at a time, on top of
    the residual stream (residual, normed input, sub-layer output). After the last layer only the
    hidden states remain while the lm_head and sampler work on the sampled rows.
    """
    c, t = config, tokens
    residual = 3 * t * c.hidden_size * ACT_BYTES
    rope_tables = t * c.head_dim * 4  # cos and sin, fp32, head_dim/2 each
    attention = (t * (c.q_size + 2 * c.kv_size) * ACT_BYTES  # fused qkv output
                 + t * (c.q_size + c.kv_size) * ROPE_TEMP_BYTES_PER_ELEM  # fp32 rope on q and k
                 + t * c.q_size * ACT_BYTES  # attention output, before o_proj
                 + attention_workspace)
    mlp = 4 * t * c.intermediate_size * ACT_BYTES  # gate|up (2I), silu(gate) (I), product (I)
    if scheme == "fp8":
        mlp += t * c.intermediate_size  # activations quantized to e4m3 for the W8A8 GEMM
    if scheme == "nf4":
        from fitllm.kernels.codebook4 import DEQUANT_FROM_M

        dequant_from = DEQUANT_FROM_M
    elif scheme in ("awq", "gptq") and dequant_from is None:
        dequant_from = dequant_min_tokens(config)
    if scheme in ("awq", "gptq", "nf4") and t >= dequant_from:
        # fitllm's "dequant" W4A16 backend (large M, when its tile table picks it) and NF4 from
        # DEQUANT_FROM_M rows dequantize the whole weight to bf16, then call cuBLAS; counted as the
        # largest weight, the fused gate|up.
        mlp += 2 * c.hidden_size * 2 * c.intermediate_size
    layers = residual + rope_tables + max(attention, mlp)
    if not sampled_rows:
        return layers
    return max(layers, t * c.hidden_size * ACT_BYTES + sampled_rows * c.vocab_size * SAMPLER_BYTES_PER_LOGIT)


# ---------------------------------------------------------------- the whole budget
@dataclass(frozen=True)
class Settings:
    """What `quant serve` is asked for; the same names as its options."""

    scheme: str = "bf16"
    kv_dtype: str = "bf16"
    max_model_len: int = 4096
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS
    block_size: Optional[int] = None  # None: default_block_size(kv_dtype)
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    cuda_graphs: bool = True
    group_size: Optional[int] = None
    bits: int = 4  # awq / gptq layers: 4 or 8 (GPTQ int8)
    # Attention implementation, eager / in the decode graphs: "fused" (Triton, the target),
    # "torch" / "padded" (today's fallbacks; see attention_workspace_bytes).
    attention: str = "fused"
    graph_attention: str = "fused"
    # The card's architecture ('sm90', 'sm89', ...), which picks the kernels' tile tables (what the
    # 4-bit GEMMs dequantize, and from how many tokens); None: not known, the soonest of them.
    gpu_arch: Optional[str] = None
    kv_layout: str = "auto"  # sliding-window layers: blocks of their own ("split") or not ("shared"); see splits_kv

    def __post_init__(self):
        if self.block_size is None:
            object.__setattr__(self, "block_size", default_block_size(self.kv_dtype))
        # named as the options of `quant serve` / `quant memory` that set them
        for option, value in (("--block-size", self.block_size), ("--max-model-len", self.max_model_len),
                              ("--max-num-seqs", self.max_num_seqs),
                              ("--max-num-batched-tokens", self.max_batched_tokens)):
            if value < 1:
                raise FitLLMError(f"{option} {value}: must be at least 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise FitLLMError(f"--gpu-memory-utilization {self.gpu_memory_utilization:g}: must be in (0, 1]")
        if self.kv_layout not in KV_LAYOUTS:
            raise FitLLMError(f"--kv-layout {self.kv_layout!r}: choose one of {', '.join(KV_LAYOUTS)}")


TERM_HELP = {
    "cuda_context": "CUDA context, kernel images; outside torch",
    "weights": "linears in the scheme; embeddings and norms bf16, lm_head too unless quantized",
    "workspace": "cuBLAS/cuBLASLt workspaces",
    "activations": "peak of one step: MLP/qkv temporaries, logits of sampled rows",
    "cuda_graphs": "memory pool of the captured decode graphs",
    "allocator_slack": "reserved by torch's allocator, not handed out",
    "kv_cache": "K and V of every layer and KV head, whole blocks",
}


@dataclass
class Budget:
    settings: Settings
    gpu_memory: int  # bytes on the card
    weights: Weights
    kv_bytes_per_token: int
    terms: dict[str, int]  # every term but kv_cache, in allocation order
    num_kv_blocks: int  # with a split cache: its pages
    model_max_len: int
    window: Optional[int] = None  # the sliding layers' window (None: no layer slides)
    window_bytes_per_token: int = 0  # the sliding layers' share of kv_bytes_per_token
    page_widths: Optional[tuple[int, int]] = None  # a split cache's pages a block (full, sliding); None: no split
    page_bytes_per_token: int = 0  # a split cache's page, per token it holds
    window_only: bool = False  # every layer slides: the one pool keeps only each sequence's window

    @property
    def split(self) -> bool:
        return self.page_widths is not None

    def _window_held(self, context: int) -> int:
        return window_held(self.window, context, self.settings.block_size)

    def _pages_at(self, context: int) -> int:
        """Pages a sequence of `context` tokens holds in a split cache."""
        full, sliding = self.page_widths
        return blocks_for_tokens(context, self.settings.block_size) * full + self._window_held(context) * sliding

    def _longest_in_pages(self, pages: int) -> int:
        return longest_in_pages(pages, self.page_widths, self.window, self.settings.block_size)

    @property
    def usable(self) -> int:
        return int(self.gpu_memory * self.settings.gpu_memory_utilization)

    @property
    def kv_cache(self) -> int:
        per_token = self.page_bytes_per_token if self.split else self.kv_bytes_per_token
        return self.num_kv_blocks * self.settings.block_size * per_token

    @property
    def fixed(self) -> int:
        return sum(self.terms.values())

    @property
    def total(self) -> int:
        """What the process uses on the card (nvidia-smi's number)."""
        return self.fixed + self.kv_cache

    @property
    def torch_peak(self) -> int:
        """What torch.cuda.max_memory_allocated() should report: no context, no slack."""
        return self.total - self.terms["cuda_context"] - self.terms["allocator_slack"]

    @property
    def kv_tokens(self) -> int:
        """The tokens the KV cache holds (a split cache: of one sequence, as long as they fit)."""
        if self.split:
            return self._longest_in_pages(self.num_kv_blocks)
        return self.num_kv_blocks * self.settings.block_size

    def max_seqs_at(self, context: int) -> int:
        """Concurrent sequences whose KV fits when each holds `context` tokens."""
        if self.window_only:
            return self.num_kv_blocks // self._window_held(context)
        if self.split:
            return self.num_kv_blocks // self._pages_at(context)
        return self.num_kv_blocks // blocks_for_tokens(context, self.settings.block_size)

    def kv_read_bytes(self, context: int) -> int:
        """K/V one decode step reads for a sequence of `context` tokens: the sliding layers only
        their window (in either layout)."""
        slid = min(context, self.window or context)
        return (self.kv_bytes_per_token - self.window_bytes_per_token) * context + self.window_bytes_per_token * slid

    def longest_context_at(self, num_seqs: int) -> int:
        """The longest context each of `num_seqs` sequences can reach together (model limit too)."""
        per_seq = self.num_kv_blocks // max(1, num_seqs)
        if self.window_only and per_seq >= self._window_held(self.model_max_len):
            return self.model_max_len  # each holds no more than its window, however long
        if self.split:
            return min(self._longest_in_pages(per_seq), self.model_max_len)
        return min(per_seq * self.settings.block_size, self.model_max_len)

    @property
    def fits(self) -> bool:
        return self.settings.max_model_len <= self.model_max_len and self.max_seqs_at(self.settings.max_model_len) >= 1

    def as_dict(self) -> dict:
        s = self.settings
        return {
            "settings": asdict(s),
            "gpu_memory_bytes": self.gpu_memory,
            "usable_bytes": self.usable,
            "terms_bytes": {**self.terms, "kv_cache": self.kv_cache},
            "weights_bytes": {**asdict(self.weights), "total": self.weights.total},
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_blocks": self.num_kv_blocks,
            "kv_layout": "split" if self.split else "shared",
            "kv_page_widths": self.page_widths,
            "kv_tokens": self.kv_tokens,
            "total_bytes": self.total,
            "torch_peak_bytes": self.torch_peak,
            "fits": self.fits,
            "max_seqs_at_max_model_len": self.max_seqs_at(s.max_model_len),
            "longest_context_at_max_num_seqs": self.longest_context_at(s.max_num_seqs),
        }


def estimate(config: ModelConfig, settings: Settings, gpu_memory_bytes: int,
             num_kv_blocks: Optional[int] = None) -> Budget:
    """The budget of serving `config` with `settings` on a card of `gpu_memory_bytes`.

    Without `num_kv_blocks` the KV cache takes what is left of gpu_memory * utilization (what
    the server will allocate), in pages of a split cache where splits_kv says so; pass the server's
    real block (page) count to predict its actual peak.
    """
    s = replace(settings, kv_dtype=normalize_kv_dtype(settings.kv_dtype))
    weights = weight_bytes(config, s.scheme, s.group_size, s.bits)
    t, seqs, ctx = s.max_batched_tokens, s.max_num_seqs, s.max_model_len
    sampled = min(seqs, t)  # at most one sampled row per sequence
    dequant_from = dequant_min_tokens(config, s.group_size, s.gpu_arch, s.bits) if s.scheme in ("awq", "gptq") else None
    activations = activation_bytes(config, t, sampled, s.scheme,
                                   attention_workspace_bytes(config, min(seqs, t), ctx, t, s.attention), dequant_from)
    graph_batch = min(seqs, CUDA_GRAPH_MAX_BATCH)
    # All decode graphs share one pool, sized by the largest captured batch; it is not shared
    # with eager steps, so it adds to their peak. Graphs hold the forward pass only: logits and
    # sampling run eagerly (their memory is already in `activations`).
    graph_attention = attention_workspace_bytes(config, graph_batch, ctx, graph_batch, s.graph_attention)
    graphs = activation_bytes(config, graph_batch, 0, s.scheme, graph_attention, dequant_from) if s.cuda_graphs else 0
    terms = {
        "cuda_context": CUDA_CONTEXT_BYTES,
        "weights": weights.total,
        "workspace": CUBLAS_WORKSPACE_BYTES,
        "activations": activations,
        "cuda_graphs": graphs,
        "allocator_slack": max(ALLOCATOR_SLACK_MIN_BYTES, int(ALLOCATOR_SLACK_FRACTION * (activations + graphs))),
    }
    per_token = kv_bytes_per_token(config, s.kv_dtype)
    num_sliding, window = sliding_layers(config)
    window_per_token = kv_bytes_per_token(config, s.kv_dtype, num_sliding)
    widths, page_per_token = None, 0
    if splits_kv(config, ctx, s.kv_layout):
        page_layers, widths = page_geometry(config)
        page_per_token = kv_bytes_per_token(config, s.kv_dtype, page_layers)
    if num_kv_blocks is None:
        free = int(gpu_memory_bytes * s.gpu_memory_utilization) - sum(terms.values())
        if widths is not None:
            num_kv_blocks = max(0, free) // (s.block_size * page_per_token)
        else:
            num_kv_blocks = kv_cache_blocks_for(free, config, s.kv_dtype, s.block_size)
    return Budget(s, int(gpu_memory_bytes), weights, per_token, terms, num_kv_blocks,
                  config.max_position_embeddings, window, window_per_token, widths, page_per_token,
                  keeps_windows_only(config, ctx, s.kv_layout))


def decode_tokens_per_s(budget: Budget, bandwidth_gbs: float, num_seqs: int, context: int) -> float:
    """Aggregate decode tokens/s from the bandwidth roofline: a step streams every weight once
    and each sequence's KV once. An upper bound: it ignores compute (large batches) and launch
    overheads (tiny models)."""
    step_bytes = budget.weights.read_per_step + num_seqs * budget.kv_read_bytes(context)
    return num_seqs * bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY / step_bytes


# ---------------------------------------------------------------- GPU catalog
@dataclass(frozen=True)
class Gpu:
    key: str
    name: str
    memory_gib: float  # what the driver reports (ECC and reserved memory already taken off)
    bandwidth_gbs: float  # peak memory bandwidth, vendor spec
    fp8: bool  # FP8 tensor cores (sm89+): W8A8 and fp8 KV run natively
    arch: str  # compute capability as the kernels' tables key it ('sm90')

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GiB)


GPUS = [Gpu(*row) for row in [
    # Ampere consumer (sm86)
    ("rtx3060", "RTX 3060 12GB", 12.0, 360, False, "sm86"),
    ("rtx3080-10g", "RTX 3080 10GB", 10.0, 760, False, "sm86"),
    ("rtx3080-12g", "RTX 3080 12GB", 12.0, 912, False, "sm86"),
    ("rtx3090", "RTX 3090", 24.0, 936, False, "sm86"),
    ("rtx3090ti", "RTX 3090 Ti", 24.0, 1008, False, "sm86"),
    # Ada consumer (sm89)
    ("rtx4060ti-16g", "RTX 4060 Ti 16GB", 16.0, 288, True, "sm89"),
    ("rtx4070", "RTX 4070", 12.0, 504, True, "sm89"),
    ("rtx4070super", "RTX 4070 Super", 12.0, 504, True, "sm89"),
    ("rtx4070ti", "RTX 4070 Ti", 12.0, 504, True, "sm89"),
    ("rtx4070tisuper", "RTX 4070 Ti Super", 16.0, 672, True, "sm89"),
    ("rtx4080", "RTX 4080", 16.0, 717, True, "sm89"),
    ("rtx4080super", "RTX 4080 Super", 16.0, 736, True, "sm89"),
    ("rtx4090", "RTX 4090", 24.0, 1008, True, "sm89"),
    # Blackwell consumer (sm120)
    ("rtx5070", "RTX 5070", 12.0, 672, True, "sm120"),
    ("rtx5070ti", "RTX 5070 Ti", 16.0, 896, True, "sm120"),
    ("rtx5080", "RTX 5080", 16.0, 960, True, "sm120"),
    ("rtx5090", "RTX 5090", 32.0, 1792, True, "sm120"),
    # Data center
    ("t4", "Tesla T4", 15.0, 320, False, "sm75"),
    ("a10g", "A10G", 22.5, 600, False, "sm86"),
    ("l4", "L4", 22.5, 300, True, "sm89"),
    ("l40s", "L40S", 45.0, 864, True, "sm89"),
    ("a100-40g", "A100 40GB", 40.0, 1555, False, "sm80"),
    ("a100-80g", "A100 80GB", 80.0, 2039, False, "sm80"),
    ("h100-pcie", "H100 PCIe", 79.6, 2000, True, "sm90"),
    ("h100-sxm", "H100 SXM", 79.6, 3350, True, "sm90"),
    ("h200", "H200", 140.4, 4800, True, "sm90"),
]]
GPU_ALIASES = {"h100": "h100-sxm", "a100": "a100-80g", "rtx3080": "rtx3080-10g", "rtx4060ti": "rtx4060ti-16g"}


def _norm(name: str) -> str:
    name = name.lower().replace("nvidia", "").replace("geforce", "").replace("tesla", "")
    return "".join(ch for ch in name if ch.isalnum())


def find_gpu(name: str) -> Gpu:
    """A catalog GPU by key or name, case- and punctuation-insensitive ("RTX 4090", "4090", "h200")."""
    by_key = {_norm(g.key): g for g in GPUS} | {_norm(g.name): g for g in GPUS}
    by_key |= {_norm(a): by_key[_norm(k)] for a, k in GPU_ALIASES.items()}
    wanted = _norm(name)
    for candidate in (wanted, "rtx" + wanted):
        if candidate in by_key:
            return by_key[candidate]
    # Device names as torch reports them ("NVIDIA H100 80GB HBM3"): the longest key inside.
    for key in sorted(by_key, key=len, reverse=True):
        if len(key) >= 4 and key in wanted:
            return by_key[key]
    raise FitLLMError(f"unknown GPU {name!r}; choose one of: {', '.join(g.key for g in GPUS)} "
                      "(or give --gpu-mem GIB)")


# ---------------------------------------------------------------- advice
@dataclass
class Plan:
    budget: Budget
    gpu: Optional[Gpu]
    command: Optional[str]  # a `quant serve` command that fits, or None
    alternatives: list[dict] = field(default_factory=list)  # when it does not fit: what would

    def tokens_per_s(self) -> dict:
        if self.gpu is None:
            return {}
        b, s = self.budget, self.budget.settings
        seqs = max(1, min(s.max_num_seqs, b.max_seqs_at(s.max_model_len)))
        return {"single_seq_short_ctx": decode_tokens_per_s(b, self.gpu.bandwidth_gbs, 1, min(1024, s.max_model_len)),
                "batch_seqs": seqs,
                "batch_full_ctx": decode_tokens_per_s(b, self.gpu.bandwidth_gbs, seqs, s.max_model_len)}


def serve_command(model: Optional[str], s: Settings, num_seqs: int) -> str:
    parts = ["quant serve"] + ([model] if model else [])
    parts += [f"--kv-dtype {s.kv_dtype}", f"--max-model-len {s.max_model_len}", f"--max-num-seqs {num_seqs}",
              f"--gpu-memory-utilization {s.gpu_memory_utilization:g}"]
    if s.max_batched_tokens != DEFAULT_MAX_BATCHED_TOKENS:
        parts.append(f"--max-num-batched-tokens {s.max_batched_tokens}")
    if not s.cuda_graphs:
        parts.append("--no-cuda-graphs")
    if s.kv_layout != "auto":
        parts.append(f"--kv-layout {s.kv_layout}")
    return " ".join(parts)


def _smaller_schemes(scheme: str) -> list[str]:
    return {"bf16": ["fp8", "awq"], "fp16": ["fp8", "awq"], "fp8": ["awq"]}.get(scheme, [])


def _smaller_kv(kv: str, gpu: Optional[Gpu]) -> list[str]:
    # fp8 KV needs e4m3 conversions in the attention kernel: native from sm89 on.
    order = (["fp8"] if gpu is not None and gpu.fp8 else []) + ["int8", "int4"]
    return [k for k in order if KV_DTYPES[k] < KV_DTYPES[kv]]


def plan(config: ModelConfig, settings: Settings, gpu_memory_bytes: int, gpu: Optional[Gpu] = None,
         model_arg: Optional[str] = None, checkpoint_scheme: Optional[str] = None) -> Plan:
    """The budget, a serve command that fits, and when it does not fit, the cheapest changes that do:
    first a smaller KV dtype, then a smaller weight scheme (with the KV dtype too), then a shorter
    context. A scheme other than the checkpoint's means converting first (`quant convert`), so
    those commands serve CONVERTED_DIR. A catalog `gpu` gives its architecture to settings that name none."""
    if gpu is not None and settings.gpu_arch is None:
        settings = replace(settings, gpu_arch=gpu.arch)
    budget = estimate(config, settings, gpu_memory_bytes)
    s = budget.settings
    checkpoint_scheme = checkpoint_scheme or s.scheme

    def command(alt: Budget) -> str:
        seqs = min(alt.settings.max_num_seqs, alt.max_seqs_at(alt.settings.max_model_len))
        converted = alt.settings.scheme != checkpoint_scheme
        return serve_command("CONVERTED_DIR" if converted else model_arg, alt.settings, seqs)

    if budget.fits:
        return Plan(budget, gpu, command(budget))

    alternatives: list[dict] = []

    def four_bit(changes: dict) -> dict:  # the smaller schemes are 4-bit ones
        return {**changes, "bits": 4} if changes.get("scheme", s.scheme) != s.scheme else changes

    def attempt(why: str, **changes) -> bool:
        changes = four_bit(changes)
        alt = estimate(config, replace(s, **changes), gpu_memory_bytes)
        if not alt.fits:
            return False
        seqs = min(alt.settings.max_num_seqs, alt.max_seqs_at(alt.settings.max_model_len))
        alternatives.append({"change": why, **changes, "max_num_seqs": seqs, "total_bytes": alt.total,
                             "command": command(alt)})
        return True

    any(attempt(f"KV cache in {kv}", kv_dtype=kv) for kv in _smaller_kv(s.kv_dtype, gpu))
    for scheme in _smaller_schemes(s.scheme):  # each smaller scheme, alone or with the first KV dtype that fits
        attempt(f"weights in {scheme} (quant convert --method {scheme})", scheme=scheme) or any(
            attempt(f"weights in {scheme}, KV cache in {kv}", scheme=scheme, kv_dtype=kv)
            for kv in _smaller_kv(s.kv_dtype, gpu))
    # A shorter context as asked; only if nothing else fits, with the smallest scheme and KV too.
    smallest = {"scheme": (_smaller_schemes(s.scheme) or [s.scheme])[-1],
                "kv_dtype": (_smaller_kv(s.kv_dtype, gpu) or [s.kv_dtype])[-1]}
    for changes in ({}, smallest):
        if changes and len(alternatives) > 0:
            break
        longest = estimate(config, replace(s, **four_bit(changes)), gpu_memory_bytes).longest_context_at(1)
        longest = min(longest, s.max_model_len) // 1024 * 1024
        why = f"context {longest}" + "".join(f", {k} {v}" for k, v in changes.items())
        if longest >= 1024 and attempt(why, max_model_len=longest, **changes):
            break
    return Plan(budget, gpu, None, alternatives)


def cards_that_fit(config: ModelConfig, settings: Settings) -> list[Gpu]:
    return [g for g in GPUS if estimate(config, replace(settings, gpu_arch=g.arch), g.memory_bytes).fits]


# ---------------------------------------------------------------- predicted vs measured (server)
def compare_with_measured(budget: Budget, device=None) -> dict:
    """After loading, cache allocation and a full-load warm-up, what the card measured beside what
    the budget predicted. `budget` should be built with the server's real `num_kv_blocks`."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    rows = {
        # torch's own peak: weights, KV, activations, graph pool, workspaces.
        "torch_peak": (budget.torch_peak, torch.cuda.max_memory_allocated(device)),
        # + allocator slack (reserved, unused).
        "torch_reserved": (budget.torch_peak + budget.terms["allocator_slack"], torch.cuda.max_memory_reserved(device)),
        # + CUDA context; includes other processes on the same card, if any.
        "device_used": (budget.total, total - free),
    }
    return {name: {"predicted": p, "measured": m, "error": (p - m) / m if m else None}
            for name, (p, m) in rows.items()}


def format_comparison(report: dict) -> str:
    return "; ".join(f"{name} predicted {r['predicted'] / GiB:.2f} GiB, measured {r['measured'] / GiB:.2f} GiB"
                     + (f" ({r['error']:+.1%})" if r["error"] is not None else "") for name, r in report.items())


# ---------------------------------------------------------------- configs for planning
# Common models, so users can plan without downloading: (architecture, vocab, hidden,
# intermediate, layers, heads, kv_heads, head_dim, tied embeddings, max context).
KNOWN_MODELS = {
    "smollm2-135m": ("LlamaForCausalLM", 49152, 576, 1536, 30, 9, 3, 64, True, 8192),
    "smollm2-360m": ("LlamaForCausalLM", 49152, 960, 2560, 32, 15, 5, 64, True, 8192),
    "smollm2-1.7b": ("LlamaForCausalLM", 49152, 2048, 8192, 24, 32, 32, 64, True, 8192),
    "smollm3-3b": ("SmolLM3ForCausalLM", 128256, 2048, 11008, 36, 16, 4, 128, True, 65536),
    "llama-2-7b": ("LlamaForCausalLM", 32000, 4096, 11008, 32, 32, 32, 128, False, 4096),
    "llama-3-8b": ("LlamaForCausalLM", 128256, 4096, 14336, 32, 32, 8, 128, False, 8192),
    "llama-3.1-8b": ("LlamaForCausalLM", 128256, 4096, 14336, 32, 32, 8, 128, False, 131072),
    "llama-3.1-70b": ("LlamaForCausalLM", 128256, 8192, 28672, 80, 64, 8, 128, False, 131072),
    "llama-3.2-1b": ("LlamaForCausalLM", 128256, 2048, 8192, 16, 32, 8, 64, True, 131072),
    "llama-3.2-3b": ("LlamaForCausalLM", 128256, 3072, 8192, 28, 24, 8, 128, True, 131072),
    "mistral-7b": ("MistralForCausalLM", 32768, 4096, 14336, 32, 32, 8, 128, False, 32768),
    "mistral-small-24b": ("MistralForCausalLM", 131072, 5120, 32768, 40, 32, 8, 128, False, 131072),  # 3.1 / 3.2
    "qwen2.5-0.5b": ("Qwen2ForCausalLM", 151936, 896, 4864, 24, 14, 2, 64, True, 32768),
    "qwen2.5-1.5b": ("Qwen2ForCausalLM", 151936, 1536, 8960, 28, 12, 2, 128, True, 32768),
    "qwen2.5-3b": ("Qwen2ForCausalLM", 151936, 2048, 11008, 36, 16, 2, 128, True, 32768),
    "qwen2.5-7b": ("Qwen2ForCausalLM", 152064, 3584, 18944, 28, 28, 4, 128, False, 32768),
    "qwen2.5-14b": ("Qwen2ForCausalLM", 152064, 5120, 13824, 48, 40, 8, 128, False, 32768),
    "qwen2.5-32b": ("Qwen2ForCausalLM", 152064, 5120, 27648, 64, 40, 8, 128, False, 32768),
    "qwen3-0.6b": ("Qwen3ForCausalLM", 151936, 1024, 3072, 28, 16, 8, 128, True, 40960),
    "qwen3-1.7b": ("Qwen3ForCausalLM", 151936, 2048, 6144, 28, 16, 8, 128, True, 40960),
    "qwen3-4b": ("Qwen3ForCausalLM", 151936, 2560, 9728, 36, 32, 8, 128, True, 40960),
    "qwen3-8b": ("Qwen3ForCausalLM", 151936, 4096, 12288, 36, 32, 8, 128, False, 40960),
    "qwen3-32b": ("Qwen3ForCausalLM", 151936, 5120, 25600, 64, 64, 8, 128, False, 40960),
    "phi-3-mini-4k": ("Phi3ForCausalLM", 32064, 3072, 8192, 32, 32, 32, 96, False, 4096),
    "phi-3.5-mini": ("Phi3ForCausalLM", 32064, 3072, 8192, 32, 32, 32, 96, False, 131072),
    "phi-3-medium-4k": ("Phi3ForCausalLM", 32064, 5120, 17920, 40, 40, 10, 128, False, 4096),
    "phi-4": ("Phi3ForCausalLM", 100352, 5120, 17920, 40, 40, 10, 128, False, 16384),
    "phi-4-mini": ("Phi3ForCausalLM", 200064, 3072, 8192, 32, 24, 8, 128, True, 131072),
    "gemma-3-1b": ("Gemma3ForCausalLM", 262144, 1152, 6912, 26, 4, 1, 256, True, 32768),
    "gemma-3-4b": ("Gemma3ForCausalLM", 262208, 2560, 10240, 34, 8, 4, 256, True, 131072),
    "gemma-3-12b": ("Gemma3ForCausalLM", 262208, 3840, 15360, 48, 16, 8, 256, True, 131072),
    "gemma-3-27b": ("Gemma3ForCausalLM", 262208, 5376, 21504, 62, 32, 16, 128, True, 131072),
}


# Fields of a known model's config.json that the rows above leave to transformers' defaults, where
# those differ (Gemma3TextConfig's default window is 4096, Phi3Config's none).
KNOWN_MODEL_FIELDS = {"gemma-3-1b": {"sliding_window": 512}, "gemma-3-4b": {"sliding_window": 1024},
                      "gemma-3-12b": {"sliding_window": 1024}, "gemma-3-27b": {"sliding_window": 1024},
                      "phi-3-mini-4k": {"sliding_window": 2047}, "phi-3-medium-4k": {"sliding_window": 2047}}


def known_model(name: str) -> Optional[ModelConfig]:
    # "meta-llama/Meta-Llama-3-8B-Instruct" -> "llama-3-8b"
    key = name.split("/")[-1].lower().replace("_", "-").removeprefix("meta-")
    key = key.removesuffix("-instruct").removesuffix("-it")
    row = KNOWN_MODELS.get(key)
    if row is None:
        return None
    arch, vocab, hidden, inter, layers, heads, kv, head_dim, tied, max_len = row
    return ModelConfig.from_hf_dict({
        "architectures": [arch], "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": head_dim, "tie_word_embeddings": tied, "max_position_embeddings": max_len,
        **KNOWN_MODEL_FIELDS.get(key, {}),
    }, source=name)


def gguf_config(path: Path) -> ModelConfig:
    """A ModelConfig from a GGUF's metadata alone (no dequantizing). Slow for large vocabularies:
    gguf's reader parses every tokenizer string."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def get(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = get("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3", "mistral"):
        raise FitLLMError(f"{path}: GGUF architecture {arch!r} is not supported (llama, qwen2, qwen3, mistral)")
    heads = get(f"{arch}.attention.head_count")
    hidden = get(f"{arch}.embedding_length")
    names = {t.name for t in reader.tensors}
    return ModelConfig.from_hf_dict({
        "model_type": arch, "hidden_size": hidden, "num_attention_heads": heads,
        "intermediate_size": get(f"{arch}.feed_forward_length"), "num_hidden_layers": get(f"{arch}.block_count"),
        "num_key_value_heads": get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": get(f"{arch}.attention.key_length", hidden // heads),
        "vocab_size": get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data),
        "max_position_embeddings": get(f"{arch}.context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
    }, source=str(path))


def load_config(model: Optional[str]) -> tuple[ModelConfig, str]:
    """A config to plan with, and a label: the embedded default, a known name, a HF folder, a
    config.json, a .gguf file, or a hub id (only its config.json is downloaded)."""
    if model is None:
        # The embedded GGUF is SmolLM2-135M; its known shape spares parsing 98 MB of GGUF.
        return known_model("smollm2-135m"), "SmolLM2-135M-Instruct (embedded)"
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return gguf_config(path), path.name
    if path.exists():
        return ModelConfig.from_file(path), str(path)
    config = known_model(model)
    if config is not None:
        return config, model
    if "/" in model and not model.startswith((".", "/")):
        try:
            from huggingface_hub import hf_hub_download

            return ModelConfig.from_file(hf_hub_download(model, "config.json")), model
        except FitLLMError:
            raise
        except Exception as exc:  # offline, gated, no such repo
            raise FitLLMError(f"{model}: not a local path or known name, and the hub lookup failed ({exc.__class__.__name__})") from None
    raise FitLLMError(f"{model}: no such file or folder, and not a known model; known: {', '.join(KNOWN_MODELS)}")
