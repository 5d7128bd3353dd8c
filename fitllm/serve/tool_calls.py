"""Tool calls in free text, for tool_choice "auto". Three formats, each a parser of whole replies
(`parse`) and a rule for what may stream as content before the reply is whole (`streamable`):

- "hermes", which Qwen2.5 / Qwen3, Hermes and many fine-tunes write after (or instead of) their answer:

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  A reply whose blocks all parse is tool calls (the text before the first block is its content, as
  in vLLM's parser: text after the calls is dropped); otherwise it is text, as written. Text streams
  up to the first block's tag, holding back a tail that might be the beginning of one.

- "llama3_json", Llama 3.1 / 3.2 / 3.3's: the whole reply is one call or several joined by ";", each
  `{"name": ..., "parameters": {...}}`, after an optional <|python_tag|> (a special token, usually
  already dropped from the text). A reply that begins with "{" is held back until it is whole.

- "mistral", Mistral's two forms. v3 tokenizers (Mistral-7B-Instruct-v0.3, Nemo, Small 2501): text, then
  [TOOL_CALLS] and one JSON list of `{"name": ..., "arguments": {...}}`. Later ones (Small 3.2, Magistral,
  Devstral): `[TOOL_CALLS]name[ARGS]{...}` per call. The markers are special tokens, so with special tokens
  skipped (the default) a reply is the list alone, or `name{...}` calls one after another: a reply that is
  only calls, or text up to the first marker and calls after it, is tool calls. Text streams up to a marker; a
  reply that begins with "[", or with a name not yet followed by anything else, is held back until it is whole.
"""
from __future__ import annotations

import json
import re
from typing import Optional

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# a block, or the last one left open (a model may stop right after its JSON, as vLLM's parser allows)
BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>|<tool_call>\s*(.*?)\s*$", re.S)
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
NAME = re.compile(r"\s*([A-Za-z_][\w.-]*)")  # a function name before its arguments (Mistral's later form)
NAMED, SPACE, SEMICOLON = re.compile(NAME.pattern + r"\s*"), re.compile(r"\s*"), re.compile(r"\s*;\s*")
DECODER = json.JSONDecoder()
# what Llama 3.x templates tell the model when they show it tools
LLAMA3_MARKS = (PYTHON_TAG, "respond with a JSON for a function call")

Calls = list[tuple[str, str]]  # (name, arguments as JSON text)


def detect(chat_template: Optional[str]) -> Optional[str]:
    """The parser a chat template implies: "hermes" where it shows the model the tag, "llama3_json"
    where it speaks as Llama 3.x's templates do, else None."""
    if not chat_template:
        return None
    if OPEN in chat_template:
        return "hermes"
    if MISTRAL_TAG in chat_template:
        return "mistral"
    return "llama3_json" if any(mark in chat_template for mark in LLAMA3_MARKS) else None


def _call(value) -> Optional[tuple[str, str]]:
    """A parsed {"name", "arguments" or "parameters"} object as (name, arguments' JSON text); None if not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, (dict, str)):
        return None
    return value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def parse(text: str, parser: str = "hermes") -> tuple[Optional[str], Calls]:
    """(content, calls): no calls unless the whole reply reads as calls in that format."""
    if parser == "mistral":
        return _parse_mistral(text)
    return _parse_llama3(text) if parser == "llama3_json" else _parse_hermes(text)


def streamable(text: str, parser: str = "hermes") -> int:
    """How many characters of text may go out as content now."""
    if parser == "llama3_json":
        body = text.lstrip()
        may_be_call = not body or body.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(body)
        return 0 if may_be_call else len(text)
    if parser == "mistral" and _may_be_mistral_calls(text):
        return 0
    return _before_tag(text, MISTRAL_TAG if parser == "mistral" else OPEN)


def _before_tag(text: str, tag: str) -> int:
    """Up to the tag, holding back a tail that may be the tag's beginning."""
    start = text.find(tag)
    if start >= 0:
        return start
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return len(text) - k
    return len(text)


def _parse_hermes(text: str) -> tuple[Optional[str], Calls]:
    start = text.find(OPEN)
    blocks = [closed or left_open for closed, left_open in BLOCK.findall(text, start)] if start >= 0 else []
    calls = []
    for block in blocks:
        try:
            call = _call(json.loads(block))
        except ValueError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    if not calls:
        return text, []
    return text[:start].strip() or None, calls


def _json_run(body: str, first: re.Pattern, then: re.Pattern) -> Optional[list[tuple[re.Match, object]]]:
    """A body (stripped) that is JSON values and nothing else, each after what `first` (the first one)
    or `then` (the others) matches: the (match, value) pairs; None for any other body."""
    run, at, lead = [], 0, first
    while at < len(body):
        match = lead.match(body, at)
        if match is None:
            return None
        try:
            value, at = DECODER.raw_decode(body, match.end())
        except ValueError:
            return None
        run.append((match, value))
        lead = then
    return run


def _parse_llama3(text: str) -> tuple[Optional[str], Calls]:
    body = text.strip()
    body = body[len(PYTHON_TAG):] if body.startswith(PYTHON_TAG) else body
    run = _json_run(body.removesuffix(";").rstrip(), SPACE, SEMICOLON)  # calls joined by ";"
    calls = [_call(value) for _, value in run or []]
    return (None, calls) if calls and None not in calls else (text, [])


def _may_be_mistral_calls(text: str) -> bool:
    """A reply still able to become calls with their markers skipped: nothing yet, a list under way (or the
    beginning of a marker), a name alone, or a name and the arguments it begins."""
    body = text.lstrip()
    name = NAME.match(body)
    return (not body or body.startswith("[") or (name is not None and name.end() == len(body))
            or (name is not None and body[name.end():].lstrip().startswith("{")))


def _parse_mistral(text: str) -> tuple[Optional[str], Calls]:
    start = text.find(MISTRAL_TAG)
    content, body = (text[:start].strip() or None, text[start:]) if start >= 0 else (None, text)
    body = body.replace(MISTRAL_TAG, " ").replace(MISTRAL_ARGS, "").strip()
    try:
        value = json.loads(body)
    except ValueError:
        calls = _named_calls(body)
    else:
        calls = [_call(v) for v in (value if isinstance(value, list) else [value])]
    if not calls or None in calls:
        return text, []
    return content, calls


def _named_calls(body: str) -> Calls:
    """`name{...}` calls one after another (the later form with its markers skipped); [] unless that is all."""
    run = _json_run(body, NAMED, NAMED) or []
    if not all(isinstance(value, dict) for _, value in run):
        return []
    return [(name.group(1), json.dumps(value, ensure_ascii=False)) for name, value in run]
