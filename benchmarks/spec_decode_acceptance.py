"""Speculative decoding acceptance on the CPU with the embedded model (real weights).

    OMP_NUM_THREADS=1 python benchmarks/spec_decode_acceptance.py            # print the table
    OMP_NUM_THREADS=1 python benchmarks/spec_decode_acceptance.py --write    # and append it to RESULTS.md

Random weights say nothing about acceptance, so it is measured here, on the embedded
SmolLM2-135M-Instruct (fp32 target by default), greedy, through the real engine:
  - drafters: the int4 self-drafter (RTN int4 copy of the target) and the n-gram drafter;
  - workloads (chat-formatted): "edit" — code editing and summarisation-like prompts whose
    answers copy much of the prompt (what n-gram lookup is for); "open" — open questions;
  - k in {2, 4, 6}.
Reported per (drafter, workload, k), over all requests:
  acceptance  = accepted draft tokens / drafted tokens
  len/verify  = tokens per verification step (accepted + the target's own token)
  tau         = generated tokens per target forward over the whole decode, steps without a
                draft included (n-gram lookup finds nothing at times): the factor by which
                speculation cuts target forwards, what benchmarks/spec_decode_gpu.py --tau takes.
The last line prints the --tau arguments for the GPU estimate.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

import torch

from fitllm.models.hub import resolve_model
from fitllm.models.loader import load_model
from fitllm.models.tokenizer import load_tokenizer
from fitllm.quant.inplace import quantized_copy
from fitllm.serve.engine import EngineConfig, LLMEngine
from fitllm.serve.sampling import SamplingParams
from fitllm.serve.spec_decode import dense_linears

CODE = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, age, city = line.strip().split(",")
            users.append({"name": name, "age": int(age), "city": city})
    return users


def oldest_user(users):
    best = None
    for user in users:
        if best is None or user["age"] > best["age"]:
            best = user
    return best
'''
ARTICLE = ("The city council met on Tuesday to discuss the new public library. The library will be built "
           "on Main Street, next to the old post office. Construction will start in March and is expected to "
           "take two years. The council said the library will have a children's room, a study hall with fifty "
           "desks, and a small cafe. The total cost of the library is twelve million dollars, paid for by the "
           "city and by a grant from the state. Some residents asked the council to add more parking near the "
           "library; the council said it will study the parking question in the spring.")
WORKLOADS = {
    "edit": [
        f"Rename the variable `users` to `people` in this code. Reply with the full code only.\n\n{CODE}",
        f"Add type hints to every function in this code. Reply with the full code only.\n\n{CODE}",
        f"Add a docstring to each function in this code and reply with the whole code.\n\n{CODE}",
        f"Summarise this article in three sentences, reusing its wording.\n\n{ARTICLE}",
        f"Repeat the following text exactly, then stop.\n\n{ARTICLE}",
        f"List every fact in this article as a bullet point.\n\n{ARTICLE}",
    ],
    "open": [
        "What are three good habits for staying healthy?",
        "Explain what a hash table is to a beginner.",
        "Write a short poem about the sea.",
        "Why do leaves change colour in autumn?",
        "Give me a recipe for a simple tomato soup.",
        "What is the difference between weather and climate?",
    ],
}


def chat(tokenizer, text: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def measure(target, tokenizer, drafter_model, speculative: str, k: int, prompts, max_tokens: int) -> dict:
    config = EngineConfig(block_size=16, num_kv_blocks=512, max_model_len=1024, max_num_batched_tokens=1024,
                          speculative=speculative, num_speculative_tokens=k)
    engine = LLMEngine(config, model=target, tokenizer=tokenizer, draft_model=drafter_model)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    c = engine.spec_counts
    decoded = sum(len(o.new_token_ids) for o in outs) - len(outs)  # the first token comes from the prefill
    forwards = decoded - c["accepted"]  # every target decode forward yields one token plus its accepted drafts
    return dict(acceptance=c["accepted"] / max(c["drafted"], 1), len_per_verify=(c["accepted"] + c["steps"]) /
                max(c["steps"], 1), tau=decoded / max(forwards, 1), seconds=time.perf_counter() - t,
                drafted_share=c["steps"] / max(forwards, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", default="2,4,6")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", help="the target's dtype (float32 or bfloat16)")
    ap.add_argument("--write", action="store_true", help="append a dated section to benchmarks/RESULTS.md")
    args = ap.parse_args()
    folder = resolve_model(None)
    target = load_model(folder, dtype=getattr(torch, args.dtype))
    tokenizer = load_tokenizer(folder)
    int4 = quantized_copy(target, "int4")
    dense_linears(int4)  # the same RTN-int4 values, stored dense: the CPU has no fast int4 GEMM
    prompts = {name: [chat(tokenizer, p) for p in texts] for name, texts in WORKLOADS.items()}
    runs = [("self-int4", "edit"), ("self-int4", "open"), ("ngram", "edit"), ("ngram", "open")]
    rows, taus = [], {}
    header = "| drafter | workload | k | acceptance | len/verify | tau (tokens per target forward) | drafted steps | s |"
    print(header + "\n|---|---|---|---|---|---|---|---|", flush=True)
    for drafter, workload in runs:
        for k in map(int, args.ks.split(",")):
            spec = "draft-model" if drafter == "self-int4" else drafter
            r = measure(target, tokenizer, int4 if drafter == "self-int4" else None, spec, k, prompts[workload],
                        args.max_tokens)
            row = (f"| {drafter} | {workload} | {k} | {r['acceptance']:.3f} | {r['len_per_verify']:.2f} | "
                   f"{r['tau']:.2f} | {r['drafted_share']:.0%} | {r['seconds']:.0f} |")
            print(row, flush=True)
            rows.append(row)
            taus.setdefault(f"{drafter}/{workload}", []).append(f"{k}={r['tau']:.3f}")
    tau_args = " ".join(f"--tau {name}:{','.join(v)}" for name, v in taus.items())
    print(f"\nfor benchmarks/spec_decode_gpu.py: {tau_args}")
    if args.write:
        write_results(args, header, rows, tau_args)


def write_results(args, header: str, rows: list[str], tau_args: str) -> None:
    text = f"""
## {datetime.date.today()} — speculative decoding acceptance (CPU, embedded SmolLM2-135M-Instruct)

`python {' '.join(sys.argv)}` (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')},
{platform.machine()} CPU, torch {torch.__version__}; the s column is wall time). Target {args.dtype}, greedy, {args.max_tokens} new tokens per request,
6 chat-formatted prompts per workload run as one batch through the engine. self-int4 = RTN int4
(asymmetric, group 64) copy of the target. "edit" = code editing / summarisation / copying prompts
whose answers reuse the prompt; "open" = open questions. acceptance = accepted / drafted tokens;
len/verify = tokens per verification step (accepted + 1); tau = generated tokens per target
forward over the whole decode (steps without a draft included); drafted steps = share of
target forwards that verified a draft.

{header}
|---|---|---|---|---|---|---|---|
""" + "\n".join(rows) + f"""

GPU speed-up estimate input: `python benchmarks/spec_decode_gpu.py {tau_args}`
"""
    path = Path(__file__).with_name("RESULTS.md")
    with path.open("a") as f:
        f.write(text)
    print(f"appended to {path}")


if __name__ == "__main__":
    main()
