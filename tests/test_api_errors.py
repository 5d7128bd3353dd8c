"""Bad input to the HTTP API: every case is a 4xx with OpenAI's error body, never a 500.

The app runs in-process over a fake engine with LLMEngine's interface (instant tokens) and the
embedded model's real tokenizer, so validation, tokenization and context checks are the real
ones while a fuzzed request that happens to be valid costs microseconds, not a forward pass.
"""
from __future__ import annotations

import json
import os
import time
from collections import deque
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

VOCAB = 49152
MAX_LEN = 128
KEY = "sk-test-0123456789"
POISON = 666  # a prompt holding this token id fails in the fake engine


class FakeEngine:
    """LLMEngine's interface: each step gives every running request token 42 (':')."""

    def __init__(self, tokenizer, step_delay: float = 0.0, max_running: int = 1024):
        self.tokenizer = tokenizer
        self.model_config = SimpleNamespace(vocab_size=VOCAB)
        self.max_model_len = MAX_LEN
        self.step_delay, self.max_running = step_delay, max_running
        self.requests: dict[str, list] = {}  # id -> [prompt, params, generated]
        self.scheduler = SimpleNamespace(waiting=deque(), running=[])
        self.outbox = []

    def validate_request(self, request_id, prompt_token_ids, params):
        if not prompt_token_ids or len(prompt_token_ids) >= self.max_model_len:
            raise ValueError("bad prompt length")
        params.validate(VOCAB)

    def add_request(self, request_id, prompt_token_ids, params):
        self.validate_request(request_id, prompt_token_ids, params)
        self.requests[request_id] = [list(prompt_token_ids), params, 0]
        self.scheduler.waiting.append(request_id)

    def abort_request(self, request_id):
        from fitllm.serve.engine import RequestOutput

        state = self.requests.pop(request_id, None)
        if state is not None:  # like LLMEngine: the abort output comes with the next step
            self.outbox.append(RequestOutput(request_id, [], "", True, "abort", len(state[0]), state[2], [], None))

    def has_unfinished_requests(self):
        return bool(self.requests or self.outbox)

    def step(self):
        from fitllm.serve.engine import RequestOutput
        from fitllm.serve.sampling import TokenLogprob

        time.sleep(self.step_delay)
        outs, self.outbox = self.outbox, []
        sched = self.scheduler
        sched.running = [r for r in sched.running if r in self.requests]
        sched.waiting = deque(r for r in sched.waiting if r in self.requests)
        while sched.waiting and len(sched.running) < self.max_running:
            sched.running.append(sched.waiting.popleft())
        for rid in list(sched.running):
            prompt, params, done = state = self.requests[rid]
            first = done == 0
            new = [] if params.max_tokens == 0 else [42]
            state[2] = done = done + len(new)
            finished = done >= params.max_tokens
            lp = [TokenLogprob(42, -0.5, [(42, -0.5), (7, -1.5)][:params.logprobs or 0])] \
                if params.logprobs is not None and new else []
            plp = None
            if first and params.prompt_logprobs is not None:
                plp = [None] + [TokenLogprob(t, -1.0, [(t, -1.0)]) for t in prompt[1:]]
            if POISON in prompt:  # what LLMEngine reports for NaN/inf logits
                outs.append(RequestOutput(rid, [], "", True, "error", len(prompt), done, [], None, "NaN logits"))
                del self.requests[rid]
                continue
            outs.append(RequestOutput(rid, new, self.tokenizer.decode(new), finished, "length" if finished else None,
                                      len(prompt), done, lp, plp))
            if finished:
                del self.requests[rid]
        return outs

    def stats(self):
        return {"num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "kv_blocks_total": 64, "kv_blocks_used": len(self.requests), "prefix_cache_hit_rate": 0.0,
                "preemptions": 0}


@pytest.fixture(scope="module")
def tokenizer(embedded_tokenizer):
    return embedded_tokenizer


def make_client(tokenizer, **config) -> TestClient:
    from fitllm.serve.app import ServerConfig, create_app

    engine = FakeEngine(tokenizer, config.pop("step_delay", 0.0), config.pop("max_running", 1024))
    app = create_app(engine, ServerConfig(served_model_name="tiny", **config))
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client(tokenizer):
    with make_client(tokenizer) as c:
        yield c


def assert_openai_error(r, status: int, param: str | None = None, code: str | None = None):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


OK_COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
OK_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

BAD_COMPLETIONS = [  # (body patch, expected param, expected code)
    ({"max_tokens": "5"}, "max_tokens", None),
    ({"max_tokens": -1}, "max_tokens", None),
    ({"max_tokens": 10**9}, "max_tokens", "context_length_exceeded"),
    ({"max_tokens": 2**70}, "max_tokens", "context_length_exceeded"),
    ({"max_tokens": 1.5}, "max_tokens", None),
    ({"n": 0}, "n", None),
    ({"n": 129}, "n", None),
    ({"n": 2, "best_of": 5}, None, None),
    ({"best_of": 100}, "best_of", None),
    ({"prompt": ""}, "prompt", "empty_prompt"),
    ({"prompt": []}, "prompt", None),
    ({"prompt": [[]]}, "prompt", None),
    ({"prompt": [1, "a"]}, "prompt", None),
    ({"prompt": [True]}, "prompt", None),
    ({"prompt": [-1]}, "prompt", None),
    ({"prompt": [VOCAB]}, "prompt", "invalid_token_id"),
    ({"prompt": None}, "prompt", None),
    ({"prompt": "word " * 4000}, "prompt", "context_length_exceeded"),
    ({"prompt": "word " * 10**5}, "prompt", "context_length_exceeded"),  # refused before tokenizing
    ({"prompt": list(range(MAX_LEN + 1))}, None, "context_length_exceeded"),
    ({"prompt": ["a"] * 100, "n": 2}, "n", "too_many_choices"),
    ({"temperature": 2.5}, "temperature", None),
    ({"temperature": "hot"}, "temperature", None),
    ({"top_p": 1.5}, "top_p", None),
    ({"logprobs": 21}, "logprobs", None),
    ({"logprobs": -1}, "logprobs", None),
    ({"presence_penalty": 3}, "presence_penalty", None),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", None),
    ({"stop": ""}, "stop", None),
    ({"stop": 5}, "stop", None),
    ({"logit_bias": {"abc": 1}}, "logit_bias", None),
    ({"logit_bias": {"-3": 1}}, "logit_bias", None),
    ({"logit_bias": {"5": 101}}, "logit_bias", None),
    ({"logit_bias": {"5": "x"}}, None, None),
    ({"logit_bias": {str(VOCAB + 5): 1}}, "logit_bias", "invalid_token_id"),
    ({"logit_bias": [1, 2]}, "logit_bias", None),
    ({"stop_token_ids": [VOCAB]}, "logit_bias", "invalid_token_id"),
    ({"suffix": "end"}, None, None),
    ({"stream_options": {"include_usage": True}}, None, None),
    ({"stream": True, "stream_options": {"include_usage": True, "bogus": 1}}, "stream_options.bogus",
     "unknown_parameter"),
    ({"unknown_field": 1}, "unknown_field", "unknown_parameter"),
    ({"seed": 2**80}, "seed", None),
    ({"echo": "yes please"}, "echo", None),
]


@pytest.mark.parametrize("patch,param,code", BAD_COMPLETIONS, ids=[json.dumps(p)[:40] for p, _, _ in BAD_COMPLETIONS])
def test_bad_completion_requests(client, patch, param, code):
    r = client.post("/v1/completions", json={**OK_COMPLETION, **patch})
    assert_openai_error(r, 404 if code == "model_not_found" else 400, param, code)


BAD_CHATS = [
    ({"messages": []}, "messages", None),
    ({"messages": "hi"}, "messages", None),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, None, None),
    ({"messages": [{"role": "user"}], "extra": 1}, "extra", "unknown_parameter"),
    ({"messages": [{"role": "user", "content": "hi", "mood": "happy"}]}, "messages.0.mood", "unknown_parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]},
     "messages.0.content", None),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content", None),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice", None),  # 'auto', the default
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tool_choice", None),
    ({"tool_choice": "required"}, "tool_choice", None),  # no tools
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", None),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2, "tool_choice": "required"}, "tools", None),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "none"},
     "tools.0.function.name", None),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": "required"},
     "tools.0.function.parameters.properties.n.uniqueItems",
     None),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "object",
        "properties": {"n": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": "auto"},
     "tools.0.function.parameters.properties.n.uniqueItems", None),  # a strict tool's arguments are enforced under 'auto' too
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools.0.function.parameters", None),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
      "tool_choice": "none"}, "tools.0.function.parameters", None),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "parallel_tool_calls": "yes"}, "parallel_tool_calls", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {"type": "object"}}}},
     "response_format.json_schema.name", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"type": "string", "format": "x"}}}}}},
     "response_format.json_schema.schema.$defs.A.format", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}}}},
     "response_format.json_schema.schema", None),  # no finite value: refused, not failed mid-answer
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"id": "c"}]}],
      "tool_choice": "none"}, "messages.1.tool_calls.0.function", None),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "logprobs": True},
     "logprobs", None),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format", None),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "min_tokens": 3},
     "min_tokens", None),
    ({"top_logprobs": 3}, None, None),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     None),
    ({"response_format": {"type": "json_schema"}}, "response_format", None),
    ({"response_format": {"type": "json_object", "json_schema": {"schema": {}}}}, "response_format", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(a)\\1"}}}}}},
     "response_format.json_schema.schema.properties.a.pattern", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "min_tokens": 1},
     "min_tokens", None),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens", None),
    ({"response_format": {"type": "json_object"}, "continue_final_message": True, "add_generation_prompt": False,
      "messages": [{"role": "assistant", "content": "{"}]}, "continue_final_message", None),
    ({"max_completion_tokens": -5}, "max_completion_tokens", None),
    ({"max_completion_tokens": 10**6}, "max_completion_tokens", "context_length_exceeded"),
    ({"max_tokens": 10**6}, "max_tokens", "context_length_exceeded"),
    ({"max_tokens": 0}, "max_tokens", None),  # a chat answer has a token at least (OpenAI refuses 0 too)
    ({"max_completion_tokens": 0}, "max_completion_tokens", None),
    ({"n": 1000}, "n", None),
    ({"messages": [{"role": "user", "content": "word " * 3000}]}, "messages", "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "word " * 10**5}]}, "messages", "context_length_exceeded"),
    ({"modalities": ["text", "audio"]}, "modalities.1", None),  # text only: audio out is not served
    ({"continue_final_message": True}, "continue_final_message", None),  # the last message is the user's
    ({"messages": [{"role": "assistant", "content": "I"}], "continue_final_message": True,
      "add_generation_prompt": True}, "continue_final_message", None),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", None),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs", None),
    ({"min_tokens": 3, "max_tokens": 2}, "min_tokens", "invalid_value"),
    ({"min_tokens": 3, "max_tokens": None, "max_completion_tokens": 2}, "min_tokens", "invalid_value"),
    ({"min_tokens": 10**6}, "min_tokens", None),  # more than the context leaves
    ({"min_tokens": -1}, "min_tokens", None),
]


@pytest.mark.parametrize("patch,param,code", BAD_CHATS, ids=[json.dumps(p)[:40] for p, _, _ in BAD_CHATS])
def test_bad_chat_requests(client, patch, param, code):
    r = client.post("/v1/chat/completions", json={**OK_CHAT, **patch})
    assert_openai_error(r, 400, param, code)


@pytest.mark.parametrize("raw", [
    b'{"prompt": "hi"',                      # truncated JSON
    b"",                                      # no body
    b"[1, 2]",                                # not an object
    b'"just a string"',
    b'{"prompt": "\xff\xfe bad utf-8"}',       # invalid UTF-8 bytes
    b'{"prompt": "\\ud800 lone surrogate"}',  # valid JSON escape, not encodable text
    b'{"prompt": "hi", "temperature": NaN}',  # JSON extension Python accepts
    b'{"prompt": "hi", "temperature": Infinity}',
    b"\x00\x01\x02",
    b'{"prompt": "hi", "prompt": 5}',         # duplicate key: the last one wins, then fails
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_bodies(client, raw, path):
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


def test_form_content_type_still_parsed_as_json(client):
    # curl -d sends application/x-www-form-urlencoded; the body is JSON all the same.
    r = client.post("/v1/completions", content=json.dumps(OK_COMPLETION),
                    headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200, r.text


def test_unknown_model_is_404(client):
    err = assert_openai_error(client.post("/v1/completions", json={**OK_COMPLETION, "model": "gpt-9"}), 404,
                              "model", "model_not_found")
    assert "gpt-9" in err["message"]
    assert_openai_error(client.post("/v1/chat/completions", json={**OK_CHAT, "model": "../etc/passwd"}), 404)


def test_long_tokens_are_not_refused_by_the_length_bound(client, tokenizer):
    """The bound checked before tokenizing is the vocabulary's longest token, not a guess: SmolLM2 has tokens of
    64+ characters (runs of '#'), so a prompt of ~40 characters a token fits (it was refused with a made-up
    count when the bound was 32 characters a token)."""
    server = client.app.state.server
    longest = max(tokenizer.get_vocab(), key=len)
    assert server.max_token_chars == len(longest) > 32
    run = "#" * 64
    prompt = run * (MAX_LEN // 2 + 4)
    n_tokens = len(tokenizer.encode(prompt))
    assert n_tokens < MAX_LEN - 8 and len(prompt) > 32 * MAX_LEN, (n_tokens, len(prompt))
    r = client.post("/v1/completions", json={**OK_COMPLETION, "prompt": prompt})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == n_tokens


def test_models_route_names_the_model(client):
    r = client.get("/v1/models/tiny")
    assert r.status_code == 200 and r.json()["id"] == "tiny" and r.json()["object"] == "model", r.text
    assert_openai_error(client.get("/v1/models/gpt-9"), 404, "model", "model_not_found")


def test_vllm_chat_template_options(client, tokenizer):
    """continue_final_message continues the assistant's last message (no new turn is opened);
    chat_template_kwargs reach the template as variables; both change the prompt the engine gets."""
    from fitllm.serve.protocol import ChatCompletionRequest

    server = client.app.state.server
    partial = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    ids = server.chat_prompt_ids(ChatCompletionRequest(messages=partial, continue_final_message=True))
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\nHello, I am"), tokenizer.decode(ids)
    opened = server.chat_prompt_ids(ChatCompletionRequest(messages=partial))
    assert tokenizer.decode(opened).endswith("<|im_start|>assistant\n")
    no_turn = server.chat_prompt_ids(ChatCompletionRequest(messages=partial[:1], add_generation_prompt=False))
    assert not tokenizer.decode(no_turn).endswith("<|im_start|>assistant\n")
    # SmolLM2's template reads no extra variables: accepted, same prompt
    same = server.chat_prompt_ids(ChatCompletionRequest(messages=partial[:1], chat_template_kwargs={"x": 1}))
    assert same == server.chat_prompt_ids(ChatCompletionRequest(messages=partial[:1]))
    r = client.post("/v1/chat/completions", json={**OK_CHAT, "messages": partial, "continue_final_message": True,
                                                 "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_vllm_detokenizer_options_reach_the_engine(client):
    server = client.app.state.server
    from fitllm.serve.protocol import CompletionRequest

    body = CompletionRequest(prompt="x", skip_special_tokens=False, include_stop_str_in_output=True, stop="a")
    params = server.sampling_params(body, 4, 0, None)
    assert params.skip_special_tokens is False and params.include_stop_str_in_output is True
    default = server.sampling_params(CompletionRequest(prompt="x"), 4, 0, None)
    assert default.skip_special_tokens is True and default.include_stop_str_in_output is False
    r = client.post("/v1/completions", json={**OK_COMPLETION, "skip_special_tokens": False,
                                             "include_stop_str_in_output": True, "stop": "x"})
    assert r.status_code == 200, r.text


def test_top_k_minus_one_means_off(client):
    """vLLM's "disabled" value, which clients copying vLLM defaults send."""
    r = client.post("/v1/completions", json={**OK_COMPLETION, "top_k": -1})
    assert r.status_code == 200, r.text
    assert_openai_error(client.post("/v1/completions", json={**OK_COMPLETION, "top_k": -2}), 400, "top_k")


def test_unknown_route_and_method(client):
    assert_openai_error(client.get("/v1/nothing"), 404)
    assert_openai_error(client.get("/v1/completions"), 405)
    assert_openai_error(client.post("/../../etc/passwd", json={}), 404)


def test_valid_requests_work(client):
    r = client.post("/v1/completions", json={**OK_COMPLETION, "echo": True, "logprobs": 1, "n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    lp = body["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == len(lp["text_offset"])
    r = client.post("/v1/chat/completions", json={**OK_CHAT, "logprobs": True, "top_logprobs": 1})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"][0]["logprob"] == -0.5
    # OpenAI parameters that change nothing about the tokens: accepted, as OpenAI's own API does
    ignored = {"user": "u1", "metadata": {"run": "a"}, "store": False, "service_tier": "auto", "modalities": ["text"],
               "parallel_tool_calls": True, "prediction": {"type": "content", "content": "Hello"}}
    r = client.post("/v1/chat/completions", json={**OK_CHAT, **ignored})
    assert r.status_code == 200, r.text


def test_prompt_lists_give_one_choice_per_prompt_and_n(client):
    r = client.post("/v1/completions", json={**OK_COMPLETION, "prompt": ["a", "b c"], "n": 2})
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]
    r = client.post("/v1/completions", json={**OK_COMPLETION, "prompt": [[1, 2], [3]], "max_tokens": 0, "echo": True})
    assert [c["text"] for c in r.json()["choices"]] == [tokenizer_decode(client, [1, 2]), tokenizer_decode(client, [3])]
    assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}


def tokenizer_decode(client, ids):
    return client.app.state.server.decode(ids)


def test_serve_binds_localhost_by_default():
    import inspect

    from fitllm.cli.serve import serve

    assert inspect.signature(serve).parameters["host"].default.default == "127.0.0.1"


@pytest.mark.parametrize("args,why", [
    (["--block-size", "0"], "block_size must be at least 1, got 0"),
    (["--max-num-batched-tokens", "0"], "max_num_batched_tokens must be at least 1, got 0"),
    (["--max-model-len", "-5"], "max_model_len must be at least 1, got -5"),
    (["--num-kv-blocks", "0"], "num_kv_blocks must be at least 1, got 0"),
    (["--kv-dtype", "fp9"], "unknown kv_dtype 'fp9'"),
])
def test_serve_refuses_bad_sizes_before_loading(args, why, monkeypatch):
    """These were tracebacks, or (--max-model-len -5) a server whose every request failed."""
    from typer.testing import CliRunner

    from fitllm.cli import serve as serve_cli
    from fitllm.cli.main import app

    monkeypatch.setattr(serve_cli, "_check_port_free", lambda host, port: None)
    monkeypatch.setattr("fitllm.serve.engine.LLMEngine", lambda config: pytest.fail("the model was loaded"))
    result = CliRunner().invoke(app, ["serve", *args])
    assert result.exit_code == 1 and why in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output


def test_body_size_limit(tokenizer):
    with make_client(tokenizer, max_body_bytes=2048) as c:
        big = {**OK_COMPLETION, "prompt": "x" * 4096}
        assert_openai_error(c.post("/v1/completions", json=big), 413, code="request_too_large")

        def chunked():  # no Content-Length: the limit must hold on the bytes actually read
            yield json.dumps(big).encode()
        assert_openai_error(c.post("/v1/completions", content=chunked(),
                                   headers={"content-type": "application/json"}), 413)
        assert c.post("/v1/completions", json=OK_COMPLETION).status_code == 200


def test_api_key(tokenizer):
    with make_client(tokenizer, api_key=KEY) as c:
        assert c.get("/health").status_code == 200  # probes need no key
        for method, path in [("get", "/v1/models"), ("get", "/metrics"), ("post", "/v1/completions"),
                             ("get", "/openapi.json"), ("get", "/docs"), ("get", "/no/such/route")]:
            assert_openai_error(getattr(c, method)(path), 401, code="invalid_api_key")
            for header in [f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", KEY, f"Basic {KEY}", f"Bearer{KEY}", ""]:
                assert_openai_error(getattr(c, method)(path, headers={"authorization": header}), 401)
        good = {"authorization": f"Bearer {KEY}"}
        assert c.get("/v1/models", headers=good).status_code == 200
        assert c.post("/v1/completions", json=OK_COMPLETION, headers=good).status_code == 200
        assert c.get("/metrics", headers=good).status_code == 200
        assert c.get("/v1/models", headers={"authorization": f"bearer {KEY}"}).status_code == 200  # RFC 7235


def test_api_key_uses_constant_time_compare(tokenizer, monkeypatch):
    import hmac

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    with make_client(tokenizer, api_key=KEY) as c:
        c.get("/v1/models", headers={"authorization": "Bearer nope"})
    assert calls, "the API key must be checked with hmac.compare_digest"


def test_overload_answers_429_with_retry_after(tokenizer):
    import concurrent.futures as cf

    with make_client(tokenizer, max_waiting=2, step_delay=0.05, max_running=2) as c:
        body = {**OK_COMPLETION, "max_tokens": 20}
        with cf.ThreadPoolExecutor(12) as pool:
            results = list(pool.map(lambda _: c.post("/v1/completions", json=body), range(12)))
        codes = sorted(r.status_code for r in results)
        assert 429 in codes and 200 in codes, codes
        limited = next(r for r in results if r.status_code == 429)
        assert_openai_error(limited, 429, code="overloaded")
        assert int(limited.headers["retry-after"]) >= 1
        assert c.post("/v1/completions", json=OK_COMPLETION).status_code == 200  # still serving
        metrics = c.get("/metrics").text
        assert 'fitllm_request_errors_total{type="overloaded"}' in metrics


def test_timeout_is_504_and_aborts(tokenizer):
    with make_client(tokenizer, request_timeout=0.3, step_delay=0.05) as c:
        r = c.post("/v1/completions", json={**OK_COMPLETION, "max_tokens": 100})
        assert_openai_error(r, 504, code="request_timeout")
        engine = c.app.state.server.engine
        deadline = time.monotonic() + 5
        while engine.stats()["kv_blocks_used"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.stats()["kv_blocks_used"] == 0


# ---- fuzzing the OpenAPI schema --------------------------------------------------------------------

def _json_values():
    scalars = (st.none() | st.booleans() | st.integers(-2**64, 2**64) | st.text(max_size=12)
               | st.floats(allow_nan=False, allow_infinity=False))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=8)


def from_schema(schema: dict, components: dict, depth: int = 0):
    """Values that follow `schema` (an OpenAPI/JSON-schema fragment), mostly; bounded in size."""
    if "$ref" in schema:
        return from_schema(components[schema["$ref"].rsplit("/", 1)[1]], components, depth)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, components, depth) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        return st.integers(lo, hi if hi is not None else (lo or 0) + 300) | st.integers(-5, 5)
    if kind == "number":
        return st.floats(schema.get("minimum", schema.get("exclusiveMinimum")), schema.get("maximum"),
                         allow_nan=False, allow_infinity=False) | st.floats(-3, 3)
    if kind == "string":
        return st.text(max_size=24)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        item = from_schema(schema.get("items", {}), components, depth + 1) if depth < 3 else st.none()
        return st.lists(item, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 4), 4))
    if kind == "object" and schema.get("properties") and depth < 4:
        props = {k: from_schema(v, components, depth + 1) for k, v in schema["properties"].items()}
        required = {k: props.pop(k) for k in schema.get("required", [])}
        return st.fixed_dictionaries(required, optional=props)
    return _json_values()


def fuzz_bodies(schema: dict, components: dict):
    """Schema-following bodies, plus the same with one field broken or an unknown field added."""
    valid = from_schema(schema, components)

    def mutate(body, key, junk):
        return {**body, key: junk}
    broken = st.builds(mutate, valid, st.sampled_from(list(schema["properties"]) + ["bogus"]), _json_values())
    return valid | broken | _json_values()


@pytest.fixture(scope="module")
def openapi(client):
    doc = client.get("/openapi.json").json()
    return doc, doc["components"]["schemas"]


@pytest.mark.parametrize("path,schema_name", [("/v1/completions", "CompletionRequest"),
                                              ("/v1/chat/completions", "ChatCompletionRequest")])
def test_fuzz_openapi_schema_never_5xx(client, openapi, path, schema_name):
    doc, components = openapi
    ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref.endswith(schema_name)
    seen = {}

    @settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(body=fuzz_bodies(components[schema_name], components))
    def check(body):
        r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (body, r.text)
        if r.status_code >= 400:
            assert_openai_error(r, r.status_code)
        elif isinstance(body, dict) and body.get("stream"):
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
        else:
            assert r.json()["choices"] is not None
    check()
    print(f"{path}: status counts {seen}")
    assert seen.get(200, 0) > 0 and sum(v for k, v in seen.items() if k >= 400) > 0, seen


def test_stream_timeout_ends_with_error_event(tokenizer):
    with make_client(tokenizer, request_timeout=0.4, step_delay=0.05) as c:
        r = c.post("/v1/completions", json={**OK_COMPLETION, "max_tokens": 100, "stream": True})
        assert r.status_code == 200  # the headers went out with the first token
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "request_timeout"
        assert 1 <= len(events) - 2 < 100


def test_engine_error_is_reported_not_propagated(client):
    import concurrent.futures as cf

    poisoned = {**OK_COMPLETION, "prompt": [1, POISON, 2]}
    with cf.ThreadPoolExecutor(4) as pool:
        bad, good, bad_stream = pool.map(lambda b: client.post("/v1/completions", json=b),
                                         [poisoned, OK_COMPLETION, {**poisoned, "stream": True}])
    err = assert_openai_error(bad, 500, code="engine_error")
    assert "NaN" in err["message"]
    assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] == "length"
    assert bad_stream.status_code == 500  # the error came before the first token: a plain HTTP error


# ---- the streaming fast path: merged outputs and preformatted chunks ------------------------------

def test_a_consumer_that_falls_behind_gets_the_pending_outputs_merged(tokenizer):
    """All outputs waiting for a request come as one, with every token, text and logprob kept."""
    import asyncio

    from fitllm.serve.async_engine import AsyncEngine
    from fitllm.serve.sampling import SamplingParams

    async def run():
        engine = AsyncEngine(FakeEngine(tokenizer))
        outs = []
        stream = engine.generate("r", [1, 2, 3], SamplingParams(max_tokens=12, logprobs=1))
        outs.append(await anext(stream))  # the engine thread now produces the rest meanwhile
        for _ in range(200):  # until the engine thread has finished the request
            await asyncio.sleep(0.01)
            if not engine.engine.has_unfinished_requests():
                break
        outs += [o async for o in stream]
        await engine.shutdown()
        return outs

    outs = asyncio.run(run())
    assert len(outs) < 12  # fewer outputs than tokens: merged
    assert sum(len(o.new_token_ids) for o in outs) == 12 and outs[-1].finished
    assert "".join(o.new_text for o in outs) == tokenizer.decode([42] * 12)
    assert sum(len(o.logprobs) for o in outs) == 12
    assert outs[-1].num_generated_tokens == 12 and outs[-1].finish_reason == "length"


@pytest.mark.parametrize("text", ["plain", 'quo"te \\ back', "new\nline\ttab", "héllo 😀 你好", "\u0001ctl", ""])
def test_chunk_templates_serialize_like_the_models(text):
    from fitllm.serve import protocol as P

    completion = P.CompletionResponse(id="cmpl-1", model="m", created=5, choices=[
        P.CompletionChoice(index=3, text=P.TextTemplate.MARK)])
    want = completion.model_copy(update={"choices": [P.CompletionChoice(index=3, text=text)]})
    assert json.loads(P.TextTemplate(completion).fill(text)) == json.loads(want.model_dump_json())
    chat = P.ChatCompletionChunk(id="chatcmpl-1", model="m", created=5, choices=[
        P.ChatChunkChoice(index=0, delta=P.ChatDelta(content=P.TextTemplate.MARK))])
    want = chat.model_copy(update={"choices": [P.ChatChunkChoice(index=0, delta=P.ChatDelta(content=text))]})
    assert json.loads(P.TextTemplate(chat).fill(text)) == json.loads(want.model_dump_json())
    with pytest.raises(ValueError, match="exactly once"):
        P.TextTemplate(P.CompletionResponse(id=P.TextTemplate.MARK, model="m", choices=[
            P.CompletionChoice(index=0, text=P.TextTemplate.MARK)]))


@pytest.mark.parametrize("path, body", [("/v1/completions", OK_COMPLETION), ("/v1/chat/completions", OK_CHAT)])
def test_streamed_text_and_usage_with_a_slow_engine(tokenizer, path, body):
    """Per-token chunks (the preformatted path) carry the whole text; usage counts every token."""
    with make_client(tokenizer, step_delay=0.01) as c:
        req = {**body, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
        r = c.post(path, json=req)
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    choices = [e["choices"][0] for e in events if e["choices"]]
    text = "".join(ch.get("text") or ch.get("delta", {}).get("content") or "" for ch in choices)
    assert text == tokenizer.decode([42] * 5)
    assert choices[-1]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 5 and events[-1]["choices"] == []
    assert len({e["created"] for e in events}) == 1 and len({e["id"] for e in events}) == 1


def test_serve_deterministic_flag_sets_the_kernels_switch_before_the_engine(monkeypatch):
    """--deterministic must be in the environment when the engine (and its CUDA graphs) is built."""
    from typer.testing import CliRunner

    from fitllm.cli import serve as serve_cli
    from fitllm.cli.main import app

    seen = []

    def fake_build(*args, **kwargs):
        seen.append(os.environ.get("FITLLM_DETERMINISTIC"))
        raise SystemExit(3)

    monkeypatch.setenv("FITLLM_DETERMINISTIC", "0")  # (restored after the test, whatever serve sets)
    monkeypatch.setattr(serve_cli, "_build_engine", fake_build)
    monkeypatch.setattr(serve_cli, "_check_port_free", lambda host, port: None)
    for flag, want in (([], "0"), (["--deterministic"], "1")):
        assert CliRunner().invoke(app, ["serve", *flag]).exit_code == 3
        assert seen[-1] == want


def test_tokenize_and_detokenize(client, tokenizer):
    """vLLM's /tokenize and /detokenize, against the tokenizer and its chat template directly."""
    text = "Héllo wörld 😀, the end."
    r = client.post("/tokenize", json={"model": "tiny", "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    ids = tokenizer.encode(text, add_special_tokens=True)
    assert r.json() == {"count": len(ids), "max_model_len": r.json()["max_model_len"], "tokens": ids,
                        "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    assert client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"] == \
        tokenizer.encode(text, add_special_tokens=False)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    chat = client.post("/tokenize", json={"messages": messages, "continue_final_message": True}).json()
    expected = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True),
                                add_special_tokens=False)
    assert chat["tokens"] == expected and chat["count"] == len(expected) and chat.get("token_strs") is None
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}
    long = "word " * 30000  # past the context: counted all the same (counting is what it is for)
    assert client.post("/tokenize", json={"prompt": long}).json()["count"] == len(tokenizer.encode(long))
    bos = client.post("/tokenize", json={"messages": messages, "continue_final_message": True,
                                         "add_special_tokens": True}).json()["tokens"]
    assert bos == tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False,
                                                                 continue_final_message=True))
    # errors as the completion routes give them
    assert_openai_error(client.post("/tokenize", json={"messages": messages, "add_generation_prompt": True,
                                                        "continue_final_message": True}), 400, "continue_final_message")
    assert_openai_error(client.post("/tokenize", json={"prompt": text, "messages": messages}), 400, "prompt",
                        "unknown_parameter")
    assert_openai_error(client.post("/tokenize", json={"prompt": "hi", "model": "other"}), 404, "model")
    assert_openai_error(client.post("/tokenize", json={}), 400, "prompt")
    assert_openai_error(client.post("/tokenize", content=b"{not json"), 400, code="invalid_json")
    assert_openai_error(client.post("/detokenize", json={"tokens": [VOCAB]}), 400, "tokens", "invalid_token_id")
    assert_openai_error(client.post("/detokenize", json={"tokens": [-1]}), 400, "tokens.0")


def test_chat_template_option(tokenizer, tmp_path, monkeypatch):
    """--chat-template: a broken or missing file fails before the model loads, naming it and the line;
    a good one replaces the tokenizer's template for chat completions and /tokenize."""
    from typer.testing import CliRunner

    from fitllm.cli import serve as serve_cli
    from fitllm.cli.main import app

    monkeypatch.setattr(serve_cli, "_check_port_free", lambda host, port: None)
    monkeypatch.setattr(serve_cli, "_build_engine", lambda *a, **k: pytest.fail("the model was loaded"))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    for path, why in ((broken, "broken.jinja: line 2"), (tmp_path / "none.jinja", "none.jinja: cannot read it")):
        result = CliRunner().invoke(app, ["serve", "--chat-template", str(path)])
        assert result.exit_code == 1 and why in " ".join(result.output.split()), result.output
    # transformers' own Jinja environment: loop controls and its generation tag compile
    hf_only = tmp_path / "hf.jinja"
    hf_only.write_text("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% break %}"
                       "{% endfor %}")
    for value in (str(hf_only), "{{ messages[0].content }}"):  # a file, or the template itself
        assert serve_cli._read_chat_template(value) == (hf_only.read_text() if value == str(hf_only) else value)
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    with make_client(tokenizer, chat_template=template) as c:
        ids = c.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()["tokens"]
        assert ids == tokenizer.encode("<user>Hi\n<assistant>", add_special_tokens=False)
        assert c.post("/v1/chat/completions", json=OK_CHAT).json()["usage"]["prompt_tokens"] == len(ids)
    assert tokenizer.chat_template != template  # the server's own copy was changed, not the engine's


def test_min_tokens_error_names_the_limit_it_exceeds(client):
    for extra, named in (({"max_completion_tokens": 2}, "(max_completion_tokens)"), ({"max_tokens": 2}, "(max_tokens)"),
                         ({"max_tokens": None, "min_tokens": 10**6}, "(the context length left after the prompt)")):
        err = assert_openai_error(client.post("/v1/chat/completions", json={**OK_CHAT, "min_tokens": 3, **extra}),
                                  400, "min_tokens", "invalid_value")
        assert named in err["message"], err


def test_tools_and_tool_history_reach_the_template(tokenizer):
    """The template sees the tools and, in the history, the calls (arguments as objects, as
    Qwen's and Llama's templates write them with tojson) and the results with their call ids."""
    template = ("{% for t in tools or [] %}[tool {{ t.function.name }} {{ t.function.parameters | tojson }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
                "{% for c in m.tool_calls or [] %}(call {{ c.function.name }} {{ c.function.arguments.x }}){% endfor %}"
                "{% if m.tool_call_id %}(result of {{ m.tool_call_id }}){% endif %}{% endfor %}<assistant>")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer"}}}}}]
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 7}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    with make_client(tokenizer, chat_template=template) as c:
        r = c.post("/tokenize", json={"messages": messages, "tools": tools})
        assert r.status_code == 200, r.text
        assert tokenizer.decode(r.json()["tokens"]) == (
            '[tool f {"type": "object", "properties": {"x": {"type": "integer"}}}]<user>Hi<assistant>(call f 7)'
            "<tool>42(result of call_1)<assistant>")
        r = c.post("/v1/chat/completions", json={**OK_CHAT, "messages": messages, "tools": tools,
                                                 "tool_choice": "required", "max_tokens": 40})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(
            c.post("/tokenize", json={"messages": messages, "tools": tools}).json()["tokens"])


def test_tools_shown_but_not_enforced_may_use_any_keyword(client):
    """With tool_choice 'none' (or 'auto') the tools are only rendered for the model: keywords the
    automaton cannot enforce (a format it does not know, uniqueItems over strings) are fine there, as in vLLM and
    OpenAI."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "when": {"type": "string", "format": "duration"}, "n": {"type": "array", "uniqueItems": True}}}}}]
    r = client.post("/v1/chat/completions", json={**OK_CHAT, "tools": tools, "tool_choice": "none", "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={**OK_CHAT, "tools": tools, "tool_choice": "required"})
    assert_openai_error(r, 400, "tools.0.function.parameters.properties.when.format")


def test_tool_choice_auto_needs_a_parser(tokenizer):
    """'auto' (the default with tools) parses Hermes blocks where the template shows the model the
    tag, or where the server is told to; else it is a 400 that says what works."""
    chat = {**OK_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "max_tokens": 8}
    hermes = "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}Call with <tool_call>.{% endif %}"
    llama = hermes.replace("Call with <tool_call>.", "Please respond with a JSON for a function call.")
    mistral = hermes.replace("Call with <tool_call>.", "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
                             "{% if false %}[TOOL_CALLS]{% endif %}")
    for config, ok in ((dict(chat_template=hermes), True), (dict(), False), (dict(tool_call_parser="hermes"), True),
                       (dict(chat_template=hermes, tool_call_parser="none"), False), (dict(chat_template=llama), True),
                       (dict(tool_call_parser="llama3_json"), True), (dict(chat_template=mistral), True),
                       (dict(tool_call_parser="mistral"), True)):
        with make_client(tokenizer, **config) as c:
            r = c.post("/v1/chat/completions", json=chat)
            if ok:
                assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None, r.text
            else:
                assert "--tool-call-parser" in assert_openai_error(r, 400, "tool_choice")["message"]


def test_tool_call_parser_option_is_checked_before_the_model_loads(monkeypatch):
    from typer.testing import CliRunner

    from fitllm.cli import serve as serve_cli
    from fitllm.cli.main import app

    monkeypatch.setattr(serve_cli, "_check_port_free", lambda host, port: None)
    monkeypatch.setattr(serve_cli, "_build_engine", lambda *a, **k: pytest.fail("the model was loaded"))
    result = CliRunner().invoke(app, ["serve", "--tool-call-parser", "granite"])
    assert result.exit_code == 1 and "expected hermes, llama3_json, mistral or none" in result.output, result.output
