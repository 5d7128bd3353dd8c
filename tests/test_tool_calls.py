"""tool_choice "auto": Hermes blocks and Llama 3 JSON calls parsed out of the model's text, whole and
while streaming."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from fitllm.serve import tool_calls
from fitllm.serve.app import ChatShaper, Choice
from fitllm.serve.protocol import ChatCompletionRequest

TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'


@pytest.mark.parametrize("text, content, calls", [
    ("Just text.", "Just text.", []),
    (CALL, None, [("get_weather", '{"city": "Zürich"}')]),
    ("Let me look.\n\n" + CALL + "\n" + CALL.replace("Zürich", "Bern"), "Let me look.",
     [("get_weather", '{"city": "Zürich"}'), ("get_weather", '{"city": "Bern"}')]),
    ('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>', None, [("f", '{"a": 1}')]),  # Llama's key
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("f", '{"a": 1}')]),  # a string
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),  # not a call: text as written
    (CALL + '<tool_call>{"arguments": {}}</tool_call>', CALL + '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f"', '<tool_call>{"name": "f"', []),  # cut short
    ('<tool_call>{"name": "f", "arguments": {}}\n', None, [("f", "{}")]),  # stopped before the closing tag (vLLM too)
])
def test_parse(text, content, calls):
    assert tool_calls.parse(text) == (content, calls)


LLAMA = '{"name": "get_weather", "parameters": {"city": "Zürich"}}'


@pytest.mark.parametrize("text, calls", [
    (LLAMA, [("get_weather", '{"city": "Zürich"}')]),
    ("<|python_tag|>" + LLAMA + "; " + LLAMA.replace("Zürich", "Bern") + "\n",
     [("get_weather", '{"city": "Zürich"}'), ("get_weather", '{"city": "Bern"}')]),
    (' {"name": "f", "arguments": {}}', [("f", "{}")]),
    ("It is sunny.", []), ('{"city": "Bern"}', []), (LLAMA + " and more", []), (LLAMA[:-3], []), ("", []),
    ('{"name": "f", "parameters": [1]}', []), (LLAMA + ";", [("get_weather", '{"city": "Zürich"}')]),
])
def test_parse_llama3_json(text, calls):
    assert tool_calls.parse(text, "llama3_json") == ((None, calls) if calls else (text, []))


MISTRAL = '[{"name": "get_weather", "arguments": {"city": "Zürich"}}]'


@pytest.mark.parametrize("text, content, calls", [
    (MISTRAL, None, [("get_weather", '{"city": "Zürich"}')]),
    ("[TOOL_CALLS] " + MISTRAL, None, [("get_weather", '{"city": "Zürich"}')]),
    ("Let me check. [TOOL_CALLS]" + MISTRAL, "Let me check.", [("get_weather", '{"city": "Zürich"}')]),
    ('[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]', None, [("a", "{}"), ("b", '{"x": 1}')]),
    ('{"name": "a", "arguments": {}}', None, [("a", "{}")]),
    ("[1, 2, 3]", "[1, 2, 3]", []), ("[]", "[]", []), ("It is sunny.", "It is sunny.", []),
    ("[TOOL_CALLS] [{broken", "[TOOL_CALLS] [{broken", []), (MISTRAL + " and more", MISTRAL + " and more", []),
    # the later form, name[ARGS]{...} per call, with its markers or with them skipped
    ('get_weather{"city": "Zürich"}', None, [("get_weather", '{"city": "Zürich"}')]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}[TOOL_CALLS]add[ARGS]{"a": 1}', None,
     [("get_weather", '{"city": "Zürich"}'), ("add", '{"a": 1}')]),
    ('Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}', "Let me check.",
     [("get_weather", '{"city": "Zürich"}')]),
    ('get_weather{"city": "Zürich"} and more', 'get_weather{"city": "Zürich"} and more', []),
    ("get_weather[1]", "get_weather[1]", []), ("Paris", "Paris", []),
])
def test_parse_mistral(text, content, calls):
    assert tool_calls.parse(text, "mistral") == (content, calls)


def test_mistral_detection_and_streaming():
    assert tool_calls.detect("{%- if message.tool_calls %}[TOOL_CALLS] [{%- endif %}") == "mistral"
    for held in ("", " ", "[", ' [{"name"', "[TOOL", "get_wea", 'get_weather{"ci', "Paris"):
        assert tool_calls.streamable(held, "mistral") == 0
    assert tool_calls.streamable("Let me check. [TOOL_CALLS] [", "mistral") == len("Let me check. ")
    assert tool_calls.streamable("Let me check. [TOO", "mistral") == len("Let me check. ")
    assert tool_calls.streamable("Sunny [ish]", "mistral") == len("Sunny [ish]")


def test_streamable_holds_back_what_may_become_a_tag():
    assert tool_calls.streamable("Hello <tool") == len("Hello ")
    assert tool_calls.streamable("Hello <") == len("Hello ")
    assert tool_calls.streamable("a < b") == len("a < b")
    assert tool_calls.streamable("Hi " + CALL) == len("Hi ")
    assert tool_calls.detect("{% if tools %}<tool_call>{% endif %}") == "hermes" and tool_calls.detect(None) is None
    assert tool_calls.detect("{{- '<|python_tag|>' + tool_call }}") == "llama3_json"
    assert tool_calls.detect("{{ '<|im_start|>' }}") is None
    for held in ("", "  ", " {", "<|pyth", "<|python_tag|>{"):
        assert tool_calls.streamable(held, "llama3_json") == 0
    assert tool_calls.streamable("Sunny {", "llama3_json") == len("Sunny {")


def shaper(stream: bool, parser: str = "hermes") -> ChatShaper:
    server = SimpleNamespace(config=SimpleNamespace(served_model_name="m"), tool_call_parser=parser,
                             usage=lambda choices: {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, stream=stream)
    return ChatShaper(server, body, "chatcmpl-1", [])


def outputs(text: str, pieces: int):
    step = max(1, len(text) // pieces)
    parts = [text[i:i + step] for i in range(0, len(text), step)]
    return [SimpleNamespace(new_text=p, finished=i == len(parts) - 1, logprobs=[]) for i, p in enumerate(parts)]


@pytest.mark.parametrize("parser, text", [
    *[("hermes", text) for text in ("Sunny, I think.", "Checking. " + CALL, CALL + "\n" + CALL.replace("Zürich", "Bern"),
                                    "a <tool_ca", "<tool_call>{broken</tool_call>")],
    *[("llama3_json", text) for text in (LLAMA, LLAMA + ";" + LLAMA, "Sunny {ish}", '{"not": "a call"}', " " + LLAMA)],
    *[("mistral", text) for text in (MISTRAL, "Checking. [TOOL_CALLS]" + MISTRAL, "Sunny [ish]", "[1, 2]",
                                     'get_weather{"city": "Bern"}', "Paris", "Paris is sunny.")]])
@pytest.mark.parametrize("pieces", [1, 7, 200])
def test_streamed_auto_answer_adds_up_to_the_whole_one(parser, text, pieces):
    whole_shaper = shaper(False, parser)
    c = Choice(0, "r-0", [1], None)
    for out in outputs(text, pieces):
        whole_shaper.collect(c, out)
    c.finish_reason = "stop"
    whole_content, whole_calls = whole_shaper.answer(c)
    assert whole_shaper.finish_reason(c, whole_calls) == ("tool_calls" if whole_calls else "stop")

    stream_shaper, s = shaper(True, parser), Choice(0, "r-0", [1], None)
    content, calls, finish = "", [], None
    for out in outputs(text, pieces):
        if out.finished:
            s.finish_reason = "stop"
        for chunk in stream_shaper.chunks(s, out):
            delta = chunk.choices[0].delta
            assert not (delta.content and calls)  # text never follows the calls
            content += delta.content or ""
            calls += delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    assert finish == whole_shaper.finish_reason(c, whole_calls)
    assert [(x["function"]["name"], x["function"]["arguments"]) for x in calls] == \
        [(x.function.name, x.function.arguments) for x in whole_calls or []]
    assert content.strip() == (whole_content or "").strip()
    ids = [x["id"] for x in calls]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)


def test_required_calls_cut_short_finish_as_text():
    """A 'required' answer a stop string cut is not calls: its text, finish_reason stop (not tool_calls)."""
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
                                 tool_choice="required")
    shaper_ = ChatShaper(SimpleNamespace(config=SimpleNamespace(served_model_name="m")), body, "chatcmpl-1", [])
    for text, finish, calls in (('[{"name": "get_weather", "parameters": {', "stop", None),
                                ('[{"name": "get_weather", "parameters": {}}]', "tool_calls", 1)):
        c = Choice(0, "r-0", [1], None, text=text, finish_reason="stop")
        content, tool_calls_ = shaper_.answer(c)
        assert shaper_.finish_reason(c, tool_calls_) == finish and len(tool_calls_ or []) == (calls or 0)
        assert content == (None if calls else text)


def test_strict_tools_under_auto_are_enforced_where_the_tags_are_tokens():
    """Server.strict_calls: the Hermes call schema and the tags' ids, only for 'auto' with a strict
    tool, the Hermes parser and tags the tokenizer writes as one token each."""
    from fitllm.serve import json_mode
    from fitllm.serve.app import Server, single_token_ids
    from fitllm.serve.protocol import hermes_call_schema

    tools = [{"type": "function", "function": {"name": "add", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "maximum": 9}}, "required": ["a"]}}},
             {"type": "function", "function": {"name": "free", "parameters": {"type": "object"}}}]
    single = {"<tool_call>": [7], "</tool_call>": [8]}
    tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens: single.get(text, [1, 2]))
    tags = (tool_calls.OPEN, tool_calls.CLOSE)
    server = SimpleNamespace(tool_call_parser="hermes", hermes_tags=single_token_ids(tokenizer, 100, tags))

    def calls(**kw):
        body = ChatCompletionRequest(messages=[{"role": "user", "content": "2+3?"}], **{"tools": tools, **kw})
        return Server.strict_calls(server, body)
    schema, open_, close = calls()
    assert (open_, close) == (7, 8) and schema == hermes_call_schema(ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], tools=tools).tools)
    compiled = json_mode.schema_for(schema)
    for text, ok in (('{"name": "add", "arguments": {"a": 3}}', True), ('{"name": "add", "arguments": {"a": 12}}', False),
                     ('{"name": "free", "arguments": {"x": [1]}}', True), ('{"name": "sub", "arguments": {}}', False)):
        assert compiled.done(compiled.walk(compiled.start, text.encode())) == ok, text
    assert calls(tool_choice="required") is None and calls(tool_choice="none") is None
    assert calls(tools=[{**tools[0], "function": {**tools[0]["function"], "strict": False}}]) is None
    server.tool_call_parser = "llama3_json"
    assert calls() is None
    single = {}
    server.tool_call_parser, server.hermes_tags = "hermes", single_token_ids(tokenizer, 100, tags)
    assert calls() is None  # the tags are several tokens: strict is not enforced under 'auto'
