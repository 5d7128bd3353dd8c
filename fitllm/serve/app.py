"""The OpenAI-compatible HTTP server: FastAPI routes over the AsyncEngine.

Request path: ASGI guards (API key, body size) -> JSON parsed and validated by protocol.py ->
prompt tokenized and checked against the model -> one engine request per choice -> the engine's
outputs merged and shaped into OpenAI responses or SSE chunks.

Every error a client can cause is a 4xx with OpenAI's body {"error": {message, type, param, code}}.
A request ends when it finishes, times out, or its client goes away: in every case the engine
requests behind it are aborted (closing the engine's async iterator aborts it), so KV blocks
return to the pool.
"""
from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import re
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from fitllm.models.tokenizer import TokenBytes
from fitllm.serve import protocol as P
from fitllm.serve import tool_calls
from fitllm.serve.async_engine import AsyncEngine, EngineOverloaded
from fitllm.serve.metrics import ServerMetrics
from fitllm.serve.sampling import SamplingParams

log = logging.getLogger("fitllm.serve")

ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               499: "client_closed_request", 503: "service_unavailable", 504: "timeout_error"}
MAX_CHOICES = P.MAX_N  # n x number of prompts: one request may not flood the queue by itself


@dataclass
class ServerConfig:
    served_model_name: str
    model_aliases: tuple[str, ...] = ()      # other names a request may use for the model
    api_key: Optional[str] = None
    max_body_bytes: int = 4 << 20            # a 128k-token prompt as token ids fits in ~1 MiB
    max_waiting: int = 256                   # engine queue bound; past it, 429
    request_timeout: float = 600.0           # seconds from arrival to the last token
    retry_after_s: int = 1
    chat_template: Optional[str] = None      # replaces the tokenizer's own (Jinja text)
    tool_call_parser: Optional[str] = None   # "auto" tool calls: hermes, llama3_json, mistral, none; None: from the template


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


def error_body(status: int, message: str, param=None, code=None, type_: Optional[str] = None) -> dict:
    type_ = type_ or ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return P.ErrorResponse(error=P.ErrorDetail(message=message, type=type_, param=param, code=code)).model_dump()


def error_response(status: int, message: str, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def sse(payload: Union[BaseModel, dict, str]) -> str:
    """One SSE event; a str payload is JSON already (a filled P.TextTemplate)."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json(exclude_none=False)
    elif not isinstance(payload, str):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"


def safe_logprob(x: float) -> float:
    return P.LOGPROB_FLOOR if x != x or x < P.LOGPROB_FLOOR else float(x)  # NaN or -inf: JSON cannot carry them


# ---- ASGI guards: run before any parsing, answer with OpenAI error bodies ------------------------

async def send_json(send, status: int, body: dict, headers: Optional[dict] = None) -> None:
    raw = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    hdrs += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": raw})


class APIKeyGuard:
    """`Authorization: Bearer KEY` on every route but /health, compared in constant time."""

    def __init__(self, app, api_key: Optional[str], metrics: ServerMetrics):
        self.app, self.metrics = app, metrics
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if self.key is None or scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        # compare_digest first and always: its time does not depend on where the bytes differ.
        if not (hmac.compare_digest(token.strip(), self.key) and scheme.lower() == b"bearer"):
            self.metrics.errors.labels("invalid_api_key").inc()
            return await send_json(send, 401, error_body(401, "Invalid or missing API key "
                                   "(send 'Authorization: Bearer KEY').", code="invalid_api_key"),
                                   {"www-authenticate": "Bearer"})
        await self.app(scope, receive, send)


class BodyLimit:
    """Reads the whole body up front (the JSON parser needs it all anyway) and refuses it past
    `limit` bytes, whether Content-Length announced it or not (chunked uploads)."""

    def __init__(self, app, limit: int, metrics: ServerMetrics):
        self.app, self.limit, self.metrics = app, limit, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        body = bytearray()
        if not declared.isdigit() or int(declared) <= self.limit:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body += message.get("body", b"")
                if len(body) > self.limit or not message.get("more_body", False):
                    break
        if len(body) > self.limit or (declared.isdigit() and int(declared) > self.limit):
            self.metrics.errors.labels("request_too_large").inc()
            return await send_json(send, 413, error_body(413, f"Request body exceeds the server's limit of "
                                   f"{self.limit} bytes.", code="request_too_large"), {"connection": "close"})
        await self.app(scope, self._replay(bytes(body), receive), send)

    @staticmethod
    def _replay(body: bytes, receive):
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the disconnect, as the server's would
        return replay


class RequestCounter:
    """Counts every answer by route and status, 401/413 from the guards included."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in ROUTES else "other"  # bounded label set

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)
        await self.app(scope, receive, counting_send)


# ---- per-choice bookkeeping ------------------------------------------------------------------------

@dataclass
class Choice:
    """One engine request = one choice of the response."""
    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_index: int = 0
    echo: bool = False
    # filled as outputs arrive
    text: str = ""
    generated: int = 0
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    offset: int = 0                         # characters emitted so far (completions text_offset)
    admitted: bool = False                  # an output has arrived
    started: bool = False                   # a token has arrived
    echoed: bool = False                    # the prompt has been echoed (completions)
    announced: bool = False                 # the role chunk has been sent (chat streams)
    last_time: float = 0.0
    logprob_rows: list = field(default_factory=list)


class Server:
    """The state behind the routes: engine, tokenizer, config, metrics."""

    def __init__(self, engine, config: ServerConfig):
        self.config = config
        self.engine = AsyncEngine(engine, max_waiting=config.max_waiting)
        # The engine thread detokenizes with engine.tokenizer; a Rust tokenizer shared across
        # threads can fail with "Already borrowed", so the HTTP side encodes with its own copy.
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        if config.chat_template is not None:
            self.tokenizer.chat_template = config.chat_template
        parser = config.tool_call_parser
        self.tool_call_parser = tool_calls.detect(getattr(self.tokenizer, "chat_template", None)) \
            if parser is None else None if parser == "none" else parser
        self.max_model_len = int(engine.max_model_len)
        self.vocab_size = int(getattr(engine.model_config, "vocab_size", len(self.tokenizer)))
        # No token spells more characters than the vocabulary's longest entry (byte-level and
        # SentencePiece pieces are at least as long as their text): a text longer than this many
        # characters per token of context cannot fit, whatever it tokenizes to.
        self.max_token_chars = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        self.hermes_tags = single_token_ids(self.tokenizer, self.vocab_size, (tool_calls.OPEN, tool_calls.CLOSE))
        self.metrics = ServerMetrics(self.engine.stats)
        self._token_text: dict[int, str] = {}
        self._token_bytes: Optional[TokenBytes] = None  # made on first use (it reads the tokenizer's decoder)
        self.started_at = int(time.time())

    # -- model and prompt checks --

    def check_model(self, name: Optional[str]) -> None:
        if name is None or name == self.config.served_model_name or name in self.config.model_aliases:
            return
        raise APIError(404, f"The model '{name}' does not exist; this server serves "
                       f"'{self.config.served_model_name}'.", param="model", code="model_not_found")

    def encode(self, prompt: Union[str, list[int]]) -> list[int]:
        if isinstance(prompt, list):
            bad = next((t for t in prompt if t >= self.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"Token id {bad} is out of range: the vocabulary has {self.vocab_size} "
                               "tokens.", param="prompt", code="invalid_token_id")
            return prompt
        self.check_text_length(prompt, "prompt")
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def check_text_length(self, text: str, param: str) -> None:
        """Refuses, before tokenizing it, a text too long to fit in any tokenization."""
        at_least = -(-len(text) // self.max_token_chars)
        if at_least > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                           f"your {param} ({len(text)} characters) "
                           f"cannot take fewer than {at_least} tokens. Please reduce it.", param=param,
                           code="context_length_exceeded")

    def too_long(self, prompt_len: int, max_tokens: int, prompt_param: str, tokens_param: str):
        raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                       f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the {prompt_param}, "
                       f"{max_tokens} for the completion). Please reduce the {prompt_param} or {tokens_param}.",
                       param=tokens_param if prompt_len < self.max_model_len else prompt_param,
                       code="context_length_exceeded")

    def token_budget(self, prompt_ids: list[int], requested: Optional[int], prompt_param: str = "prompt",
                     tokens_param: str = "max_tokens") -> int:
        """max_tokens for this prompt; None means 'up to the context length', as OpenAI does."""
        if not prompt_ids:
            raise APIError(400, "The prompt is empty (it has no tokens).", param=prompt_param, code="empty_prompt")
        room = self.max_model_len - len(prompt_ids)
        if requested is None:
            if room <= 0:
                self.too_long(len(prompt_ids), 1, prompt_param, tokens_param)
            return room
        if requested > room:
            self.too_long(len(prompt_ids), requested, prompt_param, tokens_param)
        return requested

    def sampling_params(self, body: P.SamplingFields, max_tokens: int, choice: int, logprobs: Optional[int],
                        prompt_logprobs: Optional[int] = None) -> SamplingParams:
        bias = body.logit_bias_ids()
        bad = next((t for t in list(bias) + list(body.stop_token_ids or []) if t >= self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"Token id {bad} in logit_bias/stop_token_ids is out of range: the vocabulary "
                           f"has {self.vocab_size} tokens.", param="logit_bias", code="invalid_token_id")
        min_tokens = body.min_tokens or 0
        if min_tokens > max_tokens:
            limit = body.token_limit_param()
            given = getattr(body, limit) is not None
            raise APIError(400, f"min_tokens ({min_tokens}) is more than the {max_tokens} tokens this completion may "
                           f"have ({limit if given else 'the context length left after the prompt'}).",
                           param="min_tokens", code="invalid_value")
        # n > 1 with a seed: each choice gets its own stream, still reproducible.
        seed = None if body.seed is None else (body.seed + choice) % (2**64)
        return SamplingParams(
            max_tokens=max_tokens, temperature=_or(body.temperature, 1.0),
            top_p=max(_or(body.top_p, 1.0), 1e-6),  # OpenAI allows 0 (= the top token); the sampler wants > 0
            top_k=max(_or(body.top_k, 0), 0), min_p=_or(body.min_p, 0.0), seed=seed,
            presence_penalty=_or(body.presence_penalty, 0.0), frequency_penalty=_or(body.frequency_penalty, 0.0),
            repetition_penalty=_or(body.repetition_penalty, 1.0), stop=body.stop_list(),
            stop_token_ids=list(body.stop_token_ids or []), ignore_eos=bool(body.ignore_eos),
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=bias,
            skip_special_tokens=_or(body.skip_special_tokens, True),
            include_stop_str_in_output=bool(body.include_stop_str_in_output), min_tokens=min_tokens,
            json_object=body.json_object(), json_schema=body.json_schema())

    def strict_calls(self, body: P.ChatCompletionRequest) -> Optional[tuple[dict, int, int]]:
        """tool_choice 'auto' with strict tools, in the Hermes format, where the model writes each tag
        as one token: the calls it writes between the tags follow the tools' schemas (the engine's
        tagged_json). Elsewhere strict is not enforced in 'auto' (the calls are parsed as written)."""
        if body.tool_mode() != "auto" or self.tool_call_parser != "hermes" or self.hermes_tags is None or \
                not any(t.function.strict for t in body.tools):
            return None
        return P.hermes_call_schema(body.tools), *self.hermes_tags

    def chat_prompt_ids(self, body: P.ChatTemplateFields, check_length: bool = True) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "This model has no chat template; use /v1/completions.", param="messages",
                           code="no_chat_template")
        messages = [_message_dict(m) for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
                tokenize=False, continue_final_message=bool(body.continue_final_message),
                add_generation_prompt=_or(body.add_generation_prompt, not body.continue_final_message),
                **(body.chat_template_kwargs or {}))
        except Exception as exc:  # the template's own raise_exception(), or odd message orders
            raise APIError(400, f"The chat template rejected the messages: {exc}", param="messages") from None
        if check_length:
            self.check_text_length(text, "messages")
        return self.tokenizer.encode(text, add_special_tokens=_or(body.add_special_tokens, False))

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.decode([token_id])
        return text

    def decode(self, ids: list[int]) -> str:
        # No clean-up: it strips spaces before punctuation, which would change the text.
        return self.tokenizer.decode(ids, clean_up_tokenization_spaces=False)

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's raw bytes (a byte-level BPE token may be half a UTF-8 character); a special
        token's text."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.tokenizer)
        data = self._token_bytes([token_id])[0] if token_id < len(self.tokenizer) else None
        return list(data) if data is not None else list(self.token_text(token_id).encode("utf-8"))

    # -- running requests --

    async def outputs(self, choices: list[Choice], deadline: Optional[float] = None
                      ) -> AsyncIterator[tuple[Choice, object]]:
        """(choice, RequestOutput) pairs from all choices as they come; asyncio.TimeoutError when
        waiting for one past `deadline`. Leaving early (client gone, timeout) cancels the readers,
        which closes the engine iterators, which abort the requests."""
        if len(choices) == 1:
            c = choices[0]
            stream = self.engine.generate(c.request_id, c.prompt_ids, c.params, deadline)
            try:
                async for out in stream:
                    yield c, out
            finally:
                await stream.aclose()
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def read(c: Choice):
            stream = self.engine.generate(c.request_id, c.prompt_ids, c.params, deadline)
            try:
                async for out in stream:
                    queue.put_nowait((c, out, None))
            except Exception as exc:
                queue.put_nowait((c, None, exc))
            finally:
                await stream.aclose()

        readers = [asyncio.create_task(read(c)) for c in choices]
        try:
            unfinished = len(choices)  # every engine stream ends with a finished output or raises
            while unfinished:
                c, out, exc = await queue.get()
                if exc is not None:
                    raise exc
                unfinished -= out.finished
                yield c, out
        finally:
            for task in readers:
                task.cancel()
            await asyncio.gather(*readers, return_exceptions=True)

    async def guarded(self, request: Request, awaitable, deadline: float):
        """Await `awaitable` unless the client disconnects or the deadline passes first."""
        task = asyncio.ensure_future(awaitable)
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({task, watcher}, timeout=max(0.0, deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task in done:
            return task.result()
        if watcher in done:
            raise ClientGone()
        raise self.timeout_error()

    def timeout_error(self) -> APIError:
        return APIError(504, f"The request did not finish within the server's {self.config.request_timeout:g} s "
                        "timeout.", code="request_timeout")

    def record(self, c: Choice, out, arrival: float) -> None:
        """Per-output bookkeeping and latency metrics."""
        n_new = len(out.new_token_ids)
        now = time.monotonic()
        if not c.admitted:  # the engine took the request: count its prompt once
            c.admitted = True
            self.metrics.prompt_tokens.inc(out.num_prompt_tokens)
        if n_new:
            self.metrics.generation_tokens.inc(n_new)
            if not c.started:
                self.metrics.ttft.observe(now - arrival)
            else:
                for _ in range(n_new):
                    self.metrics.itl.observe((now - c.last_time) / n_new)
            c.started, c.last_time = True, now
        c.generated = out.num_generated_tokens
        if out.finished:
            self.metrics.e2e.observe(now - arrival)
            if out.finish_reason == "error":
                self.metrics.errors.labels("engine_error").inc()
                raise APIError(500, f"The engine failed on this request: {out.error or 'unknown error'}",
                               code="engine_error")
            c.finish_reason = "length" if out.finish_reason == "abort" else out.finish_reason
            c.stop_reason = out.stop_reason

    def usage(self, choices: list[Choice]) -> P.Usage:
        prompt = sum(len(p) for p in {c.prompt_index: c.prompt_ids for c in choices}.values())
        completion = sum(c.generated for c in choices)
        return P.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    async def respond(self, request: Request, choices: list[Choice], stream: bool, arrival: float,
                      collect, chunks):
        """Run the choices; answer at once (collect) or as SSE (chunks). Errors before the first
        output (overload, bad input the engine found, timeout) become HTTP errors; errors after
        the headers went out become a final SSE error event."""
        deadline = arrival + self.config.request_timeout
        # Streams: the engine iterator enforces the deadline with one timer (asyncio.wait_for per
        # output cost a task and a timer per token); whole answers: `guarded` does.
        outputs = self.outputs(choices, deadline if stream else None)
        if not stream:
            async def run():
                try:
                    async for c, out in outputs:
                        self.record(c, out, arrival)
                        collect(c, out)
                finally:  # an error in one choice must stop the others too
                    await outputs.aclose()
            await self.guarded(request, run(), deadline)
            return None
        try:
            first = await self.guarded(request, anext(outputs), deadline)
        except asyncio.TimeoutError:  # the engine iterator's timer fired first
            raise self.timeout_error() from None
        try:
            self.record(*first, arrival)  # an engine error before any token is a plain HTTP error
        except APIError:
            await outputs.aclose()
            raise
        return StreamingResponse(self.sse_events(first, outputs, arrival, deadline, chunks),
                                 media_type="text/event-stream", headers={"cache-control": "no-cache"})

    async def sse_events(self, first, outputs, arrival, deadline, chunks) -> AsyncIterator[str]:
        """SSE lines. A client that hangs up cancels this generator (Starlette watches for the
        disconnect); closing `outputs` then aborts the engine requests."""
        try:
            item = first
            while item is not None:
                # One write per output (an output may hold several tokens when the client is behind).
                data = "".join(sse(chunk) for chunk in chunks(*item))
                if data:
                    yield data
                item = await anext(outputs, None)  # raises asyncio.TimeoutError past the deadline
                if item is not None:
                    self.record(*item, arrival)
            for chunk in chunks(None, None):  # the final usage chunk, when asked for
                yield sse(chunk)
        except asyncio.TimeoutError:  # not yet the builtin TimeoutError on Python 3.10
            self.metrics.errors.labels("request_timeout").inc()
            err = self.timeout_error()
            yield sse(error_body(err.status, err.message, code=err.code))
        except APIError as err:
            yield sse(error_body(err.status, err.message, err.param, err.code))
        except Exception as exc:  # mid-stream the status is already 200: report in-band
            log.exception("stream failed")
            self.metrics.errors.labels("server_error").inc()
            yield sse(error_body(500, f"Internal error: {exc.__class__.__name__}", code="server_error"))
        finally:
            await outputs.aclose()
        yield "data: [DONE]\n\n"


def single_token_ids(tokenizer, vocab_size: int, texts) -> Optional[tuple[int, ...]]:
    """Each text's token id where each is one token of the model's vocabulary, else None."""
    ids = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    return tuple(i[0] for i in ids) if all(len(i) == 1 and i[0] < vocab_size for i in ids) else None


def _or(value, default):
    return default if value is None else value


def _message_dict(m: P.ChatMessage) -> dict:
    d = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.name:
        d["name"] = m.name
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.tool_calls:  # chat templates (Qwen's, Llama's) write the arguments with tojson: give them the object
        d["tool_calls"] = [{**call.model_dump(exclude_none=True), "function": {
            "name": call.function.name, "arguments": _json_or_text(call.function.arguments)}} for call in m.tool_calls]
    return d


def _json_or_text(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def parse_body(request: Request, model: type[BaseModel]):
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_api_error(exc) from None


def validation_api_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"The request body is not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}",
                        code="invalid_json")
    if first["type"] in ("model_type", "model_attributes_type") and not first["loc"]:
        return APIError(400, "The request body must be a JSON object.", code="invalid_json")
    parts = []
    for e in errors[:3]:
        where = _error_param(e)
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    param = _error_param(first)
    code = "unknown_parameter" if first["type"] == "extra_forbidden" else "invalid_value"
    return APIError(400, "; ".join(parts) + more, param=param, code=code)


# ---- response shaping ----------------------------------------------------------------------------

class CompletionShaper:
    """/v1/completions: text (with the echoed prompt) and logprobs in the legacy OpenAI shape."""

    def __init__(self, server: Server, body: P.CompletionRequest, rid: str, choices: list[Choice],
                 echo_texts: list[str]):
        self.server, self.body, self.rid, self.choices, self.echo_texts = server, body, rid, choices, echo_texts
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.created = P.now()  # one timestamp for every chunk of the response
        self.templates: dict[int, P.TextTemplate] = {}  # choice index -> its plain text chunk

    def delta(self, c: Choice, out) -> tuple[str, Optional[P.CompletionLogprobs]]:
        lp = P.CompletionLogprobs() if self.body.logprobs is not None else None
        text = ""
        if c.echo and not c.echoed:
            c.echoed = True
            text = self.echo_texts[c.prompt_index]
            if lp is not None:
                rows = out.prompt_logprobs or [None] * len(c.prompt_ids)
                for tid, entry in zip(c.prompt_ids, rows, strict=True):
                    self.add_row(c, lp, tid, entry)
        text += out.new_text
        if lp is not None:
            for entry in out.logprobs:
                self.add_row(c, lp, entry.token_id, entry)
        return text, lp

    def add_row(self, c: Choice, lp: P.CompletionLogprobs, token_id: int, entry) -> None:
        token = self.server.token_text(token_id)
        lp.tokens.append(token)
        lp.text_offset.append(c.offset)
        c.offset += len(token)
        if entry is None:  # the first prompt token has no logprob
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
            return
        top = {self.server.token_text(t): safe_logprob(x) for t, x in entry.top}
        top.setdefault(token, safe_logprob(entry.logprob))
        lp.token_logprobs.append(safe_logprob(entry.logprob))
        lp.top_logprobs.append(top)

    def collect(self, c: Choice, out) -> None:
        text, lp = self.delta(c, out)
        c.text += text
        if lp is not None:
            c.logprob_rows.append(lp)

    def chunks(self, c: Optional[Choice], out):
        if c is None:
            if self.include_usage:
                yield P.CompletionResponse(id=self.rid, model=self.model, created=self.created, choices=[],
                                           usage=self.server.usage(self.choices))
            return
        text, lp = self.delta(c, out)
        if text and lp is None and not out.finished:  # the per-token case: no model to build
            yield self.text_template(c.index).fill(text)
        elif text or lp is not None or out.finished:
            choice = P.CompletionChoice(index=c.index, text=text, logprobs=lp,
                                        finish_reason=c.finish_reason if out.finished else None,
                                        stop_reason=c.stop_reason)
            yield P.CompletionResponse(id=self.rid, model=self.model, created=self.created, choices=[choice])

    def text_template(self, index: int) -> P.TextTemplate:
        template = self.templates.get(index)
        if template is None:
            choice = P.CompletionChoice(index=index, text=P.TextTemplate.MARK)
            template = self.templates[index] = P.TextTemplate(
                P.CompletionResponse(id=self.rid, model=self.model, created=self.created, choices=[choice]))
        return template

    @property
    def model(self) -> str:
        return self.server.config.served_model_name

    def final(self) -> P.CompletionResponse:
        choices = [P.CompletionChoice(index=c.index, text=c.text, logprobs=_merge_logprobs(c.logprob_rows)
                                      if self.body.logprobs is not None else None,
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                   for c in self.choices]
        return P.CompletionResponse(id=self.rid, model=self.model, choices=choices,
                                    usage=self.server.usage(self.choices))


def _merge_logprobs(rows: list[P.CompletionLogprobs]) -> P.CompletionLogprobs:
    merged = P.CompletionLogprobs()
    for r in rows:
        merged.tokens += r.tokens
        merged.token_logprobs += r.token_logprobs
        merged.top_logprobs += r.top_logprobs
        merged.text_offset += r.text_offset
    return merged


class ChatShaper:
    """/v1/chat/completions: assistant message, per-token logprobs with bytes, chunk deltas."""

    def __init__(self, server: Server, body: P.ChatCompletionRequest, rid: str, choices: list[Choice]):
        self.server, self.body, self.rid, self.choices = server, body, rid, choices
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.top_n = body.top_logprobs or 0
        self.created = P.now()  # one timestamp for every chunk of the response
        self.templates: dict[int, P.TextTemplate] = {}  # choice index -> its content-delta chunk
        self.tool_mode = body.tool_mode()  # None, or "named" / "required" / "auto": the answer holds tool calls
        self.call_ids: dict[tuple[int, int], str] = {}  # (choice, call) -> the call's id, the same in every chunk
        self.sent: dict[int, int] = {}  # choice -> characters of its text streamed as content (tool modes)

    def logprobs(self, out) -> Optional[P.ChatLogprobs]:
        if not self.body.logprobs:
            return None
        return P.ChatLogprobs(content=[self.token_logprob(e) for e in out.logprobs])

    def token_logprob(self, entry) -> P.ChatTokenLogprob:
        s = self.server
        top = [P.TopLogprob(token=s.token_text(t), logprob=safe_logprob(x), bytes=s.token_bytes(t))
               for t, x in entry.top[:self.top_n]]
        return P.ChatTokenLogprob(token=s.token_text(entry.token_id), logprob=safe_logprob(entry.logprob),
                                  bytes=s.token_bytes(entry.token_id), top_logprobs=top)

    def collect(self, c: Choice, out) -> None:
        c.text += out.new_text
        if self.body.logprobs:
            c.logprob_rows += [self.token_logprob(e) for e in out.logprobs]

    def chunk(self, c: Choice, delta: P.ChatDelta, logprobs=None, finish=None) -> P.ChatCompletionChunk:
        choice = P.ChatChunkChoice(index=c.index, delta=delta, logprobs=logprobs, finish_reason=finish,
                                   stop_reason=c.stop_reason if finish else None)
        return P.ChatCompletionChunk(id=self.rid, model=self.model, created=self.created, choices=[choice])

    def chunks(self, c: Optional[Choice], out):
        if c is None:
            if self.include_usage:
                yield P.ChatCompletionChunk(id=self.rid, model=self.model, created=self.created, choices=[],
                                            usage=self.server.usage(self.choices))
            return
        if not c.announced:  # OpenAI opens each choice with the role
            c.announced = True
            yield self.chunk(c, P.ChatDelta(role="assistant", content=None if self.tool_mode else ""))
        if self.tool_mode:
            yield from self.tool_chunks(c, out)
            return
        logprobs = self.logprobs(out)
        if out.new_text and logprobs is None:  # the per-token case: no model to build
            yield self.content_template(c).fill(out.new_text)
        elif out.new_text or (logprobs and logprobs.content):
            yield self.chunk(c, P.ChatDelta(content=out.new_text), logprobs)
        if out.finished:
            yield self.chunk(c, P.ChatDelta(), finish=c.finish_reason)

    def tool_chunks(self, c: Choice, out):
        """A named function's arguments stream as they come; 'auto' streams text up to a call's
        tag; whole calls ('required', or found by 'auto') come at the end, after any text not
        sent yet."""
        c.text += out.new_text
        if self.tool_mode == "named" and out.new_text:
            call = {"index": 0, "function": {"arguments": out.new_text}}
            if (c.index, 0) not in self.call_ids:
                call = {"index": 0, "id": self.call_id(c, 0), "type": "function",
                        "function": {"name": self.body.called_function(), "arguments": out.new_text}}
            yield self.chunk(c, P.ChatDelta(tool_calls=[call]))
        elif self.tool_mode == "auto" and not out.finished:
            yield from self.content_upto(c, tool_calls.streamable(c.text, self.server.tool_call_parser))
        if not out.finished:
            return
        calls = self.answer(c)[1]
        if self.tool_mode != "named":  # the text without calls; with them, what came before the first tag
            yield from self.content_upto(c, len(c.text) if calls is None else 0 if self.tool_mode != "auto" else
                                         tool_calls.streamable(c.text, self.server.tool_call_parser))
            if calls is not None:
                yield self.chunk(c, P.ChatDelta(tool_calls=[{"index": i, **call.model_dump()}
                                                            for i, call in enumerate(calls)]))
        yield self.chunk(c, P.ChatDelta(), finish=self.finish_reason(c, calls))

    def content_upto(self, c: Choice, upto: int):
        """The choice's text up to character `upto` that was not streamed yet."""
        sent = self.sent.get(c.index, 0)
        if upto > sent:
            self.sent[c.index] = upto
            yield self.chunk(c, P.ChatDelta(content=c.text[sent:upto]))

    def call_id(self, c: Choice, i: int) -> str:
        return self.call_ids.setdefault((c.index, i), f"call_{uuid.uuid4().hex[:24]}")

    def answer(self, c: Choice) -> tuple[Optional[str], Optional[list[P.ToolCall]]]:
        """A finished choice's (content, tool calls). Calls None where there are none: a plain
        answer, an 'auto' answer without calls, 'required' calls cut short (not JSON: the text as
        it is). A named function's text is its arguments (cut short too, with finish_reason length)."""
        if self.tool_mode == "named":
            return None, [P.ToolCall(id=self.call_id(c, 0),
                                     function=P.FunctionCall(name=self.body.called_function(), arguments=c.text))]
        if self.tool_mode == "auto":
            content, calls = tool_calls.parse(c.text, self.server.tool_call_parser)
        elif self.tool_mode == "required":
            try:
                content, calls = None, [(call["name"], json.dumps(call["parameters"], ensure_ascii=False))
                                        for call in json.loads(c.text)]
            except ValueError:
                content, calls = c.text, []
        else:
            content, calls = c.text, []
        return content, [P.ToolCall(id=self.call_id(c, i), function=P.FunctionCall(name=name, arguments=arguments))
                         for i, (name, arguments) in enumerate(calls)] or None

    def finish_reason(self, c: Choice, calls: Optional[list[P.ToolCall]]) -> Optional[str]:
        # as vLLM: calls that closed ('required', or found by 'auto') finish with tool_calls; a named function
        # with stop
        called = calls is not None and self.tool_mode in ("required", "auto")
        return "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason

    def content_template(self, c: Choice) -> P.TextTemplate:
        template = self.templates.get(c.index)
        if template is None:
            template = self.templates[c.index] = P.TextTemplate(self.chunk(c, P.ChatDelta(content=P.TextTemplate.MARK)))
        return template

    @property
    def model(self) -> str:
        return self.server.config.served_model_name

    def final(self) -> P.ChatCompletionResponse:
        choices = []
        for c in self.choices:
            content, calls = self.answer(c)
            choices.append(P.ChatChoice(
                index=c.index, message=P.ChatResponseMessage(content=content, tool_calls=calls),
                logprobs=P.ChatLogprobs(content=c.logprob_rows) if self.body.logprobs else None,
                finish_reason=self.finish_reason(c, calls), stop_reason=c.stop_reason))
        return P.ChatCompletionResponse(id=self.rid, model=self.model, choices=choices,
                                        usage=self.server.usage(self.choices))


# ---- endpoints -----------------------------------------------------------------------------------

async def completions(server: Server, request: Request):
    arrival = time.monotonic()
    body = await parse_body(request, P.CompletionRequest)
    server.check_model(body.model)
    n, prompts = body.n or 1, body.prompts()
    _check_choice_count(n * len(prompts))
    rid = P.new_id("cmpl")
    choices, echo_texts = [], []
    for p_idx, prompt in enumerate(prompts):
        ids = server.encode(prompt)
        max_tokens = server.token_budget(ids, body.max_tokens)
        echo_texts.append(prompt if isinstance(prompt, str) else server.decode(ids))
        prompt_lp = body.logprobs if body.echo else None
        for j in range(n):
            params = server.sampling_params(body, max_tokens, j, body.logprobs, prompt_lp)
            idx = p_idx * n + j
            choices.append(Choice(idx, f"{rid}-{idx}", ids, params, p_idx, echo=bool(body.echo)))
    shaper = CompletionShaper(server, body, rid, choices, echo_texts)
    streamed = await server.respond(request, choices, bool(body.stream), arrival, shaper.collect, shaper.chunks)
    return streamed or _json(shaper.final())


async def chat_completions(server: Server, request: Request):
    arrival = time.monotonic()
    body = await parse_body(request, P.ChatCompletionRequest)
    server.check_model(body.model)
    n = body.n or 1
    _check_choice_count(n)
    if body.tool_mode() == "auto" and server.tool_call_parser is None:
        raise APIError(400, "tool_choice 'auto' (the default when tools are given) needs a way to tell tool calls "
                       "in the model's text: this model's chat template shows no known format (start the server "
                       "with --tool-call-parser hermes if the model writes <tool_call> blocks, llama3_json if it "
                       "writes Llama 3's JSON calls, mistral if it writes [TOOL_CALLS] lists); or use 'required', "
                       "a named function or 'none'.", param="tool_choice", code="invalid_value")
    ids = server.chat_prompt_ids(body)
    max_tokens = server.token_budget(ids, body.token_limit(), "messages", body.token_limit_param())
    rid = P.new_id("chatcmpl")
    top = (body.top_logprobs or 0) if body.logprobs else None
    tagged = server.strict_calls(body)
    choices = [Choice(j, f"{rid}-{j}", ids,
                      replace(server.sampling_params(body, max_tokens, j, top), tagged_json=tagged)) for j in range(n)]
    shaper = ChatShaper(server, body, rid, choices)
    streamed = await server.respond(request, choices, bool(body.stream), arrival, shaper.collect, shaper.chunks)
    return streamed or _json(shaper.final())


async def tokenize(server: Server, request: Request):
    """vLLM's /tokenize: a prompt's or a chat's ids, as the completion routes would see them, at any
    length (counting is what it is for; the body size limit bounds the work)."""
    raw = await request.body()
    try:
        decoded = json.loads(raw)
    except ValueError:
        decoded = None  # the model's parse below names the problem
    chat = isinstance(decoded, dict) and "messages" in decoded
    body = await parse_body(request, P.TokenizeChatRequest if chat else P.TokenizeCompletionRequest)
    server.check_model(body.model)
    if chat:
        ids = server.chat_prompt_ids(body, check_length=False)
    else:
        ids = server.tokenizer.encode(body.prompt, add_special_tokens=_or(body.add_special_tokens, True))
    strs = server.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return _json(P.TokenizeResponse(count=len(ids), max_model_len=server.max_model_len, tokens=ids, token_strs=strs))


async def detokenize(server: Server, request: Request):
    body = await parse_body(request, P.DetokenizeRequest)
    server.check_model(body.model)
    bad = next((t for t in body.tokens if t >= server.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"Token id {bad} is out of range: the vocabulary has {server.vocab_size} tokens.",
                       param="tokens", code="invalid_token_id")
    return _json(P.DetokenizeResponse(prompt=server.decode(body.tokens)))


def _check_choice_count(count: int) -> None:
    if count > MAX_CHOICES:
        raise APIError(400, f"n times the number of prompts is {count}; at most {MAX_CHOICES} choices "
                       "per request.", param="n", code="too_many_choices")


def _json(model: BaseModel) -> Response:
    # pydantic writes the JSON (NaN/inf would become null, never an invalid document).
    return Response(model.model_dump_json(), media_type="application/json")


# ---- the application -----------------------------------------------------------------------------

def create_app(engine, config: ServerConfig) -> FastAPI:
    """The FastAPI app over an LLMEngine. The engine thread starts and drains with the app's
    lifespan, so uvicorn's graceful shutdown (SIGTERM) finishes in-flight requests first."""
    server = Server(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        try:
            yield
        finally:
            await server.engine.shutdown(drain=True)

    app = FastAPI(title="fitllm", summary="OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.server = server
    _install_error_handlers(app, server)
    # Added last = outermost: count every answer, then check the key, then the body size.
    app.add_middleware(BodyLimit, limit=config.max_body_bytes, metrics=server.metrics)
    app.add_middleware(APIKeyGuard, api_key=config.api_key, metrics=server.metrics)
    app.add_middleware(RequestCounter, metrics=server.metrics)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        content, media_type = server.metrics.render()
        return Response(content, media_type=media_type)

    @app.get("/v1/models", response_model=P.ModelList)
    async def models():
        card = P.ModelCard(id=config.served_model_name, created=server.started_at,
                           max_model_len=server.max_model_len)
        return P.ModelList(data=[card])

    @app.get("/v1/models/{model:path}", response_model=P.ModelCard,
             responses={404: {"model": P.ErrorResponse}})
    async def model(model: str):
        server.check_model(model)
        return P.ModelCard(id=model, created=server.started_at, max_model_len=server.max_model_len)

    for path, handler, bodies, answer in POST_ROUTES:
        app.add_api_route(path, _endpoint(server, handler), methods=["POST"], openapi_extra=_body_schema(*bodies),
                          responses={200: {"model": answer}, 400: {"model": P.ErrorResponse}})
    _publish_request_schemas(app)
    return app


def _install_error_handlers(app: FastAPI, server: Server) -> None:
    count = server.metrics.errors.labels

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        count(exc.code or ERROR_TYPES.get(exc.status, "server_error")).inc()
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(EngineOverloaded)
    async def overloaded(request, exc):
        count("overloaded").inc()
        return error_response(429, "The server is at capacity (its waiting queue is full); retry shortly.",
                              code="overloaded", headers={"retry-after": str(server.config.retry_after_s)})

    @app.exception_handler(ValueError)
    async def engine_rejected(request, exc: ValueError):
        # LLMEngine.add_request raises ValueError for input it cannot serve.
        count("invalid_request").inc()
        return error_response(400, f"Invalid request: {exc}", code="invalid_request")

    @app.exception_handler(ClientGone)
    async def client_gone(request, exc):
        count("client_disconnected").inc()
        return Response(status_code=499)  # nobody reads it; logged and counted

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        count(f"http_{exc.status_code}").inc()
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        count("invalid_value").inc()
        e = (exc.errors() or [{}])[0]
        where = ".".join(str(x) for x in e.get("loc", ()))
        return error_response(400, f"{where}: {e.get('msg', 'invalid request')}", param=where or None,
                              code="invalid_value")

    @app.exception_handler(Exception)
    async def internal(request, exc: Exception):
        log.exception("unhandled error")
        count("server_error").inc()
        return error_response(500, f"Internal server error ({exc.__class__.__name__}).", code="server_error")


# path, handler, the request bodies it takes (for the OpenAPI document), its answer
POST_ROUTES = [
    ("/v1/completions", completions, (P.CompletionRequest,), P.CompletionResponse),
    ("/v1/chat/completions", chat_completions, (P.ChatCompletionRequest,), P.ChatCompletionResponse),
    ("/tokenize", tokenize, (P.TokenizeCompletionRequest, P.TokenizeChatRequest), P.TokenizeResponse),
    ("/detokenize", detokenize, (P.DetokenizeRequest,), P.DetokenizeResponse),
]


def _endpoint(server: Server, handler):
    async def endpoint(request: Request):
        return await handler(server, request)
    endpoint.__name__ = handler.__name__  # the OpenAPI operation's name
    return endpoint


def _body_schema(*models: type[BaseModel]) -> dict:
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _publish_request_schemas(app: FastAPI) -> None:
    """The routes parse their bodies themselves (for exact error messages and any content type);
    this puts the request models in the OpenAPI document so clients and fuzzers still see them."""
    build = app.openapi

    def openapi():
        if app.openapi_schema:
            return app.openapi_schema
        schema = build()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (body for route in POST_ROUTES for body in route[2]):
            s = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(s.pop("$defs", {}))
            components[model.__name__] = s
        return schema
    app.openapi = openapi


def _error_param(error: dict) -> Optional[str]:
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, P.ParamError):
        return cause.param
    # Drop pydantic's union-member tags ("str", "list[str]", "function-after[...]") from the path.
    path = [str(x) for x in error["loc"] if isinstance(x, int) or not _UNION_TAG.match(str(x))]
    return ".".join(path) or None


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*|dict\[.*|.*-.*|.*\[.*\])$")
