"""GPU check of every tiny model family (tests/tiny_models.py) against Hugging Face transformers:
tests/test_models.py's CPU checks, on the card, plus the serving engine. No network: each family's
random-weight checkpoint is written by transformers itself into a temporary folder.

    python benchmarks/gpu_families_check.py                          # all families, on cuda
    python benchmarks/gpu_families_check.py --families llama,phi3-partial --kv-dtype auto
    TRITON_INTERPRET=1 python benchmarks/gpu_families_check.py --device cpu   # a dry run (no graphs)

For each family, in float32, fitllm's model (load_model) and transformers' on the same device:
  1. prompt logits: max |log_softmax difference| over a 100-token random prompt, below 1e-3;
  2. greedy: fitllm.models.generate from its first 12 tokens == transformers' generate (64 new
     tokens; 40 for the LongRoPE families, whose sequences must stay inside the original context of
     64: past it transformers recomputes the whole cache with the long factors, fitllm keeps the
     keys it cached, as vLLM does);
  3. the engine (LLMEngine), CUDA graphs on and off (CPU: off only): the same prompt == transformers,
     and 3 prompts of different lengths in one batch == each alone through the engine.
With --kv-dtype other than auto the cache is lossy: engine vs transformers is then reported
(DIFF), not failed; batch vs alone still must agree. Exit status 1 if any check fails.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]
from gpu_engine_check import free, sync  # noqa: E402
from tiny_models import FAMILIES, write_tiny_model  # noqa: E402

from fitllm.models.generate import generate, prompt_logits  # noqa: E402
from fitllm.models.loader import load_model  # noqa: E402
from fitllm.serve.engine import EngineConfig, LLMEngine  # noqa: E402
from fitllm.serve.sampling import SamplingParams  # noqa: E402

LONGROPE = ("phi3-longrope", "phi3-partial")


def report(family: str, check: str, ok: bool, detail: str, soft: bool = False) -> bool:
    print(f"{family:14s} {check:34s} {'OK' if ok else 'DIFF' if soft else 'FAIL':4s}  {detail}", flush=True)
    return ok or soft


def tokens(got: list[int], want: list[int]) -> tuple[bool, str]:
    """(equal, 'n/N tokens equal' plus where they diverge)."""
    same = sum(a == b for a, b in zip(got, want))
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    where = "" if got == want else f", diverge at token {at} (got {got[at:at + 4]}, want {want[at:at + 4]})"
    return got == want, f"{same}/{len(want)} tokens equal{where}"


def check_family(family: str, args) -> bool:
    with tempfile.TemporaryDirectory() as folder:
        hf = write_tiny_model(family, Path(folder)).to(args.device)
        ours = load_model(Path(folder), device=args.device, dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids.to(args.device)).logits[0].float()
    diff = (prompt_logits(ours, ids[0].tolist()).log_softmax(-1) - ref.log_softmax(-1)).abs().max().item()
    ok = report(family, "prompt logits (100 tokens)", diff < 1e-3, f"max |d logprob| {diff:.2e} (limit 1e-3)")

    prompt, new = ids[0, :12].tolist(), 40 if family in LONGROPE else 64
    head = ids[:, :12].to(args.device)  # the mask given: token 0, the pad id, would be taken for padding
    want = hf.generate(head, attention_mask=torch.ones_like(head), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0)[0, 12:].tolist()
    ok &= report(family, "generate == HF greedy", *tokens(generate(ours, [prompt], new)[0], want))

    # Batch vs alone. For LongRoPE the 100-token prompt is past the original context (64) and the
    # others are not: each sequence must keep its own factors.
    g = torch.Generator().manual_seed(2)
    lens = (5, 30, 100)
    batch = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    lossy = args.kv_dtype != "auto"
    for graphs in ((False, True) if args.device == "cuda" else (False,)):
        engine = LLMEngine(EngineConfig(device=args.device, max_model_len=256, max_num_seqs=8, cuda_graphs=graphs,
                                        gpu_memory_utilization=args.gpu_memory_utilization, kv_dtype=args.kv_dtype,
                                        kv_layout=args.kv_layout,
                                        max_num_batched_tokens=args.max_num_batched_tokens), model=ours, tokenizer=None)
        tag = "engine, CUDA graphs" if graphs else "engine, eager"
        if graphs and not engine.cuda_graphs:
            ok &= report(family, tag, False, "no CUDA graphs were captured (the engine runs eager)")
        got = engine.generate([prompt], params)[0].new_token_ids
        ok &= report(family, f"{tag}: == HF greedy", *tokens(got, want), soft=lossy)
        together = [o.new_token_ids for o in engine.generate(batch, params)]
        alone = [engine.generate([p], params)[0].new_token_ids for p in batch]
        bad = [f"prompt of {n}: {tokens(a, b)[1]}" for n, a, b in zip(lens, together, alone) if a != b]
        ok &= report(family, f"{tag}: batch == alone", not bad, "; ".join(bad) or
                     f"3 prompts of {lens} tokens, {new}/{new} tokens equal each")
        free(engine)
    del hf, ours
    sync(empty_cache=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run (no CUDA graphs)")
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma list of {', '.join(FAMILIES)}")
    ap.add_argument("--kv-dtype", default="auto", help="the engine's KV cache dtype (EngineConfig.kv_dtype)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    ap.add_argument("--kv-layout", default="auto", help="auto | split | shared (EngineConfig.kv_layout): split puts "
                    "the sliding-window layers of gemma3 and smollm3-window on a pool of their own")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="the engine's step budget; below 100 the batch's prompts are cut into chunks")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    unknown = [f for f in args.families.split(",") if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown} (known: {', '.join(FAMILIES)})")
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{name}  torch {torch.__version__}  kv_dtype {args.kv_dtype}  kv_layout {args.kv_layout}", flush=True)
    failed = [f for f in args.families.split(",") if not check_family(f, args)]
    print(f"FAILED: {', '.join(failed)}" if failed else "ALL FAMILIES OK", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
