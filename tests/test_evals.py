"""Evals: numbers agree with an independent transformers computation; the CLI writes its reports.

Real data comes from ../shared/data (skipped when absent); sizes are tiny because a 2-core CPU
runs the 135M-parameter embedded model at a few hundred tokens per second.
"""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from fitllm.evals import EvalSettings, ModelSpec, parse_spec, run_ab, write_report
from fitllm.evals.data import load_arc, load_hellaswag, load_lambada, load_piqa, load_text
from fitllm.evals.runner import EvalError, LoadedModel, Scorer
from fitllm.evals.stats import mean_stat, paired_diff_ci
from fitllm.evals.tasks import generation_agreement, make_windows, multiple_choice, perplexity


@pytest.fixture(scope="module")
def hf_model(embedded_folder):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(embedded_folder), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def loaded(embedded_model, embedded_tokenizer, embedded_folder):
    return LoadedModel(embedded_model, embedded_tokenizer, embedded_folder, "dense")


# ---- pure functions --------------------------------------------------------------------------

def test_windows_score_every_token_once():
    for n, ctx, stride in [(100, 32, None), (100, 32, 16), (33, 32, None), (5, 32, 8)]:
        wins = make_windows(n, ctx, stride)
        scored = [t for _, e, f in wins for t in range(f, e)]
        assert len(scored) == len(set(scored))
        assert all(e - b <= ctx and b < f for b, e, f in wins)
        if stride:  # sliding: every token but the first is scored, each with >= ctx - stride context
            assert scored == list(range(1, n))
            assert all(f - b >= min(ctx - stride, f - 1) for b, _, f in wins)


def test_spec_parsing(tmp_path):
    base = parse_spec(None)
    assert base.path is None and base.kv_dtype == "auto"
    v = parse_spec("@kv=fp8", base)
    assert v.path is None and v.kv_dtype == "fp8" and v.name == "embedded@kv=fp8"
    assert parse_spec("base@kv=int4", base).kv_dtype == "int4"
    q = parse_spec("@quant=nf4,kv=fp8", base)
    assert (q.quantization, q.kv_dtype, q.name) == ("nf4", "fp8", "embedded@quant=nf4,kv=fp8")
    with pytest.raises(EvalError, match="quant 'nf3'"):
        parse_spec("@quant=nf3", base)
    (tmp_path / "awq").mkdir()
    (tmp_path / "awq" / "config.json").write_text("{}")
    assert parse_spec(str(tmp_path / "awq"), base, default_kv="int8").kv_dtype == "int8"
    assert parse_spec("org/some-model", base).path == "org/some-model"  # a hub id, fetched when loaded
    with pytest.raises(EvalError):
        parse_spec("@kv=fp4", base)
    with pytest.raises(EvalError):
        parse_spec("@kv=fp8")  # no base to refer to
    # bad paths fail while parsing, before the base is evaluated
    with pytest.raises(EvalError, match="no such file or folder"):
        parse_spec("/nonexistent/awq", base)
    with pytest.raises(EvalError, match="not a Hugging Face model folder"):
        parse_spec(str(tmp_path), base)


def test_paired_bootstrap_ci():
    rng = np.random.default_rng(1)
    a = (rng.random(400) < 0.5).astype(float)
    b = a.copy()
    b[:40] = 1 - b[:40]  # flip 10% of answers
    d = paired_diff_ci(mean_stat(a), mean_stat(b), len(a))
    assert d["lo"] <= d["diff"] <= d["hi"]
    same = paired_diff_ci(mean_stat(a), mean_stat(a), len(a))
    assert same["diff"] == same["lo"] == same["hi"] == 0.0  # pairing: identical models, zero-width CI


def test_generation_agreement():
    prefix, exact = generation_agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]])
    assert prefix.tolist() == [0.5, 1.0] and exact.tolist() == [0.0, 1.0]


def test_loaders(shared_data):
    hs = load_hellaswag(shared_data / "hellaswag" / "hellaswag_val_full.txt")
    assert len(hs) == 10042 and all(len(e.choices) == 4 for e in hs)
    assert [sum(e.gold == k for e in hs) for k in range(4)] == [2515, 2485, 2584, 2458]
    arc = load_arc(shared_data / "arc" / "arc_challenge_test.llmfoundry.jsonl")
    assert len(arc) == 1172 and arc[0].context.startswith("Question: ") and arc[0].context.endswith("\nAnswer:")
    piqa = load_piqa(shared_data / "piqa" / "valid.jsonl")
    assert len(piqa) == 1838 and {e.gold for e in piqa} == {0, 1}
    lam = load_lambada(shared_data / "lambada" / "lambada_test.jsonl")
    assert len(lam) == 5153 and all(t.startswith(" ") and " " not in t[1:] for _, t in lam)
    assert len(load_text(shared_data / "wikitext-2" / "wiki.test.raw")) > 1_000_000


def test_quantized_kv_variant_is_measured(tmp_path):
    """A `@kv=` candidate really runs on the quantized cache: KL vs the fp32 cache is small but > 0."""
    from fitllm.models.loader import load_model
    from fitllm.evals.runner import cache_kwargs
    from tiny_models import write_tiny_model

    write_tiny_model("llama", tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    lm = LoadedModel(model, None, tmp_path, "dense")
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    windows = make_windows(len(ids), 64)
    base = perplexity(Scorer(model), ids, windows, keep_tokens=10_000)
    for kv in ("int8", "fp8"):
        calib = [ids[:150], ids[150:]]  # explicit statistics: the data-free default is slow on a CPU
        res = perplexity(Scorer(model, cache_kwargs(lm, kv, calib)), ids, windows, reference=base)
        kl = res.kl.sum() / res.kl_tokens.sum()
        assert 0 < kl < 0.05, (kv, kl)
        assert abs(res.ppl - base.ppl) / base.ppl < 0.05


# ---- agreement with transformers -------------------------------------------------------------

@pytest.mark.slow
def test_perplexity_matches_transformers(shared_data, loaded, hf_model):
    text = load_text(shared_data / "wikitext-2" / "wiki.test.raw")[:20000]
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    for stride in (None, 24):  # non-overlapping and sliding windows
        windows = make_windows(len(ids), 48, stride)[:3]
        ours = perplexity(Scorer(loaded.model, max_batch_tokens=256), ids, windows).ppl
        nll, count = 0.0, 0
        with torch.inference_mode():
            for b, e, f in windows:
                logits = hf_model(input_ids=torch.tensor([ids[b:e]])).logits[0].float()
                lp = torch.log_softmax(logits[f - b - 1: e - b - 1], -1)
                nll -= lp.gather(1, torch.tensor(ids[f:e])[:, None]).sum().item()
                count += e - f
        ref = float(np.exp(nll / count))
        assert abs(ours - ref) / ref < 1e-3, (stride, ours, ref)


@pytest.mark.slow
def test_multiple_choice_matches_transformers(shared_data, loaded, hf_model):
    tok = loaded.tokenizer
    examples = (load_arc(shared_data / "arc" / "arc_easy_test.llmfoundry.jsonl")[:2]
                + load_hellaswag(shared_data / "hellaswag" / "hellaswag_val_full.txt")[:1]
                + load_piqa(shared_data / "piqa" / "valid.jsonl")[:1])
    ours = multiple_choice(Scorer(loaded.model, max_batch_tokens=512), tok, examples, max_len=2048)
    acc, acc_norm = [], []
    with torch.inference_mode():
        for ex in examples:
            lls = []
            for choice in ex.choices:  # independent scoring: one full forward per choice
                ctx = tok(ex.context, add_special_tokens=False).input_ids
                whole = tok(ex.context + " " + choice, add_special_tokens=False).input_ids
                logits = hf_model(input_ids=torch.tensor([whole])).logits[0].float()
                lp = torch.log_softmax(logits[len(ctx) - 1: len(whole) - 1], -1)
                lls.append(lp.gather(1, torch.tensor(whole[len(ctx):])[:, None]).sum().item())
            lls = np.array(lls)
            acc.append(float(np.argmax(lls) == ex.gold))
            acc_norm.append(float(np.argmax(lls / np.array([len(c) for c in ex.choices])) == ex.gold))
            np.testing.assert_allclose(ours.lls[len(acc) - 1], lls, rtol=1e-4, atol=1e-3)
    assert ours.acc.tolist() == acc and ours.acc_norm.tolist() == acc_norm


# ---- the A/B run and the CLI -----------------------------------------------------------------

def _fake_quant_model(model, bits=4, group=64):
    """A candidate with real quantization error: round-to-nearest int4 of every linear, in place
    on a copy (stands in for a converted checkpoint without writing one to disk)."""
    import copy

    cand = copy.deepcopy(model)
    for m in cand.fused_linears().values():
        w = m.weight.data
        g = w.reshape(w.shape[0], -1, group)
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = (hi - lo).clamp_min(1e-8) / (2 ** bits - 1)
        m.weight.data = (((g - lo) / scale).round() * scale + lo).reshape_as(w)
    return cand


@pytest.mark.slow
def test_ab_four_candidates_small(shared_data, loaded, tmp_path):
    """The A/B for base + 4 candidates at a tiny size: identical weights must show zero difference,
    a 4-bit candidate a positive KL; all three report files are written."""
    quant = LoadedModel(_fake_quant_model(loaded.model), loaded.tokenizer, loaded.folder, "rtn-int4")
    base = ModelSpec("base", None, loader=lambda: loaded)
    same = lambda: loaded  # noqa: E731  (one loader object so the model is reused, not reloaded)
    cands = [ModelSpec("same", None, loader=same), ModelSpec("int4", None, loader=lambda: quant),
             ModelSpec("same-b", None, loader=same), ModelSpec("int4-b", None, loader=lambda: quant)]
    settings = EvalSettings(tasks=["wikitext", "arc_easy"], limit=2, ctx=48, data_dirs=[shared_data],
                            gen_tokens=6, device="cpu")
    t0 = time.process_time()
    report = run_ab(base, cands, settings)
    cpu_s = time.process_time() - t0
    paths = write_report(report, tmp_path)
    assert all(p.exists() and p.stat().st_size > 0 for p in paths.values())
    ppl = next(m for m in report["metrics"] if m["metric"] == "ppl")
    assert ppl["diffs"]["same"] == {"diff": 0.0, "lo": 0.0, "hi": 0.0}
    dist = {d["candidate"]: d for d in report["distribution"]}
    assert dist["same"]["kl"]["value"] < 1e-6 and dist["same"]["top1"]["value"] == 1.0
    assert dist["int4"]["kl"]["value"] > 1e-3 and dist["int4"]["kl_by_position"]
    assert {g["candidate"] for g in report["generation"]} == {"same", "int4", "same-b", "int4-b"}
    html = paths["html"].read_text()
    assert "<svg" in html and "http" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert cpu_s < 300, cpu_s


@pytest.mark.slow
def test_cli_writes_reports(shared_data, tmp_path):
    from typer.testing import CliRunner

    from fitllm.cli.main import app

    text = tmp_path / "mine.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    out = tmp_path / "report"
    result = CliRunner().invoke(app, [
        "eval", "embedded", "@kv=int8", "@quant=nf4", "--tasks", "wikitext,piqa", "--text", str(text), "--limit", "1",
        "--ctx", "32", "--gen-tokens", "4", "--data-dir", str(shared_data), "-o", str(out)])
    assert result.exit_code == 0, result.output
    for name in ("report.md", "report.json", "report.html"):
        assert (out / name).stat().st_size > 0
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["tasks"] == ["wikitext", "piqa", "text"]
    methods = {m["name"]: m["method"] for m in report["models"]}
    assert methods["embedded@quant=nf4"] == "nf4 (quantized at load)"
    assert "| wikitext | ppl" in (out / "report.md").read_text()


def test_cli_missing_data_is_one_clear_line(tmp_path):
    from typer.testing import CliRunner

    from fitllm.cli.main import app

    result = CliRunner().invoke(app, ["eval", "--tasks", "piqa", "--data-dir", str(tmp_path), "-o", str(tmp_path / "r")])
    assert result.exit_code == 1
    assert "piqa" in result.output and "Traceback" not in result.output
