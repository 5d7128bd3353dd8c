"""Tool calls in free text, for tool_choice "auto": the Hermes format, which Qwen2.5 / Qwen3, Hermes
and many fine-tunes are trained to write after (or instead of) their answer:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A reply whose blocks all parse is tool calls (the text before the first block is its content, as
in vLLM's parser: text after the calls is dropped); otherwise it is text, as written. While streaming, text is sent up to the first block's tag, holding
back a tail that might be the beginning of one.
"""
from __future__ import annotations

import json
import re
from typing import Optional

OPEN = "<tool_call>"
# a block, or the last one left open (a model may stop right after its JSON, as vLLM's parser allows)
BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>|<tool_call>\s*(.*?)\s*$", re.S)


def detect(chat_template: Optional[str]) -> Optional[str]:
    """The parser a chat template implies: "hermes" where it shows the model the tag."""
    return "hermes" if chat_template and OPEN in chat_template else None


def parse(text: str) -> tuple[Optional[str], list[tuple[str, str]]]:
    """(content, [(name, arguments as JSON text)]): no calls unless every block is one."""
    start = text.find(OPEN)
    blocks = [closed or left_open for closed, left_open in BLOCK.findall(text, start)] if start >= 0 else []
    calls = []
    for block in blocks:
        try:
            call = json.loads(block)
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append((call["name"], arguments if isinstance(arguments, str) else
                      json.dumps(arguments, ensure_ascii=False)))
    if not calls:
        return text, []
    return text[:start].strip() or None, calls


def streamable(text: str) -> int:
    """How many characters of text may go out as content now: up to a block's tag, less a tail
    that could still become one."""
    start = text.find(OPEN)
    if start >= 0:
        return start
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return len(text) - k
    return len(text)
