"""The speculative accept/reject rules: lossless by construction, checked statistically."""
from __future__ import annotations

import torch

from fitllm.serve.spec_decode import NgramDrafter, accept_greedy, accept_sampled


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    ctx = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 3, 4, 5, 6, 7]
    # suffix [5,6,7] last occurred at index 7 and was followed by 3, 4
    assert NgramDrafter(max_n=3).propose(ctx, 2) == ([3, 4], None)
    assert NgramDrafter().propose([1, 2, 3], 4) == ([], None)


def test_greedy_acceptance_stops_at_first_mismatch():
    logits = torch.full((4, 10), -5.0)
    for row, best in enumerate([3, 4, 9, 2]):
        logits[row, best] = 5.0
    best = logits.argmax(-1).tolist()
    assert accept_greedy([3, 4, 5], best) == [3, 4, 9]
    assert accept_greedy([3, 4, 9], best) == [3, 4, 9, 2]


def _first_token_histogram(draft_probs, target_probs, trials, generator, sampler=accept_sampled):
    vocab = target_probs.shape[-1]
    counts = torch.zeros(vocab)
    for _ in range(trials):
        draft = [int(torch.multinomial(draft_probs[0], 1, generator=generator))]
        counts[sampler(draft, draft_probs, target_probs, generator)[0]] += 1
    return counts


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    stat = ((counts.double() - expected) ** 2 / expected).sum()
    dof = torch.tensor(len(counts) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))  # chi-square survival function


def _toy_distributions():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2, 6, generator=g) * 1.5, -1)  # target: token 0 and bonus
    q = torch.softmax(torch.randn(1, 6, generator=g) * 1.5, -1)  # a different draft distribution
    return p, q


def test_sampled_acceptance_reproduces_the_target_distribution():
    p, q = _toy_distributions()
    g = torch.Generator().manual_seed(1)
    counts = _first_token_histogram(q, p, 6000, g)
    assert _chi_square_p(counts, p[0]) > 0.001


def test_the_statistical_test_catches_a_missing_correction(monkeypatch):
    """Resampling from p instead of max(0, p - q) biases towards the draft: the test must see it."""
    p, q = _toy_distributions()

    def broken(draft, draft_probs, target_probs, generator=None):
        tok = draft[0]
        if torch.rand((), generator=generator) < (target_probs[0, tok] / draft_probs[0, tok]).clamp(max=1):
            return [tok]
        return [int(torch.multinomial(target_probs[0], 1, generator=generator))]

    g = torch.Generator().manual_seed(1)
    counts = _first_token_histogram(q, p, 6000, g, sampler=broken)
    assert _chi_square_p(counts, p[0]) < 1e-6
