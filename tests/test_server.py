"""The real server (`quant serve` in a subprocess, the embedded model) through the official
`openai` client: completions and chat, streaming and not, and greedy parity with the model
runtime's own `generate`, alone and inside a batch of 16 concurrent requests."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch

KEY = "sk-fitllm-test"
MAX_NEW = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`python -m fitllm.cli.main serve` on a free port; waits for /health."""

    def __init__(self, *options: str, api_key: str | None = None, startup_timeout: float = 300.0):
        self.port = free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="fitllm-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "fitllm.cli.main", "serve", "--port", str(self.port), *options]
        if api_key:
            cmd += ["--api-key", api_key]
        # One torch thread by default: the test process runs beside it on 2 cores, and torch's
        # OpenMP threads slow down several-fold when they must share cores with other work.
        threads = os.environ.get("FITLLM_TEST_SERVER_THREADS", "1")
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": threads}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     cwd=Path(__file__).resolve().parents[1])
        self._wait_healthy(startup_timeout)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout} s:\n{self.output()}")

    def headers(self) -> dict:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        """Unlabelled fitllm_* samples of /metrics, name -> value."""
        text = httpx.get(self.url + "/metrics", headers=self.headers(), timeout=10).text
        values = {}
        for line in text.splitlines():
            if line.startswith("fitllm_") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Until no request runs or waits and every KV block is back in the pool."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["fitllm_kv_blocks_used"] == 0 and m["fitllm_num_requests_running"] == 0 \
                    and m["fitllm_num_requests_waiting"] == 0:
                return m
            if time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-4000:]

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


# Small step budget: prompts are prefilled in chunks while others decode; prefix cache on.
SERVER_OPTIONS = ("--max-num-batched-tokens", "32", "--num-kv-blocks", "160", "--max-model-len", "512",
                  "--max-num-seqs", "16", "--log-level", "warning")


@pytest.fixture(scope="module")
def server():
    s = LiveServer(*SERVER_OPTIONS, api_key=KEY)
    yield s
    assert s.stop() in (0, -signal.SIGTERM), s.output()  # uvicorn re-raises SIGTERM after a clean drain


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The reference model runs here while the server computes: keep to one core each."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aclient(server):
    import openai

    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def greedy_reference(model, tokenizer, prompt_ids: list[int], max_new: int = MAX_NEW) -> tuple[str, int, str]:
    """(text, number of tokens, finish reason) of the runtime's own greedy generate."""
    from fitllm.models.generate import generate

    eos = set(model.config.eos_token_ids) | {tokenizer.eos_token_id}
    tokens = generate(model, [prompt_ids], max_new, eos_token_ids=sorted(eos))[0]
    reason = "length"
    if tokens and tokens[-1] in eos:
        tokens, reason = tokens[:-1], "stop"
    text = tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return text, len(tokens) + (reason == "stop"), reason


TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4, 5,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In machine learning, a neural network is",
    "The quick brown fox",
    "Translate to French: good morning ->",
    "A haiku about autumn:\n",
    "The capital of France is Paris. The capital of Germany is",
    "The capital of France is Paris. The capital of Italy is",
    "Q: What is 7 times 8?\nA:",
    "Photosynthesis is the process by which plants " * 3,
    "Hello",
    "import numpy as np\nx = np.arange(10)\nprint(",
]


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]


def test_completion_greedy_matches_generate(client, embedded_model, embedded_tokenizer):
    for text in TEXTS[:2]:
        ids = embedded_tokenizer.encode(text)
        want, n_tokens, reason = greedy_reference(embedded_model, embedded_tokenizer, ids)
        r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=MAX_NEW, temperature=0)
        assert r.choices[0].text == want
        assert r.choices[0].finish_reason == reason
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == n_tokens
        # A text prompt is tokenized the same way.
        r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=text, max_tokens=MAX_NEW, temperature=0)
        assert r.choices[0].text == want


def test_batch_of_16_concurrent_matches_alone(aclient, embedded_model, embedded_tokenizer):
    prompts = [embedded_tokenizer.encode(t) for t in TEXTS]
    assert len(prompts) == 16 and len({len(p) for p in prompts}) > 8  # mixed lengths
    want = [greedy_reference(embedded_model, embedded_tokenizer, p)[0] for p in prompts]

    async def run_all():
        calls = [aclient.completions.create(model="SmolLM2-135M-Instruct", prompt=p, max_tokens=MAX_NEW,
                                            temperature=0) for p in prompts]
        return await asyncio.gather(*calls)
    got = [r.choices[0].text for r in asyncio.run(run_all())]
    assert got == want


def test_completion_stream_equals_non_stream(client):
    kwargs = dict(model="SmolLM2-135M-Instruct", prompt=TEXTS[4], max_tokens=MAX_NEW, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_chat_greedy_matches_generate_and_streams(client, embedded_model, embedded_tokenizer):
    messages = [{"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    ids = chat_ids(embedded_tokenizer, messages)
    want, n_tokens, reason = greedy_reference(embedded_model, embedded_tokenizer, ids)
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=MAX_NEW,
                                       temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == reason
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == n_tokens

    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=MAX_NEW,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.prompt_tokens == len(ids)
    # max_completion_tokens is the newer name for the same limit.
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_completion_tokens=2,
                                       temperature=0)
    assert r.usage.completion_tokens <= 2


def test_json_object_response_format(client):
    """OpenAI's JSON mode through the client: the content is a JSON object (or, cut by max_tokens, the
    start of one), streamed or not."""
    from fitllm.serve import json_mode

    messages = [{"role": "user", "content": "Give me a JSON object describing a cat."}]
    for seed in (1, 2):
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=60,
                                           temperature=0.8, seed=seed, response_format={"type": "json_object"})
        content = r.choices[0].message.content
        assert json_mode.JSON_OBJECT.walk(json_mode.JSON_OBJECT.start, content.encode()) is not None, content
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(content), dict)
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=60,
                                            temperature=0.8, seed=1, response_format={"type": "json_object"},
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=60,
                                       temperature=0.8, seed=1,
                                       response_format={"type": "json_object"}).choices[0].message.content


def test_json_schema_response_format_through_the_clients_parse(client):
    """Structured outputs as the OpenAI client asks for them: a pydantic model sent as a strict
    json_schema, the answer parsed back into the model by the client."""
    from typing import Literal

    import pydantic

    class Cat(pydantic.BaseModel):
        name: str
        age: int
        mood: Literal["happy", "grumpy"]

    import openai

    parsed = 0
    for seed in (1, 2, 3, 4):
        try:
            r = client.chat.completions.parse(model="SmolLM2-135M-Instruct", response_format=Cat, max_tokens=80,
                                              temperature=0.8, seed=seed,
                                              messages=[{"role": "user", "content": "Describe a cat."}])
        except openai.LengthFinishReasonError:  # (this small model may ramble inside a string)
            continue
        assert isinstance(r.choices[0].message.parsed, Cat)
        parsed += 1
    assert parsed >= 2


WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time."}},  # no parameters
]


def test_tool_choice_required_and_named_through_the_client(client):
    """Forced tool calls: 'required' gives one or more calls of the tools given, each with
    arguments of its schema (finish_reason tool_calls); a named function gives its arguments;
    streamed, the deltas add up to the same calls with one id each; the history can carry the
    calls and their results back to the model."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=messages, tools=WEATHER_TOOLS, max_tokens=80, seed=3)
    r = client.chat.completions.create(tool_choice="required", temperature=0, **kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"].get("parameters") for t in WEATHER_TOOLS}
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call") and call.function.name in schemas
        arguments = json.loads(call.function.arguments)
        if schemas[call.function.name]:
            jsonschema.validate(arguments, schemas[call.function.name])
        else:
            assert arguments == {}
    assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)

    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(tool_choice=named, temperature=0.7, **kwargs)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), schemas["get_weather"])
    one = client.chat.completions.create(tool_choice="required", temperature=0.7, parallel_tool_calls=False, **kwargs)
    assert len(one.choices[0].message.tool_calls) == 1

    for choice_ in ("required", named):
        whole = client.chat.completions.create(tool_choice=choice_, temperature=0.7, **kwargs).choices[0]
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(tool_choice=choice_, temperature=0.7, stream=True, **kwargs):
            for delta_call in chunk.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(delta_call.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = entry["id"] or delta_call.id
                entry["name"] = entry["name"] or delta_call.function.name
                entry["arguments"] += delta_call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == whole.finish_reason
        assert [(c["name"], c["arguments"]) for c in calls.values()] == \
            [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert all(c["id"] for c in calls.values())

    history = messages + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=history, tools=WEATHER_TOOLS,
                                       tool_choice="none", max_tokens=20, temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_echo_scoring_logprobs_match_model(client, embedded_model, embedded_tokenizer):
    from fitllm.models.generate import prompt_logits

    ids = embedded_tokenizer.encode(TEXTS[2])
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == embedded_tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = torch.log_softmax(prompt_logits(embedded_model, ids), dim=-1)
    want = [ref[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=2e-3)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])  # top 2, plus the actual token
    assert lp.text_offset == sorted(lp.text_offset) and r.usage.completion_tokens == 0


def test_chat_logprobs_shape(client):
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=3, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3 and isinstance(entry.bytes, list)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
    assert content[0].top_logprobs[0].token == content[0].token  # greedy picks the most likely


def test_n_choices_and_seed_reproducible(client):
    kwargs = dict(model="SmolLM2-135M-Instruct", prompt=TEXTS[7], max_tokens=4, temperature=1.0, n=3, seed=1234)
    a, b = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert 3 <= a.usage.completion_tokens <= 12


def test_stop_sequence(client):
    base = client.completions.create(model="SmolLM2-135M-Instruct", prompt=TEXTS[3], max_tokens=MAX_NEW, temperature=0)
    text = base.choices[0].text
    stop = text.strip()[:2] if text.strip() else None
    if not stop:
        pytest.skip("greedy output is blank")
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=TEXTS[3], max_tokens=MAX_NEW, temperature=0,
                                  stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert r.choices[0].model_extra["stop_reason"] == stop and base.choices[0].model_extra["stop_reason"] is None
    assert text.startswith(r.choices[0].text)


def test_errors_through_the_client(client, server):
    import openai

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=10_000)
    assert err.value.code == "context_length_exceeded"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    assert httpx.get(server.url + "/metrics").status_code == 401


def test_load_generator_against_the_server(server):
    """`quant bench serve`'s client (its own small HTTP/1.1 code): every request streams, with the
    API key, and the output tokens it counts are the server's usage counts."""
    from fitllm.serve.bench import make_workload, run_online

    workload = make_workload(6, 8, 5, vocab_size=49152, seed=1)
    summary = asyncio.run(run_online(server.url, workload, float("inf"), api_key=KEY, max_concurrency=3))
    assert summary["completed"] == 6 and summary["errors"] == 0, summary["error_examples"]
    assert summary["output_tokens_per_s"] * summary["duration_s"] == pytest.approx(30)  # 6 x 5, EOS ignored
    bad = asyncio.run(run_online(server.url, make_workload(1, 8, 2, vocab_size=49152), float("inf"),
                                 model="SmolLM2-135M-Instruct", api_key="wrong"))
    assert bad["errors"] == 1 and bad["error_examples"] == ["HTTP 401"]
