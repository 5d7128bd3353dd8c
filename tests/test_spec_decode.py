"""Speculative decoding through the real engine: lossless at temperature 0 (token-identical) and
above it (the sampled distribution is the target's), rollback leaves no block behind."""
from __future__ import annotations

import pytest
import torch

from fitllm.models.config import ModelConfig
from fitllm.models.decoder import CausalLM
from fitllm.models.generate import prompt_logits
from fitllm.models.kv_cache import NoCacheContext
from fitllm.quant.inplace import quantized_copy
from fitllm.serve import spec_decode
from fitllm.serve.engine import EngineConfig, LLMEngine
from fitllm.serve.spec_decode import dense_linears, sampling_probs
from fitllm.serve.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
CFG = dict(max_num_batched_tokens=32, block_size=8, num_kv_blocks=160, max_model_len=512)


def make_engine(model, tokenizer=None, draft_model=None, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(**{**CFG, **kw}), model=model, tokenizer=tokenizer, draft_model=draft_model)


def assert_all_blocks_back(eng: LLMEngine) -> None:
    assert eng.stats()["kv_blocks_used"] == 0 and not eng.block_manager.seqs
    bm = getattr(eng.drafter, "bm", None)
    if bm is not None:
        assert bm.num_used_blocks == 0 and not bm.seqs and not eng.drafter.seen


@pytest.fixture(scope="module")
def int4_drafter(embedded_model):
    model = quantized_copy(embedded_model, "int4")
    dense_linears(model)
    return model


@pytest.fixture(scope="module")
def prompts(embedded_tokenizer):
    """16 prompts of mixed lengths, half of them repetitive (what n-gram drafts thrive on)."""
    enc = lambda s: embedded_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    texts = [code + "# The same two functions, with type hints:\n",
             "Summarise: The cat sat on the mat. The cat was happy. The cat slept.\nSummary: The cat",
             "1, 2, 3, 4, 5, 6, 7, 8,", "Hello", "Once upon a time",
             "Copy this list: apples, pears, plums, cherries.\nCopy: apples,",
             "What is the capital of France?", "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [",
             "Why is the sky blue?", code, "Name three colours.", "The quick brown fox jumps over the lazy dog. " * 2,
             "a b c d a b c d a b", "Translate 'cat' to German.", "2+2=", "for i in range(10):\n    print(i)\n" * 2]
    return [enc(t) for t in texts]


@pytest.fixture(scope="module")
def reference(embedded_model, embedded_tokenizer, prompts):
    """Greedy tokens and logprobs without speculation."""
    params = SamplingParams(**{**vars(GREEDY), "logprobs": 1})
    outs = make_engine(embedded_model, embedded_tokenizer).generate(prompts, params)
    return [o.new_token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]


@pytest.mark.parametrize("speculative", ["ngram", "self-int4"])
def test_greedy_alone_is_token_identical(embedded_model, embedded_tokenizer, prompts, reference, speculative):
    eng = make_engine(embedded_model, embedded_tokenizer, speculative=speculative)
    params = SamplingParams(**{**vars(GREEDY), "logprobs": 1})
    out = eng.generate([prompts[0]], params)[0]
    assert out.new_token_ids == reference[0][0]
    assert [lp.logprob for lp in out.logprobs] == pytest.approx(reference[1][0], abs=1e-4)
    assert out.spec_acceptance_rate > 0.3 and out.spec_mean_accepted_len > 1.5  # drafts were accepted
    stats = eng.stats()
    assert stats["spec_acceptance_rate"] == out.spec_acceptance_rate and stats["spec_mean_accepted_len"] > 1.5
    assert_all_blocks_back(eng)


@pytest.mark.parametrize("speculative", ["ngram", "draft-model"])
def test_greedy_batch_of_16_mixed_requests(embedded_model, embedded_tokenizer, int4_drafter, prompts, reference,
                                           speculative):
    """Staggered arrivals, chunked prefill (32-token steps: drafts compete with prefills for the
    budget), per-request k (0 = no speculation), a penalised request (never speculates) and one
    that stops on a token the drafts run past."""
    eng = make_engine(embedded_model, embedded_tokenizer, int4_drafter, speculative=speculative)
    tokens = reference[0]
    stop_id = tokens[2][6]
    ks = [4, 0, 2, 6, 4, 1, 0, 3, 4, 5, 0, 4, 6, 2, 4, 4]
    params = [GREEDY] * 16
    params[5] = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.0001)
    params[2] = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[stop_id])
    results: dict[str, list[int]] = {}
    for step in range(10_000):
        if step in (0, 3, 6):
            for i in range(step // 3 * 5, 16 if step == 6 else step // 3 * 5 + 5):
                eng.add_request(str(i), prompts[i], params[i], num_speculative_tokens=ks[i])
        if not eng.has_unfinished_requests():
            break
        for o in eng.step():
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
    want = list(tokens)
    want[2] = tokens[2][: tokens[2].index(stop_id) + 1]
    want[5] = make_engine(embedded_model, embedded_tokenizer).generate([prompts[5]], params[5])[0].new_token_ids
    assert [results[str(i)] for i in range(16)] == want
    assert eng.stats()["spec_acceptance_rate"] > 0.2
    assert_all_blocks_back(eng)


@pytest.mark.parametrize("speculative", ["ngram", "draft-model"])
def test_graph_paths_emulated_on_cpu_are_token_identical(embedded_model, embedded_tokenizer, int4_drafter, prompts,
                                                         reference, speculative):
    """The graph path's buffers and padding, run eagerly: verification steps on the q = k + 1
    graphs (shorter drafts and plain decodes in the same batch padded up to q), and the draft
    model's catch-up on its q = 2 graphs. Greedy tokens and logprobs must not change."""
    eng = make_engine(embedded_model, embedded_tokenizer, int4_drafter, speculative=speculative, max_num_seqs=8)
    assert eng.runner.capture_graphs(8, emulate_on_cpu=True, query_lens=(1, 2, 3, 4, 5))
    runners = [eng.runner]
    if eng.drafter.needs_cache:
        assert eng.drafter.runner.capture_graphs(8, emulate_on_cpu=True, query_lens=(1, 2))
        runners.append(eng.drafter.runner)
    used = [[] for _ in runners]  # per runner: (q, lengths of the real sequences)
    for runner, log in zip(runners, used):
        graphs, run = runner.graphs, runner.graphs.run
        graphs.run = lambda seqs, run=run, graphs=graphs, log=log: (
            log.append((graphs._shape(seqs)[0], [len(s.token_ids) for s in seqs])) or run(seqs))
    picks, ks = [0, 1, 2, 7, 11, 12], [4, 0, 2, 3, 4, 1]
    params = SamplingParams(**{**vars(GREEDY), "logprobs": 1})
    for i, k in zip(picks, ks):
        eng.add_request(str(i), prompts[i], params, num_speculative_tokens=k)
    results: dict[str, list] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            results.setdefault(o.request_id, []).extend(o.logprobs)
    assert [[lp.token_id for lp in results[str(i)]] for i in picks] == [reference[0][i] for i in picks]
    for i in picks:
        assert [lp.logprob for lp in results[str(i)]] == pytest.approx(reference[1][i], abs=1e-4)
    verify = [lens for q, lens in used[0] if q > 1]
    assert any(len(lens) > 1 and min(lens) < max(lens) for lens in verify)  # padded sequences inside a batch
    if len(runners) > 1:
        assert any(q == 2 and max(lens) == 2 for q, lens in used[1])  # catch-up of two tokens on its graph
    assert eng.stats()["spec_mean_accepted_len"] > 1.5
    assert_all_blocks_back(eng)


@pytest.mark.parametrize("speculative", ["ngram", "draft-model"])
def test_sampled_verification_reports_the_emitted_tokens_logprobs(embedded_model, embedded_tokenizer, int4_drafter,
                                                                   prompts, speculative):
    """Temperature > 0: the logprobs that come back with a verification step are the raw
    model's, of the tokens actually emitted (accepted drafts, then the correction or bonus)."""
    eng = make_engine(embedded_model, embedded_tokenizer, int4_drafter, speculative=speculative)
    params = SamplingParams(max_tokens=12, temperature=0.5, seed=3, ignore_eos=True, logprobs=2)
    prompt = prompts[2]  # counting: drafts get accepted
    out = eng.generate([prompt], params)[0]
    assert out.spec_mean_accepted_len > 1.0 and len(out.logprobs) == len(out.new_token_ids) == 12
    lps = torch.log_softmax(prompt_logits(embedded_model, prompt + out.new_token_ids), -1)
    for j, lp in enumerate(out.logprobs):
        row = lps[len(prompt) - 1 + j]
        assert lp.token_id == out.new_token_ids[j]
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(2).indices.tolist()
    assert_all_blocks_back(eng)


def test_preemption_and_aborts_with_drafts_return_every_block(embedded_model, embedded_tokenizer, int4_drafter,
                                                             prompts, reference):
    # 7 blocks of 8 tokens for three requests: the newest get preempted, drafts are dropped.
    eng = make_engine(embedded_model, embedded_tokenizer, int4_drafter, speculative="draft-model", num_kv_blocks=7)
    picks = [0, 12, 4]
    outs = eng.generate([prompts[i] for i in picks], GREEDY)
    assert [o.new_token_ids for o in outs] == [reference[0][i] for i in picks]
    assert eng.stats()["preemptions"] > 0
    assert_all_blocks_back(eng)
    eng = make_engine(embedded_model, embedded_tokenizer, int4_drafter, speculative="draft-model")
    for i in range(3):
        eng.add_request(str(i), prompts[i], GREEDY)
    for _ in range(3):
        eng.step()
    assert eng.drafter.bm.num_used_blocks > 0
    for i in range(3):
        eng.abort_request(str(i))
    eng.step()
    assert_all_blocks_back(eng)


# ---- temperature > 0: the distribution is the target's --------------------------------------------
VOCAB = 12


def tiny_model(seed: int) -> CausalLM:
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
    torch.manual_seed(seed)
    model = CausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.3 if name.startswith(("lm_head", "model.embed")) else 0.2)
    return model.eval()


@torch.inference_mode()
def exact_marginals(model: CausalLM, prompt: list[int], params: SamplingParams, depth: int) -> list[torch.Tensor]:
    """P(output token j = t) for j < depth, summing over every path of earlier outputs (all
    paths of one length scored in one forward)."""
    paths, weights = [[]], torch.ones(1, dtype=torch.float64)
    marginals = []
    for _ in range(depth):
        seqs = [prompt + path for path in paths]
        ids = torch.tensor([t for s in seqs for t in s])
        pos = torch.tensor([i for s in seqs for i in range(len(s))])
        hidden = model(ids, pos, NoCacheContext([len(s) for s in seqs]))
        last = hidden.view(len(seqs), -1, hidden.shape[-1])[:, -1]
        probs = sampling_probs(model.compute_logits(last), params).double()  # [paths, vocab]
        marginals.append(weights @ probs)
        joint = weights[:, None] * probs
        keep = torch.nonzero(joint)
        paths = [paths[i] + [t] for i, t in keep.tolist()]
        weights = joint[keep[:, 0], keep[:, 1]]
    return marginals


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Survival function of the chi-square statistic; cells expecting < 5 are pooled."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]).double()
    exp = torch.cat([expected[~small], expected[small].sum()[None]]).double()
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum() + (obs[~keep].sum() * 1e9)
    dof = torch.tensor(int(keep.sum()) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def sampled_histograms(speculative: str, params: SamplingParams, prompt: list[int], n: int):
    target, drafter = tiny_model(0), tiny_model(1)  # the drafter's q differs from p
    eng = LLMEngine(EngineConfig(block_size=4, num_kv_blocks=4096, max_num_seqs=512, max_num_batched_tokens=4096,
                                 max_model_len=64, speculative=speculative, num_speculative_tokens=3),
                    model=target, draft_model=drafter)
    seeded = [SamplingParams(**{**vars(params), "seed": i}) for i in range(n)]
    outs = eng.generate([prompt] * n, seeded)
    counts = torch.zeros(params.max_tokens, VOCAB)
    for o in outs:
        for j, t in enumerate(o.new_token_ids):
            counts[j, t] += 1
    assert eng.spec_counts["steps"] >= n // 2 and eng.spec_counts["accepted"] >= n // 50  # speculation happened
    assert_all_blocks_back(eng)
    return counts, exact_marginals(target, prompt, params, params.max_tokens)


SAMPLED = SamplingParams(max_tokens=4, temperature=0.9, top_k=9, ignore_eos=True)
PROMPT = list(range(VOCAB)) * 2  # every token occurs before: the n-gram drafter always proposes


@pytest.mark.parametrize("speculative", ["draft-model", "ngram"])
def test_sampled_tokens_follow_the_target_distribution(speculative):
    counts, marginals = sampled_histograms(speculative, SAMPLED, PROMPT, 1000)
    for j in (1, 2, 3):  # output 0 comes from the prefill; later ones from verification steps
        assert chi_square_p(counts[j], marginals[j]) > 1e-3, (j, counts[j], marginals[j] * counts[j].sum())


def test_the_statistical_test_catches_a_missing_correction(monkeypatch):
    monkeypatch.setattr(spec_decode, "residual_distribution", lambda p, q: p)  # resample from p instead
    counts, marginals = sampled_histograms("draft-model", SAMPLED, PROMPT, 1000)
    assert min(chi_square_p(counts[j], marginals[j]) for j in (1, 2, 3)) < 1e-6
