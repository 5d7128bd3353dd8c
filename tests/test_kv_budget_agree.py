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
