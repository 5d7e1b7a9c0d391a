"""`graphrelay serve --port PORT`: the OpenAI-compatible HTTP API over the serving loop.

Starlette under uvicorn, one event loop. Handlers validate a request (`openai_api`), hand
it to the engine (an `engine_handle.EngineHandle`: a thread in this process, `engine_worker`,
or its own process, `engine_process`) and turn the tokens that come back into text
(`detokenize.TextStream`, which also applies the stop strings) for a JSON answer or a
server-sent-event stream, each piece with the logprobs of the tokens it carries when asked
(`openai_logprobs`). The detokenization stays on this side, so the engine only schedules and
reads tokens. With an engine thread, a request's grammar compiles in a worker thread before it
is submitted, so a slow compile holds up only its own request; an engine process compiles it
as it admits the request.

A client that goes away mid-stream cancels its handler, which aborts the request; the loop
frees the slot once no in-flight iteration reads it. SIGINT / SIGTERM: uvicorn stops
accepting connections and lets running requests finish for up to the shutdown grace, then
cancels (aborts) the rest; the engine thread drains and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import time
from typing import AsyncIterator, Callable, NamedTuple, Optional

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from graphrelay.capture.model.text import TextCodec
from graphrelay.capture.serving.detokenize import TextStream
from graphrelay.capture.serving.engine_handle import EngineHandle, EngineStopped, Overloaded, Rejected
from graphrelay.capture.serving.heap import frozen_startup_heap
from graphrelay.capture.serving.loop import RequestOutput
from graphrelay.capture.serving.openai_api import (
    ApiError, ChatRequest, CompletionRequest, Limits, Prepared, check_controls, controls_error, decode, prepare_chat,
    prepare_completion, usage,
)
from graphrelay.capture.serving.openai_logprobs import (
    LogprobCursor, TokenEntry, TokenStrings, chat_logprobs, completion_logprobs,
)

_encode = msgspec.json.Encoder().encode
RETRY_AFTER_S = 1
INLINE_PREPARE_CHARS = 1024  # prompt text tokenized on the event loop (~0.25 ms at most on a slow CPU)


class ServerOptions(msgspec.Struct, frozen=True):
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "graphrelay"
    max_waiting: int = 1024  # requests queued beyond the slots before 429
    max_body_bytes: int = 1 << 20
    shutdown_grace_s: float = 30.0
    api_servers: int = 1  # processes serving this port (`api_servers`)


def _json(payload, status: int = 200, headers: Optional[dict] = None) -> Response:
    return Response(_encode(payload), status_code=status, media_type="application/json", headers=headers)


def _error(exc: ApiError) -> Response:
    return _json(exc.body(), exc.status, exc.headers)


class Piece(NamedTuple):
    text: str
    logprobs: Optional[list[TokenEntry]]  # the tokens the text carries; None unless asked


class Completion:
    """One request's answer as it is produced: text pieces, then the finish reason."""

    def __init__(self, prepared: Prepared):
        self.prepared = prepared
        self.finish_reason: Optional[str] = None
        self.completion_tokens = 0

    @property
    def usage(self) -> dict:
        return usage(len(self.prepared.request.prompt), self.completion_tokens)


class OpenAIServer:
    """The app's handlers; `app` is the ASGI application."""

    def __init__(self, worker: EngineHandle, codec: TextCodec, options: ServerOptions, index: int = 0,
                 on_start: Optional[Callable[[], None]] = None):
        info = worker.info
        self.index = index  # which of the API server processes this is
        self.on_start = on_start  # called once serving, its stop signals handled
        self.codec = codec
        self.options = options
        self.limits = Limits(options.model_name, info.model.max_seq_len, info.model.vocab_size, info.max_top_k,
                             controls=info.has_controls)
        self.token_strings = TokenStrings(codec.tokenizer)
        self.worker = worker
        self.started = int(time.time())
        self._starlette = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ],
            exception_handlers={HTTPException: self._http_error, Exception: self._internal_error},
            lifespan=self._lifespan,
        )
        self._direct = {"/v1/completions": self.completions, "/v1/chat/completions": self.chat}

    async def app(self, scope, receive, send) -> None:
        """The ASGI application. A completion POST goes straight to its handler; everything else
        (other paths and methods, the lifespan) through Starlette. Starlette's middleware wraps
        `send` in two more coroutines per message, and each streamed chunk is a message: about
        10% of the HTTP process's CPU per chunk (measured with a fake engine on the CPU)."""
        handler = self._direct.get(scope.get("path")) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            await self._starlette(scope, receive, send)
            return
        http = HttpRequest(scope, receive)
        try:
            response = await handler(http)
        except Exception as exc:  # noqa: BLE001 - as Starlette's handler would: a 500 in OpenAI's shape
            response = await self._internal_error(http, exc)
        await response(scope, receive, send)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self.worker.start()
        if self.on_start is not None:
            self.on_start()
        yield
        await self.worker.stop()

    # ---- endpoints ----------------------------------------------------------------------------

    async def completions(self, http: HttpRequest) -> Response:
        return await self._answer(http, CompletionRequest, prepare_completion, chat=False)

    async def chat(self, http: HttpRequest) -> Response:
        return await self._answer(http, ChatRequest, prepare_chat, chat=True)

    async def models(self, http: HttpRequest) -> Response:
        return _json({"object": "list", "data": [{
            "id": self.options.model_name, "object": "model", "created": self.started, "owned_by": "graphrelay",
            "max_model_len": self.limits.max_seq_len,
        }]})

    async def health(self, http: HttpRequest) -> Response:
        # With several API servers, `finished` is this process's (the one the connection
        # reached); `outstanding` and `capacity` are the whole server's (one shared count), as are
        # the slot counts (the engine's) and `rss_bytes`.
        state = {**self.worker.health(), "api_server": self.index, "api_servers": self.options.api_servers,
                 "pid": os.getpid()}
        return _json(state, 200 if state["engine"] == "running" else 503)

    async def _http_error(self, http: HttpRequest, exc: HTTPException) -> Response:
        return _error(ApiError(f"{http.method} {http.url.path}: {exc.detail}", status=exc.status_code,
                               code="not_found" if exc.status_code == 404 else None))

    async def _internal_error(self, http: HttpRequest, exc: Exception) -> Response:
        return _error(ApiError(f"internal error: {exc!r}", status=500, kind="server_error"))

    # ---- one request --------------------------------------------------------------------------

    async def _answer(self, http: HttpRequest, kind: type, prepare: Callable, chat: bool) -> Response:
        try:
            body = decode(await self._body(http), kind)
            if self._prepares_quickly(body):
                prepared = self._prepare(prepare, body)
            else:
                # A long prompt's chat template and tokenization, or a grammar's compile, on a
                # worker thread: on the event loop they would stall every open stream.
                prepared = await asyncio.get_running_loop().run_in_executor(None, self._prepare, prepare, body)
            queue = await self._admit(prepared)
        except ApiError as exc:
            return _error(exc)
        completion = Completion(prepared)
        pieces = self._generate(prepared, queue, completion)
        if prepared.stream:
            return StreamingResponse(self._events(pieces, completion, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        collect = asyncio.ensure_future(_join(pieces))
        gone = asyncio.ensure_future(_disconnected(http))
        try:
            await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():  # the client left before its answer: nobody to send it to
                return Response(status_code=499)
            text, entries = collect.result()
        except EngineStopped as exc:
            return _error(ApiError(str(exc), status=503, kind="server_error"))
        finally:
            collect.cancel()
            gone.cancel()
            self._abandon(completion)  # the client left, or the handler was cancelled (shutdown)
        logprobs = self._logprobs(entries, chat)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                   "finish_reason": completion.finish_reason} if chat else
                  {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": completion.finish_reason})
        return _json({**self._head(prepared, chat, chunk=False), "choices": [choice], "usage": completion.usage})

    def _prepares_quickly(self, body) -> bool:
        """Token ids, or text of at most INLINE_PREPARE_CHARS, and no grammar to compile on
        this side: prepared on the event loop, since the hop to a worker thread and back is two
        interpreter-lock handoffs, each up to the lock's 5 ms switch interval while the loop
        is busy: more than the tokenization they would save it."""
        if self.worker.controls is not None and _asks_grammar(body):
            return False
        if isinstance(body, CompletionRequest):
            return not isinstance(body.prompt, str) or len(body.prompt) <= INLINE_PREPARE_CHARS
        return sum(len(m.content) if isinstance(m.content, str) else
                   sum(len(p.text or "") for p in m.content or ()) for m in body.messages) <= INLINE_PREPARE_CHARS

    def _prepare(self, prepare: Callable, body) -> Prepared:
        prepared = prepare(body, self.codec, self.limits)
        # An engine on this side checks (and compiles) controls here; one in its own process
        # checks them as it admits the request (`_admit`).
        if prepared.request.controls is not None and self.worker.controls is not None:
            check_controls(self.worker.controls, prepared)
        return prepared

    async def _body(self, http: HttpRequest) -> bytes:
        limit = self.options.max_body_bytes
        declared = http.headers.get("content-length")
        too_big = ApiError(f"the request body exceeds this server's limit of {limit} bytes", code="body_too_large")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    async def _admit(self, prepared: Prepared):
        try:
            return await self.worker.admit(prepared.request)
        except Rejected as exc:
            raise controls_error(str(exc), prepared) from None
        except Overloaded as exc:
            raise ApiError(f"server busy: {exc}; retry later", status=429, kind="rate_limit_error",
                           code="server_busy", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineStopped as exc:
            raise ApiError(str(exc), status=503, kind="server_error") from None

    async def _generate(self, prepared: Prepared, queue, completion: Completion) -> AsyncIterator[Piece]:
        """The completion's text pieces; sets `completion`'s finish reason and token count
        before the last piece."""
        text = TextStream(self.codec, prepared.request.stop)
        controls = prepared.request.controls
        cursor = LogprobCursor(text) if controls is not None and controls.logprobs is not None else None

        def piece(part: str, last: bool) -> Piece:
            return Piece(part, None if cursor is None else cursor.take(part, last))

        while True:
            # Every event waiting becomes one piece: a stream the event loop fell behind on
            # catches up in one server-sent event instead of one per token, so the loop's cost
            # per iteration stops growing with the tokens it owes (the engine process posts a
            # batch per iteration whether or not the loop kept up).
            shown, reason = [], None
            for event in await _backlog(queue):
                if isinstance(event, BaseException):
                    raise EngineStopped(f"the engine failed: {event!r}")
                if isinstance(event, RequestOutput):
                    shown.append(text.finish())
                    reason = "stop" if text.stopped else event.finish_reason
                    break
                if cursor is not None:
                    cursor.add(event.logprobs)
                shown.append(text.push(event.tokens))
                if text.stopped:
                    self.worker.abort(prepared.request.id)  # the tokens still in flight are not wanted
                    reason = "stop"
                    break
            part = "".join(shown)
            if reason is None:
                if part:
                    yield piece(part, False)
                continue
            completion.finish_reason, completion.completion_tokens = reason, len(text.tokens)
            yield piece(part, True)
            return

    def _logprobs(self, entries: Optional[list[TokenEntry]], chat: bool) -> Optional[dict]:
        if entries is None:
            return None
        return (chat_logprobs if chat else completion_logprobs)(entries, self.token_strings)

    def _abandon(self, completion: Completion) -> None:
        """The answer ends here: a request that has not finished (the client left, or the
        handler was cancelled) is aborted."""
        if completion.finish_reason is None:
            self.worker.abort(completion.prepared.request.id)

    async def _events(self, pieces: AsyncIterator[Piece], completion: Completion, chat: bool) -> AsyncIterator[bytes]:
        """Server-sent events: a chunk per text piece, exactly one chunk with the finish reason,
        the usage chunk when asked for, then `[DONE]`."""
        prepared = completion.prepared
        head = self._head(prepared, chat, chunk=True)
        extra = {"usage": None} if prepared.include_usage else {}

        def event(piece: Piece, finish: Optional[str]) -> bytes:
            logprobs = self._logprobs(piece.logprobs, chat)
            if chat:
                delta = {"content": piece.text} if piece.text else {}
                choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece.text, "logprobs": logprobs, "finish_reason": finish}
            return b"data: " + _encode({**head, "choices": [choice], **extra}) + b"\n\n"

        try:
            if chat:
                yield b"data: " + _encode({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                                 "logprobs": None, "finish_reason": None}], **extra}) + b"\n\n"
            try:
                async for piece in pieces:
                    yield event(piece, completion.finish_reason)
            except EngineStopped as exc:
                yield b"data: " + _encode(ApiError(str(exc), status=503, kind="server_error").body()) + b"\n\n"
                yield b"data: [DONE]\n\n"
                return
        finally:
            self._abandon(completion)  # a client that went away mid-stream ends up here
        if prepared.include_usage:
            yield b"data: " + _encode({**head, "choices": [], "usage": completion.usage}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    def _head(self, prepared: Prepared, chat: bool, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {"id": ("chatcmpl-" if chat else "cmpl-") + prepared.request.id, "object": kind,
                "created": prepared.created, "model": self.options.model_name}


def _asks_grammar(body) -> bool:
    return any(getattr(body, name) is not None
               for name in ("response_format", "structured_outputs", "guided_regex", "guided_json"))


async def _backlog(queue: asyncio.Queue) -> list:
    """The next event, and every one queued behind it."""
    events = [await queue.get()]
    while not queue.empty():
        events.append(queue.get_nowait())
    return events


async def _join(pieces: AsyncIterator[Piece]) -> tuple[str, Optional[list[TokenEntry]]]:
    """The whole text, and every token's logprobs (None unless asked)."""
    got = [piece async for piece in pieces]
    entries = None if got[-1].logprobs is None else [e for piece in got for e in piece.logprobs]
    return "".join(piece.text for piece in got), entries


async def _disconnected(http: HttpRequest) -> None:
    """Returns when the client closes the connection (the body has been read, so the server
    hears nothing else from it before that)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _event_loop_and_parser() -> tuple[str, str]:
    """uvloop and httptools when installed (the `serve` extra brings both): the stdlib loop and
    h11's pure-Python parser cost the HTTP process several times more CPU per request and per
    streamed chunk, and that process's one core is what bounds the server's throughput."""
    def have(module: str) -> bool:
        return importlib.util.find_spec(module) is not None
    return ("uvloop" if have("uvloop") else "asyncio"), ("httptools" if have("httptools") else "h11")


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, which also stops its `peers` (the other API server processes) when it
    is told to stop, and stops when one of them fails."""

    def __init__(self, config: uvicorn.Config, peers):
        super().__init__(config)
        self.peers = peers
        self.peer_failure: Optional[str] = None

    def handle_exit(self, sig, frame) -> None:
        if self.peers is not None:
            self.peers.stop()
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.peers is not None and self.peer_failure is None:
            self.peer_failure = self.peers.failure()
            if self.peer_failure is not None:
                self.peers.stop()
                return True
        return await super().on_tick(counter)


def run_server(worker: EngineHandle, codec: TextCodec, options: ServerOptions, say: Callable[[str], None], *,
               sockets: Optional[list] = None, peers=None, index: int = 0,
               on_start: Optional[Callable[[], None]] = None) -> int:
    """Serve until SIGINT or SIGTERM; returns 0 after a clean shutdown. The worker's engine
    must be captured already, and is used from the engine side only from now on. `sockets`:
    listen on these instead of binding (options.host, options.port); `peers`: the other API
    server processes' supervision (`api_servers.Peers`), `index`: this one's number;
    `on_start`: called once the server handles its stop signals (a supervisor may send one
    from then on)."""
    server = OpenAIServer(worker, codec, options, index, on_start)
    loop, http = _event_loop_and_parser()
    # interface: uvicorn cannot tell that a bound coroutine method is an ASGI 3 app.
    config = uvicorn.Config(server.app, interface="asgi3", host=options.host, port=options.port, log_level="warning",
                            access_log=False, lifespan="on", timeout_graceful_shutdown=options.shutdown_grace_s,
                            loop=loop, http=http)
    uvicorn_server = _Uvicorn(config, peers)
    # A failed engine stops the server (uvicorn polls the flag): /health's 503 alone would keep
    # a dead server listening, its clients and its supervisor none the wiser.
    server.worker.on_failure = lambda: setattr(uvicorn_server, "should_exit", True)
    # uvicorn re-raises the signal that stopped it once it is done; these handlers take it, so a
    # requested shutdown ends with exit status 0 instead of the signal's default death.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    servers = "" if options.api_servers == 1 else f", {options.api_servers} API server processes"
    say(f"graphrelay serve: {options.model_name} on http://{options.host}:{options.port}/v1 "
        f"({worker.info.max_reqs} slots, {options.max_waiting} waiting at most{servers}; {loop} event loop, "
        f"{http} HTTP parser)")
    with frozen_startup_heap():
        uvicorn_server.run(sockets=sockets)
    statuses = [] if peers is None else peers.join()
    if server.worker.failure is not None:
        say(f"graphrelay serve: the engine failed: {server.worker.failure!r}")
        return 1
    if uvicorn_server.peer_failure is not None or any(statuses):
        say(f"graphrelay serve: {uvicorn_server.peer_failure or f'an API server process exited with {statuses}'}")
        return 1
    if not uvicorn_server.started:
        return 1  # uvicorn said why (the port is taken, say)
    stats = server.worker.stats
    # The engine thread's own view, to set beside the in-process loop's on the same load: a
    # CPU scheduling time per iteration that grows under HTTP load is the interpreter lock.
    say(f"graphrelay serve: shut down after {stats.requests} requests, {stats.tokens} tokens, {stats.iterations} "
        f"iterations; CPU scheduling per iteration: median {stats.cpu_sched_us_median:.1f} us, mean "
        f"{stats.cpu_sched_us_per_iter:.1f} us" + ("" if stats.gpu_idle_fraction is None else
                                                   f"; GPU idle {100 * stats.gpu_idle_fraction:.1f}%"))
    return 0
