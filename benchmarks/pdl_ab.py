"""Programmatic dependent launch in the engine's decode step, A/B in one process (issue 10); also
RoPE in the cache write's launch against RoPE as its own kernel (variant rope-apart), and split-K
summed in a fixed order (variant ordered, FITLLM_DETERMINISTIC=1: what it costs, and whether its
greedy tokens repeat exactly), and an earlier paged_attention.py (variant attn-prev: the module
`_pa_baseline` next to this script, e.g. `git show REV:fitllm/kernels/paged_attention.py >
benchmarks/_pa_baseline.py`, not committed) in place of the current one. Variants skip-norm,
skip-silu and skip-both are timing only, with WRONG math: the RMSNorms (every one, with their
residual adds) and / or SiLU·mul launch nothing, which bounds what fusing them into the GEMVs could
save; a skipped norm hands on the residual stream unchanged (the embedding: it stays finite, so no
row fails and every variant decodes all its tokens). Variant skip-attn (timing only, wrong math too)
launches no attention kernel: the layer's attention output is its rotated queries (the cache is
still written), which bounds what decode attention costs the step. Variant attn-one-split decodes
every sequence in one split (no partials, no combine): right, but slow at long contexts; at this
script's lengths it measures what the split combine costs. Variant w4-prev builds its own model with an
earlier fitllm/kernels/w4a16_tiled.py (the module fitllm.kernels._w4_prev, e.g. `git show
REV:fitllm/kernels/w4a16_tiled.py > fitllm/kernels/_w4_prev.py`, not committed): its packing and
kernels, e.g. another weight layout. Variant fp8-prev serves the same fp8 model through an earlier
fitllm/kernels/fp8.py (the module fitllm.kernels._fp8_prev, made the same way, not committed). Both
need a file whose GEMM takes `defer` (the thirteenth session's or later). Variant defer-on hands
split-K sums to the fused kernels (kernels._utils.PendingSum; the default), defer-off finishes them
in each GEMM (FITLLM_SPLITK_DEFER=0), and wide-off runs the batch-1 GEMV's wide linears (gate_up)
at the table row's own split-K waves. Variant fp8q-on lets the RMSNorms and SiLU·mul quantize the
fp8 GEMMs' activations (kernels._utils.Fp8Activations; the default), fp8q-off leaves that to each
GEMM's own quantizer launch (FITLLM_FP8_FUSED_QUANT=0). Variant fused-prev runs an earlier
fitllm/kernels/_fused_triton.py (the module fitllm.kernels._fused_prev, made as _w4_prev, not
committed), small-prev that and _pa_baseline together. Variant early-w-on lets the fp8 batch-1 GEMV load
its first weight tile before the PDL wait (the default), early-w-off after it (FITLLM_EARLY_WEIGHTS=0);
fp8-pf-2 lets the fp8 tensor-core kernel ask L2 for its first two weight tiles before the wait, fp8-pf-0
not (FITLLM_FP8_PREFETCH). Variant dp4a-on runs the batch-1 int4 GEMVs on dp4a (kernels.w4a16_dp4a,
FITLLM_W4_DP4A=1), dp4a-off on the 16-bit GEMV.

Each variant sets its environment before its engine is built (the CUDA graphs are captured then,
and the kernels compile per setting), decodes 256 tokens at batch 1, and counts how many of its
greedy tokens equal those of the first variant and those of its own first round (with random
weights the logits are nearly flat, so split-K's atomic adds, whose order varies, flip int4 tokens
from run to run; bf16 and fp8 are deterministic and must match, and so must `ordered`). Variants
run in rounds, interleaved, so drift in the card's clocks hits all of them alike.

    python benchmarks/pdl_ab.py --schemes int4,bf16 --variants off,on --rounds 3 [--batch 64] [--out DIR]
    python benchmarks/pdl_ab.py --schemes int4 --variants on,ordered --rounds 3
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import build, engine_for  # noqa: E402
from gpu_engine_check import decode_speed, free, throughput  # noqa: E402

import fitllm.kernels._fused_triton as current_fused  # noqa: E402
import fitllm.kernels.fp8 as current_fp8  # noqa: E402
import fitllm.kernels.paged_attention as current_attention  # noqa: E402
import fitllm.kernels.w4a16_tiled as current_w4  # noqa: E402
from fitllm.kernels import fused  # noqa: E402
from fitllm.models.kv_cache import PagedKVCache  # noqa: E402
from fitllm.serve.sampling import SamplingParams  # noqa: E402

VARIANTS = {"off": {"FITLLM_PDL": "0"}, "on": {"FITLLM_PDL": "1"}, "rope-apart": {"FITLLM_PDL": "1"},
            "ordered": {"FITLLM_PDL": "1", "FITLLM_DETERMINISTIC": "1"}, "attn-prev": {"FITLLM_PDL": "1"},
            "skip-norm": {"FITLLM_PDL": "1", "FITLLM_SPLITK_DEFER": "0"},  # the skips take no pending sums
            "skip-silu": {"FITLLM_PDL": "1", "FITLLM_SPLITK_DEFER": "0"},
            "skip-both": {"FITLLM_PDL": "1", "FITLLM_SPLITK_DEFER": "0"},
            "w4-prev": {"FITLLM_PDL": "1"}, "fp8-prev": {"FITLLM_PDL": "1"},
            "defer-on": {"FITLLM_PDL": "1", "FITLLM_SPLITK_DEFER": "1"},
            "defer-off": {"FITLLM_PDL": "1", "FITLLM_SPLITK_DEFER": "0"}, "wide-off": {"FITLLM_PDL": "1"},
            "skip-attn": {"FITLLM_PDL": "1"}, "attn-one-split": {"FITLLM_PDL": "1"}, "fused-prev": {"FITLLM_PDL": "1"}, "small-prev": {"FITLLM_PDL": "1"},
            "fp8q-on": {"FITLLM_PDL": "1", "FITLLM_FP8_FUSED_QUANT": "1"},
            "fp8q-off": {"FITLLM_PDL": "1", "FITLLM_FP8_FUSED_QUANT": "0"},
            "early-w-on": {"FITLLM_PDL": "1", "FITLLM_EARLY_WEIGHTS": "1"},
            "early-w-off": {"FITLLM_PDL": "1", "FITLLM_EARLY_WEIGHTS": "0"},
            "fp8-pf-0": {"FITLLM_PDL": "1", "FITLLM_FP8_PREFETCH": "0"},
            "fp8-pf-2": {"FITLLM_PDL": "1", "FITLLM_FP8_PREFETCH": "2"},
            "dp4a-off": {"FITLLM_PDL": "1", "FITLLM_W4_DP4A": "0"},
            "dp4a-on": {"FITLLM_PDL": "1", "FITLLM_W4_DP4A": "1"}}
SWITCHES = sorted({key for env in VARIANTS.values() for key in env})  # every variable a variant sets


def skip_kernels(name: str, real=(fused.rms_norm, fused.silu_mul)) -> None:
    """Timing-only variants: the decoder calls fused.rms_norm / fused.silu_mul through the module,
    so passing a tensor through removes those launches from the captured graphs."""
    skip_norm, skip_silu = name in ("skip-norm", "skip-both"), name in ("skip-silu", "skip-both")
    fused.rms_norm = (lambda x, w, eps, residual=None, quant=None: x if residual is None else (residual, residual)) \
        if skip_norm else real[0]
    fused.silu_mul = (lambda gate_up, quant=None: gate_up[..., : gate_up.shape[-1] // 2]) if skip_silu else real[1]


def use_kernel_module(name: str, mod) -> None:
    """The engine and the quantized layers import fitllm.kernels.<name> (paged_attention,
    w4a16_tiled, fp8) at each call: point that name at `mod`."""
    import fitllm.kernels

    sys.modules[f"fitllm.kernels.{name}"] = mod
    setattr(fitllm.kernels, name, mod)


def greedy_tokens(engine, n: int = 48) -> list[int]:
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, engine.model_config.vocab_size, (100,), generator=g).tolist()
    out = engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return list(out[0].new_token_ids)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemes", default="int4,bf16")
    ap.add_argument("--variants", default="off,on")
    ap.add_argument("--kv", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=0, help="also offline throughput of this many 128/128 requests")
    ap.add_argument("--max-model-len", type=int, default=2048, help="the engine's; it sizes the decode graphs' splits")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = []
    fuses_rope, apart = PagedKVCache.fuses_rope, property(lambda self: False)
    attention, no_attention = PagedKVCache.attention, lambda self, layer, q, meta, scale: q
    decode_config = current_attention.decode_config  # variant attn-one-split: one split, no combine
    one_split = lambda *a, **k: dict(decode_config(*a, **k), num_splits=1)  # noqa: E731
    gemv_row = current_w4.TILED_CONFIGS["sm90"][0][1]  # variant wide-off: every linear at the row's waves
    wide = gemv_row["wide"]
    for scheme in args.schemes.split(","):
        models = {}
        reference, own = None, {}
        for r in range(args.rounds):
            for name in args.variants.split(","):
                for key in SWITCHES:  # back to the product's defaults, then this variant's settings
                    os.environ.pop(key, None)
                os.environ.update(VARIANTS[name])
                gemv_row["wide"] = None if name == "wide-off" else wide
                PagedKVCache.fuses_rope = apart if name == "rope-apart" else fuses_rope
                PagedKVCache.attention = no_attention if name == "skip-attn" else attention
                current_attention.decode_config = one_split if name == "attn-one-split" else decode_config
                skip_kernels(name)
                use_kernel_module("paged_attention", importlib.import_module("_pa_baseline")
                                  if name in ("attn-prev", "small-prev") else current_attention)
                use_kernel_module("_fused_triton", importlib.import_module("fitllm.kernels._fused_prev")
                                  if name in ("fused-prev", "small-prev") else current_fused)
                use_kernel_module("w4a16_tiled", importlib.import_module("fitllm.kernels._w4_prev")
                                  if name == "w4-prev" else current_w4)
                use_kernel_module("fp8", importlib.import_module("fitllm.kernels._fp8_prev")
                                  if name == "fp8-prev" else current_fp8)
                key = "w4-prev" if name == "w4-prev" else "current"
                if key not in models:
                    models[key] = build(scheme)  # packed by the module in use
                model = models[key]
                engine = engine_for(model, kv_dtype=args.kv, max_num_seqs=max(8, args.batch),
                                    max_model_len=args.max_model_len)
                tokens = greedy_tokens(engine)
                if reference is None:
                    reference = tokens
                own.setdefault(name, tokens)
                same = sum(a == b for a, b in zip(tokens, reference))
                repeat = sum(a == b for a, b in zip(tokens, own[name]))
                tps = decode_speed(engine, 128, 256)
                row = {"scheme": scheme, "kv": args.kv, "max_model_len": args.max_model_len, "variant": name,
                       "round": r, "tok_s": tps,
                       "tokens_equal": f"{same}/{len(reference)}", "tokens_repeat": f"{repeat}/{len(tokens)}"}
                if args.batch:
                    row["batch_tok_s"] = throughput(engine, args.batch, 128, 128)[0]
                rows.append(row)
                print(f"{scheme:5s} {args.kv:5s} {name:10s} round {r}: {tps:7.1f} tok/s  greedy tokens equal to the "
                      f"first variant {same}/{len(reference)}, to its round 0 {repeat}/{len(tokens)}"
                      + (f"  B={args.batch}: {row['batch_tok_s']:.0f} tok/s" if args.batch else ""), flush=True)
                free(engine)
        del models, model
        torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"pdl_ab_{args.kv}.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
