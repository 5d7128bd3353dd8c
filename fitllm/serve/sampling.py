"""Sampling parameters and the batched sampler.

One call samples a token for every row of a logits batch, each row with its own parameters, on
the logits' device. Order (as vLLM and HF do it): logit_bias and penalties, then greedy rows take
the argmax; the others are divided by their temperature, filtered by top-k, top-p and min-p, and
sampled with the exponential-race trick (argmax of p / Exp(1) noise). A request with a seed owns
a generator that draws exactly one noise vector per token it samples, so its tokens do not
depend on which other requests share the batch.

Logprobs are those of the model's raw distribution (before penalties, bias and temperature):
what scoring and evals want, and what vLLM reports by default.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: Optional[int] = 16  # None: until the context is full
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # top-n logprobs per generated token (0: only the sampled token's)
    prompt_logprobs: Optional[int] = None  # the same for prompt tokens (echo / scoring)
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self, vocab_size: int) -> None:
        """ValueError with a sentence a client can act on."""
        checks = [
            (self.max_tokens is None or self.max_tokens >= 0, f"max_tokens must be >= 0, got {self.max_tokens}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0 or self.top_k == -1, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, f"logprobs must be in [0, {MAX_LOGPROBS}]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        for tok, bias in self.logit_bias.items():
            if not 0 <= int(tok) < vocab_size:
                raise ValueError(f"logit_bias token id {tok} is outside the vocabulary (0..{vocab_size - 1})")
            if not -100.0 <= float(bias) <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {tok}")
        for tok in self.stop_token_ids:
            if not 0 <= tok < vocab_size:
                raise ValueError(f"stop_token_ids: {tok} is outside the vocabulary (0..{vocab_size - 1})")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the n most likely (token_id, logprob), best first


@dataclass
class SampleInput:
    """One row of the batch: its parameters, generator and the tokens penalties look at."""

    params: SamplingParams
    generator: Optional[torch.Generator] = None
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()


@dataclass
class SampleOutput:
    token_ids: list[int]  # -1 where the row failed
    logprobs: list[Optional[TokenLogprob]]
    failed: list[bool]  # NaN/inf logits: that request ends with an error, the others go on


class Sampler:
    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleInput]) -> SampleOutput:
        logits = logits.float()
        finite = torch.isfinite(logits).all(dim=-1)
        raw = torch.where(finite[:, None], logits, torch.zeros((), device=logits.device))
        x = apply_penalties(apply_logit_bias(raw, rows), rows)
        tokens = x.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, device=x.device)
            tokens[idx] = sample_random(x[idx], [rows[i] for i in random_rows])
        logprobs = self._logprobs(raw, tokens, rows)
        failed = (~finite).tolist()
        token_ids = [-1 if bad else t for t, bad in zip(tokens.tolist(), failed)]
        return SampleOutput(token_ids, logprobs, failed)

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, rows: Sequence[SampleInput]) -> list[Optional[TokenLogprob]]:
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        out: list[Optional[TokenLogprob]] = [None] * len(rows)
        if wanted:
            idx = torch.tensor(wanted, device=raw.device)
            found = token_logprobs(raw[idx], tokens[idx], max(rows[i].params.logprobs for i in wanted))
            for i, lp in zip(wanted, found):
                lp.top = lp.top[: rows[i].params.logprobs]
                out[i] = lp
        return out


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_n: int) -> list[TokenLogprob]:
    """Log-probability of `token_ids[i]` under row i, with the row's `top_n` best tokens."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, token_ids.long()[:, None]).squeeze(1).tolist()
    top_n = min(top_n, lp.shape[-1])
    if top_n > 0:
        top_lp, top_ids = lp.topk(top_n, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_lp.tolist())]
    else:
        tops = [[] for _ in chosen]
    return [TokenLogprob(int(t), float(c), top) for t, c, top in zip(token_ids.tolist(), chosen, tops)]


def apply_logit_bias(x: torch.Tensor, rows: Sequence[SampleInput]) -> torch.Tensor:
    entries = [(i, int(t), float(b)) for i, r in enumerate(rows) for t, b in r.params.logit_bias.items()]
    if not entries:
        return x
    r, t, b = zip(*entries)
    x = x.clone()
    x.index_put_((torch.tensor(r, device=x.device), torch.tensor(t, device=x.device)),
                 torch.tensor(b, device=x.device), accumulate=True)
    return x


def apply_penalties(x: torch.Tensor, rows: Sequence[SampleInput]) -> torch.Tensor:
    """Repetition (HF: divide positive / multiply negative logits of any prompt or output
    token); presence and frequency (OpenAI: subtract per output-token occurrence)."""
    picked = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not picked:
        return x
    x = x.clone()
    dev, vocab = x.device, x.shape[-1]
    sub = [rows[i] for i in picked]
    out_counts = _token_counts([r.output_ids for r in sub], vocab, dev)
    seen = out_counts + _token_counts([r.prompt_ids for r in sub], vocab, dev) > 0
    rep = torch.tensor([r.params.repetition_penalty for r in sub], device=dev)[:, None]
    freq = torch.tensor([r.params.frequency_penalty for r in sub], device=dev)[:, None]
    pres = torch.tensor([r.params.presence_penalty for r in sub], device=dev)[:, None]
    idx = torch.tensor(picked, device=dev)
    y = x[idx]
    y = torch.where(seen, torch.where(y > 0, y / rep, y * rep), y)
    y = y - freq * out_counts - pres * (out_counts > 0).float()
    x[idx] = y
    return x


def _token_counts(seqs: Sequence[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """[len(seqs), vocab] occurrence counts (padding goes to an extra column, then dropped)."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), max(width, 1)), vocab, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
    counts = torch.zeros(len(seqs), vocab + 1, device=device)
    counts.scatter_add_(1, ids.to(device), torch.ones(ids.shape, device=device))
    return counts[:, :vocab]


def sample_random(x: torch.Tensor, rows: Sequence[SampleInput]) -> torch.Tensor:
    dev = x.device
    temp = torch.tensor([r.params.temperature for r in rows], device=dev)[:, None]
    probs = torch.softmax(filter_logits(x / temp, [r.params for r in rows]), dim=-1)
    return (probs / exponential_noise(probs.shape, rows, dev)).argmax(dim=-1)


def filter_logits(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask to -inf what top-k, top-p and min-p exclude (the most likely token always stays)."""
    dev, vocab = x.device, x.shape[-1]
    if any(p.top_k > 1 or p.top_p < 1.0 for p in params):
        sorted_x, order = x.sort(dim=-1, descending=True)
        k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)[:, None]
        sorted_x = sorted_x.masked_fill(torch.arange(vocab, device=dev)[None, :] >= k, float("-inf"))
        top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep a token while the mass before it is still under top_p.
        sorted_x = sorted_x.masked_fill(probs.cumsum(dim=-1) - probs > top_p, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=dev)[:, None]
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return x


def exponential_noise(shape: torch.Size, rows: Sequence[SampleInput], device) -> torch.Tensor:
    """Exp(1) noise: seeded rows from their own generator, the rest from the global one."""
    noise = torch.empty(shape, device=device).exponential_()
    for i, r in enumerate(rows):
        if r.generator is not None:
            noise[i].exponential_(generator=r.generator)
    return noise.clamp_min_(1e-20)


def make_generator(seed: Optional[int], device: torch.device | str) -> Optional[torch.Generator]:
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(int(seed))
