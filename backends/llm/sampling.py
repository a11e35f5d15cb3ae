"""Next-token choice per sequence: greedy, or temperature / top-k / top-p sampling from the sequence's own seeded
generator (so a seeded request draws the same tokens whatever it is batched with)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from backends.core.devices import to_device
from backends.core.errors import InjectedFault

if TYPE_CHECKING:
    from backends.llm.sequence import Sequence


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_tokens: int = 0  # EOS is ignored until this many tokens were produced

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


GREEDY_BELOW = 1e-5  # a temperature this small is greedy decoding (its limit); dividing by it would overflow


@dataclass
class Drawn:
    """A step's tokens on the device, before the host has them (see `draw`)."""
    tokens: torch.Tensor  # [B]
    failed: dict[int, Exception]  # rows known to fail already (an injected fault)
    rows: list[int]  # the sampled rows
    on_host: tuple[torch.Tensor, torch.Tensor | None]  # (tokens, whether each sampled row's probabilities were
    # finite), on their way to pinned host memory
    copied: torch.cuda.Event | None  # recorded after those copies (on a GPU)


def _copy_to_host(tensors: list[torch.Tensor | None]) -> tuple[list[torch.Tensor | None], torch.cuda.Event | None]:
    """Copies started now, behind the kernels that compute them and ahead of whatever the host launches next (a
    step launched before these tokens are read must not delay them), with the event to wait for."""
    if tensors[0].device.type != "cuda":
        return tensors, None
    hosts = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
             for t in tensors]
    copied = torch.cuda.Event()
    copied.record()
    return hosts, copied


def draw(logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...]) -> Drawn:
    """Each row's token on the logits' device, without waiting for the device (`chosen` waits): greedy rows
    by argmax, the sampled rows together (temperature, top-k and top-p as per-row tensors over one sort), a seeded
    row from its own generator."""
    tokens = greedy_tokens(logits, seqs, eos_ids)
    failed: dict[int, Exception] = {i: InjectedFault("fault injected at sample") for i, seq in enumerate(seqs)
                                    if seq.fault == "sample"}
    rows = [i for i, seq in enumerate(seqs) if i not in failed and not seq.sampling.greedy
            and seq.sampling.temperature >= GREEDY_BELOW]
    finite = None
    if rows:
        index = to_device(rows, torch.int64, logits.device)
        drawn, finite = _sample_rows(logits[index], [seqs[i] for i in rows])
        tokens = tokens.index_copy(0, index, drawn)
    on_host, copied = _copy_to_host([tokens, finite])
    return Drawn(tokens, failed, rows, tuple(on_host), copied)


def chosen(drawn: Drawn) -> list[int | Exception]:
    """The drawn tokens on the host (waiting for their copies, not for later work on the device); a row whose
    sampling failed (non-finite logits, an injected fault) gets its exception instead: it belongs to that sequence
    alone."""
    if drawn.copied is not None:
        drawn.copied.synchronize()
    host_tokens, host_finite = drawn.on_host
    tokens: list[int | Exception] = host_tokens.tolist()
    failed = dict(drawn.failed)
    for i, ok in zip(drawn.rows, host_finite.tolist() if drawn.rows else ()):
        if not ok:
            failed[i] = RuntimeError("sampling failed: the model's probabilities are not finite")
    for i, error in failed.items():
        tokens[i] = error
    return tokens


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...]) -> list[int | Exception]:
    """logits: [B, vocab] float32 for the last position of each sequence -> each row's token or its failure."""
    return chosen(draw(logits, seqs, eos_ids))


def greedy_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...]) -> torch.Tensor:
    """Each row's most likely token, on the logits' device and without waiting for it: EOS is not a choice before
    min_tokens (`forbid`: one indexing kernel for the batch, for which the host does not wait)."""
    early = [row for row, seq in enumerate(seqs) if len(seq.output_ids) < seq.sampling.min_tokens]
    if eos_ids and early:
        forbid(logits, early, eos_ids)
    return logits.argmax(dim=-1)


def forbid(logits: torch.Tensor, rows: list[int], token_ids: tuple[int, ...]) -> None:
    """logits[rows, token_ids] = -inf, queued without the host waiting: indices from pinned memory, the value a
    device scalar. (A Python number assigned through an index is copied from pageable memory, which waits for the
    whole stream, a step launched ahead included: on the H100 every benchmark step waited so, 2026-12-05.)"""
    device = logits.device
    logits.index_put_((to_device(rows, torch.int64, device)[:, None], to_device(token_ids, torch.int64, device)),
                      logits.new_full((), float("-inf")))


def sorted_probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities in descending order, their token ids), [R, vocab] each: rows of logits after each row's
    temperature, top-k and top-p (the distribution a sampled token is drawn from; non-finite where it failed)."""
    device, vocab = logits.device, logits.shape[-1]
    column = lambda values, dtype: to_device(values, dtype, device)[:, None]  # noqa: E731
    ordered, order = (logits / column([p.temperature for p in params], torch.float32)).sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=device)[None, :]
    probs = ordered.softmax(-1)
    drop = rank >= column([p.top_k or vocab for p in params], torch.int64)  # top-k
    drop |= probs.cumsum(-1) - probs >= column([p.top_p for p in params], torch.float32)  # smallest prefix >= top_p
    return ordered.masked_fill(drop, float("-inf")).softmax(-1), order


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[R, vocab]: `sorted_probabilities` in token order (what speculative decoding compares token by token)."""
    probs, order = sorted_probabilities(logits, params)
    return torch.zeros_like(probs).scatter_(1, order, probs)


def _sample_rows(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """(token per row, whether the row's probabilities were finite) for rows [R, vocab] of sampled sequences."""
    device = logits.device
    params = [seq.sampling for seq in seqs]
    probs, order = sorted_probabilities(logits, params)
    finite = probs.isfinite().all(-1)
    first = torch.arange(probs.shape[-1], device=device)[None, :] == 0
    probs = torch.where(finite[:, None], probs, first.float())  # a failed row draws something harmless
    picks = torch.empty(len(seqs), 1, dtype=torch.int64, device=device)
    unseeded = [i for i, p in enumerate(params) if p.seed is None]
    if len(unseeded) == len(seqs):
        picks = torch.multinomial(probs, 1)
    elif unseeded:
        index = to_device(unseeded, torch.int64, device)
        picks[index] = torch.multinomial(probs[index], 1)
    for i, seq in enumerate(seqs):  # a seeded request draws from its own generator, whatever its batch
        if seq.sampling.seed is not None:
            picks[i] = torch.multinomial(probs[i], 1, generator=generator(seq, device))
    return order.gather(1, picks)[:, 0], finite


def generator(seq: Sequence, device: torch.device) -> torch.Generator:
    """A seeded sequence's own random stream (made on first use)."""
    if seq.generator is None:
        seq.generator = torch.Generator(device=device).manual_seed(seq.sampling.seed)
    return seq.generator
