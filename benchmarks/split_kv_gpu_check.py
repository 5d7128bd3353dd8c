"""The split KV cache (`--kv-layout split`) on a GPU, at Gemma 3 4B's shapes with random weights.

    python benchmarks/split_kv_gpu_check.py [--kv-bytes-gib 3] [--prompt-len 20000]
    python benchmarks/split_kv_gpu_check.py --device cpu --shape gemma-3-1b --kv-bytes-gib 0.05 \
        --prompt-len 700 --new-tokens 4 --decode-steps 2     # a dry run (no CUDA graphs)
    python benchmarks/split_kv_gpu_check.py --card-gib 12 --context 32768 --seqs 4   # memory against the plan

Two engines on the same model and the same KV memory: one pool for every layer (shared), and the
split layout (pages shared by the full-attention layers' blocks and the 29 sliding-window layers'
blocks, which go back to the pool behind each sequence's 1,024-token window). For each: the KV
tokens one sequence can hold, greedy tokens of three prompts (one long, chunked prefill
past the window many times over) decoded together with CUDA graphs, the long prompt's prefill time
and batch-1 decode speed at its length. The split engine's tokens must equal the shared one's
(same kernels, same numbers: only the block ids differ). Exit status 1 if not.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks")]
from gpu_engine_check import free, sync  # noqa: E402

from fitllm import budget  # noqa: E402
from fitllm.models.decoder import CausalLM  # noqa: E402
from fitllm.serve.engine import EngineConfig, LLMEngine  # noqa: E402
from fitllm.serve.sampling import SamplingParams  # noqa: E402


def random_gemma3(shape: str, device: str) -> CausalLM:
    config = replace(budget.known_model(shape), eos_token_ids=[])
    torch.manual_seed(0)
    model = CausalLM(config, dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(0.0)  # Gemma's norms scale by 1 + w
            else:
                p.normal_(0.0, 1.0 if "embed_tokens" in name else 0.02)
    return model.eval()


def timed_steps(engine: LLMEngine, prompt: list[int], steps: int) -> tuple[float, float]:
    """(seconds from the request to its first token, seconds per decode step after it), stepping the
    engine directly (each step waits for its tokens)."""
    engine.add_request("timed", prompt, SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    sync()
    t0 = time.perf_counter()
    while not any(o.new_token_ids for o in engine.step()):
        pass
    sync()
    t1 = time.perf_counter()
    n = 0
    while engine.has_unfinished_requests():
        n += sum(len(o.new_token_ids) for o in engine.step())
    sync()
    return t1 - t0, (time.perf_counter() - t1) / max(1, n)


def run(model: CausalLM, layout: str, kv_blocks: int, prompts: list[list[int]], new: int, steps: int) -> dict:
    # (no prefix cache in either: the long prompt's timed runs would hit it in the shared one)
    engine = LLMEngine(EngineConfig(device=str(model.device), max_model_len=32768, max_num_seqs=4, kv_layout=layout,
                                    num_kv_blocks=kv_blocks, max_num_batched_tokens=2048,
                                    enable_prefix_caching=False), model=model, tokenizer=None)
    stats = engine.stats()
    greedy = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    outs = [o.new_token_ids for o in engine.generate(prompts, greedy)]
    prefill, decode = float("inf"), float("inf")
    for _ in range(3):  # best of three: the long prompt's prefill, then `steps` decode steps of it alone
        p, d = timed_steps(engine, prompts[0], steps)
        prefill, decode = min(prefill, p), min(decode, d)
    split = stats["kv_split"]
    tokens = split["longest_sequence"] if split else stats["kv_blocks_total"] * stats["kv_block_size"]
    row = dict(layout=layout, blocks=stats["kv_blocks_total"], widths=split and split["page_widths"], tokens=tokens,
               outs=outs, prefill_s=prefill, decode_ms=decode * 1e3, graphs=engine.cuda_graphs)
    free(engine)
    return row


def outside_torch() -> int:
    """Device memory in use that torch's allocator does not hold (this process alone on the card)."""
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def memory_check(model: CausalLM, card_gib: float, context: int, seqs: int) -> bool:
    """The split cache sized from memory on an emulated card of `card_gib`, against `quant memory`'s
    plan: its pages, and torch's peak under full load (sequences of `context` tokens)."""
    from fitllm.kernels._utils import gpu_arch

    card = int(card_gib * budget.GiB)
    total = torch.cuda.mem_get_info()[1]
    settings = budget.Settings(scheme="bf16", kv_dtype="bf16", max_model_len=context, max_num_seqs=seqs,
                               max_batched_tokens=2048, gpu_memory_utilization=0.9, gpu_arch=gpu_arch(0))
    plan = budget.estimate(model.config, settings, card)
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(card / total)
    torch.cuda.reset_peak_memory_stats()
    outside_before = outside_torch()
    engine = LLMEngine(EngineConfig(device="cuda", max_model_len=context, max_num_seqs=seqs, max_num_batched_tokens=2048,
                                    gpu_memory_utilization=0.9 * card / total), model=model, tokenizer=None)
    stats = engine.stats()
    blocks, split = stats["kv_blocks_total"], stats["kv_split"]
    n = max(1, min(seqs, plan.max_seqs_at(context)))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, model.config.vocab_size, (context - 64,), generator=g).tolist() for _ in range(n)]
    engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    sync()
    measured = torch.cuda.max_memory_allocated()
    predicted = budget.estimate(model.config, settings, card, num_kv_blocks=blocks + 1).torch_peak
    used = budget.compare_with_measured(budget.estimate(model.config, settings, card,
                                                        num_kv_blocks=blocks + 1))["device_used"]
    print(f"memory outside torch (CUDA context, kernel images): {outside_before / 2**20:.0f} MiB before the engine, "
          f"{outside_torch() / 2**20:.0f} MiB after its load (the plan: {budget.CUDA_CONTEXT_BYTES / 2**20:.0f}); "
          f"device memory used predicted {used['predicted'] / 2**30:.2f} GiB, measured {used['measured'] / 2**30:.2f} GiB",
          flush=True)
    print(f"emulated {card_gib:g} GiB card, {n} x {context} tokens: KV pages planned "
          f"{plan.num_kv_blocks}, allocated {blocks} (split: {split is not None}); torch peak "
          f"predicted {predicted / 2**30:.2f} GiB, measured {measured / 2**30:.2f} GiB "
          f"({(predicted - measured) / measured:+.1%})", flush=True)
    free(engine)
    torch.cuda.set_per_process_memory_fraction(1.0)
    return split is not None and abs(predicted - measured) / measured < 0.03


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-bytes-gib", type=float, default=3.0, help="KV memory both engines get")
    ap.add_argument("--prompt-len", type=int, default=20000)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--decode-steps", type=int, default=128, help="timed decode steps of the long prompt")
    ap.add_argument("--shape", default="gemma-3-4b", help="a Gemma 3 of budget.KNOWN_MODELS")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--split-first", action="store_true", help="build and time the split engine first")
    ap.add_argument("--card-gib", type=float, help="instead: size a split cache from memory on an emulated card of "
                    "this many GiB and compare it with quant memory's plan (with --context, --seqs)")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--seqs", type=int, default=4)
    args = ap.parse_args()
    model = random_gemma3(args.shape, args.device)
    if args.card_gib:
        ok = memory_check(model, args.card_gib, args.context, args.seqs)
        print("memory: PASS (split, torch peak within 3 % of the plan)" if ok else "memory: FAIL", flush=True)
        return 0 if ok else 1
    cfg = model.config
    num_sliding, window = budget.sliding_layers(cfg)
    kv_bytes = int(args.kv_bytes_gib * budget.GiB)
    shared_blocks = kv_bytes // (16 * budget.kv_bytes_per_token(cfg, "bf16"))
    pages = kv_bytes // (16 * budget.kv_bytes_per_token(cfg, "bf16", budget.page_geometry(cfg)[0]))
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{name}  torch {torch.__version__}  {args.shape} shapes, random weights; "
          f"{cfg.num_layers} layers, {num_sliding} sliding (window {window}); KV {args.kv_bytes_gib:g} GiB", flush=True)
    g = torch.Generator().manual_seed(3)
    lens = (args.prompt_len, min(3000, args.prompt_len // 2), 100)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    order = [("shared", shared_blocks), ("split", pages)]
    rows = [run(model, layout, blocks, prompts, args.new_tokens, args.decode_steps)
            for layout, blocks in (order[::-1] if args.split_first else order)]
    rows.sort(key=lambda r: r["layout"] == "split")
    print("| layout | KV blocks (split: pages; pages a full / sliding block) | tokens one sequence can hold | graphs | "
          "prefill of the long prompt (s, best of 3) | batch-1 decode step at its length (ms, best of 3) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        widths = f" ({r['widths'][0]} / {r['widths'][1]})" if r["widths"] else ""
        print(f"| {r['layout']} | {r['blocks']}{widths} | {r['tokens']:,} | {r['graphs']} | "
              f"{r['prefill_s']:.3f} | {r['decode_ms']:.2f} |")
    same = rows[0]["outs"] == rows[1]["outs"]
    first = [sum(a == b for a, b in zip(x, y)) for x, y in zip(rows[0]["outs"], rows[1]["outs"])]
    print(f"split tokens == shared tokens: {'PASS' if same else 'FAIL'} (equal per prompt: {first} of {args.new_tokens})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
