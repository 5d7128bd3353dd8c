"""Scheduler policy without a model: budgets, decode-first, chunked prefill, prefix hits, preemption."""
from __future__ import annotations

from fitllm.serve.block_manager import BlockManager
from fitllm.serve.sampling import SamplingParams
from fitllm.serve.scheduler import Request, Scheduler


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=16):
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget)


def req(rid, n, max_tokens=4, start=0):
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens))


def run_step(s: Scheduler):
    """What the engine does after the forward pass: count tokens, 'sample' for finished prompts."""
    out = s.schedule()
    s.update_after_step(out)
    for r in list(out.num_tokens):
        if r.num_computed == r.num_tokens:
            r.token_ids.append(1000 + len(r.output_ids))
            if len(r.output_ids) >= r.params.max_tokens:
                s.finish(r, "length")
    return out


def test_chunked_prefill_respects_the_budget_and_decodes_come_first():
    s = make(budget=16)
    a, b = req("a", 5), req("b", 40)
    s.add(a)
    s.add(b)
    out = run_step(s)
    assert out.num_tokens == {a: 5, b: 11}  # a whole, b's first chunk
    out = run_step(s)
    assert list(out.num_tokens.items()) == [(a, 1), (b, 15)]  # decode first, then b's next chunk
    assert sum(out.num_tokens.values()) <= 16
    while s.has_unfinished():
        out = run_step(s)
        assert sum(out.num_tokens.values()) <= 16
    assert s.bm.num_free_blocks == s.bm.num_blocks


def test_max_num_seqs_limits_admission():
    s = make(max_num_seqs=2, budget=64)
    reqs = [req(str(i), 3) for i in range(4)]
    for r in reqs:
        s.add(r)
    out = run_step(s)
    assert set(out.num_tokens) == set(reqs[:2]) and len(s.waiting) == 2


def test_prefix_cache_hit_skips_computed_blocks():
    s = make(block_size=4, budget=64)
    a = req("a", 13)
    s.add(a)
    while s.has_unfinished():
        run_step(s)
    b = req("b", 13)  # same 13 tokens: 3 full blocks cached, the last token must be recomputed
    s.add(b)
    out = run_step(s)
    assert out.num_tokens[b] == 1 and b.num_cached_tokens == 12
    c = req("c", 12)  # block-aligned: the last block is recomputed (one token must run)
    s.add(c)
    out = run_step(s)
    assert out.num_tokens[c] == 4 and s.bm.prefix_cache_hit_rate > 0


def test_preemption_evicts_the_newest_and_nothing_is_lost():
    # 6 blocks of 4 tokens; two requests that each grow to 12 tokens (3 blocks) do not both fit
    # alongside the third.
    s = make(num_blocks=6, block_size=4, budget=64)
    reqs = [req("a", 7, max_tokens=5, start=0), req("b", 7, max_tokens=5, start=50),
            req("c", 7, max_tokens=5, start=90)]
    for r in reqs:
        s.add(r)
    preempted = []
    steps = 0
    while s.has_unfinished():
        out = run_step(s)
        preempted += out.preempted
        steps += 1
        assert steps < 100, "no progress"
        assert s.bm.num_used_blocks <= 6
    assert preempted and preempted[0] is not reqs[0]  # the oldest is never the first victim
    assert all(r.status == "finished" and len(r.output_ids) == 5 for r in reqs)
    assert s.bm.num_free_blocks == 6 and not s.bm.seqs
    assert s.num_preemptions == len(preempted)


def test_finish_while_waiting_frees_nothing_twice():
    s = make(num_blocks=4, budget=64)
    a, b = req("a", 15), req("b", 15)
    s.add(a)
    s.add(b)
    run_step(s)
    assert b.status == "waiting"
    s.finish(b, "abort")
    s.finish(a, "abort")
    assert s.bm.num_free_blocks == 4 and not s.has_unfinished()
