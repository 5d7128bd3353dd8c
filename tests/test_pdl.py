"""Programmatic dependent launch (fitllm/kernels/_pdl.py): the kernels' ordering rules, checked in
the PTX Triton emits for sm_90 (compiled offline, no GPU needed), and the host switch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import pytest

from fitllm.kernels import _utils
from fitllm.kernels._utils import pdl_args, prefetching_pdl_args


def test_pdl_is_off_for_cpu_tensors():
    assert pdl_args(torch.zeros(2)) == {}


PDL = {"PDL": True, "launch_pdl": True}


def test_l2_prefetch_only_with_pdl_from_the_config_or_the_environment(monkeypatch):
    x = torch.zeros(2)
    monkeypatch.delenv("FITLLM_L2_PREFETCH", raising=False)
    assert prefetching_pdl_args({"l2_lines": 4}, x) == {}  # no PDL: nothing waits, nothing to fill
    monkeypatch.setattr(_utils, "pdl_args", lambda t: dict(PDL))
    assert prefetching_pdl_args({"l2_lines": 4}, x) == {**PDL, "L2_LINES": 4}
    assert prefetching_pdl_args({}, x) == PDL
    monkeypatch.setenv("FITLLM_L2_PREFETCH", "8")
    assert prefetching_pdl_args({"l2_lines": 4}, x) == {**PDL, "L2_LINES": 8}
    monkeypatch.setenv("FITLLM_L2_PREFETCH", "0")
    assert prefetching_pdl_args({"l2_lines": 4}, x) == PDL
    monkeypatch.setenv("FITLLM_L2_PREFETCH", "3")  # not whole lines of a power-of-two count
    with pytest.raises(ValueError, match="one of"):
        prefetching_pdl_args({}, x)


def test_pdl_kernels_wait_before_touching_memory_and_release_where_intended():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for real, for sm_90
    script = Path(__file__).with_name("pdl_ptx.py")
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found.pop("_unlisted") == [], "kernels taking PDL that pdl_ptx.py does not check"
    absent = found.pop("_absent")
    assert absent in ([], ["w4a16_mma"]), "only the Gluon kernel may be missing (a triton without Gluon)"
    assert len(found) + len(absent) >= 15
    for name, at in found.items():
        # no global load or store (atomics included) before the wait: the previous kernel may still
        # be writing its output, or reading memory the allocator has handed to us
        assert 0 <= at["wait"] < at["load"], name
        assert at["wait"] < at["store"], name
        # the one thing allowed before it: asking L2 for weights (which no kernel writes)
        assert (0 <= at["prefetch"] < at["wait"]) if at["l2_lines"] else at["prefetch"] == -1, name
        assert at["release"] > at["wait"], name
        if at["big"]:  # a kernel that fills the GPU lets the next one launch after its main loop
            assert at["release"] > at["load"], name
        else:  # a small one right after its wait
            assert at["release"] < at["load"], name
