"""Quantize the embedded model with every fitllm method and with the peers (llm-compressor,
GPTQModel), and measure WikiText-2 perplexity, time and peak memory, one subprocess per method
(so peak RSS is per method).

    python benchmarks/quant_peers.py [--windows 24] [--group-size 64] [--calib FILE] [--only rtn-asym,awq]
        [--peer-python VENV/bin/python] [--gptqmodel-python VENV/bin/python]

Every row uses the same calibration token ids (fitllm's loader, written to WORKDIR/calib_ids.pt and
handed to the peers) and the same windows. Perplexity: the first N non-overlapping 1024-token
windows of wiki.test.raw, fp32, fitllm's decoder reading each saved checkpoint (so the peers'
rows also check that fitllm reads their formats). `--hf-check NAME` also evaluates that peer's
checkpoint with transformers in the peer venv. The peers live in their own venvs (llm-compressor
0.14 pins transformers <= 5.17, GPTQModel 7.7 wants >= 5.20): see benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

WIKI = Path("/work/shared/data/wikitext-2/wiki.test.raw")
CONFIGS = {  # name -> quantize_model kwargs
    "rtn-asym": dict(method="rtn", sym=False),
    "rtn-sym": dict(method="rtn", sym=True),
    "awq": dict(method="awq", sym=False),
    "gptq-asym": dict(method="gptq", sym=False),  # defaults: act-order (static groups in
    "gptq-sym": dict(method="gptq", sym=True),  # compressed-tensors), MSE-clipped grids, damp 0.3
    "fp8": dict(method="fp8"),
    "nf4": dict(method="nf4"),  # bitsandbytes NF4, blocks of 64 (its default), data-free
    "gptq-asym-gptqfmt": dict(method="gptq", sym=False, fmt="gptq"),  # the GPTQ v1 format (zero >= 1)
    "gptq-asym-gptqfmt+head": dict(method="gptq", sym=False, fmt="gptq", lm_head_bits=4),  # --quantize-lm-head
    "gptq-asym-gptqfmt+head8": dict(method="gptq", sym=False, fmt="gptq", lm_head_bits=8),  # + --lm-head-bits 8
}


def windows(tokenizer, n: int, length: int = 1024) -> torch.Tensor:
    ids = torch.tensor(tokenizer(WIKI.read_text())["input_ids"], dtype=torch.long)
    return ids[: n * length].reshape(n, length)


@torch.inference_mode()
def perplexity(model, wins: torch.Tensor) -> float:
    from fitllm.quant.pipeline import CalibContext

    nll, count = 0.0, 0
    pos = torch.arange(wins.shape[1])
    for w in wins:
        hidden = model(w, pos, CalibContext(1, w.numel()))
        logits = model.compute_logits(hidden[:-1]).float()
        nll += F.cross_entropy(logits, w[1:], reduction="sum").item()
        count += w.numel() - 1
    return math.exp(nll / count)


def window_ppl(logp: torch.Tensor, w: torch.Tensor) -> float:
    """Perplexity of one window from its log-softmax [L, vocab] (runs in both venvs)."""
    return round(math.exp(-logp[:-1].gather(1, w[1:, None]).mean().item()), 3)


PEERS = {  # name -> the option naming the venv it runs in
    "llmc-gptq": "peer_python",  # llm-compressor 0.14 GPTQ int4 sym, its default act-order (static)
    "llmc-awq": "peer_python",  # llm-compressor 0.14 AWQ + int4 asym (min-max)
    "llmc-fp8": "peer_python",  # llm-compressor 0.14 FP8_DYNAMIC
    "gptqmodel-gptq": "gptqmodel_python",  # GPTQModel 7.7 GPTQ int4 sym, its defaults
    "gptqmodel-dynamic": "gptqmodel_python",  # + per-module `dynamic` rules (GPTQMODEL below)
    "gptqmodel-head": "gptqmodel_python",  # + lm_head=True (its default head rule: 8-bit g32)
    "bnb-nf4": "peer_python",  # transformers + bitsandbytes NF4 (blocks of 64); fitllm's own venv has both
}
# GPTQModel rows -> QuantizeConfig kwargs on top of bits=4, --group-size, sym. The `dynamic` rules exercise
# each kind: `-:` leaves modules dense, `+:` / a bare regex override bits, group_size, sym, desc_act; the first
# matching rule wins (layer 1's down_proj takes 8 bits, not the later group-size rule).
GPTQMODEL = {
    "gptqmodel-gptq": {},
    "gptqmodel-dynamic": {"dynamic": {
        r"-:^model\.layers\.0\.self_attn\.": {},
        r"+:^model\.layers\.(1|2)\.mlp\.down_proj$": {"bits": 8},
        r"+:^model\.layers\.[13]\.mlp\.": {"group_size": 32},
        r"^model\.layers\.4\.self_attn\.[qkv]_proj$": {"sym": False, "desc_act": True},
        r"+:^model\.layers\.5\.mlp\.down_proj$": {"bits": 8, "group_size": 128, "sym": False},
        r"-:^model\.layers\.29\.mlp\.": {},
    }},
    "gptqmodel-head": {"lm_head": True},
}


def run_one(name: str, args) -> dict:
    from fitllm.models.loader import load_model
    from fitllm.quant.layers import load_quantized_model
    from fitllm.quant.pipeline import CalibContext, quantize_model

    wins = torch.load(Path(args.workdir) / "windows.pt")
    row = {"name": name}
    out = Path(args.workdir) / name
    if name == "base":
        model = load_model(Path(args.base), "cpu", torch.float32)
    elif name in PEERS:
        if not (args.reuse and (out / "config.json").exists()):
            row.update(peer_subprocess(name, args, "--peer"))
        model = load_quantized_model(out, "cpu", torch.float32)
    else:
        t0, c0 = time.time(), time.process_time()
        r = quantize_model(Path(args.base), out, group_size=args.group_size, calib=args.calib,
                           calib_samples=args.calib_samples, calib_len=args.calib_len, force=True, progress=False,
                           log=lambda s: None, **CONFIGS[name])
        row.update(seconds=round(time.time() - t0, 1), cpu_seconds=round(time.process_time() - c0, 1),
                   peak_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
                   mean_layer_err=round(sum(r.layer_errors) / len(r.layer_errors), 4), note=r.group_note)
        model = load_quantized_model(out, "cpu", torch.float32)
    row["ppl"] = round(perplexity(model, wins), 3)
    if name in (args.hf_check or "").split(","):
        row.update(peer_subprocess(name, args, "--hf-eval"))
        peer_logp = Path(args.workdir) / f"{name}.logp0.pt"  # the peer's log-softmax on window 0
        if peer_logp.exists():
            with torch.inference_mode():
                w = wins[0]
                ours = F.log_softmax(model.compute_logits(model(w, torch.arange(w.numel()), CalibContext(1, w.numel()))).float(), -1)
            row["max_dlogp"] = round((ours - torch.load(peer_logp)).abs().max().item(), 5)
            row["max_dlogp_bf16_kernel"] = round((ours - torch.load(Path(args.workdir) / f"{name}.logp0-bf16.pt")).abs().max().item(), 4)
            row["ppl_w0"] = window_ppl(ours, w)
    return row


def peer_subprocess(name: str, args, mode: str) -> dict:
    """Run `mode` for peer `name` in its own venv; returns the dict it printed."""
    python = getattr(args, PEERS[name])
    if not python:
        raise SystemExit(f"{name}: pass --{PEERS[name].replace('_', '-')} (the venv it is installed in)")
    cmd = [python, __file__, mode, name, "--base", args.base, "--workdir", args.workdir,
           "--group-size", str(args.group_size)] + (["--parallel"] if args.parallel else [])
    log = Path(args.workdir) / f"{name}{mode}.log"  # the peer's progress, to follow a long run
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True)
    line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{name} {mode} failed:\n{p.stdout[-3000:]}\n{log.read_text()[-5000:]}")
    return json.loads(line[7:])


# --- run inside the peers' venvs: torch, transformers and the peer only, no fitllm ---

def peer_quantize(name: str, args) -> dict:
    ids = torch.load(Path(args.workdir) / "calib_ids.pt")
    out = Path(args.workdir) / name
    t0, c0 = time.time(), time.process_time()
    if name in GPTQMODEL:
        quantize_gptqmodel(args.base, ids, out, args.group_size, **GPTQMODEL[name])
    elif name == "bnb-nf4":
        quantize_bitsandbytes(args.base, out)
    else:
        quantize_llmcompressor(name, args.base, ids, out, args.group_size)
    return dict(seconds=round(time.time() - t0, 1), cpu_seconds=round(time.process_time() - c0, 1),
                peak_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2))


def quantize_bitsandbytes(base: str, out: Path) -> None:
    """transformers' own bitsandbytes NF4 (data-free: no calibration ids), saved as it saves it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=config, device_map="cpu", dtype=torch.float32)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)


def quantize_llmcompressor(name: str, base: str, ids: torch.Tensor, out: Path, group: int) -> None:
    import datasets
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.pipelines.cache import IntermediatesCache
    from transformers import AutoModelForCausalLM, AutoTokenizer

    IntermediatesCache.pin_memory = lambda self, *a, **k: None  # AWQ pins on CPU, which needs an accelerator

    def int4(sym: bool) -> dict:
        weights = QuantizationArgs(num_bits=4, type="int", symmetric=sym, strategy="group", group_size=group)
        return {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}

    recipe = {"llmc-gptq": [GPTQModifier(config_groups=int4(True), ignore=["lm_head"])],
              "llmc-awq": [AWQModifier(), QuantizationModifier(config_groups=int4(False), ignore=["lm_head"])],
              "llmc-fp8": [QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])]}[name]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    oneshot(model=model, dataset=data, recipe=recipe, num_calibration_samples=len(ids),
            max_seq_length=ids.shape[1], shuffle_calibration_samples=False)
    model.save_pretrained(out, save_compressed=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)


def quantize_gptqmodel(base: str, ids: torch.Tensor, out: Path, group: int, **qc) -> None:
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    from gptqmodel import GPTQModel, QuantizeConfig

    if qc.get("lm_head") and json.loads((Path(base) / "config.json").read_text()).get("tie_word_embeddings"):
        base = untie(base, out.parent / "base-untied")  # GPTQModel refuses to quantize a tied lm_head
    model = GPTQModel.load(base, QuantizeConfig(bits=4, group_size=group, sym=True, **qc))
    model.quantize([{"input_ids": row, "attention_mask": [1] * len(row)} for row in ids.tolist()])
    model.save(str(out))


def untie(base: str, folder: Path) -> str:
    """A copy of `base` whose lm_head is its own tensor (config tie_word_embeddings false)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    return str(folder)


@torch.inference_mode()
def hf_perplexity(name: str, args) -> dict:
    """The peer checkpoint evaluated by its own stack, same windows: transformers (decompressed on
    load), or GPTQModel's own loader and CPU kernels for its checkpoints (then window 0's
    log-softmax is saved too, for run_one to compare with fitllm's)."""
    path = Path(args.workdir) / name
    wins = torch.load(Path(args.workdir) / "windows.pt")

    def ppl(model, save_logp=None, n=None) -> float:
        nll, count = 0.0, 0
        for i, w in enumerate(wins[:n]):
            logits = model(input_ids=w[None]).logits[0].float()
            if i == 0 and save_logp:
                torch.save(F.log_softmax(logits, -1), save_logp)
            nll += F.cross_entropy(logits[:-1], w[1:], reduction="sum").item()
            count += w.numel() - 1
        return round(math.exp(nll / count), 3)

    if not name.startswith("gptqmodel"):
        from transformers import AutoModelForCausalLM

        device_map = {"device_map": "cpu"} if name == "bnb-nf4" else {}  # bitsandbytes places its weights at load
        return {"hf_ppl": ppl(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **device_map).eval())}
    from gptqmodel import GPTQModel
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear

    # GPTQModel's torch kernel (its CPU default, torch_fused, takes 4-bit modules only) runs fp16/bf16
    # only, and slowly on a CPU: its own forward in bf16 on window 0, then every module dequantized by
    # GPTQModel in fp32 and an fp32 forward on all windows (window 0's log-softmax saved for run_one). Its
    # bf16 load has rounded the fp16 scales to bf16, so this forward is close to fitllm's, not equal.
    model = GPTQModel.load(str(path), device="cpu", dtype=torch.bfloat16, backend="torch").model.eval()
    bf16 = Path(args.workdir) / f"{name}.logp0-bf16.pt"
    if bf16.exists() and bf16.stat().st_mtime > (path / "model.safetensors").stat().st_mtime:  # minutes on a CPU
        logp = torch.load(bf16)
        out = {"gptqmodel_bf16_ppl_w0": window_ppl(logp, wins[0])}
    else:
        out = {"gptqmodel_bf16_ppl_w0": ppl(model, bf16, n=1)}
    for mod_name, mod in list(model.named_modules()):
        if isinstance(mod, BaseQuantLinear):
            mod.scales = mod.scales.float()
            w = mod.dequantize_weight().float()  # [in, out]: its forward computes x @ w
            assert w.shape == (mod.in_features, mod.out_features), (mod_name, w.shape)
            w = w.t()
            dense = torch.nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
            dense.weight.data.copy_(w)
            if mod.bias is not None:
                dense.bias.data.copy_(mod.bias.float())
            parent, _, child = mod_name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, dense)
    out["hf_ppl"] = ppl(model.float(), Path(args.workdir) / f"{name}.logp0.pt")
    return out


def make_calib_text(path: Path) -> None:
    """Calibration text that is neither WikiText nor network-fetched, rebuilt the same way on any
    machine with this venv: the license files of the installed packages, then the docstrings of the
    standard library's modules, sorted by name (the kind of text the issue's peers were calibrated on)."""
    import ast
    import site
    import sysconfig

    parts = []
    for sp in sorted(site.getsitepackages()):
        for lic in sorted(Path(sp).glob("*.dist-info/licenses/**/*")) + sorted(Path(sp).glob("*.dist-info/LICENSE*")):
            if lic.is_file() and lic.stat().st_size < 200_000:
                parts.append(lic.read_text(errors="replace"))
    for py in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in py.parts or "site-packages" in py.parts:
            continue
        try:
            tree = ast.parse(py.read_text(errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    parts.append(doc)
    path.write_text("\n\n".join(parts))
    print(f"{path}: {len(parts)} texts, {path.stat().st_size / 1e6:.1f} MB")


GREEDY_PROMPT, GREEDY_NEW = 64, 32  # the first 64 tokens of window 0, then 32 greedy tokens


def greedy_prompt(args) -> list[int]:
    return torch.load(Path(args.workdir) / "windows.pt")[0][:GREEDY_PROMPT].tolist()


def greedy_check(names: list[str], args) -> list[dict]:
    """fitllm's greedy tokens on each peer checkpoint against the peer stack's own (transformers,
    or GPTQModel for its checkpoint), fp32 on the CPU, same prompt."""
    from fitllm.models.generate import generate
    from fitllm.quant.layers import load_quantized_model

    from fitllm.quant.pipeline import CalibContext

    rows = []
    prompt = greedy_prompt(args)
    for name in names:
        model = load_quantized_model(Path(args.workdir) / name, "cpu", torch.float32)
        ours = generate(model, [prompt], GREEDY_NEW)[0]
        peer = peer_subprocess(name, args, "--hf-greedy")
        theirs = peer["tokens"]
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
        # Teacher-forced: fitllm's argmax after each prefix of the peer's own output (one prefill, no
        # cache). W8A8 rounds activations per token, so a cached decode and a prefill can flip an
        # e4m3 rounding and then a close argmax; this compares the functions without that noise.
        seq = torch.tensor(prompt + theirs)
        with torch.inference_mode():
            logits = model.compute_logits(model(seq, torch.arange(len(seq)), CalibContext(1, len(seq)))).float()
        forced = logits[len(prompt) - 1:-1].argmax(-1).tolist()
        agree = sum(a == b for a, b in zip(forced, peer["forced"]))
        rows.append(dict(name=name, identical_prefix=same, teacher_forced_agree=agree, of=len(ours), fitllm=ours,
                         peer=theirs))
        print(f"greedy {name}: {same}/{len(ours)} tokens identical before the first difference; teacher-forced "
              f"argmax (both stacks, one forward over the peer's sequence) agrees on {agree}/{len(theirs)}", flush=True)
    return rows


@torch.inference_mode()
def hf_greedy(name: str, args) -> dict:
    """(peer venv) Greedy tokens of the peer checkpoint through the peer's own stack."""
    path = Path(args.workdir) / name
    ids = torch.tensor([greedy_prompt(args)])
    if name.startswith("gptqmodel"):
        from gptqmodel import GPTQModel

        model = GPTQModel.load(str(path), device="cpu")
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=GREEDY_NEW, min_new_tokens=GREEDY_NEW)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=GREEDY_NEW,
                             min_new_tokens=GREEDY_NEW)
    tokens = out[0, ids.shape[1]:].tolist()
    full = torch.tensor([greedy_prompt(args) + tokens])  # one forward over prompt + output: argmax per position
    logits = model(input_ids=full).logits[0] if not name.startswith("gptqmodel") else model.model(input_ids=full).logits[0]
    return {"tokens": tokens, "forced": logits[ids.shape[1] - 1:-1].argmax(-1).tolist()}


def prepare(args) -> None:
    """Calibration ids and evaluation windows, written once and read by every row."""
    from fitllm.models.tokenizer import load_tokenizer
    from fitllm.quant.calibration import load_calibration

    tok = load_tokenizer(Path(args.base))
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    ids = load_calibration(Path(args.base), tok, args.calib_samples, args.calib_len, args.calib)
    for fname, t in (("calib_ids.pt", ids), ("windows.pt", windows(tok, args.windows))):
        tmp = Path(args.workdir) / f".{fname}.{os.getpid()}"
        torch.save(t, tmp)
        os.replace(tmp, Path(args.workdir) / fname)  # atomic: other runs may share the workdir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--calib", default=None)
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--workdir", default="/tmp/fitllm-quant-bench")
    ap.add_argument("--only", default=None, help="comma-separated: base," + ",".join([*CONFIGS, *PEERS]))
    ap.add_argument("--parallel", action="store_true", help="one process per method at once, 1 thread each")
    ap.add_argument("--peer-python", default=None, help="python of the venv with llm-compressor")
    ap.add_argument("--gptqmodel-python", default=None, help="python of the venv with GPTQModel")
    ap.add_argument("--hf-check", default=None, help="peers whose checkpoints their own stack also evaluates")
    ap.add_argument("--reuse", action="store_true", help="peer rows: evaluate the checkpoint already in --workdir")
    ap.add_argument("--base", default=None, help="model folder (default: the embedded model)")
    ap.add_argument("--make-calib", default=None, metavar="FILE", help="write the license/docstring calibration text and exit")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--peer", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--hf-eval", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--hf-greedy", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--greedy-check", default=None,
                    help="comma-separated peer rows already in --workdir: fitllm's greedy tokens vs the peer's")
    args = ap.parse_args()
    if args.make_calib:
        return make_calib_text(Path(args.make_calib))
    if args.parallel:
        torch.set_num_threads(1)
    if args.one or args.peer or args.hf_eval or args.hf_greedy:
        fn, name = ((run_one, args.one) if args.one else (peer_quantize, args.peer) if args.peer else
                    (hf_perplexity, args.hf_eval) if args.hf_eval else (hf_greedy, args.hf_greedy))
        print("RESULT " + json.dumps(fn(name, args)), flush=True)
        return
    if args.base is None:
        from fitllm.models.hub import resolve_model

        args.base = str(resolve_model(None))
    if args.greedy_check:
        rows = greedy_check(args.greedy_check.split(","), args)
        (Path(args.workdir) / "greedy_check.json").write_text(json.dumps(rows, indent=1))
        return
    prepare(args)
    names = args.only.split(",") if args.only else ["base", *CONFIGS] + [p for p in PEERS if getattr(args, PEERS[p])]
    procs = []
    for name in names:
        cmd = [sys.executable, __file__, "--one", name, *sys.argv[1:], "--base", args.base]
        procs.append((name, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        if not args.parallel:
            procs[-1] = (name, procs[-1][1].communicate())
    rows = []
    for name, p in procs:
        out, err = p if isinstance(p, tuple) else p.communicate()
        line = next((l for l in out.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            print(f"{name}: failed\n{err[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(line[7:]))
        print(json.dumps(rows[-1]), flush=True)
    print("\n| model | WikiText-2 ppl | time (s) | CPU time (s) | peak RSS (GiB) | mean layer err |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['ppl']:.3f} | {r.get('seconds', '-')} | {r.get('cpu_seconds', '-')} | "
              f"{r.get('peak_gib', '-')} | {r.get('mean_layer_err', '-')} |")


if __name__ == "__main__":
    main()
