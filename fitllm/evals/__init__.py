"""Evals and A/B reports: `quant eval BASE CANDIDATE...`.

data     local files / HF datasets -> strings, MCExample lists, LAMBADA pairs
runner   model specs (PATH@kv=fp8), loading, the Scorer (log-probs through the paged KV cache)
tasks    perplexity (+ KL, top-1 vs a reference), multiple choice, LAMBADA, generation agreement
stats    paired bootstrap CIs
ab       the A/B run: evaluate base and candidates on the same items, summarise
report   report.md / report.json / report.html
"""
from fitllm.evals.ab import EvalSettings, run_ab
from fitllm.evals.report import write_report
from fitllm.evals.runner import EvalError, ModelSpec, parse_spec

__all__ = ["EvalSettings", "run_ab", "write_report", "EvalError", "ModelSpec", "parse_spec"]
