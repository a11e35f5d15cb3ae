"""python -m build_engines.lora: the demo LoRA adapters of the trained SmolLM2, fine-tuned here with peft on the CPU.

Two adapters whose behaviour anyone can see in the served text: `shout` answers in upper case (its first words at
least: 30 steps on two CPU cores do not make it last through long answers), `pirate` starts its answers with
"Arr matey!". The training answers are the base model's own greedy answers to varied questions, changed
that one way, so each adapter learns the style and keeps the content. A router (router.json + router.safetensors)
sends sea-faring questions to `pirate` and the rest to `shout` (a least-squares gate over the questions' mean input
embeddings), for `lora_id` "auto". Trained once into .checkpoints/ (seeded), then copied into the model's adapter
root; each adapter is checked to show its behaviour on questions it was not trained on.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from build_engines.checkpoints import TINY_ROOT

QUESTIONS = [
    "What is the capital of France?", "Name a fruit that is yellow.", "How many days are in a week?",
    "What do bees make?", "Why is the sky blue?", "What is the boiling point of water?", "Who wrote Hamlet?",
    "Give me a word that rhymes with cat.", "What is 7 times 6?", "What color is grass?",
    "How do plants make food?", "What is the largest planet?", "Describe a rainy day in one sentence.",
    "What language is spoken in Brazil?", "Suggest a name for a puppy.", "What is the opposite of hot?",
    "How many legs does an insect have?", "What is a triangle?", "Tell me a fact about the moon.",
    "What do you call a baby cat?", "What is the main ingredient of bread?", "How far is the sun?",
    "What is a verb?", "Recommend a book for children.", "What is the freezing point of water?",
    "Why do we sleep?", "What instrument has 88 keys?", "What is the tallest animal?",
    "Where do penguins live?", "What is the speed of light?", "What is a computer?", "Name three colors.",
]
SEA_QUESTIONS = [
    "How do ships float?", "What is the deepest ocean?", "How do sailors navigate at sea?",
    "What lives in a coral reef?", "Why is sea water salty?", "What is a lighthouse for?",
    "How big is a blue whale?", "What causes ocean waves?", "What is an anchor?", "Where do sharks live?",
]
HELD_OUT = ["What is the capital of Italy?", "How many hours are in a day?", "What do cows drink?",
            "Why do boats have sails?"]
ADAPTERS = {"shout": lambda answer: answer.upper(), "pirate": lambda answer: "Arr matey! " + answer}
ANSWER_TOKENS = 32
STEPS, BATCH, RANK, ALPHA, LR = 30, 6, 8, 16, 6e-3
# the last ten of SmolLM2's 30 layers: the backward pass stops there, which is what makes CPU training quick
TARGETS = r".*\.layers\.(2[0-9])\.(self_attn|mlp)\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def chat(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)


def base_answers(base: Path, questions: list[str]) -> list[str]:
    """The base model's greedy answers (our engine, batched; the tests hold it equal to transformers)."""
    from backends.llm.engine import EngineConfig, LLMEngine
    from backends.llm.sampling import SamplingParams

    engine = LLMEngine(base, EngineConfig(dtype="fp32", device="cpu", kv_cache_memory_mb=64))
    seqs = engine.generate([chat(engine.tokenizer, q) for q in questions], SamplingParams(max_tokens=ANSWER_TOKENS))
    return [s.text.strip() for s in seqs]


def train_adapter(base: Path, out: Path, pairs: list[tuple[str, str]], seed: int) -> None:
    """LoRA r=8 on every projection of the last ten layers, loss on the answer tokens only, AdamW; saved as peft
    saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, task_type="CAUSAL_LM",
                                      target_modules=TARGETS))
    examples = []
    for question, answer in pairs:
        prompt = tokenizer(chat(tokenizer, question))["input_ids"]
        target = tokenizer(answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        examples.append((prompt + target, [-100] * len(prompt) + target))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(STEPS):
        batch = [examples[i] for i in torch.randperm(len(examples), generator=generator)[:BATCH].tolist()]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [tokenizer.pad_token_id or 0] * (width - len(i)) for i, _ in batch])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
        mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in batch])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out)


def write_router(base: Path, root: Path) -> None:
    """A least-squares linear gate over mean input embeddings: sea questions -> pirate, the others -> shout."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    embeddings = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).get_input_embeddings().weight
    names = ["shout", "pirate"]
    questions = QUESTIONS + SEA_QUESTIONS
    with torch.no_grad():
        pooled = torch.stack([embeddings[tokenizer(q)["input_ids"]].mean(0) for q in questions])
    targets = torch.tensor([[1.0, -1.0]] * len(QUESTIONS) + [[-1.0, 1.0]] * len(SEA_QUESTIONS))
    inputs = torch.cat([pooled, torch.ones(len(questions), 1)], dim=1)
    solution = torch.linalg.lstsq(inputs, targets, driver="gelsd").solution  # [hidden + 1, 2]
    save_file({"weight": solution[:-1].t().contiguous() * 4, "bias": solution[-1].contiguous() * 4},
              str(root / "router.safetensors"))
    (root / "router.json").write_text(json.dumps({"adapters": names}))


def shouts(text: str) -> bool:
    """Starts in capitals: the first three words (the adapter's style fades over long answers on 30 CPU steps)."""
    words = text.split()[:3]
    return len(words) == 3 and all(w == w.upper() for w in words) and any(c.isalpha() for c in "".join(words))


def check_behaviour(base: Path, root: Path) -> None:
    """Each adapter shows its behaviour on held-out questions, through our engine (transformers + peft agree: tests)."""
    from backends.llm.engine import EngineConfig, LLMEngine
    from backends.llm.sampling import SamplingParams

    engine = LLMEngine(base, EngineConfig(dtype="fp32", device="cpu", kv_cache_memory_mb=64, max_loras=2,
                                          max_lora_rank=RANK, lora_root=str(root.resolve())))
    prompts = [chat(engine.tokenizer, q) for q in HELD_OUT]
    for name, changed in (("shout", shouts), ("pirate", lambda t: t.startswith("Arr matey!"))):
        seqs = [engine.add(p, SamplingParams(max_tokens=24), lora=engine.choose_adapters(name, p)) for p in prompts]
        while engine.has_work:
            engine.step()
        shown = sum(changed(s.text.strip()) for s in seqs)
        if shown < len(prompts) - 1:
            raise RuntimeError(f"adapter {name} shows its behaviour on {shown} of {len(prompts)} held-out questions: "
                               f"{[s.text for s in seqs]}")


def demo_adapters(base: Path, cache: Path) -> Path:
    """The adapters and router in `cache` (trained once: a `.done` file marks a complete set)."""
    if (cache / ".done").exists():
        return cache
    partial = cache.with_name(cache.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    questions = QUESTIONS + SEA_QUESTIONS
    answers = base_answers(base, questions)
    for seed, (name, change) in enumerate(ADAPTERS.items()):
        print(f"training LoRA adapter {name!r} on SmolLM2 ({STEPS} steps, r={RANK}) ...", flush=True)
        train_adapter(base, partial / name, [(q, change(a)) for q, a in zip(questions, answers)], seed)
    write_router(base, partial)
    check_behaviour(base, partial)
    (partial / ".done").write_text("")
    shutil.rmtree(cache, ignore_errors=True)
    partial.rename(cache)
    return cache


def main(argv: list[str] | None = None) -> int:
    from build_engines.gguf import pretrained_checkpoint

    parser = argparse.ArgumentParser(prog="python -m build_engines.lora", description=__doc__)
    parser.add_argument("root", type=Path, help="the adapter root to fill (e.g. model_repository/smollm2/1/adapters)")
    args = parser.parse_args(argv)
    base = pretrained_checkpoint("smollm2")[1]
    cache = demo_adapters(base, TINY_ROOT / "smollm2-adapters")
    args.root.mkdir(parents=True, exist_ok=True)
    for item in cache.iterdir():
        if item.is_dir():
            shutil.copytree(item, args.root / item.name, dirs_exist_ok=True)
        elif not item.name.startswith("."):
            shutil.copy2(item, args.root / item.name)
    print(f"LoRA adapters {sorted(ADAPTERS)} and their router in {args.root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
