"""Programmatic dependent launch (fitllm/kernels/_pdl.py): the kernels' ordering rules, checked in
the PTX Triton emits for sm_90 (compiled offline, no GPU needed), and the host switch."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from fitllm.kernels._utils import pdl_args


def test_pdl_is_off_for_cpu_tensors():
    assert pdl_args(torch.zeros(2)) == {}


@functools.lru_cache(maxsize=None)
def ptx_report() -> str:
    """pdl_ptx.py's JSON line: where each kernel's PTX waits, releases, loads and stores, and its fenced atomics."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for real, for sm_90
    script = Path(__file__).with_name("pdl_ptx.py")
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip().splitlines()[-1]


def test_pdl_kernels_wait_before_touching_memory_and_release_where_intended():
    found = json.loads(ptx_report())
    assert found.pop("_unlisted") == [], "kernels taking PDL that pdl_ptx.py does not check"
    assert len(found) >= 14
    assert {n for n, at in found.items() if at["early"]} == {"rms_norm", "rms_norm_perm", "rms_norm_x16", "gather_row",
                                                           "rope_write",
                                                           "decode", "decode_cols", "fp8_gemv_early"}
    for name, at in found.items():
        # no global store (atomics included) before the wait: the previous kernel may still be reading
        # memory the allocator has handed to us; no load either, but in the kernels that read what
        # older launches wrote first (_pdl.py), whose loads of the previous kernel's output follow it
        if at["early"]:
            assert 0 <= at["load"] < at["wait"] < at["load_after_wait"], name
        else:
            assert 0 <= at["wait"] < at["load"], name
        assert at["wait"] < at["store"], name
        # L2 prefetches (a hint, no data) of weights only before the wait, and only where asked
        if name.endswith("_prefetch"):
            assert 0 <= at["prefetch"] < at["wait"], name
        else:
            assert at["prefetch"] < 0, name
        assert at["release"] > at["wait"], name
        load = at["load_after_wait"] if at["early"] else at["load"]
        if at["big"]:  # a kernel that fills the GPU lets the next one launch after its main loop
            assert at["release"] > load, name
        else:  # a small one right after its wait
            assert at["release"] < load, name


def test_split_kernels_fence_only_at_their_arrival_ticket():
    """A kernel split over K (or a sequence) fences once, at its arrival ticket (acq_rel: its partial sums
    are released before it counts, the last arrival acquires them). The last arrival's reads of the sums
    and the counter's reset are relaxed: as acq_rel atomics each was a fence and a round trip, one after
    another at the end of the kernel (W4A16 layer at M = 64 107 -> 90 µs without them, thirty-fourth
    session, RESULTS.md). The reads stay atomics in the adds' own register layout: plain loads took another
    layout and read wrong sums on the GPU (the interpreter, sequential, cannot show it)."""
    found = json.loads(ptx_report())
    found.pop("_unlisted")
    fenced = {name: at["fenced_atomics"] for name, at in found.items() if at["fenced_atomics"]}
    assert fenced == dict.fromkeys(["tiled_gemv", "dp4a_gemv", "tiled_tc", "fp8_gemv", "fp8_gemv_early", "fp8_tc", "fp8_tc_prefetch",
                                    "decode", "decode_cols", "greedy"], 1)
