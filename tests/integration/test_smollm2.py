"""The trained SmolLM2 served as `smollm2` beside the tiny `llm`, by the same backend: streamed answers to concurrent
chat prompts equal transformers' greedy answers, ending at the end-of-turn token."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from client.sdk import Client

QUESTIONS = ["What is the capital of France?", "Name a fruit that is yellow.", "What color is the sky?",
             "Write one sentence about cats."]


def test_served_answers_equal_transformers(server, smollm2_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, dtype=torch.float32).eval()
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in QUESTIONS]
    expected = []
    for chat in chats:
        ids = tokenizer(chat, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=40, do_sample=False)[0, ids.input_ids.shape[1]:]
        expected.append(tokenizer.decode(out, skip_special_tokens=True))

    def ask(chat: str) -> str:
        with Client(server.grpc_url, "grpc") as client:
            return "".join(client.generate(chat, 40, model="smollm2"))

    with ThreadPoolExecutor(len(chats)) as pool:
        answers = list(pool.map(ask, chats))
    assert answers == expected
    assert "Paris" in answers[0]
