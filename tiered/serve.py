"""``tiered serve``: an OpenAI-compatible HTTP server for a model loaded with :func:`tiered.load` (issue 26).

Endpoints (the subset of OpenAI's API that llama.cpp's server and vLLM serve; FastAPI on uvicorn, the ``serve``
extra: ``pip install 'tiered[serve]'``):

* ``GET /v1/models`` — the one model, named ``--model-name`` (default: the directory's name);
* ``POST /v1/chat/completions`` — ``messages`` through the tokenizer's chat template;
* ``POST /v1/completions`` — a ``prompt`` string (or a list of one string, or of token ids).

Fields: ``max_tokens`` (``max_completion_tokens``), ``temperature`` (0: greedy, the default is greedy too), ``top_p``,
``seed``, ``stop`` (a string or up to 4), ``stream`` (server-sent events, ``data: {chunk}`` lines then
``data: [DONE]``), ``stream_options.include_usage``, ``n`` (1 only). Answers carry ``finish_reason`` (``stop``: the
end-of-sequence token or a stop string, cut from the text as OpenAI does; ``length``: ``max_tokens``) and ``usage``
(prompt, completion and total tokens).

Scheduling: one generation at a time, first come first served (:class:`Server`'s lock; the model runs one pass at
a time anyway: its calls are serialised). Each generation runs on a worker thread; its tokens reach the request's
coroutine through a queue. A client that disconnects (streaming or not) stops its generation at the next token
(a ``StoppingCriteria``), which frees the model for the next request. Memory: the model's own bound plus each
queued request's token ids.

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a malformed body (bad JSON,
a missing or mistyped field, ``n`` > 1, a prompt plus ``max_tokens`` beyond the model's context:
``context_length_exceeded``), 404 for another model name, 413 for a body over ``max_body_bytes``.
"""

import asyncio
import collections
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Server", "create_app", "MAX_BODY_BYTES"]

#: largest request body accepted (bytes): 413 above it
MAX_BODY_BYTES = 1 << 20
#: ``max_tokens`` when a request gives none: what fits in the context after the prompt, at most this
DEFAULT_MAX_TOKENS = 512


class ApiError(Exception):
    """A request refused with OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Job:
    """One request's generation: its prompt ids and sampling, the queue its events go to, its cancel flag."""

    ids: list[int]
    max_tokens: int
    temperature: float | None
    top_p: float | None
    seed: int | None
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)


def _field(body: dict, name: str, types: tuple, default: Any = None, *, low: float | None = None,
           high: float | None = None) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, types):
        raise ApiError(400, f"'{name}' must be {' or '.join(t.__name__ for t in types)}, got {json.dumps(v)[:80]}",
                       param=name)
    if low is not None and v < low or high is not None and v > high:
        raise ApiError(400, f"'{name}' must be between {low} and {high}, got {v}", param=name)
    return v


class Server:
    """The model, its tokenizer and the one-at-a-time scheduler behind :func:`create_app`.

    Args:
        model: a causal LM from :func:`tiered.load` (any ``generate``-capable model works).
        tokenizer: its tokenizer (the chat template for ``/v1/chat/completions``).
        name: the model's name in ``/v1/models`` and in answers.
        max_body_bytes: request bodies above it get 413.
    """

    def __init__(self, model: Any, tokenizer: Any, name: str, *, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.model, self.tok, self.name = model, tokenizer, name
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        cfg = getattr(model, "config", None)
        self.context = int(getattr(cfg, "max_position_embeddings", 0) or 0) or None
        self.lock = threading.Lock()  # one generation at a time (FIFO enough: a worker thread per queued request)
        import torch

        #: torch's CPU threads where the server was made (after ``tiered.load`` applied ``compute_threads``), set
        #: again on each generation's worker thread: the matmul library keeps its count per thread, so a worker
        #: left alone runs with the default count (fp32 sums then differ from the loading thread's, and on few cores
        #: the compute threads oversubscribe the readers; measured on the 2-core machine, twenty-third session)
        self.compute_threads = torch.get_num_threads()
        self.eos = self._eos_ids()
        #: the last generations, newest last: (tokens generated, stopped early by its request: the client left or
        #: a stop string was seen) — for logs and tests
        self.history: collections.deque[tuple[int, bool]] = collections.deque(maxlen=64)

    def _eos_ids(self) -> set[int]:
        gc = getattr(self.model, "generation_config", None)
        e = getattr(gc, "eos_token_id", None)
        if e is None:
            e = getattr(self.tok, "eos_token_id", None)
        return set(e if isinstance(e, list) else [e]) - {None}

    # ------------------------------------------------------------------ parsing
    def parse(self, body: Any, chat: bool, loop: asyncio.AbstractEventLoop) -> tuple[Job, bool, bool]:
        """A validated job from a request body; (job, stream, include_usage). Raises :class:`ApiError`."""
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.name:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves '{self.name}'",
                           param="model", code="model_not_found")
        n = _field(body, "n", (int,), 1, low=1)
        if n != 1:
            raise ApiError(400, "'n' > 1 is not supported: one choice per request", param="n")
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise ApiError(400, "'messages' must be a non-empty list of {'role': ..., 'content': ...}",
                               param="messages")
            turns = [{"role": m["role"], "content": _content(m, k)} for k, m in enumerate(msgs)
                     if _content(m, k) is not None or m.get("role") != "assistant"]
            if getattr(self.tok, "chat_template", None) is None:
                raise ApiError(400, f"'{self.name}' has no chat template; use /v1/completions", param="messages")
            ids = self.tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
        else:
            p = body.get("prompt")
            if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
                p = p[0]
            if isinstance(p, str):
                ids = self.tok(p)["input_ids"]
            elif isinstance(p, list) and p and all(isinstance(i, int) and not isinstance(i, bool) for i in p):
                ids = list(p)
            else:
                raise ApiError(400, "'prompt' must be a string, a list of one string, or a list of token ids",
                               param="prompt")
            vocab = int(getattr(getattr(self.model, "config", None), "vocab_size", 0) or 0)
            if vocab and any(not 0 <= i < vocab for i in ids):
                raise ApiError(400, f"'prompt' holds token ids outside [0, {vocab})", param="prompt")
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        mt = _field(body, "max_completion_tokens", (int,), None, low=1)
        mt = _field(body, "max_tokens", (int,), mt, low=1)
        room = self.context - len(ids) if self.context else None
        if room is not None and room < 1 or mt is not None and room is not None and mt > room:
            raise ApiError(400, f"This model's maximum context length is {self.context} tokens; the prompt has "
                           f"{len(ids)} and max_tokens asks for {mt if mt is not None else 'at least 1'}",
                           param="max_tokens" if mt is not None else "messages" if chat else "prompt",
                           code="context_length_exceeded")
        if mt is None:
            mt = min(DEFAULT_MAX_TOKENS, room) if room is not None else DEFAULT_MAX_TOKENS
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop
        if stop is None:
            stop = []
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 of them", param="stop")
        temperature = _field(body, "temperature", (int, float), None, low=0, high=2)
        top_p = _field(body, "top_p", (int, float), None, low=0, high=1)
        seed = _field(body, "seed", (int,), None, low=-(2**63), high=2**64 - 1)  # torch.manual_seed's range
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise ApiError(400, f"'stream' must be true or false, got {json.dumps(stream)[:80]}", param="stream")
        so = body.get("stream_options") or {}
        if not isinstance(so, dict):
            raise ApiError(400, "'stream_options' must be an object", param="stream_options")
        job = Job(ids, mt, float(temperature) if temperature is not None else None,
                  float(top_p) if top_p is not None else None, seed, stop, loop)
        return job, bool(stream), bool(so.get("include_usage"))

    # ------------------------------------------------------------------ generating (worker thread)
    def start(self, job: Job) -> threading.Thread:
        """Run ``job`` on a worker thread, after the generations queued before it. Its events on ``job.events``:
        ``("token", id)`` per new token, then ``("end", None)`` or ``("error", exc)``."""
        t = threading.Thread(target=self._run, args=(job,), name="tiered-serve-gen", daemon=True)
        t.start()
        return t

    def _run(self, job: Job) -> None:
        server = self

        def emit(kind: str, value: Any) -> None:
            job.loop.call_soon_threadsafe(job.events.put_nowait, (kind, value))

        try:
            with self.lock:
                if job.cancel.is_set():
                    emit("end", None)
                    return
                import torch
                from transformers import StoppingCriteria, StoppingCriteriaList

                torch.set_num_threads(self.compute_threads)  # this thread's matmuls as the loading thread's

                class _Cancel(StoppingCriteria):
                    def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
                        return torch.full((input_ids.shape[0],), job.cancel.is_set(), dtype=torch.bool,
                                          device=input_ids.device)

                class _Out:
                    def __init__(self) -> None:
                        self.first, self.n, self.new = True, 0, []

                    def put(self, value: Any) -> None:
                        if self.first:  # generate() hands the prompt first
                            self.first = False
                            return
                        for i in value.reshape(-1).tolist():
                            self.n += 1
                            self.new.append(int(i))
                            emit("token", int(i))
                        # stop strings are matched in the completion's text only (as OpenAI's): the generation
                        # stops at the token that completes one (the request cuts the text there)
                        if job.stop and _cut(server.text(self.new), job.stop)[1]:
                            job.cancel.set()

                    def end(self) -> None:
                        pass

                dev = self.model.device
                ids = torch.tensor([job.ids], device=dev)
                out = _Out()
                kw: dict[str, Any] = {"max_new_tokens": job.max_tokens, "streamer": out,
                                      "stopping_criteria": StoppingCriteriaList([_Cancel()]),
                                      "attention_mask": torch.ones_like(ids)}
                if job.temperature:  # > 0: sample; 0 or absent: greedy
                    kw.update(do_sample=True, temperature=job.temperature)
                    if job.top_p is not None:
                        kw["top_p"] = job.top_p
                else:
                    kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
                pad = getattr(self.tok, "pad_token_id", None)
                kw["pad_token_id"] = pad if pad is not None else next(iter(self.eos), 0)
                if job.seed is not None:
                    torch.manual_seed(job.seed)
                with torch.no_grad():
                    self.model.generate(ids, **kw)
                self.history.append((out.n, job.cancel.is_set()))
            emit("end", None)
        except BaseException as e:  # noqa: BLE001 - reported to the request
            emit("error", e)

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def _content(m: Any, k: int) -> str | None:
    """A chat message's text: a string, or OpenAI's list of parts whose ``text`` parts are joined; ``None`` (an
    assistant turn that only called tools) stays None. Raises :class:`ApiError` for anything else."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ApiError(400, f"messages[{k}] must be an object with a 'role' string", param=f"messages[{k}]")
    c = m.get("content")
    if isinstance(c, str) or (c is None and m["role"] == "assistant"):
        return c
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   for p in c):
        return "".join(p["text"] for p in c)
    raise ApiError(400, f"messages[{k}].content must be a string or a list of text parts "
                        "([{'type': 'text', 'text': ...}]); this server reads text only", param=f"messages[{k}].content")


def _cut(text: str, stop: list[str]) -> tuple[str, bool]:
    """``text`` up to the first stop string (excluded), and whether one was found."""
    at = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:at], True) if at >= 0 else (text, False)


def create_app(server: Server) -> Any:
    """The FastAPI application serving ``server`` (see the module docstring). (This module has no ``from __future__
    import annotations``: FastAPI reads the handlers' ``Request`` annotation, a name local to this function.)"""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="tiered", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(ApiError(400, str(e)).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:  # 404 route, 405 method...
        return JSONResponse(ApiError(e.status_code, str(e.detail), type_="invalid_request_error").body(),
                            status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse(ApiError(500, f"{type(e).__name__}: {e}", type_="server_error").body(), status_code=500)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": server.created,
                                            "owned_by": "tiered"}]}

    async def body_of(request: Request) -> Any:
        n = request.headers.get("content-length")
        if n is not None and n.isdigit() and int(n) > server.max_body_bytes:
            raise ApiError(413, f"the request body is {n} bytes; at most {server.max_body_bytes} are accepted")
        raw = b""
        async for part in request.stream():
            raw += part
            if len(raw) > server.max_body_bytes:
                raise ApiError(413, f"the request body is over {server.max_body_bytes} bytes")
        try:
            return json.loads(raw)
        except ValueError as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None

    async def complete(request: Request, chat: bool) -> Any:
        job, stream, include_usage = server.parse(await body_of(request), chat, asyncio.get_running_loop())
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"
        created = int(time.time())
        server.start(job)
        usage = lambda n: {"prompt_tokens": len(job.ids), "completion_tokens": n,  # noqa: E731
                           "total_tokens": len(job.ids) + n}
        hold = max((len(s) for s in job.stop), default=1) - 1  # text that could still start a stop string

        def finish_reason(new: list[int], stopped: bool) -> str:
            if stopped or (new and new[-1] in server.eos):
                return "stop"
            return "length" if len(new) >= job.max_tokens else "stop"

        if not stream:
            new: list[int] = []

            async def watch() -> None:  # the client left: its generation stops at the next token
                while not job.cancel.is_set():
                    if await request.is_disconnected():
                        job.cancel.set()
                        return
                    await asyncio.sleep(0.2)

            watcher = asyncio.create_task(watch())
            try:
                while True:
                    kind, v = await job.events.get()
                    if kind == "token":
                        new.append(v)
                    elif kind == "error":
                        raise ApiError(500, f"generation failed: {type(v).__name__}: {v}", type_="server_error")
                    else:
                        break
            finally:
                job.cancel.set()
                watcher.cancel()
            text, stopped = _cut(server.text(new), job.stop)
            fr = finish_reason(new, stopped)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": fr}
                      if chat else {"index": 0, "text": text, "finish_reason": fr, "logprobs": None})
            return {"id": rid, "object": obj, "created": created, "model": server.name, "choices": [choice],
                    "usage": usage(len(new))}

        obj_chunk = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, fr: str | None, first: bool = False) -> str:
            if chat:
                d: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
                if delta:
                    d["content"] = delta
                c = {"index": 0, "delta": d, "finish_reason": fr}
            else:
                c = {"index": 0, "text": delta or "", "finish_reason": fr, "logprobs": None}
            return "data: " + json.dumps({"id": rid, "object": obj_chunk, "created": created, "model": server.name,
                                          "choices": [c]}) + "\n\n"

        async def events() -> AsyncIterator[str]:
            new: list[int] = []
            sent = 0
            stopped = False
            try:
                if chat:
                    yield chunk(None, None, first=True)
                while True:
                    kind, v = await job.events.get()
                    if kind == "error":
                        yield "data: " + json.dumps(ApiError(500, f"generation failed: {type(v).__name__}: {v}",
                                                             type_="server_error").body()) + "\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    done = kind == "end"
                    if not done:
                        new.append(v)
                    text = server.text(new)
                    if not done:  # a multi-byte character not finished yet: nothing of it goes out
                        text = text.rstrip("\ufffd")
                    cut, stopped = _cut(text, job.stop)
                    if stopped:
                        job.cancel.set()
                    safe = len(cut) if (done or stopped) else max(sent, len(cut) - hold)
                    if safe > sent:
                        yield chunk(cut[sent:safe], None)
                        sent = safe
                    if done:
                        break
                yield chunk(None, finish_reason(new, stopped))
                if include_usage:
                    yield "data: " + json.dumps({"id": rid, "object": obj_chunk, "created": created,
                                                 "model": server.name, "choices": [], "usage": usage(len(new))}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                job.cancel.set()  # a client gone mid-stream: its generation stops at the next token

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await complete(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await complete(request, False)

    return app


def run(server: Server, host: str, port: int) -> None:
    """Serve until interrupted (uvicorn, one process)."""
    import uvicorn

    uvicorn.run(create_app(server), host=host, port=port, log_level="info")
