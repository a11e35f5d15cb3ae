"""All per-request state of the engine lives in one `Sequence`; the scheduler only moves sequences between queues."""
from __future__ import annotations

import enum
import itertools
import struct
import time
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

import torch

from backends.core.qos import Ticket
from backends.llm.sampling import SamplingParams

if TYPE_CHECKING:
    from backends.llm.adapters import LoraAdapter

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    sampling: SamplingParams
    request_id: str = ""
    ticket: Ticket = field(default_factory=Ticket.untracked)  # its QoS class, cost score and arrival
    arrival: float = field(default_factory=time.monotonic)
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # leading tokens whose keys and values are in the cache
    step_tokens: int = 0  # uncached tokens the scheduled step computes (a chunk of the prompt, or the newest token)
    draft_ids: list[int] = field(default_factory=list)  # speculative decoding: the step's proposals, after the newest
    speculate: int = 0  # how many tokens to propose next (adaptive; 0 until its first decode step)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "length", "stop" (EOS or a stop string), "cancelled", "error"
    error: Exception | None = None  # why this sequence failed (finish_reason "error")
    preemptions: int = 0
    generator: torch.Generator | None = None  # seeded per request, so sampling is reproducible in any batch
    embeds: torch.Tensor | None = None  # [n, hidden] input embeddings (image features) for the prompt positions:
    embed_positions: tuple[int, ...] = ()  # ... kept for recomputation after a preemption
    embeds_key: bytes = b""  # identifies the image behind `embeds` in prefix-cache keys
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of the full blocks so far
    lora: tuple[tuple[LoraAdapter, float], ...] = ()  # (adapter, share) pairs: none, one, or the router's two
    lora_slots: list[int] = field(default_factory=list)  # their device slots while running
    fault: str | None = None  # a test's injected fault stage ("sample": its sampling fails)
    # overlap_steps: while the engine launches the step after the one computing this sequence's next token, that
    # token is a stand-in at the end of output_ids (`placeholder`), or, when it will be the last, no step follows
    # (`ending`); both only within one engine.step call
    placeholder: bool = False
    ending: bool = False
    text: str = ""  # detokenised output so far (stop strings already cut)
    emitted: int = 0  # characters of `text` already handed to the caller
    _decode_offsets: tuple[int, int] = (0, 0)  # incremental detokenisation window (prefix, read)

    @property
    def cache_salt(self) -> bytes:
        """What its keys and values depend on besides its tokens and image: its adapters (in prefix-cache keys)."""
        return b"".join(adapter.key + struct.pack("<d", share) for adapter, share in self.lora)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
