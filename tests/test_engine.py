"""The engine end to end on the embedded model (CPU, fp32): batching must not change results."""
from __future__ import annotations

import asyncio

import pytest
import torch

from fitllm.models.generate import generate, prompt_logits
from fitllm.serve.async_engine import AsyncEngine, EngineOverloaded
from fitllm.serve.engine import EngineConfig, LLMEngine
from fitllm.serve.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def make_engine(model, tokenizer, **kw) -> LLMEngine:
    cfg = dict(max_num_batched_tokens=32, block_size=8, num_kv_blocks=128, max_model_len=512)
    return LLMEngine(EngineConfig(**{**cfg, **kw}), model=model, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def prompts(embedded_tokenizer):
    """16 prompts of mixed lengths; most share a 21-token prefix (two full 8-token blocks)."""
    enc = lambda s: embedded_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    shared = enc("You are a helpful assistant. Answer briefly and precisely, in plain English.")
    tails = ["What is the capital of France?", "Name a prime number.", "2+2=", "Why is the sky blue?",
             "Translate 'cat' to German.", "List three fruits.", "Who wrote Hamlet?", "Hello",
             "Define entropy in one sentence.", "What is 7 times 8?", "Spell 'banana'.", "Is water wet?"]
    out = [shared + enc(" " + t) for t in tails]
    out += [enc("Once upon a time"), enc("The quick brown fox jumps over the lazy dog. " * 3),
            enc("1, 2, 3, 4,"), shared + enc(" What is the capital of France?")]  # a duplicate too
    assert len(out) == 16
    return out


@pytest.fixture(scope="module")
def reference(embedded_model, prompts):
    return generate(embedded_model, prompts, GREEDY.max_tokens)


def test_greedy_alone_equals_generate(embedded_model, embedded_tokenizer, prompts, reference):
    eng = make_engine(embedded_model, embedded_tokenizer)
    out = eng.generate([prompts[0]], GREEDY)[0]
    assert out.new_token_ids == reference[0] and out.finish_reason == "length"
    assert out.new_text == embedded_tokenizer.decode(reference[0], skip_special_tokens=True)


def test_greedy_batch_of_16_with_chunked_prefill_and_prefix_cache(embedded_model, embedded_tokenizer, prompts,
                                                                  reference):
    eng = make_engine(embedded_model, embedded_tokenizer)
    # Staggered arrivals: the later ones find the shared prefix already cached.
    for i in range(4):
        eng.add_request(str(i), prompts[i], GREEDY)
    results: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished_requests():
        steps += 1
        if steps == 3:
            for i in range(4, 16):
                eng.add_request(str(i), prompts[i], GREEDY)
        for o in eng.step():
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert [results[str(i)] for i in range(16)] == reference
    stats = eng.stats()
    assert stats["prefix_cache_hit_rate"] > 0.2 and stats["kv_blocks_used"] == 0


def test_preemption_and_recompute_give_the_same_tokens(embedded_model, embedded_tokenizer, prompts, reference):
    # 5 blocks of 8 tokens for four requests of 15-36 tokens: the newest keep being preempted.
    eng = make_engine(embedded_model, embedded_tokenizer, num_kv_blocks=5)
    picks = [13, 0, 3, 14]
    outs = eng.generate([prompts[i] for i in picks], GREEDY)
    assert [o.new_token_ids for o in outs] == [reference[i] for i in picks]
    stats = eng.stats()
    assert stats["preemptions"] > 0 and stats["kv_blocks_used"] == 0


def test_aborts_and_finishes_return_every_block(embedded_model, embedded_tokenizer, prompts):
    eng = make_engine(embedded_model, embedded_tokenizer)
    for i in range(4):
        eng.add_request(str(i), prompts[i], SamplingParams(max_tokens=50, temperature=0.0))
    eng.step()
    eng.abort_request("0")  # running
    eng.abort_request("3")  # still waiting for budget
    eng.abort_request("nope")  # unknown: ignored
    finals = {}
    for _ in range(2):
        for o in eng.step():
            finals[o.request_id] = o
    assert finals["0"].finish_reason == "abort" and finals["3"].finish_reason == "abort"
    eng.abort_request("1")
    eng.abort_request("2")
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.stats()["kv_blocks_used"] == 0 and not eng.block_manager.seqs


def test_seeded_sampling_does_not_depend_on_the_batch(embedded_model, embedded_tokenizer, prompts):
    seeded = SamplingParams(max_tokens=4, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    eng = make_engine(embedded_model, embedded_tokenizer)
    alone = eng.generate([prompts[12]], seeded)[0].new_token_ids
    others = [SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True) for _ in range(2)]
    mixed = eng.generate([prompts[14], prompts[12], prompts[7]], [others[0], seeded, others[1]])
    assert mixed[1].new_token_ids == alone


def test_stop_conditions_and_prompt_logprobs(embedded_model, embedded_tokenizer, prompts, reference):
    eng = make_engine(embedded_model, embedded_tokenizer)
    text = embedded_tokenizer.decode(reference[0])
    stop_at = text[len(text) // 2:][:3]  # a stop string somewhere inside the greedy text
    prompt = prompts[13]  # 34 tokens: prefilled in two chunks
    outs = eng.generate([prompts[0], prompts[0], prompt], [
        SamplingParams(max_tokens=5, temperature=0.0, stop=[stop_at]),
        SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=[reference[0][1]], logprobs=2),
        SamplingParams(max_tokens=0, prompt_logprobs=1)])
    assert outs[0].finish_reason == "stop" and outs[0].new_text == text[: text.index(stop_at)]
    assert outs[1].finish_reason == "stop" and outs[1].new_token_ids == reference[0][:2]
    assert (outs[0].stop_reason, outs[1].stop_reason, outs[2].stop_reason) == (stop_at, reference[0][1], None)
    eos = min(eng.eos_ids)
    forced = dict(max_tokens=3, temperature=0.0, logit_bias={eos: 100.0})
    stopped, banned = eng.generate([prompts[0]] * 2, [SamplingParams(**forced, stop_token_ids=[eos]),
                                                      SamplingParams(**forced, ignore_eos=True, min_tokens=2)])
    # EOS is checked first, as vLLM does: no stop_reason though it is also a stop token
    assert stopped.new_token_ids == [eos] and (stopped.finish_reason, stopped.stop_reason) == ("stop", None)
    # min_tokens bans EOS even where it would not stop the output (vLLM)
    assert eos not in banned.new_token_ids[:2] and banned.new_token_ids[2] == eos
    assert [lp.token_id for lp in outs[1].logprobs] == reference[0][:2] and len(outs[1].logprobs[0].top) == 2
    scored = outs[2]
    assert scored.finish_reason == "length" and scored.new_token_ids == []
    lps = torch.log_softmax(prompt_logits(embedded_model, prompt), -1)
    expected = [lps[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    assert scored.prompt_logprobs[0] is None
    got = [lp.logprob for lp in scored.prompt_logprobs[1:]]
    assert torch.allclose(torch.tensor(got), torch.tensor(expected), atol=1e-4)


def test_min_tokens_bans_the_stop_tokens_until_then(embedded_model, embedded_tokenizer):
    """vLLM's min_tokens: EOS and stop_token_ids cannot be sampled for the first min_tokens outputs.
    Oracle: greedy over transformers-free full forwards with those ids masked. The two values of m
    picked differ only in whether output m may stop, so a ban one token too long or too short fails;
    checked plain, with look-ahead steps (their row samples output num_output + 1) and with
    speculation by an int4 copy (no drafts before min_tokens)."""
    tok = embedded_tokenizer
    prompt = tok.encode("1, 2, 3, 4,", add_special_tokens=False)
    comma = tok.encode(",", add_special_tokens=False)
    assert len(comma) == 1
    eng = make_engine(embedded_model, tok)
    stops = sorted({comma[0]} | eng.eos_ids)

    def oracle(m: int, n: int = 10) -> list[int]:
        out: list[int] = []
        while len(out) < n and (not out or out[-1] not in stops):
            logits = prompt_logits(embedded_model, prompt + out)[-1].clone()
            if len(out) < m:
                logits[stops] = float("-inf")
            out.append(int(logits.argmax()))
        return out

    expected = {m: oracle(m) for m in range(6)}
    m = next(m for m in range(5) if expected[m][-1] in stops and len(expected[m]) == m + 1
             and expected[m + 1] != expected[m])  # output m stops unless it is banned
    for kw in (dict(), dict(async_scheduling=True), dict(speculative="self-int4")):
        eng = make_engine(embedded_model, tok, **kw)
        for mt in (m, m + 1):
            params = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[comma[0]], min_tokens=mt)
            out = eng.generate([prompt], params)[0]
            assert out.new_token_ids == expected[mt], (kw, mt)
            assert out.finish_reason == ("stop" if expected[mt][-1] in stops else "length")


def test_nan_logits_fail_only_that_request(embedded_model, embedded_tokenizer, prompts, reference):
    eng = make_engine(embedded_model, embedded_tokenizer)
    broken = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    sample = eng.sampler.sample

    def poisoned(logits, rows):
        logits = logits.clone()
        for i, r in enumerate(rows):
            if r.params is broken:
                logits[i, 0] = float("nan")
        return sample(logits, rows)

    eng.sampler.sample = poisoned
    outs = eng.generate([prompts[0], prompts[1]], [broken, GREEDY])
    assert outs[0].finish_reason == "error" and outs[0].error
    assert outs[1].new_token_ids == reference[1]
    assert eng.stats()["kv_blocks_used"] == 0


def test_request_validation(embedded_model, embedded_tokenizer):
    eng = make_engine(embedded_model, embedded_tokenizer, max_model_len=64)
    with pytest.raises(ValueError, match="maximum context length"):
        eng.add_request("long", [1] * 64, GREEDY)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("empty", [], GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request("vocab", [10**6], GREEDY)
    eng.add_request("ok", [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="in use"):
        eng.add_request("ok", [1, 2, 3], GREEDY)


def test_async_engine_streams_and_aborts_on_disconnect(embedded_model, embedded_tokenizer, prompts, reference):
    eng = make_engine(embedded_model, embedded_tokenizer)

    async def main():
        aeng = AsyncEngine(eng)
        aeng.start()

        async def collect(rid, prompt, limit=None):
            toks = []
            async for out in aeng.generate(rid, prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
                                           if limit else GREEDY):
                toks += out.new_token_ids
                if limit and len(toks) >= limit:
                    break  # the client goes away
            return toks

        full, cut = await asyncio.gather(collect("a", prompts[2]), collect("b", prompts[3], limit=2))
        with pytest.raises(ValueError):
            async for _ in aeng.generate("c", [], GREEDY):
                pass
        overloaded = AsyncEngine(eng, max_waiting=0)
        with pytest.raises(EngineOverloaded):
            async for _ in overloaded.generate("d", prompts[0], GREEDY):
                pass
        await aeng.shutdown(drain=True)
        return full, cut, aeng.stats()

    full, cut, stats = asyncio.run(main())
    assert full == reference[2] and len(cut) >= 2
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and not eng.requests


def test_decode_graph_path_emulated_on_cpu(embedded_model, embedded_tokenizer, prompts, reference):
    """The CUDA-graph path's static buffers, padding to captured sizes, scratch block and padded
    attention, run eagerly: greedy tokens must not change."""
    eng = make_engine(embedded_model, embedded_tokenizer, max_num_seqs=8, max_model_len=128)
    assert eng.runner.capture_graphs(8, emulate_on_cpu=True)
    assert eng.runner.graphs.shapes == {1: [1, 2, 4, 8]}
    used = []
    run = eng.runner.graphs.run
    eng.runner.graphs.run = lambda seqs, *ids: used.append(len(seqs)) or run(seqs, *ids)
    picks = [0, 4, 12, 13, 14]  # 5 decodes pad to 8; later 4 and fewer
    params = SamplingParams(**{**vars(GREEDY), "logprobs": 2})
    outs = eng.generate([prompts[i] for i in picks], params)
    assert [o.new_token_ids for o in outs] == [reference[i] for i in picks]
    assert used and max(used) == 5
    eager = make_engine(embedded_model, embedded_tokenizer).generate([prompts[i] for i in picks], params)
    for o, e in zip(outs, eager):  # logprobs through the one host copy, graph path vs eager
        assert [lp.top for lp in o.logprobs] == [[(t, pytest.approx(v, abs=1e-4)) for t, v in lp.top]
                                                 for lp in e.logprobs]


def test_int8_kv_cache_and_copy_on_write_copies(embedded_model, embedded_tokenizer, prompts, reference):
    eng = make_engine(embedded_model, embedded_tokenizer, kv_dtype="int8")
    outs = eng.generate([prompts[0], prompts[12]], GREEDY)
    assert [o.new_token_ids[0] for o in outs] == [reference[0][0], reference[12][0]]  # int8 KV: ~exact
    assert eng.stats()["kv_blocks_used"] == 0
    cache = eng.runner.cache
    before = [t[:, 0].clone() for t in (cache.k, cache.v, cache.k_scales)]
    eng.runner.copy_blocks([(0, 3)])  # what the block manager queues for copy-on-write
    assert all(torch.equal(b, t[:, 3]) for b, t in zip(before, (cache.k, cache.v, cache.k_scales)))


def test_look_ahead_steps_change_no_output(embedded_model, embedded_tokenizer, prompts, reference):
    """async_scheduling queues decode step N + 1 before step N's tokens are read (its input ids
    on the device). Outputs must equal the engine without it, including requests that step N
    finishes (a stop token: the look-ahead row is wasted), seeded sampling, logprobs, and the
    graph path; every block comes back."""
    picks = [0, 3, 12, 13, 14]
    stop = next(j for j in range(2, 5) if reference[3][j] not in reference[3][:j])  # a token seen first at j
    stop_at_third = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[reference[3][stop]])
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2), stop_at_third,
              SamplingParams(max_tokens=9, temperature=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.7, top_k=20, seed=3, ignore_eos=True)]
    results = {}
    for ahead, graphs in ((False, False), (True, False), (True, True)):
        eng = make_engine(embedded_model, embedded_tokenizer, max_num_seqs=8, max_model_len=128,
                          max_num_batched_tokens=256, async_scheduling=ahead)
        if graphs:
            assert eng.runner.capture_graphs(8, emulate_on_cpu=True)
        outs = eng.generate([prompts[i] for i in picks], params)
        results[ahead, graphs] = outs
        assert (eng.num_look_ahead_steps > 5) == ahead
        assert eng.stats()["kv_blocks_used"] == 0 and not eng.has_unfinished_requests()
    base = results[False, False]
    assert base[0].new_token_ids[:5] == reference[0] and base[1].new_token_ids == reference[3][:stop + 1]
    assert base[1].finish_reason == "stop"
    for key, outs in results.items():
        for o, b in zip(outs, base):
            assert (o.new_token_ids, o.finish_reason, o.num_generated_tokens) == \
                (b.new_token_ids, b.finish_reason, b.num_generated_tokens), key
            assert [lp.token_id for lp in o.logprobs] == [lp.token_id for lp in b.logprobs]
            assert [lp.logprob for lp in o.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-4)


def test_look_ahead_with_masks_and_penalties(embedded_model, embedded_tokenizer, prompts):
    """Requests whose sampling follows their output (a JSON schema's mask, penalties) run ahead too:
    the forward of step N + 1 is queued first, its sampling once step N's tokens are applied.
    Outputs equal the engine without look-ahead, JSON answers included (one finishes early: its
    look-ahead row is wasted)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"]}
    params = [SamplingParams(max_tokens=14, temperature=0.0, json_schema=schema),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_tokens=12, temperature=0.9, seed=5, json_object=True, logprobs=1),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, presence_penalty=0.5, seed=1)]
    results = {}
    for ahead in (False, True):
        eng = make_engine(embedded_model, embedded_tokenizer, max_num_seqs=8, max_model_len=128,
                          max_num_batched_tokens=256, async_scheduling=ahead)
        results[ahead] = eng.generate(prompts[:4], params)
        assert (eng.num_look_ahead_steps > 5) == ahead, eng.num_look_ahead_steps
        assert eng.stats()["kv_blocks_used"] == 0 and not eng.has_unfinished_requests()
    for o, b in zip(results[True], results[False]):
        assert (o.new_token_ids, o.finish_reason, o.error) == (b.new_token_ids, b.finish_reason, b.error)
    assert results[False][0].finish_reason == "stop" and len(results[False][0].new_token_ids) < 14


def test_abort_while_a_look_ahead_step_is_queued(embedded_model, embedded_tokenizer, prompts, reference):
    eng = make_engine(embedded_model, embedded_tokenizer, max_num_batched_tokens=256)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for i in (0, 12):
        eng.add_request(f"r{i}", prompts[i], params)
    tokens = {"r0": [], "r12": []}
    while eng._inflight is None or "r0" not in {r.request_id for r in eng._inflight[0].num_tokens}:
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
    eng.abort_request("r0")  # in the queued step: its row is computed, its output dropped
    finals = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.request_id not in finals, "an output after the request finished"
                finals[out.request_id] = out.finish_reason
    assert finals == {"r0": "abort", "r12": "length"}
    assert tokens["r0"] == reference[0][:len(tokens["r0"])] and tokens["r12"][:5] == reference[12]
    assert len(tokens["r12"]) == 10 and eng.stats()["kv_blocks_used"] == 0


def test_longrope_prompt_keeps_its_factors_through_chunks_and_the_prefix_cache(tmp_path):
    """A prompt past LongRoPE's original context (64 here) takes the long factors for all its tokens
    however the scheduler cuts it into chunks (24 tokens a step here), and does not reuse the
    blocks a short prompt with the same first tokens left in the prefix cache (those keys carry the
    short factors): tokens and their logprobs equal transformers' with the whole prompt at once.
    (On this tiny random model short-rotated keys move a logprob by ~5e-4, no token.)"""
    from fitllm.models.loader import load_model
    from tiny_models import write_tiny_model

    hf = write_tiny_model("phi3-longrope", tmp_path)
    ours = load_model(tmp_path, dtype=torch.float32)
    prompt = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(4)).tolist()
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                       pad_token_id=0)[0, 100:].tolist()
    with torch.no_grad():  # each token's logprob from transformers' forward over everything before it
        logits = hf(torch.tensor([prompt + want])).logits[0, 99:-1].log_softmax(-1)
    want_lp = logits[torch.arange(8), want].tolist()
    engine = LLMEngine(EngineConfig(max_num_batched_tokens=24, block_size=8, num_kv_blocks=64, max_model_len=256),
                       model=ours, tokenizer=None)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    engine.generate([prompt[:40]], params)  # its blocks (short factors) stay in the prefix cache
    out = engine.generate([prompt], params)[0]
    assert out.new_token_ids == want and engine.block_manager.hit_tokens == 0
    assert max(abs(lp.logprob - w) for lp, w in zip(out.logprobs, want_lp)) < 1e-4


@pytest.mark.parametrize("family", ["gemma3", "smollm3-window"])
def test_per_layer_windows_and_ropes_in_the_engine_equal_transformers(tmp_path, family):
    """Gemma 3 (two RoPEs, a 16-token window on its sliding layers) and SmolLM3 (layers without RoPE,
    windowed here) through the engine: prompts cut into chunks of 24 tokens a step, a shared prefix
    served from the prefix cache, batched: each request's greedy tokens equal transformers' generate alone."""
    from fitllm.models.loader import load_model
    from tiny_models import write_tiny_model

    hf = write_tiny_model(family, tmp_path)
    ours = load_model(tmp_path, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 256, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 30)]
    prompts.append(torch.randint(0, 256, (9,), generator=g).tolist())
    # (the mask given: generate would otherwise take the prompts' token 0, its pad id, for padding)
    want = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=30,
                        min_new_tokens=30, do_sample=False, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    engine = LLMEngine(EngineConfig(max_num_batched_tokens=24, block_size=8, num_kv_blocks=64, max_model_len=256),
                       model=ours, tokenizer=None)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    assert engine.generate(prompts[:1], params)[0].new_token_ids == want[0]
    outs = engine.generate(prompts, params)
    assert [o.new_token_ids for o in outs] == want and engine.block_manager.hit_tokens >= 40


WINDOWED_PARAMS = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
WINDOWED_CONFIG = dict(max_num_batched_tokens=24, block_size=8, max_model_len=256, max_num_seqs=4)


def windowed_model(folder, family: str, seed: int):
    """(transformers' model, ours in fp32, 4 prompts of 70, 33, 9 and 50 tokens) for a tiny family."""
    from fitllm.models.loader import load_model
    from tiny_models import write_tiny_model

    hf = write_tiny_model(family, folder)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (70, 33, 9, 50)]
    return hf, load_model(folder, dtype=torch.float32), prompts


def assert_transformers_argmax(hf, prompts, outs) -> None:
    """Each greedy token is transformers' argmax over the prompt and the tokens before it, in one
    forward pass of the whole text."""
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            logits = hf(torch.tensor([p + o.new_token_ids])).logits[0, len(p) - 1:-1]
        assert logits.argmax(-1).tolist() == o.new_token_ids


@pytest.mark.parametrize("graphs", [False, True])
def test_split_kv_cache_for_sliding_layers_equals_transformers(tmp_path, graphs):
    """Gemma 3 with its sliding layers in blocks of their own (--kv-layout split) over one pool of pages:
    tiny Gemma 3 has one full layer and two sliding over 16 tokens, so a page holds one layer, a
    sliding block is 2 pages (the second found through SplitKVCache.pages) and goes back to the pool
    behind each sequence's window. Prompts of up to 70 tokens in chunks of 24, few enough pages to
    preempt, eager and graph (emulated) steps, a prefix found in both kinds' caches. Each greedy token
    must be transformers' argmax over the prompt and the tokens before it (assert_transformers_argmax:
    its own generate, with its sliding cache, departed from that on a 70-token prompt here), and
    equal the shared pool's."""
    from fitllm.serve.block_manager import SplitBlockManager

    hf, ours, prompts = windowed_model(tmp_path, "gemma3", seed=6)
    params, config = WINDOWED_PARAMS, WINDOWED_CONFIG
    shared = LLMEngine(EngineConfig(num_kv_blocks=64, **config), model=ours, tokenizer=None).generate(prompts, params)
    engine = LLMEngine(EngineConfig(num_kv_blocks=40, kv_layout="split", **config), model=ours, tokenizer=None)
    bm = engine.block_manager
    assert isinstance(bm, SplitBlockManager) and bm.widths == engine.runner.cache.widths == (1, 2)
    assert engine.max_model_len == 256  # one sequence: 4 window blocks (8 pages), 32 full blocks
    if graphs:
        assert engine.runner.capture_graphs(4, emulate_on_cpu=True)
    held = []
    allocate = bm.window._grow
    bm.window._grow = lambda *a: (allocate(*a), held.append((bm.window_pages_used, bm.num_used_blocks)))[0]
    outs = engine.generate(prompts, params)
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in shared]
    assert_transformers_argmax(hf, prompts, outs)
    assert engine.scheduler.num_preemptions > 0  # 4 sequences of up to 100 tokens: 4 x 21 pages of 40
    # the sliding blocks gave their pages back (at most 4 blocks of a sequence's), and the full layers held
    # more than a fixed pool beside 4 sequences' windows would have left them
    assert max(w for w, _ in held) <= 4 * 4 * 2 and max(u - w for w, u in held) > 40 - 4 * 4 * 2
    assert bm.num_used_blocks == 0 and bm.pool.available == 40

    # The prefix cache: a prompt that starts with another's first 60 tokens finds 7 blocks (56 tokens) of
    # the full layers, and of the sliding layers the two whose tokens a query at position 56 still sees.
    fresh = LLMEngine(EngineConfig(num_kv_blocks=60, kv_layout="split", **config), model=ours, tokenizer=None)
    fresh.generate(prompts[:1], params)
    again = prompts[0][:60] + prompts[1][:10]
    out = fresh.generate([again], params)[0]
    assert out.num_cached_tokens == 56 and fresh.block_manager.window.seqs == {}
    assert_transformers_argmax(hf, [again], [out])


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_a_split_quantized_cache_equals_the_shared_one(tmp_path, kv_dtype):
    """Each layer keeps its own K/V calibration in a split cache (int4: shifts, scales, the rotation),
    so a split int4 or int8 cache stores the same codes as one shared pool: the same greedy tokens."""
    from fitllm.models.kv_cache import calibrate_kv_scales

    _, ours, prompts = windowed_model(tmp_path, "gemma3", seed=10)
    calibration = calibrate_kv_scales(ours)
    config = dict(WINDOWED_CONFIG, num_kv_blocks=64, kv_dtype=kv_dtype, kv_calibration=calibration)
    outs = {layout: [o.new_token_ids for o in LLMEngine(EngineConfig(kv_layout=layout, **config), model=ours,
                                                        tokenizer=None).generate(prompts, WINDOWED_PARAMS)]
            for layout in ("shared", "split")}
    assert outs["split"] == outs["shared"]


def test_speculation_over_a_split_cache_is_token_identical(tmp_path):
    """n-gram drafts verified and rolled back in both kinds of blocks of a split cache (the sliding ones
    keep the window of the last verified token, never of a draft): greedy tokens equal plain decoding's."""
    _, ours, prompts = windowed_model(tmp_path, "gemma3", seed=9)
    prompts = [p[:12] * 4 for p in prompts]  # repeats, for the n-gram drafter to propose
    config = dict(WINDOWED_CONFIG, num_kv_blocks=40, kv_layout="split")
    plain = LLMEngine(EngineConfig(**config), model=ours, tokenizer=None).generate(prompts, WINDOWED_PARAMS)
    engine = LLMEngine(EngineConfig(speculative="ngram", **config), model=ours, tokenizer=None)
    outs = engine.generate(prompts, WINDOWED_PARAMS)
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in plain]
    assert engine.spec_counts["drafted"] > engine.spec_counts["accepted"] > 0  # drafts kept and rolled back
    assert engine.block_manager.full.seqs == engine.block_manager.window.seqs == {}


def test_auto_layout_splits_where_the_context_passes_the_window(tmp_path, monkeypatch):
    """1 MiB of KV for tiny Gemma 3 (one full layer, two sliding over 16 tokens): with a context of 512
    auto splits into pages of one layer, whatever --max-num-seqs; with a context of 16 (the window)
    there is nothing to give back and it keeps one pool. quant serve's summary and /metrics say so."""
    from fitllm.serve import model_runner
    from fitllm.serve.block_manager import BlockManager, SplitBlockManager

    monkeypatch.setattr(model_runner, "CPU_KV_CACHE_BYTES", 1 << 20)
    _, ours, _ = windowed_model(tmp_path, "gemma3", seed=0)
    config = dict(block_size=8, max_num_batched_tokens=32)
    one_pool = LLMEngine(EngineConfig(max_num_seqs=4, max_model_len=16, **config), model=ours, tokenizer=None)
    assert isinstance(one_pool.block_manager, BlockManager)
    split = LLMEngine(EngineConfig(max_num_seqs=64, max_model_len=512, **config), model=ours, tokenizer=None)
    bm = split.block_manager
    assert isinstance(bm, SplitBlockManager) and bm.widths == (1, 2)
    per_page = 8 * 2 * 2 * 32 * 4  # 8 tokens, K and V, 2 heads of 32, fp32: one layer
    assert bm.num_blocks == (1 << 20) // per_page
    from fitllm.cli.serve import _window_pool  # quant serve's summary line

    assert "a block of the full-attention layers takes 1, one of the 2 sliding-window layers 2" in \
        _window_pool(split, split.stats())
    assert split.stats()["kv_split"]["longest_sequence"] == (bm.num_blocks - 4 * 2) * 8
    assert _window_pool(one_pool, one_pool.stats()) == ""
    from fitllm.serve.metrics import EngineCollector  # /metrics: the sliding layers' pages only where split

    gauges = {f.name: f.samples[0].value for f in EngineCollector(split.stats).collect()}
    assert gauges["fitllm_kv_window_pages_used"] == 0 and gauges["fitllm_kv_blocks_total"] == bm.num_blocks
    assert "fitllm_kv_window_pages_used" not in {f.name for f in EngineCollector(one_pool.stats).collect()}


def test_a_model_sliding_on_every_layer_keeps_only_its_windows(tmp_path):
    """Phi-3 with a 24-token window on every layer (Phi-3-mini-4k: 2047): the one pool gives back
    the blocks behind each sequence's window ("auto"): 4 prompts growing to 330 tokens together run
    in 24 blocks of 8 (192 tokens). Greedy tokens: transformers' argmax over the
    text before each, and equal to the pool that keeps everything (--kv-layout shared)."""
    hf, ours, prompts = windowed_model(tmp_path, "phi3-window", seed=8)
    params, config = WINDOWED_PARAMS, WINDOWED_CONFIG
    shared = LLMEngine(EngineConfig(num_kv_blocks=64, kv_layout="shared", **config), model=ours, tokenizer=None)
    want = [o.new_token_ids for o in shared.generate(prompts, params)]
    engine = LLMEngine(EngineConfig(num_kv_blocks=24, **config), model=ours, tokenizer=None)
    assert engine.block_manager.window == 24 and engine.max_model_len == 192  # 24 blocks of 8
    outs = engine.generate(prompts, params)
    assert [o.new_token_ids for o in outs] == want and engine.scheduler.num_preemptions == 0
    assert_transformers_argmax(hf, prompts, outs)
    assert engine.block_manager.num_used_blocks == 0


def test_longrope_factors_go_by_the_prompt_then_by_each_token(tmp_path):
    """The positions an engine step gives LongRoPE (original context 64): a prompt chunk's tokens
    go by their prompt's last position (a 100-token prompt: long from its first chunk on), later
    tokens by their own (a verification window across position 64 switches inside it, as decoding
    one token at a time does)."""
    from fitllm.models.loader import load_model
    from fitllm.serve.model_runner import ModelRunner, StepSeq
    from tiny_models import write_tiny_model

    write_tiny_model("phi3-longrope", tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    runner = ModelRunner(model, block_size=8)
    runner.allocate_cache(32, 128)
    seen = []
    rope = model.rope
    model.rope = lambda positions, ctx=None: (seen.append(ctx.last_positions(positions).tolist()), rope(positions, ctx))[1]
    table = list(range(16))
    runner.execute([StepSeq(list(range(24)), 0, table, 1, prompt_len=100),  # the first chunk of a long prompt
                    StepSeq([5] * 5, 61, table, 5, prompt_len=30)])  # a draft window over positions 61..65
    assert seen == [[99] * 24 + [61, 62, 63, 64, 65]]


def test_eager_decode_warm_up_steps_touch_only_the_scratch_block(embedded_model, embedded_tokenizer,
                                                                  prompts, reference):
    """Without CUDA graphs the warm-up decodes one batch size per variant of the decode attention
    kernel (the cache names them; none on the CPU, so stubbed here): one eager step each, on the
    scratch block, leaving every real block and later outputs as they were."""
    eng = make_engine(embedded_model, embedded_tokenizer, max_num_seqs=8, max_model_len=128)
    runner = eng.runner
    assert runner.cache.decode_batch_classes(8, 128) == []  # the torch path compiles nothing
    runner.cache.decode_batch_classes = lambda max_batch, max_seq_len: [1, 3, max_batch]
    steps, execute = [], runner.execute
    runner.execute = lambda seqs, *a: steps.append(seqs) or execute(seqs, *a)
    real = [t[:, :-1].clone() for t in (runner.cache.k, runner.cache.v)]  # all but the scratch block
    runner.warm_up_decode(eng.config.max_num_seqs)
    assert [len(s) for s in steps] == [1, 3, 8]
    assert all(q.block_table == [runner.scratch_block] and len(q.token_ids) == 1 for s in steps for q in s)
    assert all(torch.equal(b, t[:, :-1]) for b, t in zip(real, (runner.cache.k, runner.cache.v)))
    assert eng.generate([prompts[0]], GREEDY)[0].new_token_ids == reference[0]
