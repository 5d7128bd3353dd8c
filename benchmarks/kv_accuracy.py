"""Perplexity of the embedded SmolLM2 on WikiText-2 test with the KV cache in each dtype (CPU).

Every window is scored as one prefill through the paged cache, so each token's attention reads the
stored (quantized) K/V of all earlier tokens: the same numbers a decode over that cache would give.
Calibration (fp8 scales, smoothing means) comes from the *end* of the test file, disjoint from the
evaluated windows at its start. Quantized rows are compared with bf16 KV (the issue's baseline)
and with fp32 KV (the model's own precision).

    python benchmarks/kv_accuracy.py --windows 12 [--dtypes bf16,fp32,fp8,int8,int4,int4-norot] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from fitllm.models.generate import make_cache, prompt_logits
from fitllm.models.hub import resolve_model
from fitllm.models.kv_cache import calibrate_kv_scales
from fitllm.models.loader import load_model
from fitllm.models.tokenizer import load_tokenizer

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "wikitext-2" / "wiki.test.raw"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--windows", type=int, default=12)
    ap.add_argument("--window-len", type=int, default=1024)
    ap.add_argument("--dtypes", default="bf16,fp32,fp8,int8,int4")
    ap.add_argument("--calib-seqs", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--int4-group", type=int, default=32, help="values per int4 scale/zero of a value head")
    ap.add_argument("--int4-key-group", type=int, default=16, help="values per int4 scale/zero of a key head")
    ap.add_argument("--out", default=None)
    ap.add_argument("--model-dtype", default="float32", help="float32 | bfloat16 (what the GPU serves)")
    ap.add_argument("--fp32-rotation", action="store_true",
                    help="rotate in fp32 even for a 16-bit model (the scheme before 2026-12-01)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    folder = resolve_model(None)
    model = load_model(folder, dtype=getattr(torch, args.model_dtype))
    tok = load_tokenizer(folder)
    text = Path(args.data).read_text()
    need = args.windows * args.window_len
    ids = tok.encode(text[: need * 8])[:need]  # ~4 characters a token: 8x is plenty
    assert len(ids) == need, "text too short for the windows asked for"
    tail = tok.encode(text[-args.calib_seqs * 512 * 8:])
    calib = [tail[-(j + 1) * 512: len(tail) - j * 512] for j in range(args.calib_seqs)]
    windows = [ids[i * args.window_len:(i + 1) * args.window_len] for i in range(args.windows)]

    t0 = time.time()
    cal = calibrate_kv_scales(model, calib)
    print(f"calibration: {sum(map(len, calib))} tokens, {time.time() - t0:.0f}s", flush=True)

    rows = {}
    for kv in args.dtypes.split(","):
        # "int4-norot": the same dtype with the Hadamard rotation off (the earlier scheme)
        kwargs = {"kv_dtype": kv.removesuffix("-norot")}
        if kv.endswith("-norot"):
            kwargs["rotate"] = False
        if kwargs["kv_dtype"] in ("fp8", "int8", "int4"):
            kwargs["calibration"] = cal
        if kwargs["kv_dtype"] == "int4":
            kwargs.update(int4_group=args.int4_group, int4_key_group=args.int4_key_group)
        nll, n, t0 = 0.0, 0, time.time()
        for w in windows:
            cache = make_cache(model, len(w), **kwargs)
            if args.fp32_rotation:
                cache.rotation16 = None
            logp = torch.log_softmax(prompt_logits(model, w, cache).float(), -1)
            target = torch.tensor(w[1:])
            nll -= logp[:-1].gather(1, target[:, None]).sum().item()
            n += len(target)
        ppl = math.exp(nll / n)
        rows[kv] = {"ppl": ppl, "bytes_per_token": cache.bytes_per_token}
        print(f"{kv:6s} ppl {ppl:.4f}  {cache.bytes_per_token} B/token  {time.time() - t0:.0f}s", flush=True)

    def vs(kv, base):
        return f"{100 * (rows[kv]['ppl'] / rows[base]['ppl'] - 1):+.2f}%" if base in rows else "—"

    print("\n| KV dtype | bytes/token | perplexity | vs bf16 KV | vs fp32 KV |\n|---|---|---|---|---|")
    for kv, r in rows.items():
        print(f"| {kv} | {r['bytes_per_token']:,} | {r['ppl']:.3f} | {vs(kv, 'bf16')} | {vs(kv, 'fp32')} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"windows": args.windows, "window_len": args.window_len, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
