"""`quant bench`: workloads and the latency summary (the GPU numbers are benchmarks, not tests)."""
from __future__ import annotations

import math

import pytest

from fitllm.serve.bench import RequestResult, make_workload, percentiles, summarize


def test_fixed_workload_has_exact_lengths_and_is_reproducible():
    w = make_workload(5, 33, 7, vocab_size=1000, seed=3)
    assert w.input_lens == [33] * 5 and [len(p) for p in w.prompts] == w.input_lens
    assert w.output_lens == [7] * 5
    assert all(100 <= t < 1000 for p in w.prompts for t in p)
    assert make_workload(5, 33, 7, vocab_size=1000, seed=3).prompts == w.prompts


def test_sharegpt_lengths_are_long_tailed_and_fit_the_context():
    w = make_workload(2000, 220, 190, "sharegpt", vocab_size=1000, max_len=4096)
    ins = sorted(w.input_lens)
    assert 150 < ins[len(ins) // 2] < 300  # median near the requested one
    assert ins[-1] > 4 * ins[len(ins) // 2]  # a tail
    assert all(i + o <= 4096 for i, o in zip(w.input_lens, w.output_lens))
    with pytest.raises(ValueError, match="unknown length distribution"):
        make_workload(1, 1, 1, "zipf")


def test_summary_percentiles_and_errors():
    ok = [RequestResult(True, ttft=0.1 * i, latency=1.0, itls=[0.01, 0.03], output_tokens=3, prompt_tokens=10)
          for i in range(1, 11)]
    bad = [RequestResult(False, error="HTTP 429")]
    s = summarize(ok + bad, duration=2.0)
    assert s["completed"] == 10 and s["errors"] == 1 and s["error_examples"] == ["HTTP 429"]
    assert s["output_tokens_per_s"] == pytest.approx(15.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(550.0)
    assert s["itl_ms"]["mean"] == pytest.approx(20.0)
    assert math.isnan(percentiles([])["p99"])


def test_sse_events_survive_any_split_of_the_stream():
    from fitllm.serve.bench import _sse_events

    stream = b'data: {"a": 1}\n\ndata: {"b": 2}\n\n: comment\n\ndata: [DONE]\n\n'
    for cut in range(1, len(stream)):
        buffer, events = bytearray(), []
        for part in (stream[:cut], stream[cut:]):
            events += _sse_events(buffer, part)
        assert events == [b'{"a": 1}', b'{"b": 2}', b"[DONE]"], cut
