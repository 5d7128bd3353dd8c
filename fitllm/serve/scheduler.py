"""The scheduler: each step, `{request: number of new tokens}` under a token budget.

A step is just tokens. Running requests come first, decodes (one token) before the chunks of
prompts still being prefilled, then waiting requests are admitted with chunks of their prompts
(chunked prefill: a long prompt never stalls the decodes). A new request's leading blocks
found in the prefix cache count as computed and are skipped.

When the pool runs out of blocks, the newest running request is preempted: its blocks go back
(their cached content stays findable), it returns to the head of the queue with everything it
has generated so far, and is later recomputed as a longer prompt. Nothing is dropped.

Speculative decoding: the engine appends a request's draft tokens to `token_ids` before
scheduling (`num_draft` of them). Such a request still counts as a decode, and its drafts are
all or nothing: if its 1 + k tokens do not fit the budget or the pool, the drafts are dropped
(never worth a preemption) and it decodes one token. Drafts never enter the prefix cache.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

from fitllm.serve.block_manager import BlockManager
from fitllm.serve.sampling import SamplingParams

_arrival = itertools.count()


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    num_computed: int = 0  # tokens whose K/V sit in the cache
    status: str = "waiting"  # waiting | running | finished
    finish_reason: Optional[str] = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_draft: int = 0  # speculative draft tokens at the end of token_ids, not yet verified
    cache_salt: Optional[int] = None  # prefix-cache chain root: blocks are shared only under the same one
    arrival: int = field(default_factory=lambda: next(_arrival))
    state: dict[str, Any] = field(default_factory=dict)  # the engine's per-request extras

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_output(self) -> int:
        """len(output_ids), without the copy."""
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def num_remaining(self) -> int:
        """Tokens still to be run through the model before the next one can be sampled."""
        return self.num_tokens - self.num_computed

    def drop_draft(self) -> None:
        if self.num_draft:
            del self.token_ids[-self.num_draft:]
            self.num_draft = 0


@dataclass
class SchedulerOutput:
    num_tokens: dict[Request, int]  # insertion order = batch order
    preempted: list[Request]

    def __bool__(self) -> bool:
        return bool(self.num_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_caching: bool = True):
        self.bm, self.prefix_caching = block_manager, prefix_caching
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is the newest
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput({}, [])
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:  # the pool was short a moment ago: do not admit more now
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Decodes first, each group in admission order.
        decodes, chunks = [], []
        for req in self.running:
            (chunks if len(req.token_ids) - req.num_computed - req.num_draft > 1 else decodes).append(req)
        for req in itertools.chain(decodes, chunks):
            if budget <= 0:
                break
            if req.status != "running":  # preempted earlier in this loop
                continue
            n = min(len(req.token_ids) - req.num_computed, budget)
            if req.num_draft and (n < req.num_remaining or not self.bm.can_allocate(req.request_id,
                                                                                     req.num_computed, n)):
                req.drop_draft()
                n = min(req.num_remaining, budget)
            if n == 0:
                continue
            while not self.bm.allocate(req.request_id, req.num_computed, n):
                victim = self.running[-1]
                budget += out.num_tokens.pop(victim, 0)
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.num_tokens[req] = n
                budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            prefix = self._cached_prefix(req)
            computed = len(prefix) * self.bm.block_size
            n = min(req.num_tokens - computed, budget)
            if not self.bm.allocate(req.request_id, computed, n, prefix, req.cache_salt):
                break  # wait for blocks to come back; keep arrival order
            self.waiting.popleft()
            self.bm.record_prefix_query(req.num_tokens, computed)
            if not req.num_preemptions:
                req.num_cached_tokens = computed
            req.num_computed, req.status = computed, "running"
            self.running.append(req)
            out.num_tokens[req] = n
            budget -= n

    def _cached_prefix(self, req: Request) -> list[int]:
        if not self.prefix_caching or req.state.get("needs_prompt_logits"):
            return []  # (prompt logprobs need the logits of every prompt position)
        # At least one token must run through the model to produce the next token's logits.
        return self.bm.match_prefix(req.request_id, req.token_ids, req.num_tokens - 1, req.cache_salt)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """The forward pass wrote K/V for the scheduled tokens: count them and cache full blocks."""
        cache_full_blocks = self.bm.cache_full_blocks
        for req, n in out.num_tokens.items():
            req.num_computed += n
            cache_full_blocks(req.request_id, req.token_ids, req.num_computed - req.num_draft)

    def preempt(self, req: Request) -> None:
        req.drop_draft()
        self.running.remove(req)
        self.bm.free(req.request_id)
        req.num_computed, req.status = 0, "waiting"
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Remove a request wherever it is and give its blocks back at once."""
        req.drop_draft()
        if req.status == "running":
            self.running.remove(req)
        elif req.status == "waiting":
            self.waiting.remove(req)
        self.bm.free(req.request_id)
        req.status, req.finish_reason = "finished", reason
