"""Speculative decoding: drafters propose k tokens, one target forward verifies them.

The accept/reject rule keeps the output distribution exactly the target's: token i of the draft
(drawn from q) is accepted with probability min(1, p/q); on the first rejection a token is drawn
from normalize(max(0, p - q)); if all k are accepted, a bonus token is drawn from the target's
next distribution. At temperature 0 this reduces to "accept while draft == target argmax".
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch


class Drafter(Protocol):
    def propose(self, token_ids: list[int], k: int) -> tuple[list[int], Optional[torch.Tensor]]:
        """Up to k draft tokens continuing `token_ids`, and their draft probabilities [n, vocab]
        (None for deterministic drafters, whose q is one-hot)."""


class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the context's last n tokens
    (longest n first) and propose what followed it. Free, and strong on edits and summaries."""

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, token_ids: list[int], k: int) -> tuple[list[int], None]:
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = token_ids[length - n:]
            # Scan right to left so the most recent match wins; stop before the suffix itself.
            for start in range(length - n - 1, -1, -1):
                if token_ids[start:start + n] == suffix:
                    follow = token_ids[start + n:start + n + k]
                    if follow:
                        return follow, None
        return [], None


def accept_greedy(draft: list[int], target_logits: torch.Tensor) -> list[int]:
    """target_logits [len(draft) + 1, vocab]: row i predicts the token after draft[:i].
    Returns the accepted draft prefix plus the target's own next token (always >= 1 token)."""
    best = target_logits.argmax(-1).tolist()
    out = []
    for i, tok in enumerate(draft):
        if tok != best[i]:
            out.append(best[i])
            return out
        out.append(tok)
    out.append(best[len(draft)])
    return out


def accept_sampled(draft: list[int], draft_probs: Optional[torch.Tensor], target_probs: torch.Tensor,
                   generator: Optional[torch.Generator] = None) -> list[int]:
    """Rejection sampling. target_probs [len(draft) + 1, vocab] (after temperature/top-p etc.);
    draft_probs [len(draft), vocab] or None for a deterministic (one-hot) drafter."""
    device = target_probs.device
    out = []
    for i, tok in enumerate(draft):
        p = target_probs[i]
        q = draft_probs[i] if draft_probs is not None else _one_hot(tok, p)
        ratio = (p[tok] / q[tok]).clamp(max=1.0) if q[tok] > 0 else p.new_tensor(0.0)
        if torch.rand((), generator=generator, device=device) < ratio:
            out.append(tok)
            continue
        residual = (p - q).clamp(min=0)
        total = residual.sum()
        # p == q exactly leaves no residual mass; then any draw from p is correct.
        dist = residual / total if total > 0 else p
        out.append(int(torch.multinomial(dist, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[len(draft)], 1, generator=generator)))
    return out


def _one_hot(tok: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[tok] = 1.0
    return q
