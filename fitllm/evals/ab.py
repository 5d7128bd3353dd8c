"""The A/B run: evaluate a base and its candidates on the same items and compare them.

Models are evaluated one at a time (only one is in memory; consecutive specs with the same
weights, e.g. `@kv=fp8` variants, reuse the loaded model). The base keeps, per perplexity task,
its top-1 predictions for every scored token and its full log-probabilities for the first
`kl_tokens` tokens; each candidate is compared against those as it runs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from fitllm.evals import stats
from fitllm.evals.data import ALL_TASKS, MC_TASKS, DataError, load_task, load_text
from fitllm.evals.runner import (EvalError, LoadedModel, ModelSpec, Scorer, cache_kwargs, disk_bytes, load_for_eval,
                                 weight_bytes)
from fitllm.evals.tasks import (DEFAULT_PROMPTS, generation_agreement, greedy_generations, lambada, make_windows,
                                multiple_choice, perplexity)

HIGHER_IS_BETTER = {"ppl": False, "acc": True, "acc_norm": True}


@dataclass
class EvalSettings:
    tasks: list[str] = field(default_factory=lambda: ["wikitext"])
    text: Optional[Path] = None  # perplexity on a user's own plain-text file (task "text")
    limit: Optional[int] = None  # first N windows / questions / prompts per task
    ctx: int = 512
    stride: Optional[int] = None  # None: non-overlapping windows
    data_dirs: list[Path] = field(default_factory=list)
    task_files: dict[str, Path] = field(default_factory=dict)  # task -> explicit file
    kl_tokens: int = 4096  # base log-probs kept for KL: kl_tokens * vocab * 4 bytes of host memory
    prompts: Optional[list[str]] = None
    gen_tokens: int = 32
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    dtype: Optional[torch.dtype] = None  # None: bf16 on GPU, fp32 on CPU
    max_batch_tokens: int = 4096
    max_len: int = 2048  # truncation for multiple-choice / LAMBADA requests
    kv_calib: Optional[Path] = None  # text for fp8/int4 KV statistics (default: model-sampled text)


class _Bars:
    """A rich progress bar per (model, task); silent when no Progress is given."""

    def __init__(self, progress=None):
        self.progress = progress

    def start(self, description: str, total: int):
        if self.progress is None:
            return lambda n: None
        task = self.progress.add_task(description, total=total)
        return lambda n: self.progress.advance(task, n)


def load_data(settings: EvalSettings) -> dict[str, object]:
    """Every task's data, read before any model is loaded so a missing file fails fast."""
    data: dict[str, object] = {}
    for task in settings.tasks:
        if task not in ALL_TASKS:
            raise DataError(f"--tasks: unknown task {task!r} (known: {', '.join(ALL_TASKS)})")
        items = load_task(task, settings.data_dirs, settings.task_files.get(task))
        data[task] = items if isinstance(items, str) or settings.limit is None else items[: settings.limit]
    if settings.text is not None:
        data["text"] = load_text(settings.text)
    return data


def run_ab(base: ModelSpec, candidates: list[ModelSpec], settings: EvalSettings, progress=None) -> dict:
    """Evaluate everything; return the report as plain data (what report.json holds)."""
    started = time.time()
    data = load_data(settings)
    bars = _Bars(progress)
    specs = _unique_names([base] + list(candidates))
    prompts = (settings.prompts or DEFAULT_PROMPTS)[: settings.limit or None]
    results: dict[str, dict] = {}
    model_info, loaded_cache = [], {}
    for k, spec in enumerate(specs):
        loaded = _load(spec, settings, loaded_cache)
        t0 = time.time()
        calib = _calibration_ids(loaded.tokenizer, settings.kv_calib) if settings.kv_calib else None
        scorer = Scorer(loaded.model, cache_kwargs(loaded, spec.kv_dtype, calib), settings.max_batch_tokens,
                        max(settings.ctx, settings.max_len))
        out, task_seconds, ppl_rate = {}, {}, {}
        base_out = results.get(specs[0].name)
        for task, items in data.items():
            desc = f"{spec.name} · {task}"
            t_task = time.time()
            if isinstance(items, str):
                ids = _tokenize(loaded.tokenizer, items, settings)
                windows = make_windows(len(ids), settings.ctx, settings.stride)[: settings.limit or None]
                ref = base_out[task] if base_out and base_out[task]["ids_hash"] == hash(tuple(ids)) else None
                res = perplexity(scorer, ids, windows, keep_tokens=settings.kl_tokens if k == 0 else 0,
                                 reference=ref["result"] if ref else None,
                                 advance=bars.start(desc, sum(e - b for b, e, _ in windows)))
                out[task] = {"result": res, "ids_hash": hash(tuple(ids))}
                ppl_rate[task] = sum(e - b for b, e, _ in windows) / max(time.time() - t_task, 1e-9)
            elif task == "lambada":
                out[task] = {"result": lambada(scorer, loaded.tokenizer, items, settings.max_len,
                                               bars.start(desc, len(items)))}
            else:
                n = sum(len(ex.choices) for ex in items)
                out[task] = {"result": multiple_choice(scorer, loaded.tokenizer, items, settings.max_len,
                                                       bars.start(desc, n))}
            task_seconds[task] = round(time.time() - t_task, 2)
        if len(specs) > 1 and prompts:
            t_task = time.time()
            out["generation"] = greedy_generations(loaded.model, loaded.tokenizer, prompts, settings.gen_tokens, scorer)
            task_seconds["generation"] = round(time.time() - t_task, 2)
        seconds = time.time() - t0
        model_info.append({
            "name": spec.name, "path": str(loaded.folder) if loaded.folder else None, "kv_dtype": spec.kv_dtype,
            "method": loaded.method, "disk_bytes": disk_bytes(loaded.folder),
            "weight_bytes": weight_bytes(loaded.model), "kv_bytes_per_token": scorer.kv_bytes_per_token,
            "eval_seconds": round(seconds, 2), "task_seconds": task_seconds,
            # Tokens read per second by the perplexity windows (on any device: the CPU's speed too).
            "ppl_tokens_per_second": {t: round(r, 1) for t, r in ppl_rate.items()},
            "speed": measure_speed(loaded.model, scorer) if str(settings.device).startswith("cuda") else None,
        })
        results[spec.name] = out
        # Drop all but the base's results' heavy parts once used: candidates need only summaries.
        if k > 0:
            for task in data:
                if isinstance(data[task], str):
                    out[task]["result"].argmax = []
        del scorer
    base_kept = results[specs[0].name]
    for task in data:
        if isinstance(data[task], str):
            base_kept[task]["result"].kept = []
    return build_report(specs, results, model_info, data, settings, time.time() - started)


def _tokenize(tokenizer, text: str, settings: EvalSettings) -> list[int]:
    """Token ids of `text`; with --limit only a prefix long enough for the windows used. BPE
    tokenization is local (pre-tokenized at whitespace), so the prefix's ids equal the full text's
    except at the cut, which the margin keeps past the last window."""
    if settings.limit:
        needed = (settings.limit - 1) * (settings.stride or settings.ctx) + settings.ctx + 64
        ids = tokenizer.encode(text[: needed * 16], add_special_tokens=False)
        if len(ids) >= needed or needed * 16 >= len(text):
            return ids[: needed - 64] if len(ids) >= needed else ids
    return tokenizer.encode(text, add_special_tokens=False)


def _calibration_ids(tokenizer, path: Path, seqs: int = 8, length: int = 512) -> list[list[int]]:
    ids = tokenizer.encode(load_text(path)[: seqs * length * 8], add_special_tokens=False)
    return [ids[i: i + length] for i in range(0, min(len(ids), seqs * length), length) if len(ids[i: i + length]) > 1]


def _unique_names(specs: list[ModelSpec]) -> list[ModelSpec]:
    seen: dict[str, int] = {}
    for s in specs:
        seen[s.name] = seen.get(s.name, 0) + 1
        if seen[s.name] > 1:
            s.name = f"{s.name}#{seen[s.name]}"
    return specs


def _load(spec: ModelSpec, settings: EvalSettings, cache: dict) -> LoadedModel:
    key = ("loader", id(spec.loader)) if spec.loader else ("path", spec.path, spec.quantization)
    if key not in cache:
        cache.clear()  # keep one model in memory at a time
        cache[key] = spec.loader() if spec.loader else load_for_eval(spec.path, settings.device, settings.dtype,
                                                                     spec.quantization)
    return cache[key]


@torch.inference_mode()
def measure_speed(model, scorer: Scorer) -> dict:
    """Eager-mode throughput on the GPU: prefill (4 x 512 tokens in one step) and greedy decode
    (batch 1 and 16, 64 tokens). A rough guide; `quant bench` measures the serving engine."""
    from fitllm.models.generate import generate

    def timed(fn) -> float:
        fn()  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    seqs = [list(range(100, 612))] * 4
    prefill = timed(lambda: list(scorer.logprobs(seqs, [511] * 4)))
    out = {"prefill_tokens_per_s": round(2048 / prefill, 1)}
    for batch in (1, 16):
        cache = scorer.new_cache(16 + 64, batch)
        t = timed(lambda: generate(model, [list(range(100, 116))] * batch, 64, cache=cache))
        out[f"decode_tokens_per_s_batch{batch}"] = round(batch * 64 / t, 1)
    return out


# ---- summarising -----------------------------------------------------------------------------

def build_report(specs, results, model_info, data, settings: EvalSettings, elapsed: float) -> dict:
    base_name = specs[0].name
    base = results[base_name]
    metrics, distribution, generation = [], [], []
    for task, items in data.items():
        per_model = {name: results[name][task]["result"] for name in results}
        for metric, item_stat in _metric_stats(task, items):
            row = {"task": task, "metric": metric, "n": None, "higher_is_better": HIGHER_IS_BETTER[metric],
                   "values": {}, "diffs": {}}
            for name, res in per_model.items():
                n, stat = item_stat(res)
                row["n"] = n
                row["values"][name] = float(stat(np.arange(n)))
                if name != base_name:
                    bn, bstat = item_stat(per_model[base_name])
                    if bn == n:
                        row["diffs"][name] = stats.paired_diff_ci(bstat, stat, n)
            metrics.append(row)
        if isinstance(items, str):
            for name, res in per_model.items():
                if name == base_name or res.kl is None:
                    continue
                n = len(res.kl)
                with_kl = res.kl_tokens > 0
                distribution.append({
                    "task": task, "candidate": name, "windows": n, "kl_tokens": int(res.kl_tokens.sum()),
                    "kl": stats.ci(stats.ratio_stat(res.kl[with_kl], res.kl_tokens[with_kl]), int(with_kl.sum())),
                    "top1": stats.ci(stats.ratio_stat(res.top1, res.tokens), n),
                    "kl_by_position": {b: s / c for b, (s, c) in res.kl_by_bucket.items()},
                })
    if "generation" in base:
        for name in results:
            if name == base_name:
                continue
            prefix, exact = generation_agreement(base["generation"], results[name]["generation"])
            generation.append({"candidate": name, "prompts": len(prefix), "new_tokens": settings.gen_tokens,
                               "prefix_agreement": stats.ci(stats.mean_stat(prefix), len(prefix)),
                               "exact_match": stats.ci(stats.mean_stat(exact), len(exact))})
    return {
        "fitllm_eval_version": 1,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "base": base_name,
        "candidates": [s.name for s in specs[1:]],
        "settings": {"tasks": list(data), "text": str(settings.text) if settings.text else None,
                     "limit": settings.limit, "ctx": settings.ctx, "stride": settings.stride or settings.ctx,
                     "kl_tokens": settings.kl_tokens, "gen_tokens": settings.gen_tokens,
                     "device": str(settings.device), "bootstrap_resamples": stats.RESAMPLES,
                     "ci_level": stats.LEVEL},
        "models": model_info,
        "metrics": metrics,
        "distribution": distribution,
        "generation": generation,
        "elapsed_seconds": round(elapsed, 1),
    }


def _metric_stats(task: str, items):
    """(metric, fn(result) -> (n_items, statistic over an index array)) for a task."""
    if isinstance(items, str):
        return [("ppl", lambda r: (len(r.nll), stats.ratio_stat(r.nll, r.tokens, np.exp)))]
    if task == "lambada":
        return [("acc", lambda r: (len(r.acc), stats.mean_stat(r.acc))),
                ("ppl", lambda r: (len(r.ll), stats.ratio_stat(-r.ll, np.ones_like(r.ll), np.exp)))]
    assert task in MC_TASKS
    return [("acc", lambda r: (len(r.acc), stats.mean_stat(r.acc))),
            ("acc_norm", lambda r: (len(r.acc_norm), stats.mean_stat(r.acc_norm)))]


__all__ = ["EvalSettings", "run_ab", "EvalError", "DataError"]
