"""Helpers shared by the kernel tests: fresh random inputs every run, the error measure, and the
offline (sm_90) compile scripts' output."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

GEN = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))  # fresh inputs every run


def rel_err(y, ref):
    """||y - ref|| / ||ref||; fails if y holds NaN/inf (a NaN-poisoned output not fully written)."""
    assert torch.isfinite(y).all(), "output not fully written (NaN poison survived) or overflowed"
    return ((y.double() - ref).norm() / ref.norm()).item()


def act_order_weight(K, N, group_size=128, bits=4):
    """A random act-order weight: a KernelWeight whose g_idx puts groups of group_size inputs in a
    random order, as GPTQ's desc_act writes them."""
    from fitllm.quant.formats.packing import KernelWeight, pack_dim0

    G = K // group_size
    return KernelWeight(pack_dim0(torch.randint(0, 2 ** bits, (K, N), generator=GEN), bits),
                        (torch.rand(G, N, generator=GEN) * 0.02 + 0.01).bfloat16(),
                        torch.randint(0, 2 ** bits, (G, N), generator=GEN).bfloat16(), bits, group_size,
                        (torch.randperm(K, generator=GEN) // group_size).to(torch.int32))


def split_k_both_ways(run, monkeypatch):
    """run() twice: split-K partials added atomically (the default), then summed in split order
    (FITLLM_DETERMINISTIC=1). Returns both outputs after checking that each mode leaves its
    workspace ready for the next launch (atomic slice zeroed, every counter back to 0)."""
    from fitllm.kernels import _utils

    cpu = torch.device("cpu")
    monkeypatch.delenv("FITLLM_DETERMINISTIC", raising=False)
    atomic = run()
    monkeypatch.setenv("FITLLM_DETERMINISTIC", "1")
    _utils.splitk_workspace(cpu, 0, 0, ordered=True)[0].zero_()
    ordered = run()
    assert _utils.splitk_workspace(cpu, 0, 0, ordered=True)[0].any(), "the ordered path did not run"
    ws, cnt = _utils.splitk_workspace(cpu, 0, 0)
    assert not ws.any() and not cnt.any(), "atomic split-K workspace must be left zeroed"
    assert not _utils.splitk_workspace(cpu, 0, 0, ordered=True)[1].any(), "ordered split-K counters must reset"
    return atomic, ordered


def offline_script_rows(script: str):
    """Run tests/<script> (it compiles kernels for sm_90 with triton's own ptxas, so without
    TRITON_INTERPRET) and return the JSON of its last output line; skip where ptxas is missing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, str(Path(__file__).with_name(script))], capture_output=True, text=True,
                       env=env, timeout=600)
    if p.returncode != 0 and "ptxas" in p.stderr and "not found" in p.stderr:
        pytest.skip("triton's ptxas is not available here")
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])
