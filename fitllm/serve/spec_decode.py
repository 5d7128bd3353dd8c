"""Speculative decoding: drafters propose k tokens, one target forward verifies them.

The accept/reject rule keeps the output distribution exactly the target's: token i of the draft
(drawn from q) is accepted with probability min(1, p/q); on the first rejection a token is drawn
from normalize(max(0, p - q)); if all k are accepted, a bonus token is drawn from the target's
next distribution. At temperature 0 this reduces to "accept while draft == target argmax".
p and q are both taken after the request's own sampling transforms (logit bias, temperature,
top-k, top-p, min-p: `sampling_probs`), so what is preserved is the distribution the request
would have sampled from without speculation.

Drafters (`build_drafter`):
- `NgramDrafter` ("ngram"): prompt lookup, no model, deterministic (q is one-hot).
- `DraftModelDrafter` ("self-int4", "draft-model:PATH"): a smaller model sharing the tokenizer,
  with its own paged KV cache and block tables mirroring each request's tokens. It drafts
  greedily at temperature 0, else samples from its own q. Rollback is lazy: at the next
  proposal the drafter keeps the longest prefix it computed that still matches the request's
  tokens and truncates the rest (rejected drafts, anything else that changed).
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Hashable, Optional, Protocol, Sequence

import torch
import torch.nn.functional as F

from fitllm.serve.block_manager import BlockManager
from fitllm.serve.model_runner import ModelRunner, StepSeq
from fitllm.serve.sampling import SampleInput, SamplingParams, apply_logit_bias, fetch_to_host, filter_logits

SPECULATIVE_CHOICES = "ngram | self-int4 | draft-model:PATH"


@dataclass
class DraftItem:
    """One request asking for up to k draft tokens after `token_ids`."""

    seq_id: Hashable
    token_ids: list[int]
    k: int
    params: SamplingParams
    generator: Optional[torch.Generator] = None


@dataclass
class Draft:
    token_ids: list[int]
    probs: Optional[torch.Tensor] = None  # q [len(token_ids), vocab]; None: deterministic (one-hot)


class Drafter(Protocol):
    needs_cache: bool  # a KV cache of its own, sized beside the target's

    def propose_batch(self, items: Sequence[DraftItem]) -> list[Draft]: ...

    def free(self, seq_id: Hashable) -> None: ...


# ---- the n-gram drafter -----------------------------------------------------------------------
class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the context's last n tokens
    (longest n first) and propose what followed it. Free, and strong on edits and summaries."""

    needs_cache = False

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, token_ids: list[int], k: int) -> tuple[list[int], None]:
        # Search the tokens as 4-byte strings: bytes.rfind runs in C (a Python scan of a 4k-token
        # context costs milliseconds, as much as a large model's decode step).
        data, length = array("i", token_ids).tobytes(), len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # The most recent earlier occurrence, ending before the last token (not the suffix itself).
            start = _rfind_tokens(data, data[4 * (length - n):], 4 * (length - 1))
            if start >= 0:
                return token_ids[start + n:start + n + k], None
        return [], None

    def propose_batch(self, items: Sequence[DraftItem]) -> list[Draft]:
        return [Draft(self.propose(it.token_ids, it.k)[0]) for it in items]

    def free(self, seq_id: Hashable) -> None:
        pass


# ---- the draft-model drafter ------------------------------------------------------------------
class DraftModelDrafter:
    """A draft model with its own paged KV cache. Per proposal: one catch-up step (the tokens its
    cache lacks; the first time, the whole context) whose last row gives draft 1, then k - 1
    decode steps, each batched over all requests still drafting. On a GPU both replay CUDA
    graphs: after a verification the catch-up is 1 or 2 tokens per sequence (the last accepted
    draft, which was never fed back, and the target's token), captured as q = 2. Each step waits
    for the GPU once, for all of its draft tokens."""

    needs_cache = True

    def __init__(self, model, block_size: int, target_vocab: int):
        self.model, self.block_size, self.vocab = model, block_size, target_vocab
        if model.config.vocab_size > target_vocab:
            raise ValueError(f"the draft model's vocabulary ({model.config.vocab_size}) is larger than the "
                             f"target's ({target_vocab}): they cannot share a tokenizer")
        self.runner = ModelRunner(model, block_size)  # its own KV in its own dtype
        self.bm: Optional[BlockManager] = None
        self.seen: dict[Hashable, list[int]] = {}  # per sequence: the tokens whose K/V we hold
        self.max_batched_tokens = 2048

    def bytes_per_block(self) -> int:
        return self.runner.bytes_per_block()

    def allocate(self, num_blocks: int, max_num_seqs: int, max_model_len: int, max_batched_tokens: int,
                 cuda_graphs: bool) -> None:
        self.runner.allocate_cache(num_blocks, max_model_len)
        self.bm = BlockManager(num_blocks, self.block_size)
        self.max_batched_tokens = max_batched_tokens
        if cuda_graphs:
            self.runner.capture_graphs(max_num_seqs, query_lens=(1, 2),
                                       max_batched_tokens=max_batched_tokens)

    def free(self, seq_id: Hashable) -> None:
        self.seen.pop(seq_id, None)
        self.bm.free(seq_id)

    def propose_batch(self, items: Sequence[DraftItem]) -> list[Draft]:
        drafts = [Draft([]) for _ in items]
        live, logits = self._catch_up(items)
        qs: list[list[Optional[torch.Tensor]]] = [[] for _ in items]
        while live:
            for i, (tok, q) in zip(live, self._sample(logits, [items[i] for i in live])):
                drafts[i].token_ids.append(tok)
                qs[i].append(q)
            live = [i for i in live if len(drafts[i].token_ids) < items[i].k]
            if live:  # feed each draft back in (its K/V is needed for the next one)
                logits = self._run([self._feed(items[i].seq_id, drafts[i].token_ids[-1]) for i in live])
        for d, q in zip(drafts, qs):
            d.probs = torch.stack(q) if q and q[0] is not None else None
        return drafts

    def _catch_up(self, items: Sequence[DraftItem]) -> tuple[list[int], Optional[torch.Tensor]]:
        """Run each request's tokens the cache lacks, under the step budget. Returns the
        indices of the requests whose context is now complete, and their last-position logits."""
        seqs, ran, live, budget = [], [], [], self.max_batched_tokens
        for i, it in enumerate(items):
            start, prefix = self._sync(it.seq_id, it.token_ids)
            n = min(len(it.token_ids) - start, budget)
            if n <= 0:
                continue  # the step budget is spent: catch up next time
            done = start + n == len(it.token_ids)
            room = n + it.k - 1 if done else n  # the fed-back drafts need slots too
            if not self.bm.allocate(it.seq_id, start, room, prefix):
                self.free(it.seq_id)  # no room in our pool: draft nothing now, recompute later
                continue
            budget -= n
            self.seen[it.seq_id] = it.token_ids[:start + n]
            seqs.append(StepSeq(it.token_ids[start:start + n], start, self.bm.table(it.seq_id), int(done)))
            ran.append(it)
            if done:
                live.append(i)
        if not seqs:
            return [], None
        logits = self._run(seqs)
        for it in ran:  # blocks full of context (never drafts) join our prefix cache
            self.bm.cache_full_blocks(it.seq_id, it.token_ids, len(self.seen[it.seq_id]))
        return live, logits

    def _sync(self, seq_id: Hashable, token_ids: list[int]) -> tuple[int, list[int]]:
        """How many leading tokens of `token_ids` our cache holds; rolls back the rest."""
        seen = self.seen.get(seq_id)
        if seen is None:  # new to us: start from cached prefix blocks, like the scheduler
            prefix = self.bm.match_prefix(seq_id, token_ids, len(token_ids) - 1)
            return len(prefix) * self.block_size, prefix
        # At least the last token must run: its logits give the first draft.
        keep = min(common_prefix_len(seen, token_ids), len(token_ids) - 1)
        if keep < len(seen):
            self.bm.truncate(seq_id, keep)
            del seen[keep:]
        return keep, []

    def _feed(self, seq_id: Hashable, token: int) -> StepSeq:
        seen = self.seen[seq_id]
        seen.append(token)
        return StepSeq([token], len(seen) - 1, self.bm.table(seq_id), 1)

    def _run(self, seqs: list[StepSeq]) -> torch.Tensor:
        self.runner.copy_blocks(self.bm.take_copies())
        logits = self.runner.execute(seqs)
        if logits.shape[-1] < self.vocab:  # tokens the drafter cannot produce get q = 0
            logits = F.pad(logits, (0, self.vocab - logits.shape[-1]), value=float("-inf"))
        return logits

    @staticmethod
    def _sample(logits: torch.Tensor, items: Sequence[DraftItem]) -> list[tuple[int, Optional[torch.Tensor]]]:
        """One draft token per row (q: the distribution it came from; None when greedy, the greedy
        verifier compares tokens only), brought to the host with one wait."""
        tokens = apply_logit_bias(logits, [SampleInput(it.params) for it in items]).argmax(-1)
        qs: list[Optional[torch.Tensor]] = [None] * len(items)
        for i, (row, it) in enumerate(zip(logits, items)):
            if not it.params.greedy:
                qs[i] = sampling_probs(row[None], it.params)[0]
                tokens[i] = draw(qs[i], it.generator)
        return list(zip(fetch_to_host([tokens])[0].tolist(), qs))


def _rfind_tokens(data: bytes, needle: bytes, end: int) -> int:
    """Token index of the last occurrence of `needle` within data[:end], aligned to whole tokens; -1 if none."""
    while (pos := data.rfind(needle, 0, end)) >= 0 and pos % 4:
        end = pos + len(needle) - 1  # a match straddling tokens: look further left
    return pos // 4 if pos >= 0 else -1


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    return next(i for i in range(n) if a[i] != b[i])


# ---- building drafters -------------------------------------------------------------------------
def check_speculative(spec: Optional[str]) -> None:
    if spec is None or spec in ("ngram", "self-int4", "draft-model") or spec.startswith("draft-model:"):
        return
    raise ValueError(f"speculative {spec!r}: choose {SPECULATIVE_CHOICES}")


def build_drafter(spec: str, target, block_size: int, draft_model=None, load_model=None) -> Drafter:
    """`draft_model`: an already loaded model for "draft-model" (tests); `load_model(path)`
    loads "draft-model:PATH" on the target's device and dtype."""
    check_speculative(spec)
    if spec == "ngram":
        return NgramDrafter()
    if spec == "self-int4":
        from fitllm.quant.inplace import quantized_copy

        draft_model = quantized_copy(target, "int4")
        if draft_model.device.type == "cpu":
            dense_linears(draft_model)
    elif spec.startswith("draft-model:"):
        draft_model = load_model(spec.split(":", 1)[1])
    elif draft_model is None:
        raise ValueError("speculative 'draft-model' needs a draft model (or use draft-model:PATH)")
    return DraftModelDrafter(draft_model, block_size, target.config.vocab_size)


def dense_linears(model) -> None:
    """Store quantized linears as their dequantized weights, in place. On the CPU these are the
    values the reference GEMM computes with, without unpacking every weight on every call (~50x
    faster); benchmarks/act_order_check.py uses it on the GPU as a torch reference."""
    from fitllm.models.linear import DenseLinear

    for name, layer in model.fused_linears().items():
        if isinstance(layer, DenseLinear) or not hasattr(layer, "dequantized_weight"):
            continue
        dense = DenseLinear(layer.prefix, layer.in_features, layer.out_sizes, layer.bias is not None,
                            dtype=model.dtype, device=model.device)
        dense.weight.data.copy_(layer.dequantized_weight())
        if layer.bias is not None:
            dense.bias.data.copy_(layer.bias)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, dense)


# ---- acceptance --------------------------------------------------------------------------------
def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the sampler draws from for these rows (penalties excluded: they depend on
    the tokens before each row, so penalised requests do not speculate)."""
    rows = [SampleInput(params)] * logits.shape[0]
    x = apply_logit_bias(logits.float(), rows) / params.temperature
    return torch.softmax(filter_logits(x, [params] * logits.shape[0]), dim=-1)


def accept_greedy(draft: list[int], target_best: list[int]) -> list[int]:
    """target_best[i]: the target's greedy token after draft[:i] (len(draft) + 1 of them).
    Returns the accepted draft prefix plus the target's own next token (always >= 1 token)."""
    out = []
    for i, tok in enumerate(draft):
        if tok != target_best[i]:
            out.append(target_best[i])
            return out
        out.append(tok)
    out.append(target_best[len(draft)])
    return out


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What to sample from after a rejection: normalize(max(0, p - q)), per row."""
    residual = (p - q).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    # p == q exactly leaves no residual mass; then any draw from p is correct.
    return torch.where(total > 0, residual / total.clamp_min(1e-30), p)


def draw(probs: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row of `probs`, on the device (argmax of p / Exp(1) noise: torch.multinomial
    would check its input with a wait for the GPU)."""
    noise = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(1e-20)
    return (probs / noise).argmax(-1)


def rejection_sample(draft: torch.Tensor, draft_probs: Optional[torch.Tensor], target_probs: torch.Tensor,
                     generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The accept/reject rule on the device, without waiting: draft [k] token ids, draft_probs
    [k, vocab] (None: a deterministic drafter, q one-hot), target_probs [k + 1, vocab] (after
    temperature/top-p etc.). Returns (n, token): the first n drafts are accepted, then `token`
    (drawn from normalize(max(0, p - q)) at the first rejection, or from p after all k).
    A correction candidate is drawn at every position, independently of the accept draws, and
    the one at position n is used: the same distribution as drawing it after the rejection."""
    k = draft.shape[0]
    p = target_probs[:k]
    q = draft_probs if draft_probs is not None else F.one_hot(draft, p.shape[-1]).to(p.dtype)
    p_tok, q_tok = p.gather(1, draft[:, None])[:, 0], q.gather(1, draft[:, None])[:, 0]
    ratio = torch.where(q_tok > 0, p_tok / q_tok.clamp_min(1e-30), torch.zeros_like(p_tok)).clamp(max=1.0)
    rejected = torch.rand(k, generator=generator, device=p.device) >= ratio
    # The first rejection (argmax returns the first maximum), or k when every draft is accepted.
    n = torch.where(rejected.any(), rejected.int().argmax(), torch.full((), k, device=p.device))
    candidates = draw(torch.cat([residual_distribution(p, q), target_probs[k:k + 1]]), generator)
    return n, candidates.gather(0, n.view(1)).squeeze(0)  # (candidates[n] would read n on the host)


def accept_sampled(draft: list[int], draft_probs: Optional[torch.Tensor], target_probs: torch.Tensor,
                   generator: Optional[torch.Generator] = None) -> list[int]:
    """`rejection_sample` on the host: the accepted drafts plus the correction or bonus token."""
    n, token = rejection_sample(torch.tensor(draft, dtype=torch.long, device=target_probs.device), draft_probs,
                                target_probs, generator)
    n, token = fetch_to_host([n, token])
    return draft[:int(n)] + [int(token)]
