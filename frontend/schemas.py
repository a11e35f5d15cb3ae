"""The OpenAI request bodies the frontend takes, checked by pydantic: a field it does not implement is refused (400
naming it) rather than ignored, so a client never believes an option took effect."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImageURL(Strict):
    url: str
    detail: str | None = None


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]]
    name: str | None = None


class StreamOptions(Strict):
    include_usage: bool = False


class Generation(Strict):
    """What both completion endpoints take."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_tokens: int | None = Field(None, ge=0)  # vLLM's extension: no end of sequence before this many tokens

    @field_validator("n")
    @classmethod
    def one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def no_penalty(cls, value: float) -> float:
        if value != 0:
            raise ValueError("penalties are not supported (only 0)")
        return value

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(Generation):
    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def one_prompt(cls, prompt: str | list[str]) -> str:
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ValueError("exactly one prompt per request is supported")
            return prompt[0]
        return prompt

    @property
    def budget(self) -> int | None:
        return self.max_tokens


class EmbeddingRequest(Strict):
    model: str
    input: str | list[str] = Field(min_length=1)
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
