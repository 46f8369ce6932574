"""The HTTP side (Starlette under uvicorn, on rank 0): OpenAI's endpoints, /health, /metrics, /tokenize and
/detokenize. Each request becomes one `Request` per prompt in the scheduler; its tokens come back from the engine
loop's thread through an asyncio queue. A client that goes away cancels its sequences at the next step."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from moe.chat.template import NoChatTemplate, end_of_turn_id, text_content
from moe.generation.loop import prompt_batch
from moe.generation.params import SEED_LIMIT, kept_length, prepared
from moe.serve import protocol
from moe.serve.protocol import ApiError, log
from moe.serve.reasoning import ReasoningSplit
from moe.serve.scheduler import QueueFull, Request, Scheduler
from moe.tokenizer import Tokenizer


@dataclass
class ServerState:
    served: str
    max_model_len: int
    max_body_bytes: int
    api_key: str | None = None
    scheduler: Scheduler | None = None  # set once the model is loaded
    tokenizer: Tokenizer | None = None
    vocab_size: int = 0
    defaults: dict = field(default_factory=dict)  # sampling values a request leaves out: generation_config.json's
    template_kwargs: dict = field(default_factory=dict)  # the chat template's switches a request leaves out
    reasoning_parser: str | None = None  # chat answers' <think> part apart (`moe.serve.reasoning`)
    dead: str = ""
    created: int = field(default_factory=lambda: int(time.time()))


class OpenAIServer:
    """The endpoints, over the state the serving process shares with its engine loop."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def app(self) -> Starlette:
        def authorized(endpoint):
            async def wrapped(request: HttpRequest) -> Response:
                try:
                    self.check_key(request)
                    if self.state.dead:
                        raise ApiError(503, self.state.dead, kind="ServiceUnavailable")
                    return await endpoint(request)
                except ApiError as e:
                    return JSONResponse(e.body(), e.status, headers=e.headers)
                except Exception as e:  # a bug: said as one, in OpenAI's shape
                    log.exception("internal error")
                    failure = ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="InternalServerError")
                    return JSONResponse(failure.body(), 500)
            return wrapped

        return Starlette(routes=[
            Route("/health", self.health), Route("/metrics", self.metrics),
            Route("/v1/models", authorized(self.models)),
            Route("/tokenize", authorized(self.tokenize), methods=["POST"]),
            Route("/detokenize", authorized(self.detokenize), methods=["POST"]),
            Route("/v1/completions", authorized(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", authorized(self.chat), methods=["POST"])])

    async def health(self, _: HttpRequest) -> Response:
        if self.state.dead:
            return JSONResponse({"status": "dead", "error": self.state.dead}, 503)
        if self.state.scheduler is None:
            return JSONResponse({"status": "loading"}, 503)
        return JSONResponse({"status": "ok"})

    async def models(self, _: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.state.served, "object": "model", "created": self.state.created, "owned_by": "moe-shard",
             "max_model_len": self.state.max_model_len}]})

    async def metrics(self, _: HttpRequest) -> Response:
        text = self.state.scheduler.metrics.text() if self.state.scheduler is not None else ""
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def tokenize(self, request: HttpRequest) -> Response:
        body = protocol.check_fields(await self.read_json(request), "tokenize", self.state.served)
        if "messages" in body:
            ids = self.chat_ids(body)
        elif isinstance(body.get("prompt"), str):
            ids = self.state.tokenizer.encode(body["prompt"], bos=body.get("add_special_tokens", True))
        else:
            raise ApiError(400, "give 'prompt' (a string) or 'messages'", "prompt")
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.state.max_model_len})

    async def detokenize(self, request: HttpRequest) -> Response:
        body = protocol.check_fields(await self.read_json(request), "detokenize", self.state.served)
        return JSONResponse({"prompt": self.state.tokenizer.decode(self.token_ids(body.get("tokens"), "tokens"))})

    async def completions(self, request: HttpRequest) -> Response:
        body = protocol.check_fields(await self.read_json(request), "completions", self.state.served)
        prompts, texts = self.kept(body, *self.prompts_of(body.get("prompt")))
        echo = None
        if body.get("echo") is True:  # the prompt's text before the answer: as given, or token ids' text
            echo = texts or [self.state.tokenizer.decode(ids) for ids in prompts]
        return await self.run(request, "completions", body, prompts, None, echo)

    async def chat(self, request: HttpRequest) -> Response:
        body = protocol.check_fields(await self.read_json(request), "chat", self.state.served)
        try:
            template = self.state.tokenizer.chat_template()
        except NoChatTemplate as e:
            raise ApiError(400, str(e), "messages") from None
        turn_end = end_of_turn_id(self.state.tokenizer, template)
        return await self.run(request, "chat", body, self.kept(body, [self.chat_ids(body)], None)[0], turn_end)

    def chat_ids(self, body: dict) -> list[int]:
        switches = protocol.template_kwargs(body, self.state.template_kwargs)
        opens, goes_on = protocol.generation_prompt(body)
        try:
            messages = text_content(body.get("messages"), self.state.tokenizer.chat_template())
            return self.state.tokenizer.apply_chat_template(messages, add_generation_prompt=opens, return_dict=False,
                                                            continue_final_message=goes_on, **switches)
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None

    def kept(self, body: dict, prompts: list[list[int]], texts: list[str] | None
             ) -> tuple[list[list[int]], list[str] | None]:
        """vLLM's `truncate_prompt_tokens`: each prompt's last tokens only (an echo is then their text)."""
        try:
            keep = kept_length(body.get("truncate_prompt_tokens"), self.state.max_model_len)
        except ValueError as e:
            raise ApiError(400, str(e), "truncate_prompt_tokens") from None
        if keep is None or all(len(p) <= keep for p in prompts):
            return prompts, texts
        return [p[-keep:] for p in prompts], None

    def prompts_of(self, prompt: object) -> tuple[list[list[int]], list[str] | None]:
        """The prompts' ids, and their texts where they came as text."""
        try:
            prompts, is_text = prompt_batch(prompt)  # the forms `generate` takes
        except TypeError as e:
            raise ApiError(400, str(e), "prompt") from None
        if not prompts:
            raise ApiError(400, "prompt must be a string, a list of strings, or (lists of) token ids", "prompt")
        if is_text:
            return [self.state.tokenizer.encode(p) for p in prompts], prompts
        return [self.token_ids(p, "prompt") for p in prompts], None

    def token_ids(self, value: object, param: str) -> list[int]:
        if not isinstance(value, list) or not value or not all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in value):
            raise ApiError(400, f"{param} must be a string, a list of strings, or (lists of) token ids", param)
        bad = [t for t in value if not 0 <= t < self.state.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (size {self.state.vocab_size})", param)
        return value

    async def run(self, request: HttpRequest, kind: str, body: dict, prompts: list[list[int]], turn_end,
                  echo: list[str] | None = None) -> Response:
        if self.state.scheduler is None:
            raise ApiError(503, "the model is still loading", kind="ServiceUnavailable", headers={"Retry-After": "5"})
        if not all(prompts):  # an empty text where the tokenizer adds no BOS: nothing for the model to continue
            raise ApiError(400, "the prompt is empty: it has no tokens", "messages" if kind == "chat" else "prompt")
        parsed = [protocol.sampling(body, kind, len(p), self.state.max_model_len, turn_end, self.state.defaults)
                  for p in prompts]
        try:  # as `generate` readies them: bad words as token ids, ids against the vocabulary, grammars compiled
            _, ready = prepared(prompts, [p.params for p in parsed], self.state.vocab_size, self.state.max_model_len,
                                self.state.tokenizer)
        except ValueError as e:
            given = [k for k in protocol.STRUCTURED if body.get(k) is not None]  # the request's name for a structure
            field = given[0] if given and str(e).startswith("structured") else str(e).split()[0]  # as the message says
            raise ApiError(400, str(e), field) from None
        for p, params in zip(parsed, ready, strict=True):
            p.params = params
        scheduler = self.state.scheduler
        n = protocol.choices_per_prompt(body, len(prompts), scheduler.max_num_seqs + scheduler.max_queue)
        # choice i*n + j: prompt i's j-th sequence, seeded apart (seed + j), as OpenAI orders choices
        rows = [(prompt, dataclasses.replace(p.params, seed=(p.params.seed + j) % SEED_LIMIT))
                for prompt, p in zip(prompts, parsed, strict=True) for j in range(n)]
        quiet = turn_end if turn_end not in (body.get("stop_token_ids") or []) else None
        loop, events, submitted = asyncio.get_running_loop(), asyncio.Queue(), []
        try:  # every sequence's events reach this request's one queue, with its choice's index
            for i, (prompt, params) in enumerate(rows):
                sink = functools.partial(post, loop, events, i)
                submitted.append(scheduler.submit(Request(prompt, params, sink, quiet_stop=quiet,
                                                          score_only=parsed[0].score_only)))
        except QueueFull as e:
            for r in submitted:
                scheduler.cancel(r)
            raise ApiError(503, str(e), kind="ServiceUnavailable", headers={"Retry-After": "1"}) from None
        rid, prompt_tokens = protocol.new_id(kind), sum(map(len, prompts))  # a prompt counts once, whatever n
        echoes = [echo[i // n] for i in range(len(rows))] if echo is not None else None  # per choice
        if parsed[0].stream:
            return StreamingResponse(self.stream(kind, rid, submitted, events, parsed[0].include_usage, prompt_tokens,
                                                 echoes), media_type="text/event-stream")
        return await self.whole(request, kind, rid, submitted, events, prompt_tokens, echoes)

    async def whole(self, request, kind, rid, submitted, events: asyncio.Queue, prompt_tokens: int,
                    echoes: list[str] | None) -> Response:
        pieces, entries, outs = [[e] for e in echoes or [""] * len(submitted)], [[] for _ in submitted], \
            [None] * len(submitted)
        try:
            while any(out is None for out in outs):
                i, event = await next_event(request, events)
                if event[0] == "prompt":  # an echoed prompt's log-probabilities come first
                    entries[i] = protocol.prompt_entries(submitted[i].prompt, event[1])
                elif event[0] == "token":
                    pieces[i].append(event[2])
                    if event[3] is not None:
                        entries[i].append((event[1], *event[3]))
                elif event[0] == "end":
                    outs[i] = event[1]
                else:
                    status = event[2] if len(event) > 2 else 503
                    kind_of = "InternalServerError" if status == 500 else "ServiceUnavailable"
                    raise ApiError(status, event[1], kind=kind_of)
        finally:
            for req in submitted:
                self.state.scheduler.cancel(req)  # a no-op for finished ones; frees the rest if the client went away
        choices = [protocol.choice(kind, i, *self.parts(kind, submitted[i], "".join(pieces[i])), out,
                                   self.logprobs(kind, entries[i] if out.logprobs is not None else None), delta=False)
                   for i, out in enumerate(outs)]
        use = protocol.usage(prompt_tokens, sum(len(out.tokens) for out in outs))
        return JSONResponse(protocol.envelope(kind, rid, self.state.served, choices, False, use))

    async def stream(self, kind, rid, submitted, events: asyncio.Queue, include_usage, prompt_tokens: int,
                     echoes: list[str] | None):
        open_rows, completion = len(submitted), 0
        splits = [self.splitter(kind, req) for req in submitted]
        try:
            for i in range(len(submitted)) if kind == "chat" else ():  # each choice's role first, as vLLM sends it
                first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                yield sse(protocol.envelope(kind, rid, self.state.served, [first], True))
            for i, text in enumerate(echoes or ()):  # an echoed prompt first (with log-probabilities: once they come)
                if submitted[i].params.prompt_logprobs is None:
                    yield sse(protocol.envelope(kind, rid, self.state.served,
                                                [protocol.choice(kind, i, text, None, None, None, delta=True)],
                                                True))
            while open_rows:
                i, event = await events.get()
                if event[0] == "prompt":
                    scores = self.logprobs(kind, protocol.prompt_entries(submitted[i].prompt, event[1]))
                    part = protocol.choice(kind, i, echoes[i], None, None, scores, delta=True)
                    yield sse(protocol.envelope(kind, rid, self.state.served, [part], True))
                elif event[0] == "token":
                    completion += event[1] is not None
                    entries = [(event[1], *event[3])] if event[3] is not None else None
                    text, thought = (event[2], None) if splits[i] is None else splits[i].feed(event[2])[::-1]
                    if text or thought or entries:
                        part = protocol.choice(kind, i, text, thought, None, self.logprobs(kind, entries), delta=True)
                        yield sse(protocol.envelope(kind, rid, self.state.served, [part], True))
                elif event[0] == "end":
                    open_rows -= 1
                    text, thought = ("", None) if splits[i] is None else splits[i].finish()[::-1]
                    part = protocol.choice(kind, i, text, thought, event[1], None, delta=True)
                    yield sse(protocol.envelope(kind, rid, self.state.served, [part], True))
                else:
                    status = event[2] if len(event) > 2 else 503
                    yield sse(ApiError(status, event[1], kind="ServiceUnavailable").body())
                    open_rows -= 1
            if include_usage:
                use = protocol.usage(prompt_tokens, completion)
                yield sse(protocol.envelope(kind, rid, self.state.served, [], True, use))
            yield "data: [DONE]\n\n"
        finally:  # finished, or the client went away: its sequences leave at the next step
            for req in submitted:
                self.state.scheduler.cancel(req)

    def splitter(self, kind: str, request: Request) -> ReasoningSplit | None:
        """A chat answer's reasoning apart from its content, where the server was asked to (`--reasoning-parser`)."""
        if kind != "chat" or self.state.reasoning_parser is None:
            return None
        return ReasoningSplit(self.state.reasoning_parser, self.state.tokenizer.decode(request.prompt))

    def parts(self, kind: str, request: Request, text: str) -> tuple[str | None, str | None]:
        """A whole answer's (content, reasoning)."""
        split = self.splitter(kind, request)
        return (text, None) if split is None else split.whole(text)[::-1]

    def logprobs(self, kind: str, entries):
        return protocol.logprobs_object(kind, entries, self.state.tokenizer.token_text)

    async def read_json(self, request: HttpRequest) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.state.max_body_bytes:
            raise ApiError(413, f"the request body is over {self.state.max_body_bytes} bytes")
        raw = await request.body()
        if len(raw) > self.state.max_body_bytes:
            raise ApiError(413, f"the request body is over {self.state.max_body_bytes} bytes")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not JSON ({e})") from None

    def check_key(self, request: HttpRequest) -> None:
        if self.state.api_key and request.headers.get("authorization") != f"Bearer {self.state.api_key}":
            raise ApiError(401, "a valid API key is required (Authorization: Bearer KEY)", kind="AuthenticationError")


def post(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, index: int, event: tuple) -> None:
    """A request's sink, called on the engine loop's thread: the event to the HTTP thread's queue."""
    loop.call_soon_threadsafe(events.put_nowait, (index, event))


async def next_event(request: HttpRequest, events: asyncio.Queue):
    """The next (prompt index, event) of a whole (not streamed) answer; a client gone away ends it."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), 0.5)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                raise ApiError(499, "the client went away") from None


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
