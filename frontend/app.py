"""The OpenAI-compatible HTTP API over tritonserver (FastAPI): /v1/models, /v1/chat/completions and /v1/completions
for the generating models (llm, smollm2, ...), /v1/embeddings for clip_text, /v1/audio/transcriptions and
/v1/audio/translations for whisper. Every call becomes one Triton request over async gRPC; a streamed answer is
Server-Sent Events ending in `data: [DONE]`, and a client that disconnects cancels its Triton request.

Token counts in `usage` come from the model's own tokenizer (in its repository folder): the prompt as the model
tokenizes it, the completion by tokenizing its text again (Triton 2.51 returns no response parameters, so the model
cannot report its ids); `finish_reason` is "length" when that count reached the budget, else "stop".
"""
from __future__ import annotations

import base64
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from client.sdk import generation_arrays
from frontend.errors import OpenAIError
from frontend.schemas import ChatRequest, CompletionRequest, EmbeddingRequest, Generation
from frontend.triton import ServedModel, Triton

OWNER = "triton-multimodal"
TRANSCRIPTION_FORMATS = ("json", "text")


def create_app(triton_url: str, repository: Path, default_max_tokens: int = 512, max_body_mb: float = 32) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.triton = Triton(triton_url)
        yield
        await app.state.triton.close()

    app = FastAPI(title="triton-multimodal OpenAI-compatible API", lifespan=lifespan)

    @functools.lru_cache(maxsize=16)
    def tokenizer(model: str):
        from transformers import AutoTokenizer

        folder = repository / model / "1"
        return AutoTokenizer.from_pretrained(folder / "tokenizer" if (folder / "tokenizer").is_dir() else folder)

    app.add_middleware(BodyLimit, max_bytes=int(max_body_mb * 2**20))

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, error: OpenAIError):
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, error: RequestValidationError):
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        return error_response(OpenAIError(400, f"{where}: {first['msg']}", where or None))

    @app.get("/health")
    async def health():
        if not await app.state.triton.ready():
            raise OpenAIError(503, "tritonserver is not ready")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        ids = []
        for model in await app.state.triton.models():
            ids += [model.name] + [f"{model.name}:{a}" for a in await app.state.triton.adapters(model)]
        return {"object": "list", "data": [{"id": i, "object": "model", "created": 0, "owned_by": OWNER} for i in ids]}

    async def generator(requested: str, what: str) -> tuple[ServedModel, str | None]:
        """(model, adapter) of a generating model's id: `model`, or `model:adapter` for one of its LoRA adapters."""
        name, _, adapter = requested.partition(":")
        # an adapter the model does not have: Triton says so (400)
        return await app.state.triton.model(name, "generates", what), adapter or None

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        served, adapter = await generator(body.model, "chat completions")
        model = served.name
        images = [p.image_url.url for m in body.messages if not isinstance(m.content, str)
                  for p in m.content if p.type == "image_url"]
        if images and not served.sees_images:
            raise OpenAIError(400, f"the model `{model}` takes no images", "messages")
        if served.sees_images and len(images) != 1:
            raise OpenAIError(400, f"the model `{model}` takes exactly one image per request, in an image_url part "
                                   f"(the messages hold {len(images)})", "messages")
        template = tokenizer(model)
        if not template.chat_template:
            raise OpenAIError(400, f"the model `{model}` has no chat template; use /v1/completions", "model")
        messages = [{"role": m.role, "content": template_content(m.content)} for m in body.messages]
        prompt = template.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return await complete(body, model, adapter, prompt, chat=True,
                              image=data_url_bytes(images[0]) if images else None)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        served, adapter = await generator(body.model, "completions")
        if served.sees_images:
            raise OpenAIError(400, f"the model `{served.name}` needs an image: use /v1/chat/completions with an "
                                   "image_url part", "model")
        return await complete(body, served.name, adapter, body.prompt, chat=False)

    async def complete(body: Generation, model: str, adapter: str | None, prompt: str, chat: bool,
                       image: bytes | None = None):
        budget = body.budget or default_max_tokens
        options = {k: v for k, v in (("temperature", body.temperature), ("top_p", body.top_p), ("seed", body.seed),
                                     ("min_length", body.min_tokens), ("lora_id", adapter)) if v is not None}
        if body.stops:
            options["stop"] = body.stops
        arrays = generation_arrays(prompt, budget, stream=True, image=image, **options)
        deltas = app.state.triton.generate(model, arrays)
        reply = Reply(body.model, chat, tokenizer(model), prompt, budget)
        if not body.stream:
            return reply.whole("".join([delta async for delta in deltas]))
        try:  # the first piece before the response starts: a request Triton refuses gets its HTTP status
            first = [await anext(deltas)]
        except StopAsyncIteration:
            first = []
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(reply.events(first, deltas, include_usage), media_type="text/event-stream")

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        await app.state.triton.model(body.model, "embeds_text", "embeddings")
        texts = [body.input] if isinstance(body.input, str) else body.input
        out = await app.state.triton.infer(body.model, {"text": np.array([[t.encode()] for t in texts], np.object_)},
                                           ["text_embeds"])
        data = [{"object": "embedding", "index": i,
                 "embedding": (base64.b64encode(row.astype("<f4").tobytes()).decode()
                               if body.encoding_format == "base64" else row.tolist())}
                for i, row in enumerate(out["text_embeds"])]
        tokens = sum(len(tokenizer(body.model)(t)["input_ids"]) for t in texts)
        return {"object": "list", "data": data, "model": body.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def speech(task: str, file: UploadFile, model: str, language: str | None, response_format: str,
                     temperature: float):
        await app.state.triton.model(model, "transcribes", f"audio {task}s")
        if response_format not in TRANSCRIPTION_FORMATS:
            raise OpenAIError(400, f"response_format {response_format!r}: this server returns "
                                   f"{' or '.join(TRANSCRIPTION_FORMATS)}", "response_format")
        if temperature != 0:
            raise OpenAIError(400, "only temperature 0 (greedy decoding) is supported", "temperature")
        arrays = {"audio": np.array([[await file.read()]], np.object_), "task": np.array([[task.encode()]], np.object_)}
        if language:
            arrays["language"] = np.array([[language.encode()]], np.object_)
        text = (await app.state.triton.infer(model, arrays, ["text"]))["text"].reshape(-1)[0].decode()
        return PlainTextResponse(text) if response_format == "text" else {"text": text}

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(file: UploadFile = File(...), model: str = Form(...), language: str | None = Form(None),
                             prompt: str | None = Form(None), response_format: str = Form("json"),
                             temperature: float = Form(0.0)):
        if prompt:
            raise OpenAIError(400, "a prompt for transcription is not supported", "prompt")
        return await speech("transcribe", file, model, language, response_format, temperature)

    @app.post("/v1/audio/translations")
    async def translations(file: UploadFile = File(...), model: str = Form(...), prompt: str | None = Form(None),
                           response_format: str = Form("json"), temperature: float = Form(0.0)):
        if prompt:
            raise OpenAIError(400, "a prompt for translation is not supported", "prompt")
        return await speech("translate", file, model, None, response_format, temperature)

    return app


def template_content(content: str | list) -> str | list[dict]:
    """A message's content as chat templates take it: text parts joined; with an image, the parts in order (the
    image as {"type": "image"}, which LLaVA's templates turn into the image placeholder)."""
    if isinstance(content, str):
        return content
    if all(p.type == "text" for p in content):
        return "".join(p.text for p in content)
    return [{"type": "text", "text": p.text} if p.type == "text" else {"type": "image"} for p in content]


def data_url_bytes(url: str) -> bytes:
    """The file in a `data:[<media type>];base64,<data>` URL (this server fetches nothing from the network)."""
    head, comma, data = url.partition(",")
    if not (url.startswith("data:") and comma and head.endswith(";base64")):
        raise OpenAIError(400, "image_url: only base64 data: URLs (data:image/jpeg;base64,...) are accepted; this "
                               "server fetches nothing from the network", "messages")
    try:
        return base64.b64decode(data, validate=True)
    except ValueError:
        raise OpenAIError(400, "image_url: the data: URL is not valid base64", "messages") from None


class BodyLimit:
    """Refuses a request whose Content-Length is over the limit (413) before its body is read. Plain ASGI: a
    BaseHTTPMiddleware would sit between a streamed answer and the client's disconnect."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        length = dict(scope.get("headers", [])).get(b"content-length") if scope["type"] == "http" else None
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            error = OpenAIError(413, f"the request body is {int(length) / 2**20:.1f} MB; this server takes up to "
                                     f"{self.max_bytes / 2**20:g} MB")
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


class Reply:
    """One completion's response bodies (chat or text), whole or as SSE chunks."""

    def __init__(self, model: str, chat: bool, tokenizer, prompt: str, budget: int):
        self.model, self.chat, self.tokenizer, self.budget = model, chat, tokenizer, budget
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.prompt_tokens = len(tokenizer(prompt)["input_ids"])
        self.content_chunk = self.serialise("\x00")  # the per-token chunk, "\u0000" where its text goes

    def usage(self, text: str) -> dict:
        completion = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def finish_reason(self, usage: dict) -> str:
        return "length" if usage["completion_tokens"] >= self.budget else "stop"

    def head(self) -> dict:
        return {"id": self.id, "created": self.created, "model": self.model}

    def whole(self, text: str) -> dict:
        usage = self.usage(text)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": self.finish_reason(usage)}
            return {**self.head(), "object": "chat.completion", "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "finish_reason": self.finish_reason(usage), "logprobs": None}
        return {**self.head(), "object": "text_completion", "choices": [choice], "usage": usage}

    def chunk(self, content: str | None, finish_reason: str | None = None, first: bool = False) -> str:
        if content is not None and finish_reason is None and not first:  # once per token: no dict, no dumps of it
            return self.content_chunk.replace("\\u0000", json.dumps(content)[1:-1], 1)
        return self.serialise(content, finish_reason, first)

    def serialise(self, content: str | None, finish_reason: str | None = None, first: bool = False) -> str:
        if self.chat:
            delta = ({"role": "assistant"} if first else {}) | ({"content": content} if content is not None else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            body = {**self.head(), "object": "chat.completion.chunk", "choices": [choice]}
        else:
            choice = {"index": 0, "text": content or "", "finish_reason": finish_reason, "logprobs": None}
            body = {**self.head(), "object": "text_completion", "choices": [choice]}
        return f"data: {json.dumps(body)}\n\n"

    async def events(self, first: list[str], deltas: AsyncIterator[str], include_usage: bool) -> AsyncIterator[str]:
        pieces = []
        try:
            if self.chat:
                yield self.chunk(None, first=True)
            for delta in first:
                pieces.append(delta)
                yield self.chunk(delta)
            async for delta in deltas:
                pieces.append(delta)
                yield self.chunk(delta)
        except OpenAIError as e:  # the stream has started: the error goes in it, as OpenAI's API does
            yield f"data: {json.dumps(e.body())}\n\n"
            return
        finally:
            await deltas.aclose()  # also when the client went away: cancels the Triton request
        usage = self.usage("".join(pieces))
        yield self.chunk(None, self.finish_reason(usage))
        if include_usage:
            chunk_type = "chat.completion.chunk" if self.chat else "text_completion"
            yield f"data: {json.dumps({**self.head(), 'object': chunk_type, 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
