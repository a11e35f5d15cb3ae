"""Speculative decoding served by a real tritonserver: SmolLM2 built with a draft model (`build_engines llm --draft`)
and the tiny llm with prompt lookup answer concurrent streams exactly as transformers does, seeded sampling repeats
itself, and the proposal metrics move."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from backends.server import TritonServer, free_port
from build_engines.draft import truncated_draft
from client.sdk import Client
from tests.conftest import ROOT, build_engines
from tests.integration.test_llm import metric

QUESTIONS = ["What is the capital of France?", "Repeat exactly: the quick brown fox jumps over the lazy dog.",
             "Name a fruit that is yellow.", "Write one sentence about cats."]


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_checkpoint, llm_checkpoint):
    repository = tmp_path_factory.mktemp("speculative")
    draft = truncated_draft(smollm2_checkpoint, tmp_path_factory.mktemp("draft"), 8)
    assert build_engines(["llm", "--checkpoint", str(smollm2_checkpoint), "--name", "smollm2", "--draft", str(draft),
                          "--repository", str(repository)]) == 0
    assert (repository / "smollm2" / "1" / "draft" / "config.json").is_file()
    assert build_engines(["llm", "--checkpoint", str(llm_checkpoint), "--speculative", "ngram",
                          "--repository", str(repository)]) == 0
    with TritonServer(repository, free_port(), free_port(), free_port(),
                      ROOT / "logs" / "test-speculative.log") as running:
        yield running


def reference_answers(checkpoint, prompts: list[str], tokens: int, chat: bool) -> tuple[list[str], list[str]]:
    """(the prompts as sent, transformers' greedy answers)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    if chat:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                 tokenize=False) for q in prompts]
    answers = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=tokens, do_sample=False)[0, ids.input_ids.shape[1]:]
        answers.append(tokenizer.decode(out, skip_special_tokens=True))
    return prompts, answers


@pytest.mark.parametrize("model, chat", [("smollm2", True), ("llm", False)])
def test_served_speculation_answers_as_the_model_alone(server, smollm2_checkpoint, llm_checkpoint, model, chat):
    checkpoint = smollm2_checkpoint if chat else llm_checkpoint
    prompts, expected = reference_answers(checkpoint, QUESTIONS, 40, chat)
    proposed = metric(server, "llm_spec_proposed_tokens_total", model)
    accepted = metric(server, "llm_spec_accepted_tokens_total", model)

    def ask(prompt: str, protocol: str) -> str:
        url = server.grpc_url if protocol == "grpc" else server.http_url
        with Client(url, protocol) as client:
            return "".join(client.generate(prompt, 40, model=model))

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, prompts, ["grpc", "http"] * (len(prompts) // 2)))
    assert answers == expected
    assert metric(server, "llm_spec_proposed_tokens_total", model) > proposed
    if chat:
        assert "quick brown fox" in answers[1]
        assert metric(server, "llm_spec_accepted_tokens_total", model) > accepted
        with Client(server.grpc_url, "grpc") as client:  # seeded sampling: the same draws, whatever else runs
            sampled = ["".join(client.generate(prompts[3], 24, model=model, temperature=0.8, seed=7))
                       for _ in range(2)]
        assert sampled[0] == sampled[1] and sampled[0]
