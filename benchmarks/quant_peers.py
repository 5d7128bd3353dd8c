"""Quantize the embedded model with every fitllm method and measure WikiText-2 perplexity,
time and peak memory, one subprocess per method (so peak RSS is per method).

    python benchmarks/quant_peers.py [--windows 24] [--group-size 64] [--calib FILE] [--only rtn-asym,awq]

Perplexity: the first N non-overlapping 1024-token windows of wiki.test.raw, fp32, fitllm's
decoder (the same numbers transformers gives for the unquantized model). Peers (llm-compressor,
GPTQModel) are not run by this script in this version: their numbers come from the issue.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

WIKI = Path("/work/shared/data/wikitext-2/wiki.test.raw")
CONFIGS = {  # name -> quantize_model kwargs
    "rtn-asym": dict(method="rtn", sym=False),
    "rtn-sym": dict(method="rtn", sym=True),
    "awq": dict(method="awq", sym=False),
    "gptq-asym": dict(method="gptq", sym=False, act_order=True, static_groups=True),
    "gptq-sym": dict(method="gptq", sym=True, act_order=True, static_groups=True),
    "fp8": dict(method="fp8"),
}


def windows(tokenizer, n: int, length: int = 1024) -> torch.Tensor:
    ids = torch.tensor(tokenizer(WIKI.read_text())["input_ids"], dtype=torch.long)
    return ids[: n * length].reshape(n, length)


@torch.inference_mode()
def perplexity(model, wins: torch.Tensor) -> float:
    from fitllm.quant.pipeline import CalibContext

    nll, count = 0.0, 0
    pos = torch.arange(wins.shape[1])
    for w in wins:
        hidden = model(w, pos, CalibContext(1, w.numel()))
        logits = model.compute_logits(hidden[:-1]).float()
        nll += F.cross_entropy(logits, w[1:], reduction="sum").item()
        count += w.numel() - 1
    return math.exp(nll / count)


def run_one(name: str, args) -> dict:
    from fitllm.models.hub import resolve_model
    from fitllm.models.loader import load_model
    from fitllm.models.tokenizer import load_tokenizer
    from fitllm.quant.layers import load_quantized_model
    from fitllm.quant.pipeline import quantize_model

    base = resolve_model(None)
    wins = windows(load_tokenizer(base), args.windows)
    row = {"name": name}
    if name == "base":
        model = load_model(base, "cpu", torch.float32)
    else:
        out = Path(args.workdir) / name
        t0, c0 = time.time(), time.process_time()
        r = quantize_model(base, out, group_size=args.group_size, calib=args.calib, calib_samples=args.calib_samples,
                           calib_len=args.calib_len, force=True, progress=False, log=lambda s: None, **CONFIGS[name])
        row.update(seconds=round(time.time() - t0, 1), cpu_seconds=round(time.process_time() - c0, 1),
                   peak_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
                   mean_layer_err=round(sum(r.layer_errors) / len(r.layer_errors), 4), note=r.group_note)
        model = load_quantized_model(out, "cpu", torch.float32)
    row["ppl"] = round(perplexity(model, wins), 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--calib", default=None)
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--workdir", default="/tmp/fitllm-quant-bench")
    ap.add_argument("--only", default=None, help="comma-separated: base," + ",".join(CONFIGS))
    ap.add_argument("--parallel", action="store_true", help="one process per method at once, 1 thread each")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        if args.parallel:
            torch.set_num_threads(1)
        print("RESULT " + json.dumps(run_one(args.one, args)), flush=True)
        return
    names = args.only.split(",") if args.only else ["base", *CONFIGS]
    procs = []
    for name in names:
        cmd = [sys.executable, __file__, "--one", name, *sys.argv[1:]]
        procs.append((name, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        if not args.parallel:
            procs[-1] = (name, procs[-1][1].communicate())
    rows = []
    for name, p in procs:
        out, err = p if isinstance(p, tuple) else p.communicate()
        line = next((l for l in out.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            print(f"{name}: failed\n{err[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(line[7:]))
        print(json.dumps(rows[-1]), flush=True)
    print("\n| model | WikiText-2 ppl | time (s) | CPU time (s) | peak RSS (GiB) | mean layer err |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['ppl']:.3f} | {r.get('seconds', '-')} | {r.get('cpu_seconds', '-')} | "
              f"{r.get('peak_gib', '-')} | {r.get('mean_layer_err', '-')} |")


if __name__ == "__main__":
    main()
