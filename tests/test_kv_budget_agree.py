"""The memory calculator's KV bytes/token are exactly what the paged cache allocates."""
from __future__ import annotations

import pytest
import torch

from fitllm import budget
from fitllm.models.kv_cache import KVCalibration, PagedKVCache


@pytest.mark.parametrize("model", ["llama-3-8b", "smollm2-135m", "qwen2.5-1.5b"])
@pytest.mark.parametrize("kv", ["bf16", "fp8", "int8", "int4"])
def test_budget_matches_allocated_cache(model, kv):
    cfg = budget.known_model(model)
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    calibration = KVCalibration(k_mean=torch.zeros(shape), v_mean=torch.zeros(shape),
                                k_min=-torch.ones(shape), k_max=torch.ones(shape),
                                v_min=-torch.ones(shape), v_max=torch.ones(shape))
    cache = PagedKVCache(cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cpu",
                         kv_dtype=kv, calibration=calibration)
    # every per-block tensor the cache holds ([layers, blocks, ...]; fp8 values are [.., heads, dim, 16])
    per_slot = sum(t.numel() * t.element_size() for t in vars(cache).values()
                   if isinstance(t, torch.Tensor) and t.dim() >= 4 and t.shape[:2] == (cfg.num_layers, 2)) // (2 * 16)
    assert cache.bytes_per_token == per_slot == budget.kv_bytes_per_token(cfg, kv)


@pytest.mark.parametrize("kv", ["bf16", "int8", "int4"])
def test_budget_matches_a_split_cache(kv):
    """Gemma 3 1B's pages as the split cache allocates them (every per-page tensor, every plane)
    against the calculator's bytes a page holds per token, and each layer's plane and group."""
    from fitllm.models.kv_cache import SplitKVCache

    cfg = budget.known_model("gemma-3-1b")
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    calibration = KVCalibration(k_mean=torch.zeros(shape), v_mean=torch.zeros(shape),
                                k_min=-torch.ones(shape), k_max=torch.ones(shape),
                                v_min=-torch.ones(shape), v_max=torch.ones(shape))
    g, widths = budget.page_geometry(cfg)
    cache = SplitKVCache(cfg.num_layers, 3, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cpu",
                         sliding_window=cfg.attention_windows, page_layers=g, kv_dtype=kv, calibration=calibration)
    assert budget.sliding_layers(cfg) == (22, 512) and (g, widths) == (4, (1, 6)) and cache.widths == widths
    per_slot = sum(t.numel() * t.element_size() for t in vars(cache.arena).values()
                   if isinstance(t, torch.Tensor) and t.dim() >= 4 and t.shape[:2] == (g, 3)) // (3 * 16)
    assert cache.bytes_per_token == per_slot == budget.kv_bytes_per_token(cfg, kv, g)
    # every (group, plane) holds one layer: the full layers in page 0, the sliding ones in pages 0..5
    slots = [(cache.group_of[i], cache.arena.planes[i]) for i in range(cfg.num_layers)]
    assert len(set(slots)) == cfg.num_layers and {k for (k, _), _ in slots} == {0, 1}
    assert max(t for (_, t), _ in slots) == 5 and max(p for _, p in slots) == 3
