"""Full WikiText-2 (test, raw) perplexity of a model on this machine, with its CPU and wall time.

    python benchmarks/eval_full.py [MODEL] --data ../shared/data/wikitext-2/wiki.test.raw [--ctx 512]
        [--kv-dtype auto] [--max-windows N] [--threads N]

The same code path as `quant eval MODEL --tasks wikitext --ctx 512` (one model, every window,
non-overlapping). Prints one JSON line: ppl, tokens, windows, wall and CPU seconds, tokens/s.
`--max-windows N` times the first N windows only and extrapolates the full-run time from them
(marked "extrapolated"), for machines where the full run takes too long to wait for.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch

from fitllm.evals.data import load_text
from fitllm.evals.runner import Scorer, cache_kwargs, load_for_eval
from fitllm.evals.tasks import make_windows, perplexity


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--data", type=Path, required=True, help="wiki.test.raw")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--kv-dtype", default="auto")
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    t0, c0 = time.time(), cpu_seconds()
    loaded = load_for_eval(args.model, args.device)
    ids = loaded.tokenizer.encode(load_text(args.data), add_special_tokens=False)
    all_windows = make_windows(len(ids), args.ctx)
    windows = all_windows[: args.max_windows]
    setup_wall, setup_cpu = time.time() - t0, cpu_seconds() - c0

    t1, c1 = time.time(), cpu_seconds()
    scorer = Scorer(loaded.model, cache_kwargs(loaded, args.kv_dtype), max_batch_tokens=4 * args.ctx, max_seq_len=args.ctx)
    res = perplexity(scorer, ids, windows)
    wall, cpu = time.time() - t1, cpu_seconds() - c1
    scale = len(all_windows) / len(windows)
    print(json.dumps({
        "model": str(loaded.folder), "kv_dtype": args.kv_dtype, "ctx": args.ctx, "device": args.device,
        "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
        "text_tokens": len(ids), "windows": len(windows), "of_windows": len(all_windows),
        "scored_tokens": int(res.tokens.sum()), "ppl": round(res.ppl, 4),
        "setup_wall_s": round(setup_wall, 1), "setup_cpu_s": round(setup_cpu, 1),
        "eval_wall_s": round(wall, 1), "eval_cpu_s": round(cpu, 1),
        "tokens_per_wall_s": round(sum(e - b for b, e, _ in windows) / wall, 1),
        "full_run_wall_s": round(wall * scale, 1), "full_run_cpu_s": round(cpu * scale, 1),
        "extrapolated": len(windows) < len(all_windows),
    }))


if __name__ == "__main__":
    main()
