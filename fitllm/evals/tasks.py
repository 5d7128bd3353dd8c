"""The evals: perplexity (with KL / top-1 agreement against a reference), multiple-choice
log-likelihood, LAMBADA, greedy-generation agreement.

Each returns per-item numbers (per window, per question, per prompt) rather than only a summary,
so the report can pair base and candidate item by item for bootstrap CIs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from fitllm.evals.data import MCExample
from fitllm.evals.runner import Scorer
from fitllm.models.generate import generate

Advance = Callable[[int], None]

# KL is reported per bucket of context length (tokens before the predicted one, within a window):
# a quantized KV cache hurts more as more of the context is read from it.
POSITION_BUCKETS = (1, 16, 64, 256, 1024, 4096)


def _noop(_: int) -> None:
    pass


# ---- perplexity ------------------------------------------------------------------------------

def make_windows(n_tokens: int, ctx: int, stride: Optional[int] = None) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored): the model reads tokens[begin:end] and is scored on
    tokens[first_scored:end]. stride == ctx: non-overlapping windows (each window's first token has
    no context, so it is not scored). stride < ctx: sliding windows; each token is scored once,
    with at least ctx - stride tokens of context (the Hugging Face perplexity recipe)."""
    stride = stride or ctx
    if not 0 < stride <= ctx:
        raise ValueError(f"stride {stride} must be in 1..ctx ({ctx})")
    out, prev_end = [], 0
    for begin in range(0, max(n_tokens - 1, 0), stride):
        end = min(begin + ctx, n_tokens)
        first = max(prev_end, begin + 1)
        if first < end:
            out.append((begin, end, first))
        prev_end = end
        if end == n_tokens:
            break
    return out


@dataclass
class PerplexityResult:
    nll: np.ndarray  # [windows] summed negative log-likelihood (nats)
    tokens: np.ndarray  # [windows] scored tokens
    argmax: list[torch.Tensor]  # per window: the model's top-1 prediction per scored token
    kept: list[torch.Tensor] = field(default_factory=list)  # log-probs kept for KL (reference only)
    # Against a reference (None when there was none):
    kl: Optional[np.ndarray] = None  # [windows] summed KL over the kept tokens
    kl_tokens: Optional[np.ndarray] = None  # [windows] tokens with KL
    top1: Optional[np.ndarray] = None  # [windows] tokens whose argmax matches the reference
    kl_by_bucket: Optional[dict] = None  # bucket label -> (sum, count)

    @property
    def ppl(self) -> float:
        return float(np.exp(self.nll.sum() / self.tokens.sum()))


def bucket_label(i: int) -> str:
    lo, hi = POSITION_BUCKETS[i], POSITION_BUCKETS[i + 1] if i + 1 < len(POSITION_BUCKETS) else None
    return f"{lo}-{hi - 1}" if hi else f"{lo}+"


def perplexity(scorer: Scorer, ids: Sequence[int], windows: list[tuple[int, int, int]],
               keep_tokens: int = 0, reference: Optional[PerplexityResult] = None,
               advance: Advance = _noop) -> PerplexityResult:
    """Score `windows` of `ids`. `keep_tokens`: keep the first N scored tokens' full log-probs
    (the base does, for the candidates' KL). `reference`: compute KL and top-1 agreement vs it."""
    seqs = [ids[b:e] for b, e, _ in windows]
    starts = [f - b for b, _, f in windows]
    n = len(windows)
    res = PerplexityResult(np.zeros(n), np.zeros(n), [None] * n)
    if reference is not None:
        res.kl, res.kl_tokens, res.top1 = np.zeros(n), np.zeros(n), np.zeros(n)
        bucket_sum = np.zeros(len(POSITION_BUCKETS))
        bucket_cnt = np.zeros(len(POSITION_BUCKETS))
    kept = 0
    for i, lp in scorer.logprobs(seqs, starts):
        b, e, f = windows[i]
        targets = torch.tensor(ids[f:e], device=lp.device)
        res.nll[i] = -lp.gather(1, targets[:, None]).sum().item()
        res.tokens[i] = e - f
        res.argmax[i] = lp.argmax(-1).cpu()
        if keep_tokens > kept:
            res.kept.append(lp[: keep_tokens - kept].cpu())
            kept += len(res.kept[-1])
        if reference is not None:
            res.top1[i] = (res.argmax[i] == reference.argmax[i]).sum().item()
            if i < len(reference.kept):
                ref = reference.kept[i].to(lp.device)
                # KL(base || candidate) per token: how much the candidate's distribution costs
                # when the base's is the truth.
                kl = (ref.exp() * (ref - lp[: len(ref)])).sum(-1).clamp_min(0).cpu().numpy()
                res.kl[i], res.kl_tokens[i] = kl.sum(), len(kl)
                ctx_len = np.arange(f - b, f - b + len(kl))
                which = np.searchsorted(POSITION_BUCKETS, ctx_len, side="right") - 1
                np.add.at(bucket_sum, which, kl)
                np.add.at(bucket_cnt, which, 1)
        advance(e - b)
    if reference is not None:
        res.kl_by_bucket = {bucket_label(j): (float(bucket_sum[j]), int(bucket_cnt[j]))
                            for j in range(len(POSITION_BUCKETS)) if bucket_cnt[j]}
    return res


# ---- log-likelihood of continuations ---------------------------------------------------------

def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split: trailing spaces of the context move to the continuation, the whole string
    is tokenized once, and the continuation is whatever follows the context's tokens."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    if not ctx:  # nothing to condition on: lm-eval starts from the BOS (or EOS) token
        prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        return [prefix], whole
    return ctx, whole[len(ctx):]


def loglikelihoods(scorer: Scorer, tokenizer, pairs: Sequence[tuple[str, str]], max_len: int,
                   advance: Advance = _noop) -> tuple[np.ndarray, np.ndarray]:
    """(sum log p(continuation | context), is_greedy) for each (context, continuation)."""
    seqs, starts = [], []
    for context, continuation in pairs:
        ctx, cont = encode_pair(tokenizer, context, continuation)
        seq = (ctx + cont)[-max_len:]  # lm-eval truncates on the left
        seqs.append(seq)
        starts.append(max(len(seq) - len(cont), 1))
    lls, greedy = np.zeros(len(pairs)), np.zeros(len(pairs), dtype=bool)
    for i, lp in scorer.logprobs(seqs, starts):
        targets = torch.tensor(seqs[i][starts[i]:], device=lp.device)
        lls[i] = lp.gather(1, targets[:, None]).sum().item()
        greedy[i] = bool((lp.argmax(-1) == targets).all())
        advance(1)
    return lls, greedy


@dataclass
class ChoiceResult:
    acc: np.ndarray  # [examples] 0/1
    acc_norm: np.ndarray  # [examples] 0/1
    lls: list[np.ndarray]  # per example, per choice


def multiple_choice(scorer: Scorer, tokenizer, examples: Sequence[MCExample], max_len: int,
                    advance: Advance = _noop) -> ChoiceResult:
    """acc: argmax of summed log-likelihood; acc_norm: argmax of log-likelihood divided by the
    choice's length in characters (lm-eval's `len(choice)`, the same as bytes for ASCII text)."""
    pairs = [(ex.context, ex.delimiter + c) for ex in examples for c in ex.choices]
    flat, _ = loglikelihoods(scorer, tokenizer, pairs, max_len, advance)
    acc, acc_norm, per = np.zeros(len(examples)), np.zeros(len(examples)), []
    at = 0
    for k, ex in enumerate(examples):
        lls = flat[at: at + len(ex.choices)]
        at += len(ex.choices)
        lengths = np.array([float(len(c)) for c in ex.choices])
        acc[k] = float(np.argmax(lls) == ex.gold)
        acc_norm[k] = float(np.argmax(lls / lengths) == ex.gold)
        per.append(lls)
    return ChoiceResult(acc, acc_norm, per)


@dataclass
class LambadaResult:
    acc: np.ndarray  # [examples] 1 if greedy decoding reproduces the last word exactly
    ll: np.ndarray  # [examples] log-likelihood of the last word

    @property
    def ppl(self) -> float:
        return float(np.exp(-self.ll.mean()))


def lambada(scorer: Scorer, tokenizer, examples: Sequence[tuple[str, str]], max_len: int,
            advance: Advance = _noop) -> LambadaResult:
    ll, greedy = loglikelihoods(scorer, tokenizer, examples, max_len, advance)
    return LambadaResult(greedy.astype(float), ll)


# ---- greedy generation -----------------------------------------------------------------------

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "def fibonacci(n):\n",
    "The theory of relativity was developed by",
    "Photosynthesis is the process by which",
    "The largest planet in our solar system is",
    "A healthy breakfast usually includes",
    "In 1969, astronauts landed on",
    "The main difference between a virus and a bacterium is",
    "Machine learning is a field of computer science that",
    "The quick brown fox",
    "My favourite book is",
    "import numpy as np\n",
]


def greedy_generations(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, scorer: Scorer) -> list[list[int]]:
    """Greedy continuations (EOS ignored so every output has the same length to compare)."""
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    cache = scorer.new_cache(max(len(p) for p in ids) + max_new_tokens, len(ids))
    return generate(model, ids, max_new_tokens, cache=cache)


def generation_agreement(base: list[list[int]], cand: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Per prompt: fraction of tokens before the first divergence, and exact match (0/1)."""
    prefix, exact = np.zeros(len(base)), np.zeros(len(base))
    for k, (a, b) in enumerate(zip(base, cand)):
        same = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix[k] = same / max(len(a), 1)
        exact[k] = float(a == b)
    return prefix, exact
