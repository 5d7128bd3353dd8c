"""The dp4a batch-1 GEMVs inside the decoder, on a GPU (issue 10's default int4 path): a random model at
Llama-3-8B layer shapes (4 layers by default), int4 RTN g128 in memory, decodes a fixed token sequence one
token a step (teacher-forced, so every step is M = 1) with FITLLM_W4_DP4A=1 and =0. Both runs' logits are
compared with those of one prefill over the whole sequence (M > 1: the tensor-core GEMMs, x in 16 bits),
which neither batch-1 path uses. A producer handing the wrong X16 to a GEMV, or none, shows as an error
far above the 16-bit GEMV's; exit status 1 then.

    python3 benchmarks/dp4a_model_check.py [--layers 4] [--prompt 16] [--steps 48]
    python3 benchmarks/dp4a_model_check.py --shape tiny-llama-heads --device cpu   # the script's logic only
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_engine_check import SHAPES, random_model  # noqa: E402

from fitllm.models.generate import forward_tokens, make_cache, prompt_logits  # noqa: E402
from fitllm.quant.inplace import quantize_in_memory  # noqa: E402


def decode_logits(model, ids: list[int], prompt: int) -> torch.Tensor:
    """Logits [len(ids) - prompt, vocab] for positions prompt - 1 .. len - 2, the tokens after the prompt
    fed one a step."""
    cache = make_cache(model, len(ids))
    table = list(range(math.ceil(len(ids) / cache.block_size)))
    hidden = forward_tokens(model, cache, [ids[:prompt]], [prompt], [table])
    out = [model.compute_logits(hidden[-1:]).float()]
    for n in range(prompt, len(ids) - 1):
        hidden = forward_tokens(model, cache, [[ids[n]]], [n + 1], [table])
        out.append(model.compute_logits(hidden).float())
    return torch.cat(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    SHAPES["cut"] = SHAPES[a.shape][:3] + (a.layers,) + SHAPES[a.shape][4:]
    model = quantize_in_memory(random_model("cut", a.device, torch.bfloat16), "int4", group_size=128)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (a.prompt + a.steps,), generator=g).tolist()
    ref = prompt_logits(model, ids)[a.prompt - 1: -1]
    res = {}
    for name, env in (("16-bit GEMV", "0"), ("dp4a", "1")):
        os.environ["FITLLM_W4_DP4A"] = env
        got = decode_logits(model, ids, a.prompt)
        err = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        res[name] = (err, agree)
        print(f"{name:12s} vs the prefill: worst step's relative logit error {err:.2e}, argmax agreement {agree:.3f}")
    ok = res["dp4a"][0] <= 2 * res["16-bit GEMV"][0] + 1e-3
    print("DP4A MODEL CHECK", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
