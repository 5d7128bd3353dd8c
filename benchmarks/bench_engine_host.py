"""Host time per engine step at a large batch, with a model whose compute is negligible (issue 10).

The offline run of bench_serving (1000 requests x 128 prompt / 128 output tokens, max_num_seqs 256,
max_num_batched_tokens 8192) on the CPU, with a stub model: a real fitllm CausalLM of tiny shape
whose forward is replaced by an embedding lookup (no layers), so a step costs what the engine's
host side costs: scheduling, block tables, the step's input buffers (CUDA-graph path emulated on
the CPU, as the GPU runs decode steps), sampling ops, bookkeeping, output objects. On the GPU
every torch op here is a kernel launch of similar host cost, so these numbers are the host part
of a GPU step.

Time is the engine thread's CPU time (`time.thread_time`), which a shared, loaded machine
disturbs less than wall time; wall time is printed too. Steps are split into decode-only steps
and mixed steps (some prompt chunk in the batch).

    OMP_NUM_THREADS=1 python benchmarks/bench_engine_host.py              # ~1 min on a free core
    OMP_NUM_THREADS=1 python benchmarks/bench_engine_host.py --profile 25 # + cProfile, top 25

On a GPU (`--device cuda --scheme fp8`) the same run uses bench_serving's Llama-3-8B-shaped model
and engine settings, once with the look-ahead (async_scheduling) and once without; there the step
times are wall times (the host spins while it waits for the GPU, so its CPU time means little).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

import torch

from fitllm.models.config import ModelConfig
from fitllm.models.decoder import CausalLM
from fitllm.serve.engine import EngineConfig, LLMEngine
from fitllm.serve.sampling import SamplingParams


def stub_model(vocab: int, hidden: int = 64) -> CausalLM:
    """A tiny CausalLM whose forward is only its embedding (hidden states vary with the ids, so
    greedy tokens vary); the cache shapes come from its config."""
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=hidden,
                         intermediate_size=2 * hidden, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                         max_position_embeddings=4096, eos_token_ids=[])
    torch.manual_seed(0)
    model = CausalLM(config).eval()
    model.forward = lambda ids, pos, ctx: model.model.embed_tokens(ids)
    return model


def gpu_engine(model, async_scheduling: bool) -> LLMEngine:
    """bench_serving's offline settings (engine_for), look-ahead on or off."""
    from bench_serving import engine_for

    return engine_for(model, kv_dtype="auto", async_scheduling=async_scheduling)


def make_engine(args) -> LLMEngine:
    extra = {"async_scheduling": not args.no_async} if "async_scheduling" in EngineConfig.__dataclass_fields__ else {}
    config = EngineConfig(device="cpu", max_model_len=2048, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          num_kv_blocks=args.max_num_seqs * 2048 // 16 // 2, **extra)  # (older trees: no look-ahead)
    engine = LLMEngine(config, model=stub_model(args.vocab))
    # The GPU replays graphs for decode steps: run the same input-building path (eagerly).
    engine.runner.capture_graphs(config.max_num_seqs, emulate_on_cpu=True,
                                 max_batched_tokens=config.max_num_batched_tokens)
    return engine


def timed_run(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> dict:
    """engine.generate (as bench_serving's offline part), each step timed and classified."""
    steps = []  # (decode only?, batch size, cpu s, wall s)
    inner, schedule = engine.step, engine.scheduler.schedule
    last = {}

    def record_schedule():
        last["sched"] = schedule()
        return last["sched"]

    def step():
        queued = getattr(engine, "_inflight", None)  # a look-ahead step queued by the previous call
        c, w = time.thread_time(), time.perf_counter()
        out = inner()
        cpu, wall = time.thread_time() - c, time.perf_counter() - w
        tokens = (queued[0] if queued is not None else last["sched"]).num_tokens  # the step this call finished
        steps.append((all(n == 1 for n in tokens.values()), len(tokens), cpu, wall))
        return out

    engine.step, engine.scheduler.schedule = step, record_schedule
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    c, w = time.thread_time(), time.perf_counter()
    outs = engine.generate(prompts, params)
    cpu, wall = time.thread_time() - c, time.perf_counter() - w
    engine.step, engine.scheduler.schedule = inner, schedule
    generated = sum(len(o.new_token_ids) for o in outs)
    assert generated == len(prompts) * new_tokens, generated

    def summary(rows):
        if not rows:
            return {"steps": 0}
        ms = [r[2] * 1e3 for r in rows]
        return {"steps": len(rows), "ms_per_step": statistics.median(ms), "mean_ms": statistics.fmean(ms),
                "mean_batch": statistics.fmean(r[1] for r in rows),
                "us_per_seq": 1e3 * statistics.median(m / max(1, r[1]) for m, r in zip(ms, rows)),
                "wall_ms_per_step": 1e3 * statistics.median(r[3] for r in rows)}

    full = [s for s in steps if s[0] and s[1] == engine.config.max_num_seqs]
    return {"cpu_s": cpu, "wall_s": wall, "generated": generated, "host_bound_tok_s": generated / cpu,
            "look_ahead_steps": getattr(engine, "num_look_ahead_steps", 0),
            "decode_full_batch": summary(full), "decode_all": summary([s for s in steps if s[0]]),
            "mixed": summary([s for s in steps if not s[0]])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128, help="small: the sampling ops' compute stays negligible")
    ap.add_argument("--no-async", action="store_true", help="no look-ahead decode steps (async_scheduling off)")
    ap.add_argument("--profile", type=int, default=0, help="cProfile the run; print the top N by total time")
    ap.add_argument("--json", help="write the numbers here")
    ap.add_argument("--device", default="cpu", help="cuda: bench_serving's model and engine, look-ahead on and off")
    ap.add_argument("--scheme", default="fp8", help="with --device cuda: bf16 | fp8 | int4 weights")
    args = ap.parse_args()
    if args.device == "cuda":
        return main_gpu(args)
    torch.set_num_threads(1)
    engine = make_engine(args)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, args.vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]
    timed_run(engine, prompts[:32], 4)  # warm-up
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
    res = timed_run(engine, prompts, args.output_len)
    if args.profile:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    print(json.dumps(res, indent=1))
    d, m = res["decode_full_batch"], res["mixed"]
    print(f"host CPU: {res['cpu_s']:.2f} s for {res['generated']} tokens -> host-bound ceiling "
          f"{res['host_bound_tok_s']:.0f} output tok/s (wall {res['wall_s']:.2f} s); "
          f"look-ahead steps {res['look_ahead_steps']}")
    if d["steps"]:
        print(f"decode steps at batch {args.max_num_seqs}: {d['steps']}, {d['ms_per_step']:.2f} ms/step "
              f"({d['us_per_seq']:.1f} us/seq)")
    if m["steps"]:
        print(f"mixed steps: {m['steps']}, {m['ms_per_step']:.2f} ms/step (mean batch {m['mean_batch']:.0f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def main_gpu(args) -> int:
    from bench_serving import build
    from gpu_engine_check import free, sync

    model = build(args.scheme)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]
    results = {}
    for ahead in (True, False):
        engine = gpu_engine(model, ahead)
        timed_run(engine, prompts[:32], 16)  # warm-up: kernels for the prefill shapes
        sync()
        res = timed_run(engine, prompts, args.output_len)
        sync()
        results["look_ahead" if ahead else "no_look_ahead"] = res
        d, m = res["decode_full_batch"], res["mixed"]
        print(f"{args.scheme} look-ahead={ahead}: {res['generated'] / res['wall_s']:.0f} output tok/s "
              f"(wall {res['wall_s']:.2f} s, {res['look_ahead_steps']} look-ahead steps); decode at batch "
              f"{args.max_num_seqs}: {d.get('wall_ms_per_step', float('nan')):.2f} ms/step wall; "
              f"mixed: {m.get('steps', 0)} steps, {m.get('wall_ms_per_step', float('nan')):.1f} ms/step", flush=True)
        free(engine)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
