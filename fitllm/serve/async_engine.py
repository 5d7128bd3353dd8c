"""The engine behind an asyncio server: LLMEngine.step runs in one background thread.

Only that thread touches the LLMEngine. Callers on the event loop send it commands (add, abort)
through a thread-safe queue; it hands a step's outputs back with one `call_soon_threadsafe` per
step (not per token: each call wakes the loop through a syscall). A consumer that has fallen
behind takes all of its request's pending outputs at once, merged into one, so a busy server
sends fewer, larger chunks instead of falling further behind. A consumer that stops iterating
(a client that disconnects) aborts its request, which frees its blocks at once.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import AsyncIterator, Optional

from fitllm.serve.engine import LLMEngine, RequestOutput, merge_outputs
from fitllm.serve.sampling import SamplingParams

log = logging.getLogger(__name__)


class EngineOverloaded(RuntimeError):
    """The waiting queue is full: the server should answer 503/429 and let the client retry."""


class EngineDead(RuntimeError):
    """The engine thread has stopped."""


class _Timeout:
    """Put in a stream when its deadline passes."""


class _Stream:
    """One request's pending outputs. Touched only on its event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: list = []
        self.waiter: Optional[asyncio.Future] = None

    def push(self, item) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def take(self) -> list:
        """Everything pending, waiting for at least one item."""
        while not self.items:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        return items

    def put_threadsafe(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.push, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass


def _push_all(pairs: list) -> None:
    for stream, out in pairs:
        stream.push(out)


def _coalesce(items: list) -> list:
    """Each run of consecutive outputs merged into one; exceptions and timeouts kept in place.
    A lone output is passed as it is; a merged one is a copy (the engine's lists stay untouched)."""
    merged: list = []
    copied = False  # merged[-1] is our own copy, safe to extend
    for item in items:
        last = merged[-1] if merged else None
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput):
            if not copied:
                merged[-1] = last = merge_outputs(None, last)
                copied = True
            merge_outputs(last, item)
        else:
            merged.append(item)
            copied = False
    return merged


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 256):
        self.engine, self.max_waiting = engine, max_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams and _queued
        self._queued = 0  # adds sent but not yet taken by the engine thread
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._stats = engine.stats()

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="fitllm-engine", daemon=True)
            self._thread.start()

    async def shutdown(self, drain: bool = True) -> None:
        """Stop the engine thread: after in-flight requests finish (drain) or aborting them."""
        if not drain:
            with self._lock:
                ids = list(self._streams)
            for rid in ids:
                self._send(("abort", rid))
        while drain and self._thread is not None and self._thread.is_alive() and self._busy():
            await asyncio.sleep(0.01)
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def stats(self) -> dict:
        with self._lock:
            queued = self._queued
        stats = dict(self._stats)
        stats["num_waiting"] = stats.get("num_waiting", 0) + queued
        return stats

    # ---- requests ----------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       deadline: Optional[float] = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come; a consumer that falls behind gets the outputs
        pending for it merged into one. ValueError for a request the engine cannot serve,
        EngineOverloaded when the waiting queue is full, asyncio.TimeoutError when the output
        is still unfinished at `deadline` (time.monotonic())."""
        self.engine.validate_request(request_id, prompt_token_ids, params)
        self.start()
        loop = asyncio.get_running_loop()
        stream = _Stream(loop)
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            if self._queued + len(self.engine.scheduler.waiting) >= self.max_waiting:
                raise EngineOverloaded(f"the server is busy: {self.max_waiting} requests are already waiting")
            self._streams[request_id] = stream
            self._queued += 1
        self._send(("add", request_id, list(prompt_token_ids), params))
        # One timer per request, not one per awaited output.
        timer = None if deadline is None else loop.call_later(max(0.0, deadline - time.monotonic()),
                                                               stream.push, _Timeout())
        finished = False
        try:
            while not finished:
                for item in _coalesce(await stream.take()):
                    if isinstance(item, _Timeout):
                        raise asyncio.TimeoutError()
                    if isinstance(item, BaseException):
                        finished = True
                        raise item
                    finished = item.finished
                    yield item
                    if finished:
                        break
        finally:
            if timer is not None:
                timer.cancel()
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:  # the consumer left early: free the request's blocks now
                self._send(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    # ---- the engine thread -------------------------------------------------------------------------
    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _busy(self) -> bool:
        return not self._commands.empty() or self.engine.has_unfinished_requests()

    def _run(self) -> None:
        while True:
            self._wake.clear()
            self._take_commands()
            if not self.engine.has_unfinished_requests():
                if self._stopping:
                    return
                self._wake.wait(timeout=0.5)
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug, not a bad request: fail everything in flight, keep serving
                log.exception("engine step failed")
                outputs = self._fail_all(exc)
            self._stats = self.engine.stats()
            self._deliver(outputs)

    def _take_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, rid, prompt, params = command
                with self._lock:
                    self._queued -= 1
                    stream = self._streams.get(rid)
                if stream is None:
                    continue  # the caller left before the engine saw the request
                try:
                    self.engine.add_request(rid, prompt, params)
                except ValueError as exc:
                    stream.put_threadsafe(exc)
            else:
                self.engine.abort_request(command[1])
        self._stats = self.engine.stats()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """One loop wake-up per step (per event loop) for all of the step's outputs."""
        by_loop: dict = {}
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, pairs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_push_all, pairs)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                pass

    def _fail_all(self, exc: Exception) -> list[RequestOutput]:
        outputs = []
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
        for out in self.engine.step():  # collects the abort outputs, schedules nothing
            out.finish_reason, out.error = "error", f"{exc.__class__.__name__}: {exc}"
            outputs.append(out)
        return outputs
