"""OpenAI wire format: requests (validated), responses, stream chunks and error bodies.

Requests reject unknown fields (as OpenAI does: "Unrecognized request argument"), so a typo in
a parameter name is a 400, not a silently ignored option. A few non-OpenAI sampling options that
vLLM users pass through `extra_body` (top_k, min_p, repetition_penalty, ...) are accepted by name.
Checks that need the model (vocabulary size, context length, chat template) live in the app.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_serializer,
    model_validator,
)

from fitllm.serve import json_mode

MAX_N = 128          # OpenAI's limit on choices per request
MAX_LOGPROBS = 20    # top-n logprobs per token
MAX_STOP = 4         # stop sequences per request
LOGPROB_FLOOR = -9999.0  # JSON has no -inf: an impossible token reports this instead

TokenId = Annotated[StrictInt, Field(ge=0)]


class ParamError(ValueError):
    """A whole-request check that names the offending parameter (pydantic cannot place it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _check_utf8(value: str, what: str) -> str:
    # JSON can carry lone surrogates ("\ud800") that Python accepts but a tokenizer cannot encode.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid UTF-8 (lone surrogate)") from None
    return value


class Request(BaseModel):
    """Base of the request bodies: unknown fields and NaN/inf numbers are errors."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(Request):
    include_usage: bool = False


class SamplingFields(Request):
    """The sampling options both endpoints share, with OpenAI's ranges."""
    model: Optional[StrictStr] = None  # optional: one server serves one model
    max_tokens: Optional[Annotated[StrictInt, Field(ge=0)]] = None
    temperature: Optional[StrictFloat] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[StrictFloat] = Field(None, ge=0.0, le=1.0)
    n: Optional[Annotated[StrictInt, Field(ge=1, le=MAX_N)]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    presence_penalty: Optional[StrictFloat] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[StrictFloat] = Field(None, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, StrictFloat]] = None
    seed: Optional[Annotated[StrictInt, Field(ge=-(2**63), le=2**64 - 1)]] = None
    user: Optional[StrictStr] = None
    # Extensions (vLLM names), reachable through the openai client's extra_body.
    top_k: Optional[Annotated[StrictInt, Field(ge=-1)]] = None  # 0 or -1 (vLLM's value): off
    min_p: Optional[StrictFloat] = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Optional[StrictFloat] = Field(None, gt=0.0, le=10.0)
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[list[TokenId]] = Field(None, max_length=64)
    skip_special_tokens: Optional[bool] = None  # default true
    include_stop_str_in_output: Optional[bool] = None
    min_tokens: Optional[Annotated[StrictInt, Field(ge=0)]] = None  # stop tokens and strings wait for these

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed")
        for s in stops:
            if not s:
                raise ValueError("stop sequences must be non-empty strings")
            _check_utf8(s, "stop")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v is None:
            return v
        if len(v) > 300:  # OpenAI's own limit; bounds the work a request can ask for
            raise ValueError("logit_bias may hold at most 300 entries")
        for key, bias in v.items():
            if not key.isdigit() or not key.isascii():
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must lie in [-100, 100], got {bias} for token {key}")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed when stream is true")
        return self

    def token_limit_param(self) -> str:
        """The field that limits the completion's tokens (named in errors)."""
        return "max_tokens"

    def json_object(self) -> bool:
        """Whether the answer must be one JSON object (chat's response_format)."""
        return False

    def json_schema(self) -> Optional[dict]:
        """The JSON schema the answer must follow (chat's response_format), if any."""
        return None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}


def _is_token_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


Prompt = Union[StrictStr, list[StrictStr], list[TokenId], list[list[TokenId]]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: Optional[Annotated[StrictInt, Field(ge=0)]] = 16  # OpenAI's default here
    echo: Optional[bool] = False
    logprobs: Optional[Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]] = None
    best_of: Optional[Annotated[StrictInt, Field(ge=1, le=MAX_N)]] = None
    suffix: Optional[StrictStr] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        # One clear sentence instead of pydantic's error per union member.
        ok = isinstance(v, str) or (isinstance(v, list) and (
            all(isinstance(x, str) for x in v) or all(_is_token_id(x) for x in v)
            or all(isinstance(x, list) and all(_is_token_id(t) for t in x) for x in v)))
        if not ok:
            raise ValueError("prompt must be a string, a list of strings, a list of token ids "
                             "(non-negative integers) or a list of token-id lists")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        items = [v] if isinstance(v, str) else v
        for item in items:
            if isinstance(item, str):
                _check_utf8(item, "prompt")
            elif isinstance(item, list) and not item:
                raise ValueError("token-id prompts must not be empty")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        if self.suffix:
            raise ParamError("suffix", "suffix is not supported (no fill-in-the-middle models are served)")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ParamError("best_of", "best_of different from n is not supported")
        return self

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompt as a list: one entry per prompt, each text or token ids."""
        v = self.prompt
        if isinstance(v, str):
            return [v]
        if all(isinstance(x, int) for x in v):
            return [list(v)]
        return list(v)


class HistoryFunctionCall(Request):
    name: StrictStr
    arguments: StrictStr  # JSON text, as the server returned it


class HistoryToolCall(Request):
    """A call an assistant message of the history made (as OpenAI's responses carry it)."""
    id: Optional[StrictStr] = None
    type: Literal["function"] = "function"
    function: HistoryFunctionCall


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[StrictStr, list[dict[str, Any]]]] = None
    name: Optional[StrictStr] = None
    tool_call_id: Optional[StrictStr] = None
    tool_calls: Optional[list[HistoryToolCall]] = None
    refusal: Optional[StrictStr] = None

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        if isinstance(v, list):
            for part in v:
                if part.get("type") != "text":
                    raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
                if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                    raise ValueError("a text content part is {\"type\": \"text\", \"text\": STRING}")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part["text"] for part in self.content)
        return self.content or ""

    @model_validator(mode="after")
    def _utf8(self):
        _check_utf8(self.text(), "message content")
        return self


def _schema_error(param: str, e: json_mode.SchemaError) -> ParamError:
    """The parameter that holds the schema, down to the place in it that cannot be enforced."""
    return ParamError(param + e.where.removeprefix("schema"), e.problem)


class JsonSchemaFormat(Request):
    """OpenAI's response_format.json_schema: a named schema the answer must follow (always enforced:
    `strict` false does not loosen it)."""
    model_config = ConfigDict(populate_by_name=True)
    name: Optional[Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]] = None  # (vLLM: optional)
    description: Optional[StrictStr] = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: Optional[StrictBool] = None


class ResponseFormat(Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ParamError("response_format", "response_format.json_schema is required with type 'json_schema' "
                             "and only allowed with it")
        if self.json_schema is not None:
            try:
                json_mode.schema_for(self.json_schema.schema_)
            except json_mode.SchemaError as e:
                raise _schema_error("response_format.json_schema.schema", e) from None
        return self


# apply_chat_template's own arguments, which chat_template_kwargs must not override
TEMPLATE_ARGUMENTS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                      "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                      "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


class FunctionDefinition(Request):
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema of the arguments object; none: no arguments
    strict: Optional[StrictBool] = None

    def arguments_schema(self) -> dict:
        return self.parameters if self.parameters is not None else {"type": "object", "additionalProperties": False}


class Tool(Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Request):
    name: StrictStr


class NamedToolChoice(Request):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateFields(Request):
    """The messages, the tools the template shows the model, and vLLM's chat template options,
    shared by chat completions and /tokenize: continue the last (assistant) message instead of
    opening a new one, and extra template variables (e.g. {"enable_thinking": false} for Qwen3)."""
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Optional[list[Tool]] = None
    add_generation_prompt: Optional[bool] = None  # default true
    continue_final_message: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_special_tokens: Optional[bool] = None  # default false: the template writes them (true adds e.g. a BOS too)

    @model_validator(mode="after")
    def _template_options(self):
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            raise ParamError("tools", "tool function names must be unique")
        for i, tool in enumerate(self.tools or []):  # OpenAI's rule: the arguments are a JSON object
            if tool.function.arguments_schema().get("type", "object") != "object":
                raise ParamError(f"tools.{i}.function.parameters", "a function's parameters must be an object "
                                 "schema (type 'object')")
        if self.continue_final_message and self.add_generation_prompt:
            raise ParamError("continue_final_message",
                             "continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ParamError("continue_final_message", "continue_final_message needs an assistant message last")
        taken = set(self.chat_template_kwargs or {}) & TEMPLATE_ARGUMENTS
        if taken:
            raise ParamError("chat_template_kwargs", f"chat_template_kwargs may not set {sorted(taken)}: "
                             "they are the server's (or request fields of their own)")
        return self


def tool_calls_schema(tools: list[Tool], parallel: bool) -> dict:
    """tool_choice 'required': a list of calls, each {"name": one of the tools, "parameters": its
    arguments} (vLLM's form)."""
    calls, defs = _call_schemas(tools, "parameters", strict_only=False)
    return {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({} if parallel else {"maxItems": 1}),
            "$defs": defs}


def hermes_call_schema(tools: list[Tool]) -> dict:
    """tool_choice 'auto' with strict tools: one Hermes call, {"name": one of the tools, "arguments":
    its arguments}; a tool that is not strict takes any arguments object."""
    calls, defs = _call_schemas(tools, "arguments", strict_only=True)
    return {"anyOf": calls, "$defs": defs}


def _call_schemas(tools: list[Tool], key: str, strict_only: bool) -> tuple[list[dict], dict]:
    """Each tool's call object, {"name": const, key: its arguments}; the arguments' schemas move
    under $defs, their own $refs re-rooted there."""
    defs = {}
    for i, t in enumerate(tools):
        enforced = t.function.strict or not strict_only
        defs[f"tool{i}"] = _rerooted(t.function.arguments_schema(), f"#/$defs/tool{i}") if enforced \
            else {"type": "object"}
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, key: {"$ref": f"#/$defs/tool{i}"}},
              "required": ["name", key]} for i, t in enumerate(tools)]
    return calls, defs


def _rerooted(schema: Any, root: str) -> Any:
    """schema with every local $ref ("#...") pointing into it where it now lives (at `root`)."""
    if isinstance(schema, dict):
        return {k: (root + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rerooted(v, root))
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rerooted(v, root) for v in schema]
    return schema


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    # A chat answer has at least one token (OpenAI refuses 0; /v1/completions allows it, for scoring).
    max_tokens: Optional[Annotated[StrictInt, Field(ge=1)]] = None
    max_completion_tokens: Optional[Annotated[StrictInt, Field(ge=1)]] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]] = None
    response_format: Optional[ResponseFormat] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    # Accepted and ignored: they change nothing about the tokens (prediction, OpenAI's predicted output, is a
    # latency hint; modalities may only ask for text). Clients that fill in OpenAI's defaults send them.
    metadata: Optional[dict[str, StrictStr]] = None
    store: Optional[bool] = None
    service_tier: Optional[StrictStr] = None
    prediction: Optional[dict[str, Any]] = None
    modalities: Optional[list[Literal["text"]]] = None

    @model_validator(mode="after")
    def _consistency(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs requires logprobs to be true")
        self._check_tool_choice()
        structured = self.json_object() or self.json_schema() is not None
        what = f"tool_choice {self.tool_mode()!r}" if self.tool_mode() in ("named", "required") else \
            f"response_format {self.response_format.type}" if structured else None
        if structured and self.min_tokens:
            raise ParamError("min_tokens", f"min_tokens cannot be combined with {what} (the JSON value may close "
                             "before it)")
        if structured and self.continue_final_message:
            raise ParamError("continue_final_message", f"continue_final_message cannot be combined with {what} "
                             "(the answer is a whole value of its own)")
        if self.tool_mode() and self.logprobs:
            raise ParamError("logprobs", "logprobs cannot be combined with tool calls (tool_choice other than 'none')")
        return self

    def _check_tool_choice(self) -> None:
        choice = self.effective_tool_choice()
        if choice != "none" and not self.tools:
            raise ParamError("tool_choice", "tool_choice other than 'none' needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in [t.function.name for t in self.tools]:
            raise ParamError("tool_choice", f"tool_choice names {choice.function.name!r}, which is not among tools")
        mode = self.tool_mode()
        if mode in ("named", "required", "auto"):  # arguments that are enforced need schemas the automaton reads
            for i, tool in enumerate(self.tools):  # (with 'auto' a strict tool's; with 'none' none: only shown)
                if mode == "required" or tool.function.name == self.called_function() or (
                        mode == "auto" and tool.function.strict):
                    try:
                        json_mode.schema_for(tool.function.arguments_schema())
                    except json_mode.SchemaError as e:
                        raise _schema_error(f"tools.{i}.function.parameters", e) from None
        if mode and self.response_format is not None and self.response_format.type != "text":
            raise ParamError("response_format", "response_format cannot be combined with tool calls (tool_choice "
                             "other than 'none'): the tools' parameters give the calls' schemas")

    def effective_tool_choice(self) -> Union[str, NamedToolChoice]:
        """tool_choice, or OpenAI's default: 'auto' when tools are given, else 'none'."""
        return self.tool_choice if self.tool_choice is not None else "auto" if self.tools else "none"

    def tool_mode(self) -> Optional[str]:
        """'required' (the answer is a list of calls), 'named' (the answer is one function's
        arguments), 'auto' (text, with any calls in it parsed out) or None (a plain answer)."""
        choice = self.effective_tool_choice()
        return "named" if isinstance(choice, NamedToolChoice) else None if choice == "none" else choice

    def called_function(self) -> Optional[str]:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def json_object(self) -> bool:
        return self.response_format is not None and self.response_format.type == "json_object"

    def json_schema(self) -> Optional[dict]:
        """The schema the answer follows: response_format's, or the tool call's the tool_choice forces."""
        if self.tool_mode() == "named":
            return next(t.function.arguments_schema() for t in self.tools if t.function.name == self.called_function())
        if self.tool_mode() == "required":
            return tool_calls_schema(self.tools, self.parallel_tool_calls is not False)
        fmt = self.response_format
        return fmt.json_schema.schema_ if fmt is not None and fmt.json_schema is not None else None

    def token_limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def token_limit_param(self) -> str:
        """The field token_limit() came from (named in errors)."""
        return "max_tokens" if self.max_completion_tokens is None and self.max_tokens is not None \
            else "max_completion_tokens"


class TokenizeCompletionRequest(Request):
    """vLLM's /tokenize for a prompt: its ids as /v1/completions would encode it."""
    model: Optional[StrictStr] = None
    prompt: StrictStr
    add_special_tokens: Optional[bool] = None  # default true (a BOS where the tokenizer adds one)
    return_token_strs: Optional[bool] = None


class TokenizeChatRequest(ChatTemplateFields):
    """vLLM's /tokenize for messages: the ids /v1/chat/completions would prompt the model with."""
    model: Optional[StrictStr] = None
    return_token_strs: Optional[bool] = None


class DetokenizeRequest(Request):
    model: Optional[StrictStr] = None
    tokens: list[TokenId]


# ---- responses ----------------------------------------------------------------------------------

# vLLM's extension of a finished choice: the stop_token_ids entry or stop string that ended it (None at EOS or length)
StopReason = Optional[Union[int, str]]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class Response(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="null")


class Usage(Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(Response):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: StopReason = None


class CompletionResponse(Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class TopLogprob(Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(Response):
    content: Optional[list[ChatTokenLogprob]] = None


class FunctionCall(Response):
    name: str
    arguments: str  # JSON text


class ToolCall(Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(Response):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None

    @model_serializer(mode="wrap")
    def _no_empty_calls(self, handler):
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(Response):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: StopReason = None


class ChatCompletionResponse(Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(Response):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # {"index", and the first time "id", "type"; "function"}

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        # OpenAI's deltas carry only what changed: {"content": "..."}, and {} at the end.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(Response):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: StopReason = None


class ChatCompletionChunk(Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


class TextTemplate:
    """A response's JSON with one string field left open, filled per chunk: building and
    serializing pydantic models for every streamed token costs more than the rest of the path.
    The JSON around the text comes from the model itself, so the chunk's shape cannot drift."""

    MARK = "@@fitllm-text@@"  # put in the open field; JSON-encodes to itself in quotes

    def __init__(self, response: Response):
        self.head, sep, self.tail = response.model_dump_json().partition(json.dumps(self.MARK))
        if not sep or self.MARK in self.tail:
            raise ValueError("the template must hold the mark exactly once")

    def fill(self, text: str) -> str:
        return self.head + json.dumps(text, ensure_ascii=False) + self.tail


class ModelCard(Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "fitllm"
    max_model_len: Optional[int] = None


class ModelList(Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(Response):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class TokenizeResponse(Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None  # each token's vocabulary entry, when return_token_strs


class DetokenizeResponse(Response):
    prompt: str


class ErrorResponse(Response):
    error: ErrorDetail
