"""Incremental detokenisation with stop strings: each new token yields the text it completes, never half a UTF-8
character and never the beginning of a stop string that may still complete."""
from __future__ import annotations

import functools
from typing import Callable

from backends.llm.sequence import Sequence


@functools.cache
def text_of(tokenizer) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`; for a fast tokenizer that cleans up no spaces, its Rust
    backend's own decode, which that call ends in: the Python around it cost 4x the decoding itself, a third of an
    engine step's host time with 64 sequences (measured on the VM with the model's logits stubbed out)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return functools.partial(backend.decode, skip_special_tokens=True)
    return functools.partial(tokenizer.decode, skip_special_tokens=True)


def append_text(tokenizer, seq: Sequence, check_stop: bool = True) -> bool:
    """Decode `seq`'s newest token into seq.text; True when a stop string ended the output (text cut before it).
    Stop strings are looked for only when `check_stop` (not before min_tokens)."""
    prefix, read = seq._decode_offsets
    ids, decode = seq.output_ids, text_of(tokenizer)
    before = decode(ids[prefix:read])
    after = decode(ids[prefix:])
    if len(after) <= len(before) or after.endswith("\ufffd"):
        return False  # an incomplete character: wait for the next token
    seq.text += after[len(before):]
    seq._decode_offsets = (read, len(ids))
    for stop in seq.sampling.stop if check_stop else ():
        at = seq.text.find(stop, max(0, seq.emitted - len(stop)))
        if at >= 0:
            seq.text = seq.text[:at]
            return True
    return False


def flush_text(tokenizer, seq: Sequence) -> None:
    """At the end, take what was held back as incomplete, as `tokenizer.decode` of the whole output gives it."""
    prefix, read = seq._decode_offsets
    decode = text_of(tokenizer)
    before, after = decode(seq.output_ids[prefix:read]), decode(seq.output_ids[prefix:])
    seq.text += after[len(before):]
    seq._decode_offsets = (len(seq.output_ids), len(seq.output_ids))


def pending_text(seq: Sequence) -> str:
    """Text ready to hand out: all of it once finished, else all but a tail that could start a stop string."""
    hold = 0 if seq.finished else max((_overlap(seq.text, stop) for stop in seq.sampling.stop), default=0)
    end = max(seq.emitted, len(seq.text) - hold)
    delta, seq.emitted = seq.text[seq.emitted:end], end
    return delta


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
