"""The engine: requests in, tokens out, one scheduler step at a time.

    step = schedule -> (copy-on-write copies) -> one forward over the flat batch -> count the
           computed tokens (full blocks join the prefix cache) -> prompt logprobs -> sample ->
           append, detokenize, check stop conditions -> incremental outputs

A request whose prompt is still being prefilled in chunks produces no output until its last
chunk; a preempted request simply waits and is recomputed, its generated tokens included.

One wait for the GPU per step: sampling (greedy, temperature, penalties, logprobs) is queued on
the device (`_queue_outputs`), the host does the step's bookkeeping while the GPU runs, then one
copy brings the sampled tokens and any requested logprobs over (`_apply_outputs`).

Look-ahead (`EngineConfig.async_scheduling`): in steady decode the next step's batch is known
before this step's tokens are: the same requests, one token each, one position further. Then
`step` queues step N + 1 on the GPU (input ids: step N's sampled tokens, still on the device)
before waiting for step N, so the GPU runs step N + 1 while the host applies step N's outputs and
returns them. Whatever the host does per step is hidden behind the GPU as long as it takes less.
A request that step N finishes by EOS or a stop string wastes its row in step N + 1. Where a
request's sampling follows its output (a JSON grammar's mask, penalties), step N + 1's forward is
queued ahead all the same, and its sampling once step N's tokens are applied (`_Deferred`): the
host builds the masks while the GPU runs the forward.

Speculative decoding (`EngineConfig.speculative`, see spec_decode.py) fits this loop without new
machinery: before scheduling, each request about to decode gets up to k draft tokens appended to
`req.token_ids` (`req.num_draft`); the scheduler gives it 1 + k tokens; `_step_seq` asks for
1 + k logit rows (the verification rows, computed over the paged cache like a prompt chunk);
greedy requests' verification rows go through the sampler with the other rows (their argmax);
`_accept` keeps a prefix of the draft plus one token of the target's, drops the draft from
`token_ids`, lowers `num_computed` to the verified tokens and rolls the rejected tokens' K/V
back with `block_manager.truncate`. Requests that do not speculate decode as usual in the same
batch; a step with no drafts at all keeps the CUDA-graph decode path. Not speculated (they
decode normally): requests with repetition/presence/frequency penalties (the penalties of
draft position i depend on drafts before it).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from dataclasses import replace
from typing import Optional, Union

import torch

from fitllm.budget import (KV_LAYOUTS, default_block_size, keeps_windows_only, longest_in_pages, page_geometry,
                           sliding_layers, splits_kv)
from fitllm.models.kv_cache import KVCalibration, check_kv_dtype
from fitllm.models.tokenizer import vocabulary_bytes
from fitllm.serve import json_mode
from fitllm.serve.block_manager import BlockManager, SplitBlockManager
from fitllm.serve.detokenizer import IncrementalDetokenizer
from fitllm.serve.model_runner import ModelRunner, StepSeq
from fitllm.serve.sampling import (DeviceSample, HostFetch, LogprobTensors, SampleInput, Sampler, SamplingParams,
                                   TokenLogprob, logprob_tensors, make_generator, to_device)
from fitllm.serve.scheduler import Request, Scheduler, SchedulerOutput
from fitllm.serve.spec_decode import (DraftItem, accept_greedy, build_drafter, check_speculative, rejection_sample,
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
    block_size: Optional[int] = None  # tokens per KV block; None: 64 for fp8 / int8 KV, else 16 (budget.default_block_size)
    max_model_len: Optional[int] = None  # None: the model's, capped by what the KV pool holds
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    num_kv_blocks: Optional[int] = None  # None: sized from memory
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # Sliding-window layers (Gemma 3): "split" gives them blocks of their own, given back behind each
    # sequence's window (SplitKVCache), "shared" keeps every token of every layer, "auto" splits where
    # the context is longer than the window (budget.splits_kv)
    kv_layout: str = "auto"
    cuda_graphs: bool = True
    kv_calibration: Optional[KVCalibration] = None  # K/V statistics for fp8/int4 KV (else measured)
    speculative: Optional[str] = None  # None | "ngram" | "self-int4" | "draft-model:PATH"
    quantization: Optional[str] = None  # int4 | fp8 | nf4: quantize a dense checkpoint as it loads
    num_speculative_tokens: int = 4  # k: draft tokens per step (a request may ask for fewer)
    async_scheduling: bool = True  # steady decode: queue step N + 1 on the GPU before step N's tokens are read
    warm_up: bool = True  # GPU: compile the kernels of each step size class before serving (see _warm_up)

    def __post_init__(self):
        check_speculative(self.speculative)
        if self.quantization is not None:
            from fitllm.quant.inplace import check_method

            check_method(self.quantization)
            if self.speculative == "self-int4":
                raise ValueError("--speculative self-int4 drafts with an int4 copy of a dense model; with "
                                 f"--quantization {self.quantization} the model is no longer dense")
        check_kv_dtype(self.kv_dtype)  # before the model loads, not when its cache is made
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, not {self.kv_layout!r}")
        if self.block_size is None:
            self.block_size = default_block_size(self.kv_dtype)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_speculative_tokens",
                     "max_model_len", "num_kv_blocks"):  # the last two: None means sized by the engine
            if getattr(self, name) is not None and getattr(self, name) < 1:
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
    stop_reason: Optional[Union[int, str]] = None  # the stop token id or stop string that ended it (vLLM); EOS: None


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
        self.max_model_len, num_blocks, page_layers = self._size_kv_cache()
        self.runner.allocate_cache(num_blocks, self.max_model_len, page_layers)
        if self.drafter is not None and self.drafter.needs_cache:
            self.drafter.allocate(num_blocks, config.max_num_seqs, self.max_model_len,
                                  config.max_num_batched_tokens, config.cuda_graphs)
        # Graphs for decode (q = 1) and, with speculation, verification of 1..k drafts (q = 2..k + 1).
        spec_k = config.num_speculative_tokens if self.drafter is not None else 0
        self.cuda_graphs = config.cuda_graphs and self.runner.capture_graphs(
            config.max_num_seqs, query_lens=tuple(range(1, spec_k + 2)),
            max_batched_tokens=config.max_num_batched_tokens)
        window = sliding_layers(self.model_config)[1]
        self._kv_split = None  # stats()'s: what a split cache is (it does not change)
        if page_layers is not None:
            self.block_manager = SplitBlockManager(num_blocks, config.block_size, window, self.runner.cache.widths)
            self._kv_split = {"page_layers": page_layers, "page_widths": self.block_manager.widths,
                              "longest_sequence": self._longest_in_pages(num_blocks)}
        else:  # (every layer sliding: one pool that gives back what falls behind the window)
            self.block_manager = BlockManager(num_blocks, config.block_size, window if self._window_only() else None)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   prefix_caching=config.enable_prefix_caching)
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self.eos_ids = set(self.model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self._outbox: list[RequestOutput] = []  # outputs produced between steps (aborts)
        self._json_grammar: Optional[json_mode.JsonGrammar] = None  # made in the GPU warm-up or when first needed
        self._inflight: Optional[tuple[SchedulerOutput, _Pending]] = None  # queued, outputs not read yet
        self._reset_counters()
        if config.warm_up and self.device.type == "cuda":
            self._warm_up()

    def _reset_counters(self) -> None:
        """The statistics `stats()` and /metrics report, from zero."""
        self.num_look_ahead_steps = 0
        self.num_generated_tokens = 0
        self.spec_counts = dict(drafted=0, accepted=0, steps=0)  # over all requests
        self.block_manager.query_tokens = self.block_manager.hit_tokens = 0
        self.scheduler.num_preemptions = 0

    def _warm_up(self) -> None:
        """Triton compiles each kernel config at its first use (seconds each on a machine whose
        cache is cold), and the GEMM and attention tables pick configs by step size: without this,
        the first requests of each size class wait for compilers (seen: TTFT p99 1-2 s at 4 req/s).
        One prompt per size class runs to two tokens (decode graphs are already captured; without
        graphs, one eager decode step per variant of the decode attention kernel follows); then the
        counters are reset. Its blocks stay in the prefix cache as evictable (random tokens)."""
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(0)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        for n in self._warm_up_lengths():
            n = min(n, self.max_model_len - 2, self.config.max_num_batched_tokens)
            if n > 0:
                self.generate([torch.randint(0, self.model_config.vocab_size, (n,), generator=gen).tolist()], params)
        if not self.cuda_graphs:  # eager decode steps meet every batch size: compile their attention now
            for runner in (self.runner, getattr(self.drafter, "runner", None)):
                if runner is not None:
                    runner.warm_up_decode(self.config.max_num_seqs)
        if self.tokenizer is not None:  # JSON mode's token bytes (~1 s for a 128k vocabulary): not mid-serving
            self.json_grammar()
        self._reset_counters()
        log.info("warm-up (kernel compilation per step size, JSON mode's vocabulary) took %.1f s",
                 time.perf_counter() - t0)

    def _warm_up_lengths(self) -> list[int]:
        """One prompt length per M row of the GEMM tables: the row's largest M (the GEMMs do not
        specialise on M, so one M compiles the whole row), the step budget for the last rows, and the
        last eager M below fp8's TMA kernel (such a row runs the pointer kernel there, fp8._tma_pays)."""
        from fitllm.kernels import fp8, w4a16, w4a16_tiled
        from fitllm.kernels._utils import gpu_arch, row_bounds

        arch = gpu_arch(self.device.index)
        tables = (w4a16_tiled.TILED_CONFIGS, w4a16_tiled.TILED8_CONFIGS, fp8.FP8_CONFIGS, w4a16.W4A16_CONFIGS,
                  w4a16.W8A16_CONFIGS)
        return sorted({m for t in tables for m in row_bounds(t, arch)}
                      | {self.config.max_num_batched_tokens, fp8.TMA_EAGER_MIN_M - 1})

    def _size_kv_cache(self) -> tuple[int, int, Optional[int]]:
        """(max_model_len, KV blocks (a split cache: pages), the layers a page holds or None: no split)."""
        c = self.config
        model_len = self.model_config.max_position_embeddings
        if c.max_model_len is not None:
            if c.max_model_len > model_len:
                log.warning("max_model_len %d exceeds the model's %d positions", c.max_model_len, model_len)
            model_len = c.max_model_len
        page_layers = self._split_page_layers(model_len)
        if page_layers is not None:
            num_blocks = c.num_kv_blocks or max(1, self.runner.kv_cache_bytes(
                c.max_num_seqs, model_len, c.max_num_batched_tokens, c.gpu_memory_utilization, c.cuda_graphs)
                // self.runner.page_bytes(page_layers))
            longest = self._longest_in_pages(num_blocks)
        else:
            num_blocks = c.num_kv_blocks or self.runner.choose_num_blocks(
                c.max_num_seqs, model_len, c.max_num_batched_tokens, c.gpu_memory_utilization, c.cuda_graphs)
            if c.num_kv_blocks is None and self.device.type == "cuda" and getattr(self.drafter, "needs_cache", False):
                # The drafter's cache holds the same tokens: split the KV memory between the two.
                target, draft = self.runner.bytes_per_block(), self.drafter.bytes_per_block()
                num_blocks = max(1, num_blocks * target // (target + draft))
            longest = num_blocks * c.block_size
        # One sequence must always fit alone, or preemption could not guarantee progress.
        if longest < model_len:
            log.warning("the KV cache holds %d tokens: max_model_len lowered from %d", longest, model_len)
        return min(model_len, longest), num_blocks, page_layers

    def _longest_in_pages(self, num_pages: int) -> int:
        """The most tokens one sequence can hold in a split cache of `num_pages` pages."""
        return longest_in_pages(num_pages, page_geometry(self.model_config)[1], sliding_layers(self.model_config)[1],
                                self.config.block_size)

    def _window_only(self) -> bool:
        """One pool that gives back what falls behind each window (budget.keeps_windows_only), where
        no draft model's cache shares its blocks."""
        return (keeps_windows_only(self.model_config, self.max_model_len, self.config.kv_layout)
                and not getattr(self.drafter, "needs_cache", False))

    def _split_page_layers(self, model_len: int) -> Optional[int]:
        """The layers a page of a split cache holds, where the model has both full-attention and
        sliding-window layers and c.kv_layout splits (budget.splits_kv); else None."""
        c = self.config
        if not splits_kv(self.model_config, model_len, c.kv_layout):
            return None
        if self.drafter is not None and self.drafter.needs_cache:
            if c.kv_layout == "split":
                raise ValueError("--kv-layout split: not with a draft model (its cache shares the target's blocks)")
            return None
        page_layers, (full, sliding) = page_geometry(self.model_config)
        num_sliding, window = sliding_layers(self.model_config)
        log.info("KV cache split: pages of %d layers; a block of the %d full-attention layers takes %d, one of the "
                 "%d sliding-window layers (window %d) %d, given back behind the window", page_layers,
                 self.model_config.num_layers - num_sliding, full, num_sliding, window, sliding)
        return page_layers

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
        if (params.stop or params.structured or params.tagged_json) and self.tokenizer is None:
            raise ValueError("stop strings and structured output (JSON) need a tokenizer; this engine has none")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    num_speculative_tokens: Optional[int] = None) -> None:
        """`num_speculative_tokens`: this request's k (default: the engine's; 0: no speculation)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_request(request_id, prompt_token_ids, params)
        # LongRoPE rotates a prompt past the original context with the long factors throughout: its
        # blocks must not serve a short prompt's prefix, nor the other way round
        long_from = self.model.rope_long_from
        req = Request(request_id, list(prompt_token_ids), params,
                      cache_salt=1 if long_from is not None and len(prompt_token_ids) > long_from else None)
        generator = make_generator(params.seed, self.device)
        schema = json_mode.schema_for(params.json_schema) if params.structured else None
        if params.tagged_json is not None:
            schema = json_mode.schema_for(params.tagged_json[0])
        req.state.update(
            generator=generator,
            sample_input=None if params.follows_output else SampleInput(params, generator),
            schema=schema,
            json=schema.start if params.structured else None,  # the automaton's configuration (tagged: in a value)
            needs_prompt_logits=params.prompt_logprobs is not None,
            prompt_logprobs=[None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None,
            detok=None if self.tokenizer is None else IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens,
                params.include_stop_str_in_output, params.min_tokens),
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
        return self.scheduler.has_unfinished() or bool(self._outbox) or self._inflight is not None

    # ---- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step and return its outputs. With `async_scheduling`, the next step may
        already be queued on the GPU when this returns (see `_look_ahead`)."""
        outputs, self._outbox = self._outbox, []
        if self._inflight is None:
            self._inflight = self._launch(outputs)
            if self._inflight is None:
                return outputs
        pending = self._inflight[1]
        self._inflight = self._look_ahead(pending) if self.config.async_scheduling else None
        outputs += self._apply_outputs(pending)  # the step's one wait for the GPU
        if self._inflight is not None:  # the next step's bookkeeping, now that this step's tokens are in
            sched, queued = self._inflight
            if isinstance(queued, _Deferred):  # its sampling, now that the masks / penalties can see them
                self._inflight = sched, self._queue_outputs(sched, queued.seqs, queued.logits)
            ahead = {r: n for r, n in self._inflight[0].num_tokens.items() if r.status == "running"}
            self.scheduler.update_after_step(SchedulerOutput(ahead, []))
        return outputs

    def _launch(self, outputs: list[RequestOutput]) -> Optional[tuple[SchedulerOutput, "_Pending"]]:
        """Schedule a step and queue it on the GPU: forward, sampling, the copy of its results.
        None when there is nothing to run (or the forward failed: error outputs in `outputs`)."""
        if self.drafter is not None:
            self._propose_drafts()
        sched = self.scheduler.schedule()
        if self.drafter is not None:
            for req in self.scheduler.running:  # drafts of a request left out of this step go stale
                if req.num_draft and req not in sched.num_tokens:
                    req.drop_draft()
        if not sched:
            return None
        seqs = [self._step_seq(req, n) for req, n in sched.num_tokens.items()]
        try:
            self.runner.sync_blocks(self.block_manager)
            logits = self.runner.execute(seqs)
        except Exception as exc:  # one broken step must not take the server down
            log.exception("the forward pass failed; failing the %d requests in the step", len(seqs))
            for req in list(sched.num_tokens):
                self._finish(req, "error")
                outputs.append(self._output(req, [], "", [], error=f"{exc.__class__.__name__}: {exc}"))
            return None
        pending = self._queue_outputs(sched, seqs, logits)  # sampling queued on the GPU
        self.scheduler.update_after_step(sched)  # host bookkeeping while the GPU works
        return sched, pending

    def _look_ahead(self, pending: "_Pending") -> Optional[tuple[SchedulerOutput, Union["_Pending", "_Deferred"]]]:
        """Queue step N + 1 behind step N on the GPU, before step N's tokens reach the host, when
        it can only be a decode of the same requests (`_look_ahead_batch`). Its input ids are step
        N's sampled tokens, on the device. A request that step N finishes (EOS, a stop string)
        wastes its row; its output is dropped. The bookkeeping (`update_after_step`) waits for
        step N's tokens: full blocks are hashed by their tokens."""
        reqs = self._look_ahead_batch(pending)
        if reqs is None:
            return None
        bm, sched, seqs = self.block_manager, SchedulerOutput({}, []), []
        for req in reqs:
            if not bm.allocate(req.request_id, req.num_computed, 1):
                return None  # (checked before; what was allocated is what the next step takes anyway)
            sched.num_tokens[req] = 1
            seqs.append(StepSeq([0], req.num_computed, bm.table(req.request_id), 1,  # token: on the device
                                window_table=self._window_table(req)))
        try:
            self.runner.sync_blocks(bm)
            logits = self.runner.execute(seqs, input_ids=pending.sampled.token_ids.clamp_min(0))
        except Exception:  # the next step runs the ordinary way (and reports a persistent failure)
            log.exception("queuing the next decode step ahead failed")
            return None
        self.num_look_ahead_steps += 1
        if any(req.params.follows_output for req in reqs):
            return sched, _Deferred(seqs, logits)
        return sched, self._queue_outputs(sched, seqs, logits, ahead=1)

    def _look_ahead_batch(self, pending: "_Pending") -> Optional[list[Request]]:
        """The requests of step N + 1 if they are certain now: every running request sampled one
        token in step N and none can finish by length with it, no waiting request can be admitted
        (none waits, or the batch is full: a request that step N finishes by EOS lets the next one
        in a step later), no speculation, and the pool has a block for each. Else None: the next
        step is scheduled after step N's tokens."""
        running = self.scheduler.running
        admits = self.scheduler.waiting and len(running) < self.config.max_num_seqs
        if (self.drafter is not None or admits or pending.fetch or pending.sampled is None
                or len(pending.todo) != len(running) or len(running) > self.block_manager.num_free_blocks):
            return None
        reqs = []
        for kind, req, _ in pending.todo:
            p = req.params
            if (kind != "sample" or req.status != "running"
                    or req.num_computed != len(req.token_ids) or len(req.token_ids) + 1 >= self.max_model_len
                    or (p.max_tokens is not None and req.num_output + 1 >= p.max_tokens)):
                return None
            reqs.append(req)
        return reqs

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
        if p.follows_output or req.num_output < p.min_tokens:  # verification rows ban no tokens
            return 0
        # Room for the accepted drafts plus the target's own token, within both length limits.
        room = self.max_model_len - req.num_tokens
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - len(req.output_ids))
        return max(0, min(req.state["spec_k"], room - 1))

    def _step_seq(self, req: Request, n: int) -> StepSeq:
        start = req.num_computed
        if req.num_draft:  # verification rows: the last real token and every draft token
            num_logits = 1 + req.num_draft
        elif req.state["needs_prompt_logits"]:
            num_logits = n  # every position: each predicts the next prompt token (or the first output)
        else:
            num_logits = 1 if start + n == len(req.token_ids) else 0
        return StepSeq(req.token_ids[start:start + n], start, self.block_manager.table(req.request_id), num_logits,
                       len(req.prompt_ids), self._window_table(req))

    def _window_table(self, req: Request) -> Optional[list[int]]:
        """The request's table in the sliding layers' pool of a split cache (else None)."""
        bm = self.block_manager
        return bm.window_table(req.request_id) if isinstance(bm, SplitBlockManager) else None

    def _queue_outputs(self, sched: SchedulerOutput, seqs: list[StepSeq], logits: torch.Tensor,
                       ahead: int = 0) -> "_Pending":
        """Queue on the GPU what the step's outputs need: sampled tokens (for greedy verification,
        the target's argmax of every verification row), logprobs, prompt logprobs. No waiting.
        `ahead`: output tokens sampled by steps whose results are not applied yet (a look-ahead: 1)."""
        pending = _Pending()
        rows, inputs, row = [], [], 0
        for (req, n), seq in zip(sched.num_tokens.items(), seqs):
            first, row = row, row + seq.num_logits
            if req.state["needs_prompt_logits"]:
                self._queue_prompt_logprobs(pending, req, seq, logits[first:row])
                if seq.start + n < len(req.token_ids):
                    continue  # more prompt chunks to go
                req.state["needs_prompt_logits"] = False
            elif seq.start + n < len(req.token_ids):
                continue  # more prompt chunks to go
            if req.params.max_tokens == 0:  # scoring only: no token to generate
                pending.todo.append(("scored", req, None))
            elif req.num_draft and req.params.greedy:
                pending.todo.append(("verify", req, len(rows)))
                rows += range(first, row)
                inputs += [SampleInput(req.params)] * (row - first)
            elif req.num_draft:  # temperature > 0: rejection sampling, on the device
                pending.todo.append(("verify_sampled", req, len(pending.fetch)))
                pending.fetch += self._queue_rejection_sampling(req, logits[first:row])
            elif seq.num_logits:
                pending.todo.append(("sample", req, len(rows)))
                rows.append(row - 1)
                inputs.append(self._sample_input(req, req.num_output + ahead))
        if rows:
            index = slice(rows[0], rows[0] + len(rows)) if rows == list(range(rows[0], rows[0] + len(rows))) \
                else to_device(rows, torch.long, logits.device)
            pending.sampled = self.sampler.sample(logits[index], inputs)
        lead = pending.sampled.tensors() if pending.sampled is not None else []
        pending.host = HostFetch(lead + pending.fetch)  # queued now: a step queued after it does not delay it
        return pending

    def _queue_prompt_logprobs(self, pending: "_Pending", req: Request, seq: StepSeq, rows: torch.Tensor) -> None:
        """Row j predicts the token at position start + j + 1; keep those inside the prompt."""
        count = max(0, min(len(seq.token_ids), len(req.prompt_ids) - 1 - seq.start))
        if count:
            targets = req.prompt_ids[seq.start + 1: seq.start + 1 + count]
            lps = logprob_tensors(rows[:count], to_device(targets, torch.long, rows.device), req.params.prompt_logprobs)
            pending.todo.append(("prompt_logprobs", req, (seq.start, targets, len(pending.fetch))))
            pending.fetch += lps.tensors()

    def _apply_outputs(self, pending: "_Pending") -> list[RequestOutput]:
        host = pending.host.wait()  # the one wait
        lead = len(pending.sampled.tensors()) if pending.sampled is not None else 0
        sampled = pending.sampled.from_host(host[:lead]) if lead else None
        host = host[lead:]
        outputs: list[RequestOutput] = []
        for kind, req, info in pending.todo:
            if req.status == "finished":  # aborted, or finished by the step before (a look-ahead row)
                continue
            if kind == "prompt_logprobs":
                start, targets, at = info
                found = LogprobTensors.to_list(targets, *host[at: at + 3], [req.params.prompt_logprobs] * len(targets))
                req.state["prompt_logprobs"][start + 1: start + 1 + len(found)] = found  # by position
            elif kind == "scored":
                self._finish(req, "length")
                outputs.append(self._output(req, [], "", []))
            elif kind == "sample":
                outputs.append(self._append(req, sampled.token_ids[info], sampled.logprobs[info], sampled.failed[info]))
            elif kind == "verify":
                best = sampled.token_ids[info: info + req.num_draft + 1]
                outputs.append(self._verify_greedy(req, best, sampled.logprobs[info: info + len(best)]))
            else:
                outputs.append(self._verify_sampled(req, host[info: info + 6]))
        return outputs

    def _verify_greedy(self, req: Request, best: list[int], logprobs: list[Optional[TokenLogprob]]) -> RequestOutput:
        """best[i]: the target's choice after draft[:i] (-1: non-finite logits)."""
        if min(best) < 0:
            req.drop_draft()
            return self._append(req, -1, None, failed=True)
        tokens = accept_greedy(req.token_ids[-req.num_draft:], best)
        return self._accept(req, tokens, logprobs[:len(tokens)])

    def _queue_rejection_sampling(self, req: Request, rows: torch.Tensor) -> list[torch.Tensor]:
        """rows [1 + k, vocab]: row i predicts the token after draft[:i]. Device tensors:
        [all rows finite, accepted count n, the token after them] (+ logprobs of the emitted tokens)."""
        k, p = req.num_draft, req.params
        finite = torch.isfinite(rows).all()
        rows = torch.where(finite, rows, torch.zeros((), device=rows.device))  # no NaN reaches the draws
        draft = to_device(req.token_ids[-k:], torch.long, rows.device)
        n, token = rejection_sample(draft, req.state.get("draft_probs"), sampling_probs(rows, p),
                                    req.state["generator"])
        out = [finite, n, token]
        if p.logprobs is not None:  # of the raw distribution, as the sampler reports them
            emitted = torch.where(torch.arange(k + 1, device=rows.device) == n, token, torch.cat([draft, token[None]]))
            out += logprob_tensors(rows, emitted, p.logprobs).tensors()
        return out

    def _verify_sampled(self, req: Request, host: list[torch.Tensor]) -> RequestOutput:
        """`host`: what `_queue_rejection_sampling` queued, on the host."""
        if not bool(host[0]):
            req.drop_draft()
            return self._append(req, -1, None, failed=True)
        n = int(host[1])
        tokens = req.token_ids[-req.num_draft:][:n] + [int(host[2])]
        logprobs = [None] * len(tokens)
        if req.params.logprobs is not None:
            chosen, top_ids, top_lp = (t[:len(tokens)] for t in host[3:6])
            logprobs = LogprobTensors.to_list(tokens, chosen, top_ids, top_lp, [req.params.logprobs] * len(tokens))
        return self._accept(req, tokens, logprobs)

    def _accept(self, req: Request, tokens: list[int], logprobs: list[Optional[TokenLogprob]]) -> RequestOutput:
        """Keep the accepted drafts plus one token of the target's (`tokens`: correction or
        bonus last); roll back the rejected drafts' K/V."""
        k = req.num_draft
        req.state.pop("draft_probs", None)
        req.drop_draft()
        accepted = len(tokens) - 1
        # K/V of the context and of the accepted drafts are valid; the rejected drafts' are not.
        req.num_computed = req.num_tokens + accepted
        self.block_manager.truncate(req.request_id, req.num_computed)
        for key, value in (("drafted", k), ("accepted", accepted), ("steps", 1)):
            req.state["spec_" + key] += value
            self.spec_counts[key] += value
        out = None
        for token, lp in zip(tokens, logprobs):
            out = merge_outputs(out, self._append(req, token, lp, False))
            if req.status == "finished":  # a stop among the accepted tokens: the rest is dropped
                break
        return out

    def _sample_input(self, req: Request, index: int) -> SampleInput:
        """The sampler's row for req's output token number `index` (from 0)."""
        p = req.params
        banned = self._stop_ids(p) if index < p.min_tokens else ()
        fixed = req.state.get("sample_input")  # the same every step unless its sampling follows the output
        if fixed is not None and not banned:
            return fixed
        if req.status == "finished":  # a look-ahead row of a request the step before finished: wasted
            return SampleInput(p, req.state["generator"])
        allowed = None
        if p.structured:
            allowed = self.json_grammar().mask(req.state["schema"], req.state["json"], self.device)
        elif p.tagged_json is not None and req.state["json"] is not None:  # inside a tagged value
            allowed = self._tagged_mask(req)
        if p.has_penalties:
            return SampleInput(p, req.state["generator"], req.prompt_ids, req.output_ids, banned, allowed)
        return SampleInput(p, req.state["generator"], banned=banned, allowed=allowed)

    def _tagged_mask(self, req: Request) -> torch.Tensor:
        """The value's mask, with the close tag where the value may end (in place of EOS)."""
        config, close = req.state["json"], req.params.tagged_json[2]
        allowed = self.json_grammar().mask(req.state["schema"], config, self.device)
        if json_mode.Schema.done(config):
            allowed = allowed.clone()
            allowed[sorted(self.eos_ids)] = False
            allowed[close] = True
        return allowed

    def _follow_grammar(self, req: Request, token: int) -> bool:
        """Advance the request's automaton by its new token; False where the token cannot come (the
        sampler's mask keeps such tokens out). Tagged: the open tag begins a value, the close tag
        ends it, text outside the tags is free."""
        p, config = req.params, req.state["json"]
        if p.structured:
            req.state["json"] = self.json_grammar().advance(req.state["schema"], config, token)
            return req.state["json"] is not None
        _, open_, close = p.tagged_json
        if config is None:
            if token == open_:
                req.state["json"] = req.state["schema"].start_spaced
            return True
        if token == close and json_mode.Schema.done(config):
            req.state["json"] = None
            return True
        req.state["json"] = self.json_grammar().advance(req.state["schema"], config, token)
        return req.state["json"] is not None and token not in self.eos_ids

    def json_grammar(self) -> json_mode.JsonGrammar:
        if self._json_grammar is None:
            self._json_grammar = json_mode.JsonGrammar(vocabulary_bytes(self.tokenizer),
                                                       self.model_config.vocab_size, self.eos_ids)
        return self._json_grammar

    def _stop_ids(self, p: SamplingParams) -> list[int]:
        """The tokens min_tokens bans: p's stop tokens and EOS, even with ignore_eos (as vLLM does)."""
        return sorted(set(p.stop_token_ids) | self.eos_ids)

    def _append(self, req: Request, token: int, logprob: Optional[TokenLogprob], failed: bool) -> RequestOutput:
        if failed:
            self._finish(req, "error")
            return self._output(req, [], "", [], error="the model produced NaN or infinite logits for this request")
        req.token_ids.append(token)
        self.num_generated_tokens += 1
        p, detok = req.params, req.state["detok"]
        if (p.structured or p.tagged_json is not None) and not self._follow_grammar(req, token):
            self._finish(req, "error")
            return self._output(req, [], "", [], error=f"structured output: token {token} does not continue "
                                "the JSON value")
        reason, text = None, ""
        eos = not p.ignore_eos and token in self.eos_ids
        if eos or token in p.stop_token_ids:
            reason = "stop"  # the stop token's text is not part of the output
            req.state["stop_reason"] = None if eos else token  # EOS first, as vLLM checks
        elif detok is not None:
            text = detok.add(token)
            reason = "stop" if detok.stopped else None
            req.state["stop_reason"] = detok.stop_string
        if reason is None and p.structured and json_mode.Schema.done(req.state["json"]):
            reason = "stop"  # the value is closed: nothing may follow (not even with ignore_eos)
        if reason is None and ((p.max_tokens is not None and req.num_output >= p.max_tokens)
                               or len(req.token_ids) >= self.max_model_len):
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
        prompt_lps, s = None, req.state
        if s["prompt_logprobs"] is not None and not s["sent_prompt_logprobs"]:
            prompt_lps, s["sent_prompt_logprobs"] = s["prompt_logprobs"], True
        out = RequestOutput(req.request_id, tokens, text, req.status == "finished", req.finish_reason,
                            len(req.prompt_ids), req.num_output, logprobs, prompt_lps, error,
                            req.num_cached_tokens, stop_reason=s.get("stop_reason"))
        if out.finished and s["spec_steps"]:
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
            # a split cache (None without): its blocks and pages, the pages its sliding-window layers hold
            "kv_split": self._kv_split,
            "kv_window_pages_used": bm.window_pages_used if isinstance(bm, SplitBlockManager) else None,
            "prefix_cache_hit_rate": bm.prefix_cache_hit_rate,
            "preemptions": self.scheduler.num_preemptions,
            "generated_tokens": self.num_generated_tokens,
            "cuda_graphs": self.cuda_graphs,
            "max_model_len": self.max_model_len,
            # None without speculation (the /metrics collector then leaves them out)
            **dict(zip(("spec_acceptance_rate", "spec_mean_accepted_len"),
                       spec_rates(**self.spec_counts) if self.drafter is not None else (None, None))),
        }


@dataclass
class _Deferred:
    """A look-ahead step whose forward is queued and whose sampling waits for the step before's
    tokens (a request in it samples by its output: a grammar's mask, penalties)."""

    seqs: list
    logits: torch.Tensor


@dataclass
class _Pending:
    """A step between queuing its outputs on the GPU and reading them back."""

    todo: list = field(default_factory=list)  # (kind, request, info), in the step's order
    fetch: list = field(default_factory=list)  # device tensors to bring over with the sampled tokens
    sampled: Optional[DeviceSample] = None
    host: Optional[HostFetch] = None  # the copy of `sampled` and `fetch` to the host, queued


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
    acc.stop_reason = out.stop_reason
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
    from fitllm.quant.layers import load_quantized_model

    folder = resolve_model(config.model)
    device = device or pick_device(config.device)
    dtype = dtype or pick_dtype(config.dtype, device)
    return load_quantized_model(folder, device, dtype, quantize=config.quantization), load_tokenizer(folder)
