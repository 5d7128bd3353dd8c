"""Sampling parameters and the batched sampler.

One call samples a token for every row of a logits batch, each row with its own parameters, on
the logits' device. Order (as vLLM and HF do it): logit_bias, penalties and bans, then greedy rows take
the argmax; the others are divided by their temperature, filtered by top-k, top-p and min-p, and
sampled with the exponential-race trick (argmax of p / Exp(1) noise). A request with a seed owns
a generator that draws exactly one noise vector per token it samples, so its tokens do not
depend on which other requests share the batch.

Logprobs are those of the model's raw distribution (before penalties, bias and temperature):
what scoring and evals want, and what vLLM reports by default.

Host synchronisation: `Sampler.sample` only queues GPU work and returns device tensors; the
engine brings everything a step needs to the host with `fetch_to_host` (one copy into pinned
memory, one wait). Host lists reach the device through `to_device` (pinned, non-blocking): a
plain `torch.tensor(list, device="cuda")` would wait for the GPU each time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from fitllm.kernels.fused import greedy_tokens
from fitllm.serve import json_mode

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
    include_stop_str_in_output: bool = False  # the text ends after the stop string that ended it, not before
    min_tokens: int = 0  # no stop token, EOS or stop string ends the output before this many tokens (vLLM)
    json_object: bool = False  # the output is one JSON object (OpenAI's response_format json_object)
    json_schema: Optional[dict] = None  # the output is one JSON value of this schema (response_format json_schema)
    # free text, but what comes between an open and a close tag token is one JSON value of this schema, then the
    # close tag: (schema, open id, close id); tool calls of 'auto' with strict tools (<tool_call> ... </tool_call>)
    tagged_json: Optional[tuple[dict, int, int]] = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def follows_output(self) -> bool:
        """Whether a row's sampling depends on the tokens sampled before it (penalties count them,
        a JSON grammar follows them): no drafts for such a request, and a step run ahead samples it only
        once the step before's tokens are applied."""
        return self.has_penalties or self.structured or self.tagged_json is not None

    @property
    def structured(self) -> bool:
        """Whether a grammar constrains the output (JSON mode or a JSON schema)."""
        return self.json_object or self.json_schema is not None

    def validate(self, vocab_size: int) -> None:
        """ValueError with a sentence a client can act on."""
        checks = [
            (self.max_tokens is None or self.max_tokens >= 0, f"max_tokens must be >= 0, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
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
        if self.structured and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with structured output (the JSON value may close before it)")
        if self.tagged_json is not None:
            if self.structured:
                raise ValueError("tagged_json cannot be combined with json_object / json_schema")
            if not all(0 <= tok < vocab_size for tok in self.tagged_json[1:]) or len(set(self.tagged_json[1:])) < 2:
                raise ValueError(f"tagged_json: the tags {self.tagged_json[1:]} must be two distinct token ids of "
                                 "the vocabulary")
        tagged_schema = self.tagged_json[0] if self.tagged_json is not None else None
        for name, schema in (("json_schema", self.json_schema), ("tagged_json", tagged_schema)):
            try:
                if schema is not None:
                    json_mode.schema_for(schema)
            except json_mode.SchemaError as e:
                raise ValueError(f"{name}: {e}") from None
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the n most likely (token_id, logprob), best first


@dataclass
class SampleInput:
    """One row of the batch: its parameters, generator, the tokens penalties look at, the tokens it
    may not sample this step (`banned`: the stop tokens before min_tokens) and, where only some may
    come, which (`allowed`: a bool [vocab] mask on the logits' device, JSON mode)."""

    params: SamplingParams
    generator: Optional[torch.Generator] = None
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    banned: Sequence[int] = ()
    allowed: Optional[torch.Tensor] = None


@dataclass
class SampleOutput:
    token_ids: list[int]  # -1 where the row failed
    logprobs: list[Optional[TokenLogprob]]
    failed: list[bool]  # NaN/inf logits: that request ends with an error, the others go on


@dataclass
class LogprobTensors:
    """Logprobs of some rows, still on the device: chosen [n], top_ids / top_lp [n, top_n]."""

    chosen: torch.Tensor
    top_ids: torch.Tensor
    top_lp: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.chosen, self.top_ids, self.top_lp]

    @staticmethod
    def to_list(token_ids: Sequence[int], chosen, top_ids, top_lp, top_n: Sequence[int]) -> list[TokenLogprob]:
        """Host tensors (from `fetch_to_host`) -> TokenLogprobs, row i cut to its own top_n[i]."""
        chosen, top_ids, top_lp = chosen.tolist(), top_ids.long().tolist(), top_lp.tolist()
        return [TokenLogprob(int(t), float(c), list(zip(ids[:n], lps[:n])))
                for t, c, ids, lps, n in zip(token_ids, chosen, top_ids, top_lp, top_n)]


@dataclass
class DeviceSample:
    """What `Sampler.sample` queued: token ids (-1: non-finite logits) and, for the rows that
    asked for them (`logprob_rows`), their logprobs. All on the device until `to_host`."""

    token_ids: torch.Tensor
    logprob_rows: list[int]
    logprob_top_n: list[int]
    logprobs: Optional[LogprobTensors]

    def tensors(self) -> list[torch.Tensor]:
        return [self.token_ids] + (self.logprobs.tensors() if self.logprobs is not None else [])

    def from_host(self, host: Sequence[torch.Tensor]) -> SampleOutput:
        """Build the output from `fetch_to_host(self.tensors())`."""
        tokens = host[0].long().tolist()
        logprobs: list[Optional[TokenLogprob]] = [None] * len(tokens)
        if self.logprobs is not None:
            found = LogprobTensors.to_list([tokens[i] for i in self.logprob_rows], *host[1:4], self.logprob_top_n)
            for i, lp in zip(self.logprob_rows, found):
                logprobs[i] = lp
        return SampleOutput(tokens, logprobs, [t < 0 for t in tokens])

    def to_host(self) -> SampleOutput:
        return self.from_host(fetch_to_host(self.tensors()))


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleInput]) -> SampleOutput:
        """Sample and wait for the result (tests, simple callers; the engine uses `sample`)."""
        return self.sample(logits, rows).to_host()

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: Sequence[SampleInput]) -> DeviceSample:
        """Queue the sampling of every row on the logits' device; nothing waits for the GPU."""
        # plain greedy: one kernel, the same tokens
        if all(r.params.greedy and not r.params.logit_bias and not r.params.has_penalties and not r.banned
               and r.allowed is None and r.params.logprobs is None for r in rows):
            return DeviceSample(greedy_tokens(logits), [], [], None)
        logits = logits.float()
        finite = torch.isfinite(logits).all(dim=-1)
        raw = torch.where(finite[:, None], logits, torch.zeros((), device=logits.device))
        x = apply_bans(apply_penalties(apply_logit_bias(raw, rows), rows), rows)
        tokens = x.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            idx = to_device(random_rows, torch.long, x.device)
            tokens[idx] = sample_random(x[idx], [rows[i] for i in random_rows])
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        lps = None
        if wanted:
            idx = to_device(wanted, torch.long, raw.device)
            lps = logprob_tensors(raw[idx], tokens[idx], max(rows[i].params.logprobs for i in wanted))
        tokens = tokens.masked_fill(~finite, -1)
        return DeviceSample(tokens, wanted, [rows[i].params.logprobs for i in wanted], lps)


def logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, top_n: int) -> LogprobTensors:
    """Log-probability of `token_ids[i]` under row i, with the row's `top_n` best tokens (device)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, token_ids.long()[:, None]).squeeze(1)
    top_lp, top_ids = lp.topk(min(top_n, lp.shape[-1]), dim=-1)
    return LogprobTensors(chosen, top_ids, top_lp)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_n: int) -> list[TokenLogprob]:
    """`logprob_tensors`, brought to the host (waits for the GPU)."""
    host = fetch_to_host([token_ids] + logprob_tensors(logits, token_ids, top_n).tensors())
    return LogprobTensors.to_list(host[0].long().tolist(), *host[1:], [top_n] * len(token_ids))


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list as a device tensor without waiting for the GPU (pinned, non-blocking copy;
    the pinned block is not reused before the copy has run: PyTorch's host allocator tracks it)."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def fetch_to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Device tensors on the host, with one device->host copy and one wait."""
    return HostFetch(tensors).wait()


class HostFetch:
    """Device tensors on their way to the host: one copy queued now (every tensor goes through
    float64, exact for token ids and float32 logprobs, into one pinned buffer), one wait in
    `wait`. Queuing it early lets the engine queue the next step's GPU work behind it without
    delaying it."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.tensors, self.host, self.done = list(tensors), None, None
        if not self.tensors or self.tensors[0].device.type != "cuda":
            return
        parts = [t.detach().reshape(-1).to(torch.float64) for t in self.tensors]
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        self.host = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
        self.host.copy_(flat, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()

    def wait(self) -> list[torch.Tensor]:
        if self.done is None:
            return [t.detach() for t in self.tensors]
        self.done.synchronize()
        out, i = [], 0
        for t in self.tensors:
            out.append(self.host[i: i + t.numel()].view(t.shape).to(t.dtype))
            i += t.numel()
        return out


def apply_logit_bias(x: torch.Tensor, rows: Sequence[SampleInput]) -> torch.Tensor:
    entries = [(i, int(t), float(b)) for i, r in enumerate(rows) for t, b in r.params.logit_bias.items()]
    if not entries:
        return x
    r, t, b = zip(*entries)
    x = x.clone()
    x.index_put_((to_device(r, torch.long, x.device), to_device(t, torch.long, x.device)),
                 to_device(b, x.dtype, x.device), accumulate=True)
    return x


def apply_bans(x: torch.Tensor, rows: Sequence[SampleInput]) -> torch.Tensor:
    """Each row's banned tokens, and those outside its allowed mask, to -inf (a row always keeps
    some: min_tokens bans only the stop tokens, a JSON state allows at least one token)."""
    entries = [(i, int(t)) for i, r in enumerate(rows) for t in r.banned]
    masked = [i for i, r in enumerate(rows) if r.allowed is not None]
    if not entries and not masked:
        return x
    x = x.clone()
    if entries:
        r, t = zip(*entries)
        x[to_device(r, torch.long, x.device), to_device(t, torch.long, x.device)] = float("-inf")
    if masked:
        idx = to_device(masked, torch.long, x.device)
        allowed = torch.stack([rows[i].allowed[:x.shape[-1]] for i in masked])
        x[idx] = x[idx].masked_fill(~allowed, float("-inf"))
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
    rep = to_device([r.params.repetition_penalty for r in sub], x.dtype, dev)[:, None]
    freq = to_device([r.params.frequency_penalty for r in sub], x.dtype, dev)[:, None]
    pres = to_device([r.params.presence_penalty for r in sub], x.dtype, dev)[:, None]
    idx = to_device(picked, torch.long, dev)
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
    ids = (ids.pin_memory() if torch.device(device).type == "cuda" else ids).to(device, non_blocking=True)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, device=device))
    return counts[:, :vocab]


def sample_random(x: torch.Tensor, rows: Sequence[SampleInput]) -> torch.Tensor:
    dev = x.device
    temp = to_device([r.params.temperature for r in rows], x.dtype, dev)[:, None]
    probs = torch.softmax(filter_logits(x / temp, [r.params for r in rows]), dim=-1)
    return (probs / exponential_noise(probs.shape, rows, dev)).argmax(dim=-1)


def filter_logits(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask to -inf what top-k, top-p and min-p exclude (the most likely token always stays)."""
    dev, vocab = x.device, x.shape[-1]
    if any(p.top_k > 1 or p.top_p < 1.0 for p in params):
        sorted_x, order = x.sort(dim=-1, descending=True)
        k = to_device([p.top_k if p.top_k > 0 else vocab for p in params], torch.long, dev)[:, None]
        sorted_x = sorted_x.masked_fill(torch.arange(vocab, device=dev)[None, :] >= k, float("-inf"))
        top_p = to_device([p.top_p for p in params], x.dtype, dev)[:, None]
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep a token while the mass before it is still under top_p.
        sorted_x = sorted_x.masked_fill(probs.cumsum(dim=-1) - probs > top_p, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
    if any(p.min_p > 0.0 for p in params):
        min_p = to_device([p.min_p for p in params], x.dtype, dev)[:, None]
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
