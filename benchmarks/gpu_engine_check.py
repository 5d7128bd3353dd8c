"""GPU check of the serving engine: CUDA graphs must not change greedy output; speed at batch 1
and offline throughput. Self-contained: random weights at real shapes, no network, no files.

    python benchmarks/gpu_engine_check.py                      # llama3-8b and smollm2-135m shapes
    python benchmarks/gpu_engine_check.py --shapes smollm2-135m --max-model-len 1024

For each shape: a random-weight CausalLM (lm_head scaled so logits are peaked: with a flat random
distribution greedy would hinge on near-ties and rounding noise, which says nothing about the
engine), in float32 and in bfloat16 for the parity checks and bfloat16 for speed:
  1. parity: 16 mixed-length greedy requests, chunked prefill (budget 64) and prefix caching on,
     through an engine with CUDA graphs and one without; tokens must be identical. The eager
     engine is also checked against fitllm.models.generate (contiguous blocks, no scheduler).
     A mismatch prints where it diverged and the eager run's top-2 logprob gap there.
  2. speed: decode tokens/s of one request (prompt 128, 256 new tokens), graphs on and off.
  3. offline throughput: 256 requests (prompt 256, 128 new tokens), graphs on.
Exit status 1 if any parity check fails.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time

import torch

from fitllm.models.config import ModelConfig
from fitllm.models.decoder import CausalLM
from fitllm.models.generate import generate
from fitllm.serve.engine import EngineConfig, LLMEngine
from fitllm.serve.sampling import SamplingParams

SHAPES = {
    # vocab, hidden, intermediate, layers, heads, kv heads, head_dim, tied
    "llama3-8b": (128256, 4096, 14336, 32, 32, 8, 128, False),
    "smollm2-135m": (49152, 576, 1536, 30, 9, 3, 64, True),
    "tiny": (1024, 64, 128, 2, 4, 2, 16, False),  # for a dry run: --device cpu --shapes tiny
    "tiny-llama-heads": (1024, 256, 512, 4, 8, 2, 128, False),  # Llama-3's head_dim and GQA group, on a CPU
}


def random_model(shape: str, device: str, dtype: torch.dtype, seed: int = 0) -> CausalLM:
    vocab, hidden, inter, layers, heads, kv, head_dim, tied = SHAPES[shape]
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=hidden,
                         intermediate_size=inter, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                         head_dim=head_dim, rope_theta=500000.0, max_position_embeddings=8192,
                         tie_word_embeddings=tied, eos_token_ids=[])
    torch.manual_seed(seed)
    model = CausalLM(config, dtype=dtype, device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)  # tied: also the lm_head, logits std ~ sqrt(hidden)
            elif name.startswith("lm_head"):
                p.normal_(0.0, 0.5)  # peaked logits (std ~ 0.5 sqrt(hidden))
            else:
                p.normal_(0.0, 0.02)
    return model.eval()


@torch.no_grad()
def quantize_act_order(model: CausalLM, group_size: int = 128, seed: int = 0, bits: int = 4,
                       sort: bool = True) -> CausalLM:
    """Every dense linear (not a plain lm_head) as an act-order GPTQ checkpoint holds it: groups of
    `group_size` inputs in a random order, RTN in each at `bits`, g_idx naming each input's group.
    Installed as the GPU loader installs one (QuantLinear.set_parts: rows sorted by group and
    tiled), then CausalLM.fold_input_orders as load_tensors runs it (FITLLM_ACT_ORDER_FOLD=0: no
    fold). sort=False: installed as stored instead, g_idx and all (the path before the GPU sorted
    8-bit rows; A/B runs). In place."""
    from fitllm.models.linear import DenseLinear
    from fitllm.quant.formats.packing import KernelWeight, pack_dim0, to_kernel, unpack_dim0
    from fitllm.quant.layers import QuantLinear
    from fitllm.quant.rtn import rtn_quantize
    from fitllm.quant.scheme import QuantScheme

    gen = torch.Generator(device=model.device).manual_seed(seed)
    for name, lin in model.fused_linears().items():
        if not isinstance(lin, DenseLinear):
            continue
        K = lin.in_features
        size = min(group_size, K)  # (tiny test shapes)
        order = torch.randperm(K, generator=gen, device=model.device)  # input order[j] goes to group j // size
        kw = to_kernel(rtn_quantize(lin.weight[:, order], QuantScheme("rtn", bits=bits, group_size=size)), model.dtype)
        q = torch.empty(K, lin.out_features, dtype=torch.int32, device=model.device)
        q[order] = unpack_dim0(kw.qweight, bits)
        g_idx = torch.empty(K, dtype=torch.int32, device=model.device)
        g_idx[order] = (torch.arange(K, device=model.device) // size).to(torch.int32)
        quantized = QuantLinear(lin.prefix, K, lin.out_sizes, lin.bias is not None, reader=None, dtype=model.dtype,
                                device=model.device)
        stored = KernelWeight(pack_dim0(q, bits), kw.scales, kw.zeros, bits, size, g_idx)
        if sort:
            quantized.set_parts([stored])
        else:
            quantized.pending, quantized.parts = [], [stored]
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, quantized)
    model.fold_input_orders()
    return model


def make_engine(model: CausalLM, graphs: bool, args, **kw) -> LLMEngine:
    cfg = EngineConfig(device=args.device, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       cuda_graphs=graphs, gpu_memory_utilization=args.gpu_memory_utilization,
                       kv_dtype=args.kv_dtype, block_size=args.block_size, **kw)
    t = time.perf_counter()
    engine = LLMEngine(cfg, model=model, tokenizer=None)
    s = engine.stats()
    print(f"    engine graphs={graphs}: {s['kv_blocks_total']} KV blocks of {s['kv_block_size']} ({args.kv_dtype}), "
          f"max_model_len {engine.max_model_len}, "
          f"cache {type(engine.runner.cache).__name__}, graphs captured {engine.cuda_graphs}, "
          f"{time.perf_counter() - t:.1f}s to start", flush=True)
    return engine


def free(engine: LLMEngine) -> None:
    engine.runner.graphs = engine.runner.cache = None
    del engine
    gc.collect()
    sync(empty_cache=True)


def sync(empty_cache: bool = False) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        if empty_cache:
            torch.cuda.empty_cache()


def parity_prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, vocab, (40,), generator=g).tolist()  # 2.5 blocks shared by half of them
    lens = [3, 17, 64, 100, 250, 31, 8, 129, 5, 77, 200, 16, 48, 1, 90, 300]
    out = []
    for i, n in enumerate(lens):
        tail = torch.randint(0, vocab, (n,), generator=g).tolist()
        out.append(shared + tail if i % 2 == 0 else tail)
    out[-1] = list(out[0])  # an exact duplicate
    return out


def compare(name: str, got: list[list[int]], want: list[list[int]], gaps=None) -> bool:
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    if not bad:
        print(f"    {name}: OK ({len(got)} requests, {sum(map(len, got))} tokens identical)", flush=True)
        return True
    for i in bad[:4]:
        at = next(j for j, (x, y) in enumerate(zip(got[i], want[i])) if x != y)
        gap = f", eager top-2 logprob gap there {gaps[i][at]:.4f}" if gaps else ""
        print(f"    {name}: request {i} diverges at token {at}{gap}", flush=True)
    print(f"    {name}: MISMATCH in {len(bad)}/{len(got)} requests", flush=True)
    return False


def run_parity(model: CausalLM, args) -> bool:
    prompts = parity_prompts(model.config.vocab_size)
    params = SamplingParams(max_tokens=args.parity_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    results, gaps = {}, None
    for graphs in (False, True):
        engine = make_engine(model, graphs, args, max_num_batched_tokens=64)
        outs = engine.generate(prompts, params)
        results[graphs] = [o.new_token_ids for o in outs]
        if not graphs:
            gaps = [[lp.top[0][1] - lp.top[1][1] for lp in o.logprobs] for o in outs]
            alone = [engine.generate([p], params)[0].new_token_ids for p in prompts[:3]]
        free(engine)
    ok = True
    if args.kv_dtype == "auto":  # generate() keeps K/V in the model's dtype
        ref = generate(model, prompts, args.parity_tokens)
        ok &= compare("engine eager == fitllm.models.generate", results[False], ref, gaps)
    ok &= compare("engine eager alone == in the batch", alone, results[False][:3], gaps)
    ok &= compare("engine CUDA graphs == eager", results[True], results[False], gaps)
    return ok


def decode_speed(engine: LLMEngine, prompt_len: int, new_tokens: int, sync_each_step: bool = False) -> float:
    """Batch-1 decode tokens/s as a client of the engine sees them: the rate at which step() returns
    tokens (each return has waited for its step's tokens; with look-ahead the next step is already
    queued then, as in the server's loop). sync_each_step=True also waits for that queued step
    before timing the return, which serialises the look-ahead with the host's work: the method of
    the sessions before the sixth, kept for comparison."""
    prompt = torch.randint(0, engine.model_config.vocab_size, (prompt_len,),
                           generator=torch.Generator().manual_seed(3)).tolist()
    engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(f"speed-{time.perf_counter_ns()}", prompt, params)
    times = []
    while engine.has_unfinished_requests():
        engine.step()
        if sync_each_step:
            sync()
        times.append(time.perf_counter())
    return (len(times) - 2) / (times[-1] - times[1])  # decode steps only (the first step is the prefill)


def throughput(engine: LLMEngine, n: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, engine.model_config.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(n)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    sync()
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    sync()
    dt = time.perf_counter() - t
    generated = sum(len(o.new_token_ids) for o in outs)
    return generated / dt, (generated + n * prompt_len) / dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama3-8b,smollm2-135m")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--parity-tokens", type=int, default=24)
    ap.add_argument("--parity-dtypes", default="float32,bfloat16",
                    help="float32 first: its rounding noise is far below any logit gap, so a mismatch is a bug")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--block-size", type=int, default=None, help="tokens per KV block [default: the engine's]")
    ap.add_argument("--kv-dtype", default="auto", help="the engines' KV cache dtype (fp8: calibrated on "
                    "self-generated text; the check against generate() is skipped)")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script's logic (no graphs)")
    ap.add_argument("--weights", default="dense", choices=["dense", "int4", "int4-act", "int8-act"],
                    help="int4: the parity models' linears as RTN int4 (g128); int4-act / int8-act: as act-order GPTQ "
                         "int4 / int8 (quantize_act_order). bfloat16 only, FITLLM_DETERMINISTIC=1 for bit-stable "
                         "split-K sums")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{name}  torch {torch.__version__}", flush=True)
    all_ok = True
    for shape in args.shapes.split(","):
        for dtype_name in args.parity_dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            print(f"== {shape} (random weights, {dtype_name}): parity", flush=True)
            model = random_model(shape, args.device, dtype)
            if args.weights in ("int4-act", "int8-act"):
                quantize_act_order(model, bits=8 if args.weights == "int8-act" else 4)
            elif args.weights == "int4":
                from fitllm.quant.inplace import quantize_in_memory

                quantize_in_memory(model, "int4", group_size=128)
            all_ok &= run_parity(model, args)
            del model
            gc.collect()
            sync(empty_cache=True)
        if not args.skip_speed:
            print(f"== {shape} (random weights, bfloat16): speed", flush=True)
            model = random_model(shape, args.device, torch.bfloat16)
            for graphs in (False, True):
                engine = make_engine(model, graphs, args)
                print(f"    batch 1 decode, graphs={graphs}: {decode_speed(engine, 128, 256):.1f} tokens/s", flush=True)
                if graphs:
                    gen, total = throughput(engine, 256, 256, 128)
                    print(f"    offline 256 x (256 in, 128 out), graphs=True: {gen:.0f} generated tokens/s "
                          f"({total:.0f} tokens/s incl. prompts), preemptions {engine.stats()['preemptions']}",
                          flush=True)
                free(engine)
            del model
            gc.collect()
            sync(empty_cache=True)
    print("ALL PARITY CHECKS PASSED" if all_ok else "PARITY FAILURES (see above)", flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
