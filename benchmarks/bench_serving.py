"""Serving performance on one GPU (issue 10) and the memory model against the card (issue 8).

Self-contained: random weights at Llama-3-8B shapes (speed does not depend on their values), no
network, no files. Parts (pick with --parts):
  decode   batch-1 decode tokens/s, bf16 / AWQ-style int4 (RTN g128) / FP8 weights, bf16 and fp8 KV,
           beside HF transformers `generate` (bf16) measured in the same run
  offline  1000 requests x (128 prompt, 128 output) tokens, FP8 weights (and int4, bf16)
  profile  torch profiler over int4 batch-1 decode steps: where the time of a step goes
  online   an OpenAI server (in a subprocess) loaded at 4/16/64 req/s, ShareGPT-like lengths
  memory   emulated 12/16/24 GB cards: the engine sized by fitllm.budget, run under full load with
           the process capped at the card's size; predicted vs measured peak
Writes JSON beside the printed table when --out is given.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine_check import SHAPES, decode_speed, free, quantize_act_order, random_model, sync, throughput  # noqa: E402

from fitllm.quant.inplace import quantize_in_memory  # noqa: E402
from fitllm.serve.engine import EngineConfig, LLMEngine  # noqa: E402

RESULTS: dict = {}


def build(scheme: str, shape: str = "llama3-8b"):
    """A random model in `scheme`: bf16, int4 or fp8; int4+head / int4+head8 quantize the lm_head too
    (RTN, 4 / 8 bits); int4-act holds act-order GPTQ weights (gpu_engine_check.quantize_act_order),
    int4-act-gather the same with each layer gathering its own input (FITLLM_ACT_ORDER_FOLD=0, set
    here for the run of this model); int8-act 8-bit ones, int8-act-gidx those as stored (g_idx kernels)."""
    model = random_model(shape, "cuda", torch.bfloat16)
    base, _, head = scheme.partition("+")
    os.environ["FITLLM_ACT_ORDER_FOLD"] = "0" if base.endswith("-gather") else "1"
    if base.startswith(("int4-act", "int8-act")):
        quantize_act_order(model, bits=8 if base.startswith("int8") else 4, sort=not base.endswith("-gidx"))
    elif base != "bf16":
        quantize_in_memory(model, base, group_size=128,
                           lm_head_bits={"": None, "head": 4, "head8": 8}[head])
    gc.collect()
    torch.cuda.empty_cache()
    return model


def engine_for(model, tokenizer=None, **kw) -> LLMEngine:
    cfg = dict(device="cuda", max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=8192,
               gpu_memory_utilization=0.85)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), model=model, tokenizer=tokenizer)


def part_decode(args) -> None:
    rows = []
    for scheme in args.decode_schemes.split(","):
        model = build(scheme)
        for kv in args.decode_kv.split(","):
            engine = engine_for(model, kv_dtype=kv, max_num_seqs=8)
            tps = decode_speed(engine, 128, 256)
            synced = decode_speed(engine, 128, 256, sync_each_step=True)
            rows.append({"weights": scheme, "kv": kv, "tokens_per_s": tps, "ms_per_token": 1e3 / tps,
                         "tokens_per_s_sync_each_step": synced})
            print(f"decode b1  weights={scheme:5s} kv={kv:5s}  {tps:8.1f} tok/s  ({1e3 / tps:.2f} ms/token; "
                  f"synced after every step as before: {synced:.1f})", flush=True)
            free(engine)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    if args.hf_peer:
        rows.append({"weights": "bf16", "kv": "hf", "tokens_per_s": hf_generate_speed(), "peer": "transformers generate"})
        print(f"decode b1  HF transformers generate bf16: {rows[-1]['tokens_per_s']:.1f} tok/s", flush=True)
    RESULTS["decode"] = rows


def hf_generate_speed(new_tokens: int = 64) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab, hidden, inter, layers, heads, kv, head_dim, tied = SHAPES["llama3-8b"]
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                         tie_word_embeddings=tied, max_position_embeddings=8192)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        model = LlamaForCausalLM(config).eval()
        torch.set_default_dtype(torch.float32)
    ids = torch.randint(0, vocab, (1, 128), device="cuda")
    kw = dict(do_sample=False, min_new_tokens=new_tokens, max_new_tokens=new_tokens, pad_token_id=0)
    model.generate(ids, **{**kw, "min_new_tokens": 4, "max_new_tokens": 4})
    sync()
    t = time.perf_counter()
    model.generate(ids, **kw)
    sync()
    speed = new_tokens / (time.perf_counter() - t)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return speed


def part_offline(args) -> None:
    rows = []
    for scheme in args.offline_schemes.split(","):
        model = build(scheme)
        engine = engine_for(model, kv_dtype="auto", max_num_seqs=args.offline_max_seqs,
                            max_num_batched_tokens=args.offline_batched_tokens)
        throughput(engine, 32, 128, 16)  # warm-up: compile kernels for prefill shapes
        gen, total = throughput(engine, args.offline_requests, 128, 128)
        rows.append({"weights": scheme, "requests": args.offline_requests, "output_tokens_per_s": gen,
                     "total_tokens_per_s": total, "preemptions": engine.stats()["preemptions"],
                     "max_num_seqs": args.offline_max_seqs, "max_num_batched_tokens": args.offline_batched_tokens})
        print(f"offline    weights={scheme:5s} seqs={args.offline_max_seqs} {args.offline_requests} x (128 in, 128 out): "
              f"{gen:8.0f} output tok/s "
              f"({total:.0f} incl. prompt)", flush=True)
        free(engine)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    RESULTS["offline"] = rows


SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


def part_profile(args) -> None:
    """Batch-1 decode steps (--profile-scheme, int4): wall time per step (no profiler), then under the
    profiler the GPU time per step and the host calls that wait for the GPU (the engine's target: one)."""
    from fitllm.serve.sampling import SamplingParams

    model = build(args.profile_scheme)
    rows = []
    for sampling in args.profile_sampling.split(","):
        engine = engine_for(model, max_num_seqs=8, kv_dtype=args.profile_kv)
        print(f"profile kv={args.profile_kv}: cuda graphs {engine.cuda_graphs}, cache {type(engine.runner.cache).__name__}",
              flush=True)
        params = SamplingParams(max_tokens=400, ignore_eos=True, **({"temperature": 0.0} if sampling == "greedy" else
                                                                     {"temperature": 0.8, "top_p": 0.95, "seed": 1}))
        engine.add_request("p", list(range(100, 228)), params)
        for _ in range(8):  # prefill and warm-up
            engine.step()
        sync()
        t, n = time.perf_counter(), 100
        for _ in range(n):
            engine.step()
        sync()
        wall = (time.perf_counter() - t) / n
        steps = 20
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            sync()
        avg = prof.key_averages()
        # GPU time: the kernel/memcpy events themselves (as the profiler's own "Self CUDA time total").
        gpu = sum(e.self_device_time_total for e in avg
                  if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation) / steps
        waits = {e.key: e.count / steps for e in avg if e.key in SYNC_CALLS}
        row = {"sampling": sampling, "wall_ms_per_step": 1e3 * wall, "gpu_ms_per_step": gpu / 1e3,
               "host_waits_per_step": waits, "tokens_per_s": 1 / wall}
        rows.append(row)
        if sampling == "greedy":
            print(avg.table(sort_by="self_cuda_time_total", row_limit=15), flush=True)
            print(avg.table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
            row["by_cuda_time"] = avg.table(sort_by="self_cuda_time_total", row_limit=15)
            row["by_cpu_time"] = avg.table(sort_by="self_cpu_time_total", row_limit=12)
        free(engine)
    print(f"\n| {args.profile_scheme} batch 1 | wall ms/step | GPU ms/step | tok/s | host waits per step (profiler counts) |")
    print("|---|---|---|---|---|")
    for r in rows:
        waits = ", ".join(f"{k} {v:g}" for k, v in r["host_waits_per_step"].items()) or "none"
        print(f"| {r['sampling']} | {r['wall_ms_per_step']:.2f} | {r['gpu_ms_per_step']:.2f} | {r['tokens_per_s']:.0f} "
              f"| {waits} |", flush=True)
    RESULTS["profile"] = rows


def part_memory(args) -> None:
    from fitllm import budget
    from fitllm.kernels._utils import gpu_arch
    from fitllm.serve.sampling import SamplingParams

    rows = RESULTS["memory"] = []
    total = torch.cuda.mem_get_info()[1]
    # Run one (weights, kv) pair per process (--memory-configs int4:auto): an engine that failed to
    # start can leave memory referenced, and the next measurement would count it.
    for scheme, kv in (c.split(":") for c in args.memory_configs.split(",")):
        model = build(scheme)
        for card_gib in (12, 16, 24):
            card = card_gib * 2**30
            settings = budget.Settings(scheme="awq" if scheme == "int4" else "fp8",
                                       kv_dtype="bf16" if kv == "auto" else kv, max_model_len=4096,
                                       max_num_seqs=16, max_batched_tokens=2048, gpu_memory_utilization=0.9,
                                       gpu_arch=gpu_arch(torch.cuda.current_device()))
            predicted_full = budget.estimate(model.config, settings, card)
            if not predicted_full.fits:
                rows.append({"weights": scheme, "kv": kv, "card_gib": card_gib, "fits": False})
                print(f"memory {scheme}/{kv} on {card_gib} GB: does not fit (predicted)", flush=True)
                continue
            util = 0.9 * card / total  # the engine sizes itself from `total * util`: the emulated card
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(card / total)
            torch.cuda.reset_peak_memory_stats()
            row = {"weights": scheme, "kv": kv, "card_gib": card_gib,
                   "predicted_fits_seqs_at_4096": predicted_full.max_seqs_at(4096)}
            rows.append(row)
            try:
                engine = engine_for(model, kv_dtype=kv, max_model_len=4096, max_num_seqs=16,
                                    max_num_batched_tokens=2048, gpu_memory_utilization=util)
                blocks = engine.stats()["kv_blocks_total"]
                n = min(16, blocks * 16 // 4096)
                engine.generate([list(range(100, 100 + 4096 - 64))] * max(1, n),
                                SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
                sync()
                predicted = budget.estimate(model.config, settings, card, num_kv_blocks=blocks + 1)
                measured = torch.cuda.max_memory_allocated()
                row |= {"kv_blocks": blocks, "seqs_at_4096": n, "predicted_torch_peak": predicted.torch_peak,
                        "measured_torch_peak": measured, "error": (predicted.torch_peak - measured) / measured,
                        "oom": False}
                print(f"memory {scheme}/{kv} on {card_gib} GB: {blocks} blocks, {n} x 4096 tokens; torch peak "
                      f"predicted {predicted.torch_peak / 2**30:.2f} GiB, measured {measured / 2**30:.2f} GiB "
                      f"({row['error']:+.1%})", flush=True)
                free(engine)
            except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:
                import traceback

                where = traceback.format_exc().strip().splitlines()[-6:]
                row |= {"oom": isinstance(exc, torch.cuda.OutOfMemoryError), "error_text": str(exc)[:300],
                        "where": where, "allocated_at_error": torch.cuda.memory_allocated()}
                print(f"memory {scheme}/{kv} on {card_gib} GB: {exc.__class__.__name__}: {str(exc)[:160]}\n   "
                      + "\n   ".join(where[:4]), flush=True)
                del exc  # the traceback holds the half-built engine's tensors
            finally:
                gc.collect()
                torch.cuda.empty_cache()
                torch.cuda.set_per_process_memory_fraction(1.0)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    RESULTS["memory"] = rows


def serve_random(scheme: str, port: int, tokenizer_dir: Path) -> None:
    """A `quant serve` equivalent over a random Llama-3-8B-shaped model with the tokenizer's vocab."""
    import uvicorn

    from fitllm.models.tokenizer import load_tokenizer
    from fitllm.serve.app import ServerConfig, create_app

    SHAPES["llama3-8b-49k"] = (49152,) + SHAPES["llama3-8b"][1:]
    model = build(scheme, "llama3-8b-49k")
    engine = engine_for(model, max_num_seqs=128, max_model_len=4096, max_num_batched_tokens=4096,
                        tokenizer=load_tokenizer(tokenizer_dir))
    app = create_app(engine, ServerConfig(served_model_name="default", max_waiting=4096))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def part_online(args) -> None:
    """Poisson arrivals at 4/16/64 req/s, ShareGPT-like lognormal lengths, through HTTP."""
    import asyncio
    import subprocess
    import urllib.request

    from fitllm.serve.bench import make_workload, run_online

    rows = []
    for scheme in args.online_schemes.split(","):
        port = 8123
        server = subprocess.Popen([sys.executable, __file__, "--serve-random", scheme, "--port", str(port),
                                   "--tokenizer", str(args.tokenizer)])
        try:
            for _ in range(600):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                    break
                except OSError:
                    if server.poll() is not None:
                        raise RuntimeError("server exited")
                    time.sleep(0.5)
            for rate in (4.0, 16.0, 64.0):
                n = int(max(48, rate * 8))
                workload = make_workload(n, 220, 190, "sharegpt", vocab_size=49152, max_len=4096, seed=int(rate))
                summary = asyncio.run(run_online(f"http://127.0.0.1:{port}", workload, rate))
                rows.append({"weights": scheme, "rate": rate, "num_prompts": n} | summary)
                print(f"online {scheme:5s} {rate:4.0f} req/s ({n} prompts): TTFT p50 {summary['ttft_ms']['p50']:.0f} "
                      f"p99 {summary['ttft_ms']['p99']:.0f} ms | ITL p50 {summary['itl_ms']['p50']:.1f} "
                      f"p99 {summary['itl_ms']['p99']:.1f} ms | {summary['output_tokens_per_s']:.0f} out tok/s | "
                      f"errors {summary['errors']}", flush=True)
        finally:
            server.terminate()
            server.wait(timeout=60)
    RESULTS["online"] = rows


PARTS = {"decode": part_decode, "offline": part_offline, "profile": part_profile, "memory": part_memory,
         "online": part_online}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="decode,offline,profile,memory")
    ap.add_argument("--offline-requests", type=int, default=1000)
    ap.add_argument("--offline-schemes", default="fp8,int4,bf16")
    ap.add_argument("--offline-max-seqs", type=int, default=256, help="offline: the engine's max_num_seqs")
    ap.add_argument("--offline-batched-tokens", type=int, default=8192, help="offline: tokens per step")
    ap.add_argument("--decode-schemes", default="bf16,int4,fp8",
                    help="weights: bf16, int4, fp8, nf4 (bitsandbytes NF4 on fitllm.kernels.codebook4), int4-act (act-order GPTQ), int8-act, int8-act-gidx (as stored), "
                         "int4-act-gather (the same, each layer "
                         "gathering its input); int4+head / int4+head8 quantize the lm_head too (4 / 8 bits)")
    ap.add_argument("--online-schemes", default="bf16,int4")
    ap.add_argument("--decode-kv", default="auto,fp8")
    ap.add_argument("--no-hf-peer", dest="hf_peer", action="store_false")
    ap.add_argument("--memory-configs", default="int4:auto,int4:fp8,fp8:auto,fp8:fp8")
    ap.add_argument("--profile-sampling", default="greedy,top_p", help="profile: greedy and/or top_p (T=0.8)")
    ap.add_argument("--profile-kv", default="auto", help="profile: the KV cache dtype")
    ap.add_argument("--profile-scheme", default="int4", help="profile: the weights (as --decode-schemes)")
    ap.add_argument("--tag", default="", help="suffix of the JSON file name")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tokenizer", type=Path, default=Path(".gpu_assets/tokenizer"))
    ap.add_argument("--serve-random", help="internal: run a server over a random model of this scheme")
    ap.add_argument("--port", type=int, default=8123)
    args = ap.parse_args()
    if args.serve_random:
        serve_random(args.serve_random, args.port, args.tokenizer)
        return 0
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    for part in args.parts.split(","):
        t = time.perf_counter()
        try:
            PARTS[part](args)
        except Exception as exc:  # one part failing must not lose the others' numbers
            print(f"PART {part} FAILED: {exc.__class__.__name__}: {exc}", flush=True)
            RESULTS[f"{part}_error"] = repr(exc)
        print(f"-- {part} took {time.perf_counter() - t:.0f}s", flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"bench_serving{args.tag}.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
