"""The engine: requests in, tokens out, one scheduler step at a time.

    step = schedule -> (copy-on-write copies) -> one forward over the flat batch -> count the
           computed tokens (full blocks join the prefix cache) -> prompt logprobs -> sample ->
           append, detokenize, check stop conditions -> incremental outputs

A request whose prompt is still being prefilled in chunks produces no output until its last
chunk; a preempted request simply waits and is recomputed, its generated tokens included.

Speculative decoding (`EngineConfig.speculative`, see spec_decode.py) fits this loop without new
machinery: before scheduling, each request about to decode gets up to k draft tokens appended to
`req.token_ids` (`req.num_draft`); the scheduler gives it 1 + k tokens; `_step_seq` asks for
1 + k logit rows (the verification rows, computed over the paged cache like a prompt chunk);
`_verify` accepts a prefix of the draft plus one token of the target's, drops the draft from
`token_ids`, lowers `num_computed` to the verified tokens and rolls the rejected tokens' K/V
back with `block_manager.truncate`. Requests that do not speculate decode as usual in the same
batch; a step with no drafts at all keeps the CUDA-graph decode path. Not speculated (they
decode normally): requests with repetition/presence/frequency penalties (the penalties of
draft position i depend on drafts before it).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from dataclasses import replace
from typing import Optional

import torch

from fitllm.models.kv_cache import KVCalibration
from fitllm.serve.block_manager import BlockManager
from fitllm.serve.detokenizer import IncrementalDetokenizer
from fitllm.serve.model_runner import ModelRunner, StepSeq
from fitllm.serve.sampling import (SampleInput, Sampler, SamplingParams, TokenLogprob, apply_logit_bias,
                                   make_generator, token_logprobs)
from fitllm.serve.scheduler import Request, Scheduler, SchedulerOutput
from fitllm.serve.spec_decode import (DraftItem, accept_greedy, accept_sampled, build_drafter, check_speculative,
                                      sampling_probs)

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "TokenLogprob", "SamplingParams"]
log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


@dataclass
class EngineConfig:
    model: Optional[str] = None  # folder, .gguf, hub id; None: the embedded SmolLM2
    device: str = "auto"  # auto: cuda if available
    dtype: Optional[str] = None  # None/auto: bf16 on GPU, fp32 on CPU
    kv_dtype: str = "auto"  # auto (the model's dtype) | bf16 | fp16 | fp8 | int8 | int4
    block_size: int = 16
    max_model_len: Optional[int] = None  # None: the model's, capped by what the KV pool holds
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    num_kv_blocks: Optional[int] = None  # None: sized from memory
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True
    kv_calibration: Optional[KVCalibration] = None  # K/V statistics for fp8/int4 KV (else measured)
    speculative: Optional[str] = None  # None | "ngram" | "self-int4" | "draft-model:PATH"
    num_speculative_tokens: int = 4  # k: draft tokens per step (a request may ask for fewer)

    def __post_init__(self):
        check_speculative(self.speculative)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_speculative_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: Optional[str]  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_generated_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None  # sent once, with the first output
    error: Optional[str] = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Speculation, at finish (None when the request never verified a draft):
    spec_acceptance_rate: Optional[float] = None  # accepted draft tokens / drafted tokens
    spec_mean_accepted_len: Optional[float] = None  # tokens per verification step (1 = no draft accepted)


class LLMEngine:
    def __init__(self, config: EngineConfig, model=None, tokenizer=None, draft_model=None):
        """`model`/`tokenizer`: an already loaded CausalLM (tests, benchmarks with random
        weights); without a tokenizer the engine works on token ids only (no text, no stop strings).
        `draft_model`: a loaded drafter for `speculative="draft-model"`."""
        self.config = config
        if model is None:
            model, tokenizer = load_model_and_tokenizer(config)
        self.model, self.tokenizer = model, tokenizer
        self.model_config = model.config
        self.device, self.dtype, self.kv_dtype = model.device, model.dtype, config.kv_dtype
        self.runner = ModelRunner(model, config.block_size, config.kv_dtype, config.kv_calibration)
        self.drafter = None if config.speculative is None else build_drafter(
            config.speculative, model, config.block_size, draft_model,
            lambda path: load_model_and_tokenizer(replace(config, model=path), self.device, self.dtype)[0])
        self.max_model_len, num_blocks = self._size_kv_cache()
        self.runner.allocate_cache(num_blocks)
        if self.drafter is not None and self.drafter.needs_cache:
            self.drafter.allocate(num_blocks, config.max_num_seqs, self.max_model_len,
                                  config.max_num_batched_tokens, config.cuda_graphs)
        self.cuda_graphs = config.cuda_graphs and self.runner.capture_graphs(config.max_num_seqs, self.max_model_len)
        self.block_manager = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   prefix_caching=config.enable_prefix_caching)
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self.eos_ids = set(self.model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self._outbox: list[RequestOutput] = []  # outputs produced between steps (aborts)
        self.num_generated_tokens = 0
        self.spec_counts = dict(drafted=0, accepted=0, steps=0)  # over all requests

    def _size_kv_cache(self) -> tuple[int, int]:
        c = self.config
        model_len = self.model_config.max_position_embeddings
        if c.max_model_len is not None:
            if c.max_model_len > model_len:
                log.warning("max_model_len %d exceeds the model's %d positions", c.max_model_len, model_len)
            model_len = c.max_model_len
        num_blocks = c.num_kv_blocks or self.runner.choose_num_blocks(
            c.max_num_seqs, model_len, c.max_num_batched_tokens, c.gpu_memory_utilization, c.cuda_graphs)
        if c.num_kv_blocks is None and self.device.type == "cuda" and getattr(self.drafter, "needs_cache", False):
            # The drafter's cache holds the same tokens: split the KV memory between the two.
            target, draft = self.runner.bytes_per_block(), self.drafter.bytes_per_block()
            num_blocks = max(1, num_blocks * target // (target + draft))
        # One sequence must always fit alone, or preemption could not guarantee progress.
        if num_blocks * c.block_size < model_len:
            log.warning("the KV cache holds %d tokens: max_model_len lowered from %d", num_blocks * c.block_size,
                        model_len)
        return min(model_len, num_blocks * c.block_size), num_blocks

    # ---- requests --------------------------------------------------------------------------------
    def validate_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """ValueError with a clear message for what this engine cannot serve. Thread-safe."""
        vocab = self.model_config.vocab_size
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        n = len(prompt_token_ids)
        room = self.max_model_len - (0 if params.max_tokens == 0 else 1)
        if n > room:
            raise ValueError(f"the prompt has {n} tokens, but this server's maximum context length is "
                             f"{self.max_model_len} tokens" + (" (including at least one generated token)"
                                                                 if params.max_tokens != 0 else ""))
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})")
        params.validate(vocab)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    num_speculative_tokens: Optional[int] = None) -> None:
        """`num_speculative_tokens`: this request's k (default: the engine's; 0: no speculation)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_request(request_id, prompt_token_ids, params)
        req = Request(request_id, list(prompt_token_ids), params)
        req.state.update(
            generator=make_generator(params.seed, self.device),
            needs_prompt_logits=params.prompt_logprobs is not None,
            prompt_logprobs=[None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None,
            detok=None if self.tokenizer is None else IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens),
            sent_prompt_logprobs=False,
            spec_k=self.config.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens,
            spec_drafted=0, spec_accepted=0, spec_steps=0,
        )
        self.requests[request_id] = req
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            self._finish(req, "abort")
            self._outbox.append(self._output(req, [], "", []))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._outbox)

    # ---- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._outbox = self._outbox, []
        if self.drafter is not None:
            self._propose_drafts()
        sched = self.scheduler.schedule()
        for req in self.scheduler.running:  # drafts of a request left out of this step go stale
            if req.num_draft and req not in sched.num_tokens:
                req.drop_draft()
        if not sched:
            return outputs
        seqs = [self._step_seq(req, n) for req, n in sched.num_tokens.items()]
        try:
            self.runner.copy_blocks(self.block_manager.take_copies())
            logits = self.runner.execute(seqs)
        except Exception as exc:  # one broken step must not take the server down
            log.exception("the forward pass failed; failing the %d requests in the step", len(seqs))
            for req in list(sched.num_tokens):
                self._finish(req, "error")
                outputs.append(self._output(req, [], "", [], error=f"{exc.__class__.__name__}: {exc}"))
            return outputs
        self.scheduler.update_after_step(sched)
        return outputs + self._process(sched, seqs, logits)

    def _propose_drafts(self) -> None:
        """Append draft tokens to the requests about to decode, within the step's token budget
        (every decode takes one token; each draft token one more)."""
        ready = [r for r in self.scheduler.running if r.num_remaining == 1 and not r.state["needs_prompt_logits"]]
        budget = self.config.max_num_batched_tokens - len(ready)
        items, reqs = [], []
        for req in ready:
            k = min(self._num_to_draft(req), budget)
            if k > 0:
                items.append(DraftItem(req.request_id, req.token_ids, k, req.params, req.state["generator"]))
                reqs.append(req)
                budget -= k
        for req, draft in zip(reqs, self.drafter.propose_batch(items) if items else []):
            req.token_ids.extend(draft.token_ids)
            req.num_draft, req.state["draft_probs"] = len(draft.token_ids), draft.probs

    def _num_to_draft(self, req: Request) -> int:
        p = req.params
        if p.has_penalties:
            return 0
        # Room for the accepted drafts plus the target's own token, within both length limits.
        room = self.max_model_len - req.num_tokens
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - len(req.output_ids))
        return max(0, min(req.state["spec_k"], room - 1))

    def _step_seq(self, req: Request, n: int) -> StepSeq:
        start = req.num_computed
        if req.num_draft:  # verification rows: the last real token and every draft token
            return StepSeq(req.token_ids[start:start + n], start, self.block_manager.table(req.request_id),
                           1 + req.num_draft)
        if req.state["needs_prompt_logits"]:
            num_logits = n  # every position: each predicts the next prompt token (or the first output)
        else:
            num_logits = 1 if start + n == req.num_tokens else 0
        return StepSeq(req.token_ids[start:start + n], start, self.block_manager.table(req.request_id), num_logits)

    def _process(self, sched: SchedulerOutput, seqs: list[StepSeq], logits: torch.Tensor) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        sample_reqs, sample_rows, row = [], [], 0
        for (req, n), seq in zip(sched.num_tokens.items(), seqs):
            rows = logits[row: row + seq.num_logits]
            row += seq.num_logits
            if req.state["needs_prompt_logits"]:
                self._record_prompt_logprobs(req, seq, rows)
            if req.num_computed < req.num_tokens:
                continue  # more prompt chunks to go
            req.state["needs_prompt_logits"] = False
            if req.params.max_tokens == 0:  # scoring only: no token to generate
                self._finish(req, "length")
                outputs.append(self._output(req, [], "", []))
            elif req.num_draft:
                outputs.append(self._verify(req, rows))
            elif seq.num_logits:
                sample_reqs.append(req)
                sample_rows.append(row - 1)
        if sample_reqs:
            index = torch.tensor(sample_rows, device=logits.device)
            sampled = self.sampler(logits[index], [self._sample_input(r) for r in sample_reqs])
            for i, req in enumerate(sample_reqs):
                outputs.append(self._append(req, sampled.token_ids[i], sampled.logprobs[i], sampled.failed[i]))
        return outputs

    def _verify(self, req: Request, rows: torch.Tensor) -> RequestOutput:
        """rows [1 + k, vocab]: row i predicts the token after draft[:i]. Keep the accepted
        drafts plus one token of the target's (correction or bonus); roll back the rest."""
        k, p = req.num_draft, req.params
        draft, q = req.token_ids[-k:], req.state.pop("draft_probs", None)
        req.drop_draft()
        if not torch.isfinite(rows).all():
            return self._append(req, -1, None, failed=True)
        if p.greedy:
            tokens = accept_greedy(draft, apply_logit_bias(rows, [SampleInput(p)] * len(rows)))
        else:
            tokens = accept_sampled(draft, q, sampling_probs(rows, p), req.state["generator"])
        accepted = len(tokens) - 1
        # K/V of the context and of the accepted drafts are valid; the rejected drafts' are not.
        req.num_computed = req.num_tokens + accepted
        self.block_manager.truncate(req.request_id, req.num_computed)
        for key, value in (("drafted", k), ("accepted", accepted), ("steps", 1)):
            req.state["spec_" + key] += value
            self.spec_counts[key] += value
        logprobs = [None] * len(tokens)
        if p.logprobs is not None:  # of the raw distribution, as the sampler reports them
            logprobs = token_logprobs(rows[:len(tokens)], torch.tensor(tokens, device=rows.device), p.logprobs)
        out = None
        for token, lp in zip(tokens, logprobs):
            out = merge_outputs(out, self._append(req, token, lp, False))
            if req.status == "finished":  # a stop among the accepted tokens: the rest is dropped
                break
        return out

    def _record_prompt_logprobs(self, req: Request, seq: StepSeq, rows: torch.Tensor) -> None:
        """Row j predicts the token at position start + j + 1; keep those inside the prompt."""
        store, n_prompt = req.state["prompt_logprobs"], len(req.prompt_ids)
        count = max(0, min(len(seq.token_ids), n_prompt - 1 - seq.start))
        if count:
            targets = torch.tensor(req.prompt_ids[seq.start + 1: seq.start + 1 + count], device=rows.device)
            for j, lp in enumerate(token_logprobs(rows[:count], targets, req.params.prompt_logprobs)):
                store[seq.start + 1 + j] = lp  # indexed by position: a recompute overwrites

    def _sample_input(self, req: Request) -> SampleInput:
        if req.params.has_penalties:
            return SampleInput(req.params, req.state["generator"], req.prompt_ids, req.output_ids)
        return SampleInput(req.params, req.state["generator"])

    def _append(self, req: Request, token: int, logprob: Optional[TokenLogprob], failed: bool) -> RequestOutput:
        if failed:
            self._finish(req, "error")
            return self._output(req, [], "", [], error="the model produced NaN or infinite logits for this request")
        req.token_ids.append(token)
        self.num_generated_tokens += 1
        p, detok = req.params, req.state["detok"]
        reason, text = None, ""
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            reason = "stop"  # the stop token's text is not part of the output
        elif detok is not None:
            text = detok.add(token)
            reason = "stop" if detok.stopped else None
        if reason is None and ((p.max_tokens is not None and len(req.output_ids) >= p.max_tokens)
                               or req.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            if detok is not None:
                text += detok.flush()
            self._finish(req, reason)
        return self._output(req, [token], text, [logprob] if logprob is not None else [])

    def _finish(self, req: Request, reason: str) -> None:
        self.scheduler.finish(req, reason)
        self.requests.pop(req.request_id, None)
        if self.drafter is not None:
            self.drafter.free(req.request_id)

    def _output(self, req: Request, tokens: list[int], text: str, logprobs: list[TokenLogprob],
                error: Optional[str] = None) -> RequestOutput:
        prompt_lps = None
        if req.state["prompt_logprobs"] is not None and not req.state["sent_prompt_logprobs"]:
            prompt_lps, req.state["sent_prompt_logprobs"] = req.state["prompt_logprobs"], True
        out = RequestOutput(req.request_id, tokens, text, req.status == "finished", req.finish_reason,
                            len(req.prompt_ids), len(req.output_ids), logprobs, prompt_lps, error,
                            req.num_cached_tokens)
        if out.finished and req.state["spec_steps"]:
            s = req.state
            out.spec_acceptance_rate, out.spec_mean_accepted_len = spec_rates(s["spec_drafted"], s["spec_accepted"],
                                                                              s["spec_steps"])
        return out

    # ---- conveniences -----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Offline: run prompts to completion; one accumulated RequestOutput per prompt, in order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{id(self)}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p)
        results = {rid: None for rid in ids}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id] = merge_outputs(results[out.request_id], out)
        return [results[rid] for rid in ids]

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_used": bm.num_used_blocks,
            "kv_block_size": bm.block_size,
            "prefix_cache_hit_rate": bm.prefix_cache_hit_rate,
            "preemptions": self.scheduler.num_preemptions,
            "generated_tokens": self.num_generated_tokens,
            "cuda_graphs": self.cuda_graphs,
            "max_model_len": self.max_model_len,
            # None without speculation (the /metrics collector then leaves them out)
            **dict(zip(("spec_acceptance_rate", "spec_mean_accepted_len"),
                       spec_rates(**self.spec_counts) if self.drafter is not None else (None, None))),
        }


def spec_rates(drafted: int, accepted: int, steps: int) -> tuple[float, float]:
    """(acceptance rate, mean accepted length = tokens per verification step, the target's own
    token included: what one target forward yields; 1.0 = no draft accepted)."""
    return accepted / drafted if drafted else 0.0, (accepted + steps) / steps if steps else 0.0


def merge_outputs(acc: Optional[RequestOutput], out: RequestOutput) -> RequestOutput:
    """Fold an incremental output into the accumulated one."""
    if acc is None:
        return RequestOutput(**{**vars(out), "new_token_ids": list(out.new_token_ids), "logprobs": list(out.logprobs)})
    acc.new_token_ids += out.new_token_ids
    acc.new_text += out.new_text
    acc.logprobs += out.logprobs
    acc.prompt_logprobs = acc.prompt_logprobs if out.prompt_logprobs is None else out.prompt_logprobs
    acc.finished, acc.finish_reason, acc.error = out.finished, out.finish_reason, out.error
    acc.num_generated_tokens = out.num_generated_tokens
    acc.spec_acceptance_rate, acc.spec_mean_accepted_len = out.spec_acceptance_rate, out.spec_mean_accepted_len
    return acc


# ---- loading ------------------------------------------------------------------------------------
def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: Optional[str], device: torch.device) -> torch.dtype:
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: choose auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[name]


def load_model_and_tokenizer(config: EngineConfig, device: Optional[torch.device] = None,
                             dtype: Optional[torch.dtype] = None):
    """Any checkpoint fitllm reads (dense or quantized), on the configured device (or `device`)."""
    from fitllm.models.hub import resolve_model
    from fitllm.models.tokenizer import load_tokenizer

    folder = resolve_model(config.model)
    device = device or pick_device(config.device)
    dtype = dtype or pick_dtype(config.dtype, device)
    try:
        from fitllm.quant import load_quantized_model
    except ImportError:
        try:
            from fitllm.quant.layers import load_quantized_model
        except ImportError:  # quant not built: dense checkpoints only
            from fitllm.models.loader import load_model as load_quantized_model
    model = load_quantized_model(folder, device, dtype)
    return model, load_tokenizer(folder)
