"""A minimal generation path over the paged cache: the same model code the engine runs.

Used by tests (parity with transformers) and as the simplest way to drive the decoder. Each
sequence gets a contiguous run of blocks; the engine replaces this with the block manager.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from fitllm.models.decoder import CausalLM
from fitllm.models.kv_cache import AttentionMetadata, ForwardContext, PagedKVCache


def make_cache(model: CausalLM, max_tokens: int, num_seqs: int = 1, block_size: int = 16,
               cache_cls=PagedKVCache, **cache_kwargs) -> PagedKVCache:
    c = model.config
    blocks = num_seqs * math.ceil(max_tokens / block_size)
    return cache_cls(c.num_layers, blocks, block_size, c.num_kv_heads, c.head_dim,
                     dtype=model.dtype, device=model.device, sliding_window=c.attention_windows, **cache_kwargs)


@torch.inference_mode()
def forward_tokens(model: CausalLM, cache: PagedKVCache, chunks: list[list[int]], seq_lens: list[int],
                   block_tables: list[list[int]]) -> torch.Tensor:
    """Run one step: chunks[i] are the newest tokens of sequence i, whose length becomes seq_lens[i].
    Returns hidden states for every new token, flat [T, hidden]."""
    meta = AttentionMetadata.build([len(c) for c in chunks], seq_lens, block_tables, cache.block_size, model.device)
    ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=model.device)
    pos = torch.tensor([p for c, s in zip(chunks, seq_lens) for p in range(s - len(c), s)], device=model.device)
    return model(ids, pos, ForwardContext(cache, meta))


@torch.inference_mode()
def prompt_logits(model: CausalLM, token_ids: list[int], cache: Optional[PagedKVCache] = None) -> torch.Tensor:
    """Logits [L, vocab] for every position of one sequence (one prefill step)."""
    cache = cache or make_cache(model, len(token_ids))
    table = list(range(math.ceil(len(token_ids) / cache.block_size)))
    hidden = forward_tokens(model, cache, [token_ids], [len(token_ids)], [table])
    return model.compute_logits(hidden).float()


@torch.inference_mode()
def generate(model: CausalLM, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
             eos_token_ids: Optional[list[int]] = None, seed: Optional[int] = None,
             cache: Optional[PagedKVCache] = None, on_step: Optional[Callable[[], None]] = None) -> list[list[int]]:
    """Batched generation: greedy at temperature 0, else sampling. Returns new tokens per prompt.
    on_step: called after each step (one new token for every sequence still running)."""
    longest = max(len(p) for p in prompts) + max_new_tokens
    cache = cache or make_cache(model, longest, num_seqs=len(prompts))
    per_seq = cache.num_blocks // len(prompts)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    generator = torch.Generator(device=model.device).manual_seed(seed) if seed is not None else None
    eos = set(eos_token_ids or [])
    outputs: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    chunks = [list(p) for p in prompts]
    lens = [len(p) for p in prompts]
    while active:
        hidden = forward_tokens(model, cache, [chunks[i] for i in active], [lens[i] for i in active],
                                [tables[i] for i in active])
        last = torch.tensor([len(chunks[i]) for i in active], device=model.device).cumsum(0) - 1
        logits = model.compute_logits(hidden[last]).float()
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            next_ids = torch.multinomial(probs, 1, generator=generator).squeeze(1).tolist()
        else:
            next_ids = logits.argmax(-1).tolist()
        still = []
        for i, tok in zip(active, next_ids):
            outputs[i].append(tok)
            chunks[i], lens[i] = [tok], lens[i] + 1
            if tok not in eos and len(outputs[i]) < max_new_tokens:
                still.append(i)
        active = still
        if on_step is not None:
            on_step()
    return outputs
