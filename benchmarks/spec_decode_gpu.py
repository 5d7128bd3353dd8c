"""Speculative decoding on the GPU: step times, batch-1 tokens/s, and the speed-up estimate.

    python benchmarks/spec_decode_gpu.py --tau self-int4/edit:2=2.3,4=2.9,6=3.1 --tau ngram/edit:2=1.7,4=1.9,6=2.0
    python benchmarks/spec_decode_gpu.py --device cpu --shape tiny       # dry run of the logic

  0. a lossless check on the device first (--check-only to run just that): SmolLM2-135M shapes,
     random weights, fp32 (where graphs vs eager rounding cannot flip a greedy token), 4 repetitive
     prompts with k = 4, 2, 0, 3: greedy tokens with n-gram / draft-model speculation (the target
     itself as the drafter: full acceptance, so every step runs the drafter's 2-token catch-up)
     must equal those without, with the verification (q = k + 1) and catch-up (q = 2) CUDA graphs
     in use.

Self-contained (no network, no files): a random-weight Llama-3-8B-shaped bf16 target
(benchmarks/gpu_engine_check.py's `random_model`) and its RTN-int4 copy as the self-drafter
(fitllm.quant.inplace.quantized_copy: shares embeddings and norms, int4 linears on the w4a16 kernel).
Random weights make acceptance meaningless, so acceptance comes from the CPU measurement with the
real embedded model (benchmarks/spec_decode_acceptance.py prints the --tau arguments), and this
script measures what the GPU costs:

  1. forward times (batch 1, context --prompt-len, each timed as many back-to-back
     ModelRunner.execute calls, host work included, which is what the engine pays per step):
     T_dec      target decode step (1 token; CUDA graph)
     T_ver(k)   target verification step (k + 1 tokens, their logits; CUDA graph q = k + 1)
     T_dstep    int4 drafter decode step (CUDA graph); T_dcatch: its 2-token catch-up step (graph q = 2)
     T_ngram    n-gram lookup on the host over the context
     ..._eager  the same steps with the graphs switched off (the path before the q > 1 graphs)
  2. engine tokens/s at batch 1 on a repetitive prompt (a 32-token random block repeated):
     no speculation, n-gram (real acceptance of this random model, whatever it is) and int4
     self-draft, for each k; from these, the engine's wall time per target forward with
     speculation, T_eng(k), all engine overheads included (scheduling, drafting, verification).
  3. the estimate, with tau = tokens per target forward measured on the CPU:
     kernel level:  speed-up = tau * T_dec / (T_ver(k) + T_draft(k)),
                    T_draft = T_dcatch + (k - 1) * T_dstep (int4 self-draft), T_ngram (n-gram)
     engine level:  speed-up = tau * T_eng_plain / T_eng(k),  T_eng_plain = 1 / plain tokens/s
     (tau already counts decode steps where the drafter proposed nothing. The kernel level
     charges every step a full verification, pessimistic for n-gram; the engine level uses the
     run's average step, for n-gram a mix of verifications and plain graph decodes at this
     random model's own draft rate.)
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine_check import SHAPES, random_model  # noqa: E402

from fitllm.quant.inplace import quantized_copy  # noqa: E402
from fitllm.serve.engine import EngineConfig, LLMEngine  # noqa: E402
from fitllm.serve.model_runner import StepSeq  # noqa: E402
from fitllm.serve.sampling import SamplingParams  # noqa: E402
from fitllm.serve.spec_decode import NgramDrafter  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, iters: int, warmup: int = 3) -> float:
    """Seconds per call, back to back."""
    for _ in range(warmup):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t) / iters


def make_engine(model, args, speculative=None, k=4, draft_model=None) -> LLMEngine:
    config = EngineConfig(device=args.device, max_model_len=args.prompt_len + args.new_tokens + 64, max_num_seqs=4,
                          num_kv_blocks=args.num_kv_blocks, max_num_batched_tokens=2048,
                          speculative=speculative, num_speculative_tokens=k)
    return LLMEngine(config, model=model, tokenizer=None, draft_model=draft_model)


def free(engine: LLMEngine) -> None:
    for runner in (engine.runner, getattr(engine.drafter, "runner", None)):
        if runner is not None:
            runner.graphs = runner.cache = None
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def probe_table(bm, n: int) -> list[int]:
    """A sequence of n slots whose K/V content does not matter: attention costs the same."""
    bm.free("probe")
    assert bm.allocate("probe", 0, n)
    return bm.table("probe")


@contextlib.contextmanager
def eager(runner):
    graphs, runner.graphs = runner.graphs, None
    try:
        yield
    finally:
        runner.graphs = graphs


def step_times(engine: LLMEngine, args, ks: list[int]) -> dict:
    ctx, iters = args.prompt_len, args.iters
    table = probe_table(engine.block_manager, ctx + max(ks) + 1)
    run = engine.runner.execute
    out = {"T_dec": timed(lambda: run([StepSeq([1], ctx, table, 1)]), iters)}
    for k in ks:
        out[f"T_ver({k})"] = timed(lambda: run([StepSeq([1] * (k + 1), ctx, table, k + 1)]), iters)
    with eager(engine.runner):
        out["T_dec_eager"] = timed(lambda: run([StepSeq([1], ctx, table, 1)]), iters)
        for k in ks:
            out[f"T_ver_eager({k})"] = timed(lambda: run([StepSeq([1] * (k + 1), ctx, table, k + 1)]), iters)
    drafter = engine.drafter
    if drafter is not None and drafter.needs_cache:
        dtable = probe_table(drafter.bm, ctx + max(ks) + 1)
        drun = drafter.runner.execute
        out["T_dstep"] = timed(lambda: drun([StepSeq([1], ctx, dtable, 1)]), iters)
        out["T_dcatch"] = timed(lambda: drun([StepSeq([1, 1], ctx, dtable, 1)]), iters)
        with eager(drafter.runner):
            out["T_dcatch_eager"] = timed(lambda: drun([StepSeq([1, 1], ctx, dtable, 1)]), iters)
    context = repetitive_prompt(engine.model_config.vocab_size, ctx + args.new_tokens)
    out["T_ngram"] = timed(lambda: NgramDrafter().propose(context, max(ks)), 20)
    return out


def print_step_times(times: dict, ks: list[int]) -> None:
    print("\n| step (batch 1, ms) | CUDA graph | eager |")
    print("|---|---|---|")
    print(f"| target decode | {1e3 * times['T_dec']:.2f} | {1e3 * times['T_dec_eager']:.2f} |")
    for k in ks:
        print(f"| target verify k={k} ({k + 1} tokens) | {1e3 * times[f'T_ver({k})']:.2f} | "
              f"{1e3 * times[f'T_ver_eager({k})']:.2f} |")
    if "T_dstep" in times:
        print(f"| int4 draft decode | {1e3 * times['T_dstep']:.2f} | — |")
        print(f"| int4 draft catch-up (2 tokens) | {1e3 * times['T_dcatch']:.2f} | {1e3 * times['T_dcatch_eager']:.2f} |")
    print(f"| n-gram lookup (host) | {1e3 * times['T_ngram']:.3f} | — |", flush=True)


def repetitive_prompt(vocab: int, n: int) -> list[int]:
    block = torch.randint(0, vocab, (32,), generator=torch.Generator().manual_seed(7)).tolist()
    return (block * (n // 32 + 1))[:n]


def decode_run(engine: LLMEngine, args) -> dict:
    """Batch-1 decode tokens/s after the prefill, target forwards, acceptance."""
    prompt = repetitive_prompt(engine.model_config.vocab_size, args.prompt_len)
    engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))  # warm-up
    engine.spec_counts.update(drafted=0, accepted=0, steps=0)
    engine.add_request("run", prompt, SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefill
    sync()
    t, tokens, steps = time.perf_counter(), 0, 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    sync()
    dt = time.perf_counter() - t
    c = engine.spec_counts
    return dict(tps=tokens / dt, step=dt / steps, tau=tokens / steps, acceptance=c["accepted"] / max(c["drafted"], 1))


def check_lossless(device: str) -> bool:
    """Greedy tokens with and without speculation, fp32, CUDA graphs on (see the docstring)."""
    model = random_model("smollm2-135m", device, torch.float32, seed=1)
    vocab = model.config.vocab_size
    prompts = [repetitive_prompt(vocab, n)[i:] for i, n in enumerate((100, 140, 60, 200))]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, logprobs=2)
    config = dict(device=device, max_model_len=512, max_num_seqs=8, num_kv_blocks=512, max_num_batched_tokens=512)

    def run(speculative=None, draft_model=None):
        engine = LLMEngine(EngineConfig(**config, speculative=speculative, num_speculative_tokens=4),
                           model=model, draft_model=draft_model)
        if device == "cpu":  # a dry run: the graph path's padding and buffers, run eagerly
            engine.runner.capture_graphs(8, emulate_on_cpu=True, query_lens=(1, 2, 3, 4, 5))
            if engine.drafter is not None and engine.drafter.needs_cache:
                engine.drafter.runner.capture_graphs(8, emulate_on_cpu=True, query_lens=(1, 2))
        shapes = []  # (runner, q) of every graph replay
        for name, runner in (("target", engine.runner), ("draft", getattr(engine.drafter, "runner", None))):
            graphs = getattr(runner, "graphs", None)
            if graphs is not None:
                graphs.run = lambda seqs, g=graphs, r=graphs.run, name=name: shapes.append((name, g._shape(seqs)[0])) or r(seqs)
        for i, (prompt, k) in enumerate(zip(prompts, (4, 2, 0, 3))):
            engine.add_request(str(i), prompt, params, num_speculative_tokens=k)
        lps: dict[str, list] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                lps.setdefault(o.request_id, []).extend(o.logprobs)
        out = [lps[str(i)] for i in range(len(prompts))], shapes, engine.stats()
        free(engine)
        return out

    plain_lps, _, _ = run()
    plain = [[lp.token_id for lp in r] for r in plain_lps]
    ok = True
    for name, spec, draft in (("ngram", "ngram", None), ("draft-model (itself)", "draft-model", model)):
        got_lps, shapes, stats = run(spec, draft)
        got = [[lp.token_id for lp in r] for r in got_lps]
        same = sum(a == b for x, y in zip(got, plain) for a, b in zip(x, y))
        verify = sum(1 for who, q in shapes if who == "target" and q > 1)
        catch_up = sum(1 for who, q in shapes if who == "draft" and q == 2)
        good = got == plain and verify > 0 and (spec == "ngram" or catch_up > 0)
        ok &= good
        print(f"lossless check {name:22s}: {'OK' if good else 'MISMATCH'} ({same}/{sum(map(len, plain))} tokens equal; "
              f"graph steps: verification {verify}, draft catch-up {catch_up}; "
              f"tokens per verification {stats['spec_mean_accepted_len']:.2f})", flush=True)
        for r, (x, y) in enumerate(zip(got, plain)):  # a divergence at a near-tie is rounding (TF32 dots), not a bug
            j = next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), None)
            if j is not None:
                top = plain_lps[r][j].top
                print(f"   request {r} diverges at token {j}: top-2 logprob gap there without speculation "
                      f"{top[0][1] - top[1][1]:.2e}, logprob of the token taken {got_lps[r][j].logprob:.4f} vs "
                      f"{plain_lps[r][j].logprob:.4f}", flush=True)
    return ok


def parse_tau(items: list[str]) -> dict[str, dict[int, float]]:
    """--tau NAME:K=TAU,K=TAU (NAME starts with the drafter: self-int4... or ngram...)."""
    out = {}
    for item in items:
        name, _, pairs = item.partition(":")
        out[name] = {int(k): float(v) for k, v in (p.split("=") for p in pairs.split(","))}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ks", default="2,4,6")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--num-kv-blocks", type=int, default=512)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--tau", action="append", default=[], help="NAME:K=TAU,... from spec_decode_acceptance.py")
    ap.add_argument("--check-only", action="store_true", help="run only the lossless check")
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip the lossless check")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    if args.check or args.check_only:
        ok = check_lossless(args.device)
        if args.check_only or not ok:
            return 0 if ok else 1
    ks = [int(k) for k in args.ks.split(",")]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    print(f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}  torch {torch.__version__}  "
          f"{args.shape} random weights {dtype}, context {args.prompt_len}, batch 1", flush=True)
    model = random_model(args.shape, args.device, dtype)
    t = time.perf_counter()
    int4 = quantized_copy(model, "int4")
    print(f"int4 self-draft built in {time.perf_counter() - t:.1f}s", flush=True)

    engine = make_engine(model, args, "draft-model", max(ks), int4)
    times = step_times(engine, args, ks)
    free(engine)
    print_step_times(times, ks)

    runs = {}
    engine = make_engine(model, args)
    runs["plain"] = decode_run(engine, args)
    free(engine)
    for name, spec, draft in (("ngram", "ngram", None), ("self-int4", "draft-model", int4)):
        for k in ks:
            engine = make_engine(model, args, spec, k, draft)
            runs[f"{name} k={k}"] = decode_run(engine, args)
            free(engine)
    print("\n| engine run (random weights) | tokens/s | ms per target forward | tokens per forward | acceptance |")
    print("|---|---|---|---|---|")
    for name, r in runs.items():
        print(f"| {name} | {r['tps']:.1f} | {1e3 * r['step']:.2f} | {r['tau']:.2f} | {r['acceptance']:.3f} |")
    print("\n(n-gram rows: the real speed-up at this random model's own acceptance on a repetitive prompt.)")

    taus = parse_tau(args.tau)
    if taus:
        print("\nestimated speed-up at batch 1 = tau (CPU, real weights) combined with GPU step times")
        print("| workload | k | tau | T_draft ms | kernel level: tau*T_dec/(T_ver+T_draft) | "
              "engine level: tau*T_eng_plain/T_eng(k) |")
        print("|---|---|---|---|---|---|")
        for name, per_k in taus.items():
            drafter = "self-int4" if name.startswith("self-int4") else "ngram"
            for k, tau in sorted(per_k.items()):
                if f"T_ver({k})" not in times:
                    continue
                t_draft = (times["T_dcatch"] + (k - 1) * times["T_dstep"]) if drafter == "self-int4" else times["T_ngram"]
                kernel = tau * times["T_dec"] / (times[f"T_ver({k})"] + t_draft)
                engine_level = tau * runs["plain"]["step"] / runs[f"{drafter} k={k}"]["step"]
                print(f"| {name} | {k} | {tau:.2f} | {1e3 * t_draft:.2f} | {kernel:.2f}x | {engine_level:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
