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
    """Gemma 3 1B's pools as the split cache allocates them (every per-block tensor of each pool)
    against the calculator's full / sliding shares of a token's bytes."""
    from fitllm.models.kv_cache import SplitKVCache

    cfg = budget.known_model("gemma-3-1b")
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    calibration = KVCalibration(k_mean=torch.zeros(shape), v_mean=torch.zeros(shape),
                                k_min=-torch.ones(shape), k_max=torch.ones(shape),
                                v_min=-torch.ones(shape), v_max=torch.ones(shape))
    cache = SplitKVCache(cfg.num_layers, 3, 2, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cpu",
                         sliding_window=cfg.attention_windows, kv_dtype=kv, calibration=calibration)
    num_sliding, window = budget.sliding_layers(cfg)
    assert (num_sliding, window) == (22, 512) and cache.window.num_layers == 22 and cache.full.num_layers == 4

    def per_slot(pool, blocks):
        return sum(t.numel() * t.element_size() for t in vars(pool).values()
                   if isinstance(t, torch.Tensor) and t.dim() >= 4 and t.shape[1] == blocks) // (blocks * 16)

    window_share = budget.kv_bytes_per_token(cfg, kv, num_sliding)
    assert cache.pool_bytes_per_token == (per_slot(cache.full, 3), per_slot(cache.window, 2)) == \
        (budget.kv_bytes_per_token(cfg, kv) - window_share, window_share)
