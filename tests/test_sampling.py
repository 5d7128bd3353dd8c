"""The batched sampler on synthetic logits."""
from __future__ import annotations

import math

import pytest
import torch

from fitllm.serve.sampling import SampleInput, Sampler, SamplingParams, apply_penalties, make_generator

V = 32


def logits(rows=1, seed=0):
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def row(gen_seed=None, **kw):
    return SampleInput(SamplingParams(**kw), make_generator(gen_seed, "cpu"))


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    x = logits(4)
    out = Sampler()(x, [row(temperature=0), row(temperature=0.7, top_k=1), row(temperature=0), row(temperature=0)])
    assert out.token_ids == x.argmax(-1).tolist()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_plain_greedy_batches_take_the_one_kernel_path(backend, monkeypatch):
    """All rows greedy without bias, penalties or logprobs: fused.greedy_tokens, the same tokens
    (and the same failed rows) as the general path, which one row with logprobs forces."""
    monkeypatch.setenv("FITLLM_KERNEL_BACKEND", backend)
    x = logits(3, seed=7).bfloat16()
    x[2, 5] = float("inf")
    fast = Sampler()(x, [row(temperature=0)] * 3)
    general = Sampler()(x, [row(temperature=0)] * 2 + [row(temperature=0, logprobs=1)])
    assert fast.token_ids == general.token_ids and fast.failed == general.failed == [False, False, True]
    assert fast.token_ids[:2] == x[:2].float().argmax(-1).tolist()


def test_filters_keep_samples_inside_their_sets():
    x = logits(1, seed=1)
    order = x[0].argsort(descending=True).tolist()
    probs = torch.softmax(x[0], -1)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.6).sum()) + 1])
    min_p_set = {t for t in range(V) if probs[t] >= 0.2 * probs.max()}
    sampler = Sampler()
    rows = [row(5, top_k=3), row(6, top_p=0.6), row(7, min_p=0.2)]
    for _ in range(200):
        t = sampler(x.repeat(3, 1), rows).token_ids
        assert t[0] in order[:3] and t[1] in nucleus and t[2] in min_p_set


def test_temperature_sampling_follows_the_softmax():
    torch.manual_seed(0)  # the unseeded rows draw from the global generator
    x = logits(1, seed=2)
    p = torch.softmax(x[0] / 0.8, -1)
    r = row(123, temperature=0.8)
    n = 4000
    counts = torch.zeros(V)
    batch = SampleInput(r.params, r.generator)
    sampler = Sampler()
    for _ in range(n // 100):
        toks = sampler(x.repeat(100, 1), [SampleInput(r.params, None)] * 99 + [batch]).token_ids
        for t in toks:
            counts[t] += 1
    expected = p * n
    mask = expected > 5
    chi2 = (((counts - expected) ** 2 / expected)[mask]).sum().item()
    assert chi2 < 3 * int(mask.sum())  # loose: catches a wrong temperature or a biased draw


def test_seeded_rows_do_not_depend_on_the_batch():
    x = logits(5, seed=3)
    sampler = Sampler()
    g = row(42, temperature=1.0)
    alone = []
    for _ in range(20):
        alone.append(sampler(x[2:3], [g]).token_ids[0])
    g2 = row(42, temperature=1.0)
    together = []
    for i in range(20):
        others = [row(None, temperature=1.0, top_p=0.9) for _ in range(4)]
        rows = others[:i % 4] + [g2] + others[i % 4:]
        xs = torch.cat([x[:i % 4], x[2:3], x[i % 4:4]])
        together.append(sampler(xs, rows).token_ids[i % 4])
    assert alone == together


def test_penalties():
    x = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    r = SampleInput(SamplingParams(repetition_penalty=2.0), prompt_ids=[0], output_ids=[1])
    assert apply_penalties(x, [r]).tolist() == [[1.0, -4.0, 1.0, 0.5]]
    r = SampleInput(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt_ids=[2], output_ids=[3, 3, 0])
    assert apply_penalties(x, [r]).tolist() == [[2.0 - 0.75, -2.0, 1.0, 0.5 - 1.25]]


def test_logit_bias_and_logprobs_are_raw():
    x = logits(2, seed=4)
    out = Sampler()(x, [row(temperature=0, logit_bias={7: 100.0}, logprobs=3), row(temperature=0, logprobs=0)])
    assert out.token_ids[0] == 7
    lp = torch.log_softmax(x, -1)
    assert math.isclose(out.logprobs[0].logprob, lp[0, 7].item(), rel_tol=1e-5)  # before the bias
    top = out.logprobs[0].top
    assert [t for t, _ in top] == lp[0].topk(3).indices.tolist() and len(top) == 3
    assert out.logprobs[1].top == [] and out.logprobs[1].token_id == out.token_ids[1]


def test_banned_tokens_are_never_sampled_and_leave_the_logprobs_raw():
    """min_tokens' bans (SampleInput.banned): a greedy row takes the best token left, a sampled row
    never draws a banned one, and the reported logprobs are the raw distribution's."""
    x = logits(2, seed=8)
    best = x.argsort(-1, descending=True)
    banned = best[0, :2].tolist()
    out = Sampler()(x, [SampleInput(SamplingParams(temperature=0, logprobs=1), banned=banned), row(temperature=0)])
    assert out.token_ids == [best[0, 2].item(), best[1, 0].item()]  # the other row is untouched
    assert math.isclose(out.logprobs[0].top[0][1], torch.log_softmax(x[0], -1)[best[0, 0]].item(), rel_tol=1e-5)
    hot = SampleInput(SamplingParams(temperature=5.0), make_generator(9, "cpu"), banned=best[0, :V - 3].tolist())
    drawn = {Sampler()(x[:1], [hot]).token_ids[0] for _ in range(100)}
    assert drawn == set(best[0, V - 3:].tolist())  # every allowed token comes up at this temperature


def test_non_finite_logits_fail_only_their_row():
    x = logits(3, seed=5)
    x[1, 4] = float("nan")
    out = Sampler()(x, [row(temperature=0), row(temperature=0), row(1, temperature=1.0)])
    assert out.failed == [False, True, False]
    assert out.token_ids[1] == -1 and out.token_ids[0] == x[0].argmax().item()


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(logprobs=50), dict(logit_bias={V: 1.0}),
                                 dict(stop=[""]), dict(max_tokens=-1), dict(min_tokens=-1),
                                 dict(max_tokens=4, min_tokens=5)])
def test_validation_messages(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad).validate(V)
