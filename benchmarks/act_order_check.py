"""Act-order GPTQ (g_idx) weights on the GPU: the standard layout's g_idx kernels against the rows
sorted by group and x gathered (KernelWeight.grouped_by_permutation and fused.gather_columns: what
fitllm.quant.layers runs; the sorted rows tiled, 4 or 8 bits).
Correctness against float64 at the Llama-3-8B shapes; two decoder layers over a paged cache whose norms,
attention and gate_up write each GEMM's input order (model_check) against the same layers gathering;
then µs per layer (four linears, CUDA-graph replay of two weight copies) per M, bf16 cuBLAS in the same run.

  python3 benchmarks/act_order_check.py --out $OUT [--m 1,16,64,256,1024] [--bits 4|8]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.bench_gemm import GS, SHAPES, graph_time, log, rel_err  # noqa: E402
from fitllm.kernels.fused import gather_columns  # noqa: E402
from fitllm.kernels.w4a16 import w4a16_gemm_triton  # noqa: E402
from fitllm.kernels.w4a16_tiled import tile_pack, w4a16_tiled_triton  # noqa: E402
from fitllm.quant.formats.packing import KernelWeight, pack_dim0  # noqa: E402


def act_order_weight(K, N, dev, bits=4):
    q = torch.randint(0, 2 ** bits, (K, N), device=dev, dtype=torch.int32)
    g_idx = (torch.randperm(K, device=dev) // GS).to(torch.int32)
    kw = KernelWeight(pack_dim0(q, bits), (torch.rand(K // GS, N, device=dev) * 0.01 + 0.002).bfloat16(),
                      torch.randint(0, 2 ** bits, (K // GS, N), device=dev).bfloat16(), bits, GS, g_idx)
    plain = kw.grouped_by_permutation()
    return dict(kw=kw, plain=plain, qtile=tile_pack(plain.qweight, bits), perm=plain.perm,
                w16=torch.randn(N, K, device=dev).bfloat16() * 0.02)


def standard(x, w, out):
    kw = w["kw"]
    return w4a16_gemm_triton(x, kw.qweight, kw.scales, kw.zeros, GS, kw.bits, kw.g_idx, out=out)


def sorted_tiled(x, w, out, gather=gather_columns):
    """What fitllm.quant.layers runs: x gathered by the PDL kernel (gather=None: not gathered, timing);
    the rows sorted and tiled (4 or 8 bits)."""
    kw, x = w["kw"], gather(x, w["perm"]) if gather else x
    return w4a16_tiled_triton(x, w["qtile"], kw.scales, kw.zeros, GS, x.shape[1], out=out, bits=kw.bits)


@torch.no_grad()
def model_check(dev, bits: int = 4) -> dict:
    """Two Llama-3-8B layers with act-order int4 weights (gpu_engine_check.quantize_act_order) over a
    paged bf16 cache: the hidden states with the producers writing each GEMM's input order (the norms
    for qkv and gate_up, the attention kernels for o_proj, gate_up's permuted outputs for down_proj:
    CausalLM.fold_input_orders) equal, bit for bit, those with every layer gathering its own input
    (FITLLM_DETERMINISTIC=1: split-K sums in a fixed order), at M = 1, 16, 300 (one sequence: decode,
    then prefills); and stay near those of the same model with every quantized linear replaced by a
    dense one holding its dequantized weight (torch matmuls and attention: an independent reference)."""
    from benchmarks.gpu_engine_check import quantize_act_order
    from fitllm.kernels import fused
    from fitllm.models.config import ModelConfig
    from fitllm.models.decoder import ATTENTION_WRITES_ORDER_UP_TO, CausalLM
    from fitllm.models.kv_cache import AttentionMetadata, ForwardContext, NoCacheContext, PagedKVCache

    def paged(m):  # a fresh cache per forward
        cache = PagedKVCache(2, 20, 16, 8, 128, dtype=torch.bfloat16, device=dev, kv_dtype="bf16")
        return ForwardContext(cache, AttentionMetadata.build([m], [m], [list(range(20))], 16, dev))

    os.environ["FITLLM_DETERMINISTIC"] = "1"
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=1024, hidden_size=4096, intermediate_size=14336,
                      num_layers=2, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0)
    torch.manual_seed(0)
    model = CausalLM(cfg, dtype=torch.bfloat16, device=dev)
    for name, p in model.named_parameters():
        p.copy_(1 + torch.randn_like(p) * 0.1 if "norm" in name else torch.randn_like(p) * (1.0 if "embed" in name else 0.02))
    inputs = {m: (torch.randint(0, 1024, (m,), device=dev), torch.arange(m, device=dev)) for m in (1, 16, 300)}
    os.environ["FITLLM_ACT_ORDER_FOLD"] = "0"
    quantize_act_order(model, bits=bits)
    reference = dense_copy(model)
    dense = {m: reference(ids, pos, NoCacheContext([m])).double() for m, (ids, pos) in inputs.items()}
    del reference
    gathering = {m: model(ids, pos, paged(m)) for m, (ids, pos) in inputs.items()}
    del os.environ["FITLLM_ACT_ORDER_FOLD"]
    folded_layers = model.fold_input_orders()
    out = {"folded_layers": folded_layers, "equal": {}, "rel_err_vs_dequantized": {}, "gathers": {}}
    orig = fused.gather_columns

    def counted(x, idx):
        out["gathers"][x.shape[0]] = out["gathers"].get(x.shape[0], 0) + 1
        return orig(x, idx)

    fused.gather_columns = counted
    for m, (ids, pos) in inputs.items():
        out["gathers"][m] = 0
        got = model(ids, pos, paged(m))
        out["equal"][m] = bool(torch.equal(got, gathering[m]))
        out["rel_err_vs_dequantized"][m] = rel_err(got, dense[m])
    fused.gather_columns = orig
    # Steps longer than ATTENTION_WRITES_ORDER_UP_TO keep o_proj's own row gather: one per layer.
    expected = {m: 0 if m <= ATTENTION_WRITES_ORDER_UP_TO else cfg.num_layers for m in inputs}
    out["pass"] = (folded_layers == 2 and out["gathers"] == expected and all(out["equal"].values())
                   and max(out["rel_err_vs_dequantized"].values()) < 2e-2)
    del os.environ["FITLLM_DETERMINISTIC"]
    log(f"producers write the input order (2 layers, {folded_layers} down_proj folded, gathers by step length "
        f"{out['gathers']}, expected {expected}): "
        f"bit-equal to the layers "
        f"gathering: {out['equal']}; rel err vs the dequantized weights in torch "
        f"{ {m: round(e, 4) for m, e in out['rel_err_vs_dequantized'].items()} }: {'PASS' if out['pass'] else 'FAIL'}")
    return out


def dense_copy(model):
    """A copy of `model` (sharing its norms and embeddings) whose quantized linears are dense, holding
    their dequantized weights, and computed with torch."""
    from fitllm.quant.inplace import shared_copy
    from fitllm.serve.spec_decode import dense_linears

    twin = shared_copy(model)
    dense_linears(twin)
    return twin


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--m", default="1,16,64,256,1024")
    ap.add_argument("--bits", type=int, default=4, choices=[4, 8])
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(0)
    dev = "cuda"
    copies = [{n: act_order_weight(K, N, dev, a.bits) for n, (K, N) in SHAPES.items()} for _ in range(2)]
    worst = {"standard": 0.0, "sorted": 0.0}
    for M in (1, 3, 16, 33, 100, 300, 1000):
        for name, (K, N) in SHAPES.items():
            w = copies[0][name]
            x = torch.randn(M, K, device=dev).bfloat16()
            ref = x.double() @ w["kw"].dequantize(torch.float64).t()
            for key, fn in (("standard", standard), ("sorted", sorted_tiled)):
                y = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
                fn(x, w, y)
                worst[key] = max(worst[key], rel_err(y, ref))
    # the layer as the loader builds it on the GPU (QuantLinear.set_parts: sorted rows, tiled, perm)
    from fitllm.quant.formats.packing import TiledWeight
    from fitllm.quant.layers import QuantLinear

    worst["layer"] = 0.0
    for name, (K, N) in SHAPES.items():
        kw = copies[0][name]["kw"]
        layer = QuantLinear("model.layers.0.mlp.down_proj", K, [N], False, reader=None, dtype=torch.bfloat16,
                            device=dev)
        layer.set_parts([kw])
        assert isinstance(layer.parts[0], TiledWeight) and layer.parts[0].bits == a.bits, type(layer.parts[0])
        assert layer.parts[0].perm is not None and layer.parts[0].g_idx is None
        for M in (1, 33, 300):
            x = torch.randn(M, K, device=dev).bfloat16()
            worst["layer"] = max(worst["layer"], rel_err(layer(x), x.double() @ kw.dequantize(torch.float64).t()))
    ok = max(worst.values()) < 1e-2
    log(f"check vs float64: standard g_idx {worst['standard']:.2e}, sorted + tiled {worst['sorted']:.2e}, "
        f"the loaded layer {worst['layer']:.2e}: "
        f"{'PASS' if ok else 'FAIL'}")
    folds = model_check(dev, a.bits)
    ok = ok and folds["pass"]
    rows = []
    for M in [int(m) for m in a.m.split(",")]:
        xs = {K: torch.randn(M, K, device=dev).bfloat16() for K in (4096, 14336)}
        outs = {n: torch.empty(M, N, device=dev, dtype=torch.bfloat16) for n, (K, N) in SHAPES.items()}

        def layer_graph(fn):
            def run():
                for c in copies:
                    for name, (K, N) in SHAPES.items():
                        fn(xs[K], c[name], outs[name])
            return run
        row = {"M": M,
               "bf16": graph_time(layer_graph(lambda x, w, o: torch.mm(x, w["w16"].t(), out=o))),
               "standard_g_idx": graph_time(layer_graph(standard)),
               "sorted_tiled": graph_time(layer_graph(sorted_tiled)),
               "torch_gather": graph_time(layer_graph(lambda x, w, o: sorted_tiled(x, w, o,
                                                                                lambda x, i: x.index_select(1, i)))),
               "tiled_no_gather": graph_time(layer_graph(lambda x, w, o: sorted_tiled(x, w, o, gather=None)))}
        rows.append(row)
        log(" ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    print(f"\n{a.bits}-bit weights\n| M | bf16 cuBLAS | standard layout with g_idx | sorted rows, tiled, "
          "x gathered (PDL kernel) | the same, "
          "torch index_select | the same without the gather |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['M']} | {r['bf16']:.1f} | {r['standard_g_idx']:.1f} | **{r['sorted_tiled']:.1f}** | "
              f"{r['torch_gather']:.1f} | {r['tiled_no_gather']:.1f} |")
    json.dump({"device": torch.cuda.get_device_name(), "worst": worst, "folds": folds, "rows": rows},
              open(os.path.join(a.out, "act_order_check.json"), "w"), indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
