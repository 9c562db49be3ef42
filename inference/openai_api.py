"""The HTTP side of serve.py: an OpenAI-compatible API on FastAPI over the batching Engine.

Endpoints: `GET /health`, `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`, and the
tokenizer's `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info` (the shapes vLLM uses, which
lm-evaluation-harness's `local-completions` finds and then tokenizes with: no tokenizer file needed on its side).

Each completion (a prompt times `n`) is one batching.Sequence. Its tokens arrive from the engine's thread
as they are generated; here they become text (the whole completion decoded again each time, so that a
character split across tokens comes out whole), stop strings are searched in it (the completion ends where
one begins, the stop string left out, its slot freed), and a stream sends what is certain so far (text that
could still be the start of a stop string, or an unfinished character, waits). Replies and stream chunks are
shaped as the `openai` package's Completion, ChatCompletion and ChatCompletionChunk; every error is
`{"error": {"message", "type", "param", "code"}}` with its HTTP status, never a 500 for bad input.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import time
from typing import Any, Literal, Optional, Union

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr
from starlette.exceptions import HTTPException as StarletteHTTPException

from core import chat
from inference.batching import TOP_MAX, Engine, Sequence
from core.chat import PLAIN_STOP, plain_template

MAX_N = 128  # the most completions one request may ask for (prompts x n)
MAX_STOPS = 4  # stop strings a request may give (OpenAI's limit)
SEED_RANGE = (-2**63, 2**63)


class APIError(Exception):
    """A request refused: its HTTP status and the OpenAI error body's fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def error_response(status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


# ----------------------------------------------------------------------------------------------
# Requests: the fields of OpenAI's API this server takes (others are ignored, as OpenAI's clients send some)


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[StrictStr] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Optional[StrictInt] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    seed: Optional[StrictInt] = None
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[StrictStr] = None


class CompletionRequest(Sampling):
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    max_tokens: Optional[StrictInt] = None
    logprobs: Optional[StrictInt] = None
    echo: Optional[StrictBool] = False
    best_of: Optional[StrictInt] = None
    suffix: Optional[StrictStr] = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: StrictStr
    content: Optional[Union[StrictStr, list[TextPart]]] = None


class ChatRequest(Sampling):
    messages: list[Message]
    max_tokens: Optional[StrictInt] = None
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    prompt: Optional[StrictStr] = None
    messages: Optional[list[Message]] = None
    add_special_tokens: StrictBool = False
    model: Optional[StrictStr] = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tokens: list[StrictInt]
    model: Optional[StrictStr] = None


# ----------------------------------------------------------------------------------------------
# Chat templates


ROLES = ("system", "developer", "user", "assistant")


def message_text(message: Message, index: int) -> str:
    if message.role not in ROLES:
        raise APIError(400, f"messages[{index}].role {message.role!r} is not one of {', '.join(ROLES)}",
                       f"messages[{index}].role")
    if message.content is None:
        return ""
    text = message.content if isinstance(message.content, str) else "".join(part.text for part in message.content)
    return valid_text(text, f"messages[{index}].content")


def valid_text(text: str, param: str) -> str:
    """The text, or a 400 when it is not Unicode the tokenizer can take (a lone surrogate, as JSON's "\\ud800")."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param}: not valid Unicode text ({e.reason} at character {e.start})", param) from None
    return text


def compile_template(source: str):
    """A transformers chat template (Jinja) made ready to render, in Jinja's sandbox as transformers does."""
    def raise_exception(message):
        raise APIError(400, f"the chat template refused the messages: {message}", "messages")

    return chat.compile_template(source, raise_exception)


# ----------------------------------------------------------------------------------------------
# One completion on its way: tokens in, text and logprobs out


def pairs(ids, lps) -> list[tuple[int, float]]:
    """A token's alternatives from the engine's arrays: [(id, logprob), ...], most likely first."""
    return [(int(i), float(lp)) for i, lp in zip(ids, lps)]


def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's characters (GPT-2's scheme) to the bytes they stand for: the printable bytes stand for
    themselves, every other byte for the character 256 + its rank among them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + k): b for k, b in enumerate(others)}}


BYTE_OF_CHAR = byte_level_alphabet()


class Choice:
    """A Sequence's events turned into its text: `update` takes the tokens that arrived and returns the new
    text that is certain (and the logprobs of the tokens it released); `finish` ends it."""

    def __init__(self, server: "Server", seq: Sequence, index: int, stops: list[str], logprobs: int | None,
                 echo_ids: list[int] | None):
        self.server, self.seq, self.index, self.stops, self.want = server, seq, index, stops, logprobs
        self.ids: list[int] = []
        self.lps: list[float | None] = []
        self.tops: list[list | None] = []  # each token's alternatives, [(id, logprob), ...] most likely first
        self.offsets: list[int] = []  # each generated token's end in the text (with logprobs only)
        self.text = ""  # the completion's text so far, up to any stop string
        self.sent = 0  # characters of text already handed out
        self.released = 0  # tokens whose logprobs were handed out
        self.finish_reason: str | None = None
        self.cut = False  # whether a stop string ended it
        self.error: str | None = None
        self.prefix = server.decode(echo_ids, special=True) if echo_ids is not None else ""  # the prompt as sent
        self.echo_ids = echo_ids
        self.prompt_lps: list | None = None

    def on(self, event: tuple) -> None:
        kind = event[0]
        if kind == "prompt":
            _, lps, top_ids, top_lps = event
            self.prompt_lps = [None if np.isnan(x) else float(x) for x in lps]
            self.prompt_tops = [None if i == 0 else pairs(top_ids[i], top_lps[i])
                                for i in range(len(lps))] if self.want is not None else None
        elif kind == "tokens":
            _, ids, lps, top_ids, top_lps = event
            if self.finish_reason is not None:
                return  # tokens generated past a stop string, before the engine freed the slot
            for j, token in enumerate(ids):
                self.ids.append(token)
                self.lps.append(lps[j])
                self.tops.append(pairs(top_ids[j], top_lps[j]) if self.want is not None else None)
                if self.want is not None:
                    self.offsets.append(len(self.server.decode(self.ids)))
            self.text = self.server.decode(self.ids)
            self._find_stop()
        elif kind == "end":
            if self.finish_reason is None:
                self.finish_reason = event[1]
        elif kind == "error":
            self.error = event[1]

    def _find_stop(self) -> None:
        found = [(at, len(s)) for at, s in ((self.text.find(s, max(0, self.sent - len(s))), s) for s in self.stops)
                 if at >= 0]
        if found:
            at, length = min(found)
            # the completion's tokens are those generated until the stop string was whole (what `usage` counts):
            # the rest of the engine's chunk came after its end
            whole = next(k for k in range(1, len(self.ids) + 1) if len(self.server.decode(self.ids[:k])) >= at + length)
            for kept in (self.ids, self.lps, self.tops, self.offsets):
                del kept[whole:]
            self.text = self.text[:at]
            self.finish_reason, self.cut = "stop", True
            self.server.engine.cancel(self.seq)

    def certain(self) -> int:
        """How many characters of the text can be sent: all once finished; else all but an unfinished
        character and what could still begin a stop string."""
        if self.finish_reason is not None:
            return len(self.text)
        end = len(self.text)
        while end > self.sent and self.text[end - 1] == "\ufffd":
            end -= 1
        for stop in self.stops:
            for k in range(min(len(stop) - 1, end - self.sent), 0, -1):
                if self.text[:end].endswith(stop[:k]):
                    end -= k
                    break
        return max(end, self.sent)

    @property
    def ended(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def take(self) -> tuple[str, int]:
        """(the new certain text, how many more tokens' logprobs it releases) since the last take: the tokens
        whose text has all been sent, and once finished every token that begins within the text."""
        end = self.certain()
        delta = self.text[self.sent:end]
        self.sent = end
        if self.want is None:
            return delta, 0
        if self.cut:  # a stop string ended it: the tokens up to the one it begins in
            tokens = sum(1 for i in range(len(self.ids)) if (self.offsets[i - 1] if i else 0) < len(self.text))
        elif self.finish_reason is not None:
            tokens = len(self.ids)
        else:
            tokens = sum(1 for o in self.offsets if o <= end)
        first, self.released = self.released, max(self.released, tokens)
        return delta, self.released - first

    def completion_logprobs(self, first: int, count: int, with_prompt: bool) -> dict | None:
        """The completions API's logprobs of generated tokens first..first+count (and the prompt's first)."""
        if self.want is None:
            return None
        tokens, lps, tops, offsets = [], [], [], []
        server = self.server
        if with_prompt and self.echo_ids is not None:
            # each prompt token's offset: the length of the prompt's text before it (as `prefix` decodes it)
            before = [0] + [len(t) for t in server.tokenizer.decode_batch(
                [self.echo_ids[:i] for i in range(1, len(self.echo_ids))], skip_special_tokens=False)]
            for i, token in enumerate(self.echo_ids):
                tokens.append(server.piece(token))
                offsets.append(before[i])
                lps.append(self.prompt_lps[i] if self.prompt_lps else None)
                tops.append(server.top_dict(self.prompt_tops[i], token, lps[-1])
                            if self.prompt_lps and self.prompt_tops and self.prompt_tops[i] is not None else None)
        base = len(self.prefix)  # generated text follows the echoed prompt, in every chunk of a stream
        for i in range(first, first + count):
            tokens.append(server.piece(self.ids[i]))
            offsets.append(base + (self.offsets[i - 1] if i else 0))
            lps.append(self.lps[i])
            tops.append(server.top_dict(self.tops[i], self.ids[i], self.lps[i]))
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, first: int, count: int) -> dict | None:
        if self.want is None:
            return None
        content, server = [], self.server
        for i in range(first, first + count):
            content.append({"token": server.piece(self.ids[i]), "logprob": self.lps[i],
                            "bytes": server.token_bytes(self.ids[i]),
                            "top_logprobs": [{"token": server.piece(t), "logprob": lp, "bytes": server.token_bytes(t)}
                                             for t, lp in self.tops[i] or ()]})
        return {"content": content}


# ----------------------------------------------------------------------------------------------
# The server


class Server:
    """What the endpoints share: the engine, the tokenizer, the model's name and the request limits."""

    def __init__(self, engine: Engine, tokenizer, *, name: str, step: int, vocab_size: int, context: int,
                 learned_positions: bool, eot_id: int | None, chat_template: str | None = None,
                 api_key: str | None = None, max_body: int = 4 << 20):
        self.engine, self.tokenizer, self.name, self.step = engine, tokenizer, name, step
        self.vocab_size, self.context, self.learned = vocab_size, context, learned_positions
        self.eot_id, self.api_key, self.max_body = eot_id, api_key, max_body
        self.template_source = chat_template
        self.template = compile_template(chat_template) if chat_template else None
        self.created = int(time.time())
        self.stopping: str | None = None
        decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        self.byte_level, self.byte_fallback = "ByteLevel" in kinds, "ByteFallback" in kinds
        self.special = {t for t, added in tokenizer.get_added_tokens_decoder().items() if added.special}

    # -- tokens -------------------------------------------------------------------------------

    def encode(self, text: str, param: str) -> list[int]:
        return self.tokenizer.encode(valid_text(text, param), add_special_tokens=False).ids

    def decode(self, ids, special: bool = False) -> str:
        """Text of token ids: special tokens left out (as sample.py prints), or kept (`special`: /detokenize)."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=not special)

    def piece(self, token: int) -> str:
        """One token's own text, for logprobs (a special token as itself)."""
        return self.decode([token], special=True)

    def top_dict(self, alternatives: list, chosen: int, chosen_lp: float | None) -> dict:
        """The completions API's top_logprobs of one token: its alternatives' text to logprob, and the chosen token
        too when it is not among them (as OpenAI's: up to logprobs + 1 entries; tokens of the same text once)."""
        top: dict[str, float] = {}
        for i, lp in alternatives:
            top.setdefault(self.piece(i), lp)
        if chosen_lp is not None and not any(i == chosen for i, _ in alternatives):
            top.setdefault(self.piece(chosen), chosen_lp)
        return top

    def token_bytes(self, token: int) -> list[int]:
        """A token's own bytes (chat logprobs' `bytes`): a byte-level token's bytes, so that the piece of a character
        has its byte rather than the replacement character's three."""
        raw = self.tokenizer.id_to_token(token)
        if raw is not None and token not in self.special:
            if self.byte_level and all(c in BYTE_OF_CHAR for c in raw):
                return [BYTE_OF_CHAR[c] for c in raw]
            if self.byte_fallback and len(raw) == 6 and raw.startswith("<0x") and raw.endswith(">"):
                try:
                    return [int(raw[3:5], 16)]
                except ValueError:
                    pass
        return list(self.piece(token).encode())

    def token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokenizer.id_to_token(token_id)

    # -- checks -------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise APIError(404, f"the model {model!r} does not exist: this server serves {self.name!r}", "model",
                           "model_not_found", "not_found_error")

    def check_ids(self, ids: list[int], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"{param}: token id {bad} is outside the vocabulary (0 to {self.vocab_size - 1})", param)

    def check_length(self, prompt: int, max_tokens: int, param: str = "max_tokens") -> None:
        if prompt + max_tokens <= self.context:
            if not self.engine.prefill_fits(prompt):
                raise APIError(413, f"a prompt of {prompt} tokens needs more memory to prefill than the device has "
                                    "beside the model and the cache: shorten it (or serve with fewer --slots or a "
                                    "shorter --context)", "prompt", "prompt_too_large")
            return
        what = (f"this model's context is {self.context} tokens" if self.learned else
                f"this server's context is {self.context} tokens (serve.py --context)")
        message = (f"{what}, but the request asks for {prompt + max_tokens} ({prompt} in the prompt, {max_tokens} "
                   f"to generate): shorten the prompt or lower {param}")
        if not self.learned and prompt >= self.context:
            raise APIError(413, message, "prompt", "prompt_too_large")
        raise APIError(400, message, param, "context_length_exceeded")

    def sampling(self, r: Sampling, n_prompts: int) -> dict:
        temperature = 1.0 if r.temperature is None else r.temperature
        top_p = 1.0 if r.top_p is None else r.top_p
        n = 1 if r.n is None else r.n
        if not 0 <= temperature <= 2 or temperature != temperature:
            raise APIError(400, f"temperature must be between 0 and 2, got {temperature}", "temperature")
        if not 0 < top_p <= 1:
            raise APIError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
        if not 1 <= n <= MAX_N:
            raise APIError(400, f"n must be between 1 and {MAX_N}, got {n}", "n")
        if n * n_prompts > MAX_N:
            raise APIError(400, f"{n_prompts} prompts x n {n} = {n * n_prompts} completions, more than the {MAX_N} a "
                                "request may ask for", "n")
        stops = [] if r.stop is None else [r.stop] if isinstance(r.stop, str) else list(r.stop)
        if len(stops) > MAX_STOPS or any(s == "" for s in stops):
            raise APIError(400, f"stop takes up to {MAX_STOPS} non-empty strings", "stop")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(r, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported by this server (leave it at 0)", name)
        if r.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server", "logit_bias")
        if r.seed is not None and not SEED_RANGE[0] <= r.seed < SEED_RANGE[1]:
            raise APIError(400, "seed must be a 64-bit integer", "seed")
        seed = r.seed if r.seed is not None else secrets.randbits(63)
        return {"temperature": float(temperature), "top_p": float(top_p), "n": n, "stops": stops, "seed": seed}

    def check_max_tokens(self, value: int | None, default: int, param: str, allow_zero: bool) -> int:
        if value is None:
            return default
        if value < (0 if allow_zero else 1) or value > self.context:
            low = "0 (with echo)" if allow_zero else "1"
            raise APIError(400, f"{param} must be between {low} and the context's {self.context}, got {value}", param)
        return value

    # -- running completions ------------------------------------------------------------------

    async def run(self, request: Request, prompts: list[list[int]], settings: dict, max_tokens: list[int],
                  logprobs: int | None, echo: bool) -> tuple[list[Choice], asyncio.Queue]:
        """Queue every completion; returns their Choices and the queue their events arrive on."""
        if self.stopping:
            raise APIError(503, f"the server is stopping ({self.stopping})", None, "server_stopping", "server_error")
        self.check_engine()
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        choices: list[Choice] = []
        total = len(prompts) * settings["n"]
        if self.engine.waiting() + total > self.engine.max_queue:
            raise APIError(429, f"the server's queue is full ({self.engine.waiting()} completions waiting, at most "
                                f"{self.engine.max_queue}): try again shortly", None, "queue_full", "rate_limit_error")
        for p, (ids, most) in enumerate(zip(prompts, max_tokens)):
            for j in range(settings["n"]):
                index = len(choices)
                seq = Sequence(ids, most, lambda e, i=index: loop.call_soon_threadsafe(events.put_nowait, (i, e)),
                               temperature=settings["temperature"], top_p=settings["top_p"],
                               seed=settings["seed"] + j, top=logprobs or 0, echo=echo, logprobs=logprobs is not None)
                choices.append(Choice(self, seq, index, settings["stops"], logprobs, ids if echo else None))
        for c in choices:
            if not self.engine.submit(c.seq):
                for other in choices:
                    self.engine.cancel(other.seq)
                self.check_engine()
                raise APIError(429, "the server's queue is full: try again shortly", None, "queue_full",
                               "rate_limit_error")
        return choices, events

    def check_engine(self) -> None:
        """A 503 once generation has failed (the device, or a bug): nothing more can be generated until a restart."""
        if self.engine.failure is not None:
            raise APIError(503, f"{self.engine.failure}; restart the server", None, "generation_failed",
                           "server_error")

    def cancel(self, choices: list[Choice]) -> None:
        for c in choices:
            if c.finish_reason is None and c.error is None:
                self.engine.cancel(c.seq)

    async def wait_all(self, request: Request, choices: list[Choice], events: asyncio.Queue) -> None:
        """Until every choice has ended; a client that went away cancels them all."""
        looked = time.monotonic()
        try:
            while not all(c.ended for c in choices):
                try:
                    index, event = await asyncio.wait_for(events.get(), DISCONNECT_POLL)
                    if not choices[index].ended:
                        choices[index].on(event)
                except asyncio.TimeoutError:
                    pass
                if time.monotonic() - looked >= DISCONNECT_POLL:  # however often tokens come
                    looked = time.monotonic()
                    if await request.is_disconnected():
                        raise asyncio.CancelledError
        finally:
            self.cancel(choices)


DISCONNECT_POLL = 0.5  # seconds between two looks at whether a waiting client is still there


def completion_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(prompts: list[list[int]], choices: list[Choice]) -> dict:
    prompt = sum(len(p) for p in prompts)
    completion = sum(len(c.ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Guard:
    """ASGI middleware before every endpoint: the API key (when the server has one) and the body's size, the
    body read here (up to the limit) and handed on; what the client sends after it (its disconnect) passes
    through untouched."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        server = self.server
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if server.api_key is not None:
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {server.api_key}".encode()):
                return await error_response(401, "a valid API key is needed: send 'Authorization: Bearer KEY'",
                                            "authentication_error", None, "invalid_api_key")(scope, receive, send)
        too_large = error_response(413, f"the request body is larger than this server's {server.max_body:,} bytes "
                                        "(serve.py --max-body-bytes)", "invalid_request_error", None, "body_too_large")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > server.max_body:
            return await too_large(scope, receive, send)
        body, more = b"", scope.get("method") in ("POST", "PUT", "PATCH")
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > server.max_body:
                return await too_large(scope, receive, send)
        if body and not headers.get("content-type", "").startswith("application/json"):
            # every body is JSON here, whatever it says it is (curl -d sends a form's type unless told)
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
                     + [(b"content-type", b"application/json")]}
        given = False

        async def replay():
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def make_app(server: Server) -> FastAPI:
    app = FastAPI(title="serve.py", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error_response(e.status, e.message, e.kind, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        found = e.errors() or [{"loc": (), "msg": "invalid"}]
        if found[0].get("type") == "json_invalid":
            why = found[0].get("ctx", {}).get("error", "")
            return error_response(400, "the request body is not valid JSON" + (f": {why}" if why else ""))
        locs = [[x for x in f.get("loc", ()) if x != "body"] for f in found]
        common = locs[0]
        for loc in locs[1:]:  # a field of several types fails once per type: the field is what they share
            common = [a for a, b in zip(common, loc) if a == b][:next(
                (i for i, (a, b) in enumerate(zip(common, loc)) if a != b), min(len(common), len(loc)))]
        param = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in common).lstrip(".") or None
        reasons = list(dict.fromkeys(f["msg"] for f in found))
        message = f"{param or 'the request body'}: {'; or '.join(reasons[:3])}"
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind)

    @app.exception_handler(Exception)
    async def failure(request, e: Exception):  # a bug: said as a 500, the server goes on
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    app.add_middleware(Guard, server=server)

    @app.get("/health")
    async def health():
        engine = server.engine
        body = {"status": "stopping" if server.stopping else "ok", "model": server.name, "step": server.step,
                "slots": engine.slots, "active": engine.active(), "waiting": engine.waiting()}
        if engine.failure is not None:  # 503, so that a supervisor's probe restarts it
            return JSONResponse({**body, "status": "failed", "error": engine.failure}, 503)
        return body

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": server.created,
                                            "owned_by": "serve.py"}]}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        server.check_model(name)
        return {"id": server.name, "object": "model", "created": server.created, "owned_by": "serve.py"}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return {"eos_token": server.token_text(server.eot_id), "bos_token": None, "pad_token": None,
                "chat_template": server.template_source, "model_max_length": server.context,
                "tokenizer_class": "tokenizers"}

    @app.post("/tokenize")
    async def tokenize(r: TokenizeRequest):
        server.check_model(r.model)
        if (r.prompt is None) == (r.messages is None):
            raise APIError(400, "give either prompt (text) or messages", "prompt")
        text = r.prompt if r.prompt is not None else render_chat(server, r.messages)
        param = "prompt" if r.prompt is not None else "messages"
        tokens = (server.encode(text, param) if not r.add_special_tokens else
                  server.tokenizer.encode(valid_text(text, param)).ids)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": server.context}

    @app.post("/detokenize")
    async def detokenize(r: DetokenizeRequest):
        server.check_model(r.model)
        server.check_ids(r.tokens, "tokens")
        return {"prompt": server.decode(r.tokens, special=True)}

    @app.post("/v1/completions")
    async def completions(r: CompletionRequest, request: Request):
        server.check_model(r.model)
        prompts = completion_prompts(server, r.prompt)
        if r.suffix:
            raise APIError(400, "suffix is not supported by this server", "suffix")
        if r.best_of is not None and r.best_of != (r.n or 1):
            raise APIError(400, "best_of is not supported by this server (leave it out or equal to n)", "best_of")
        settings = server.sampling(r, len(prompts))
        if r.logprobs is not None and not 0 <= r.logprobs <= TOP_MAX:
            raise APIError(400, f"logprobs must be between 0 and {TOP_MAX}, got {r.logprobs}", "logprobs")
        most = server.check_max_tokens(r.max_tokens, 16, "max_tokens", allow_zero=bool(r.echo))
        for ids in prompts:
            server.check_length(len(ids), most)
        choices, events = await server.run(request, prompts, settings, [most] * len(prompts), r.logprobs,
                                           bool(r.echo))
        ident, created = completion_id("cmpl"), int(time.time())
        head = {"id": ident, "object": "text_completion", "created": created, "model": server.name}
        if r.stream:
            include = bool(r.stream_options and r.stream_options.include_usage)
            return sse(server, request, choices, events, lambda c, text, first, count, echoed: {
                **head, "choices": [{"index": c.index, "text": (c.prefix if echoed else "") + text,
                                     "logprobs": c.completion_logprobs(first, count, echoed),
                                     "finish_reason": c.finish_reason if c.sent == len(c.text) else None}]},
                lambda: {**head, "choices": [], "usage": usage(prompts, choices)} if include else None,
                echo=bool(r.echo))
        await server.wait_all(request, choices, events)
        fail(choices)
        out = []
        for c in choices:
            text, count = c.take()
            out.append({"index": c.index, "text": (c.prefix if r.echo else "") + text,
                        "logprobs": c.completion_logprobs(0, count, bool(r.echo)),
                        "finish_reason": c.finish_reason})
        return {**head, "choices": out, "usage": usage(prompts, choices)}

    @app.post("/v1/chat/completions")
    async def chat(r: ChatRequest, request: Request):
        server.check_model(r.model)
        if not r.messages:
            raise APIError(400, "messages is empty", "messages")
        text = render_chat(server, r.messages)
        ids = server.encode(text, "messages")
        if not ids:
            raise APIError(400, "the messages render to no tokens", "messages")
        settings = server.sampling(r, 1)
        if server.template is None:
            settings["stops"] = settings["stops"] + [PLAIN_STOP]
        if r.top_logprobs is not None and not 0 <= r.top_logprobs <= TOP_MAX:
            raise APIError(400, f"top_logprobs must be between 0 and {TOP_MAX}, got {r.top_logprobs}", "top_logprobs")
        if r.top_logprobs and not r.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        asked = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
        param = "max_completion_tokens" if r.max_completion_tokens is not None else "max_tokens"
        most = server.check_max_tokens(asked, max(1, server.context - len(ids)), param, allow_zero=False)
        server.check_length(len(ids), most, param)
        want = (r.top_logprobs or 0) if r.logprobs else None
        choices, events = await server.run(request, [ids], settings, [most], want, False)
        ident, created = completion_id("chatcmpl"), int(time.time())
        head = {"id": ident, "object": "chat.completion", "created": created, "model": server.name}
        if r.stream:
            include = bool(r.stream_options and r.stream_options.include_usage)
            chunk = {**head, "object": "chat.completion.chunk"}

            def delta(c, text, first, count, opening):
                d = {"role": "assistant", "content": text} if opening else ({"content": text} if text else {})
                return {**chunk, "choices": [{"index": c.index, "delta": d, "logprobs": c.chat_logprobs(first, count),
                                              "finish_reason": c.finish_reason if c.sent == len(c.text) else None}]}

            return sse(server, request, choices, events, delta,
                       lambda: {**chunk, "choices": [], "usage": usage([ids], choices)} if include else None, echo=True)
        await server.wait_all(request, choices, events)
        fail(choices)
        out = []
        for c in choices:
            content, count = c.take()
            out.append({"index": c.index, "message": {"role": "assistant", "content": content},
                        "logprobs": c.chat_logprobs(0, count), "finish_reason": c.finish_reason})
        return {**head, "choices": out, "usage": usage([ids], choices)}

    return app


def completion_prompts(server: Server, prompt) -> list[list[int]]:
    """The completions API's prompt (a string, strings, token ids, lists of token ids) as token ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", "prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    out = []
    for i, p in enumerate(prompt):
        ids = server.encode(p, "prompt" if len(prompt) == 1 else f"prompt[{i}]") if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, f"prompt{'' if len(prompt) == 1 else f'[{i}]'} is empty: give at least one token",
                           "prompt")
        server.check_ids(ids, "prompt")
        out.append(ids)
    return out


def render_chat(server: Server, messages: list[Message]) -> str:
    rendered = [{"role": m.role, "content": message_text(m, i)} for i, m in enumerate(messages)]
    if server.template is None:
        return plain_template(rendered)
    try:
        return server.template.render(messages=rendered, add_generation_prompt=True,
                                      eos_token=server.token_text(server.eot_id) or "", bos_token="")
    except APIError:
        raise
    except Exception as e:  # the template's own error (a missing variable, a Jinja error)
        raise APIError(400, f"the run's chat template failed on these messages: {type(e).__name__}: {e}",
                       "messages") from None


def fail(choices: list[Choice]) -> None:
    broken = next((c.error for c in choices if c.error is not None), None)
    if broken is not None:
        raise APIError(503, broken, None, "server_stopping", "server_error")


def sse(server: Server, request: Request, choices: list[Choice], events: asyncio.Queue, chunk, tail, echo: bool):
    """A StreamingResponse of server-sent events: `chunk(choice, text, first token, tokens, opening)` for each
    piece of certain text (the first of each choice `opening`), then `tail()` (the usage, or None), then
    `data: [DONE]`. An error (the server stopping) is sent as an error event before [DONE]."""

    async def stream():
        opening = {c.index for c in choices} if echo else set()
        try:
            while not all(c.ended for c in choices):
                index, event = await events.get()
                c = choices[index]
                if c.ended:
                    continue
                c.on(event)
                if c.error is not None:
                    body = {"error": {"message": c.error, "type": "server_error", "param": None,
                                      "code": "server_stopping"}}
                    yield f"data: {json.dumps(body)}\n\n"
                    break
                first = c.released
                text, count = c.take()
                if text or count or c.finish_reason is not None or c.index in opening:
                    yield f"data: {json.dumps(chunk(c, text, first, count, c.index in opening))}\n\n"
                    opening.discard(c.index)
            else:
                last = tail()
                if last is not None:
                    yield f"data: {json.dumps(last)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            server.cancel(choices)  # the client went away: its slots are freed at the engine's next chunk

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
