"""LoRA in the engine: every row of a mixed batch (base, adapter A, adapter B, the router's Top-2 mix) decodes the
tokens transformers + peft decode with that adapter applied; slots, caches, unloading and routing."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from backends.llm.adapter_cache import AdapterCache
from backends.llm.adapters import AdapterNotFound, LoraAdapter, load_router
from backends.llm.engine import EngineConfig, LLMEngine
from backends.llm.lora import LoraSlots, LoraStep, plan_tiles
from backends.llm.model import ModelArgs
from backends.llm.sampling import SamplingParams
from build_engines.checkpoints import tiny_checkpoint
from tests.conftest import ROOT
from tests.unit.test_adapters import save_peft_adapter

PROMPTS = ["a photo of the cat", "red car", "the dog is on the grass and the person is in the tree", "x"]
TOKENS = 16


@pytest.fixture(scope="module", params=["llm", "qwen2"])
def base(request) -> Path:
    return tiny_checkpoint(request.param, ROOT / ".checkpoints")


@pytest.fixture(scope="module")
def root(base, tmp_path_factory) -> Path:
    """Two adapters of different ranks and targets (one attention-only), and a router over them."""
    root = tmp_path_factory.mktemp("adapters")
    save_peft_adapter(base, root / "alpha", rank=8, alpha=16)
    save_peft_adapter(base, root / "beta", rank=4, alpha=4, targets=["q_proj", "v_proj", "o_proj"])
    save_peft_adapter(base, root / "gamma", rank=2, alpha=8, targets=["gate_proj", "down_proj"])
    hidden = ModelArgs.from_checkpoint(base).hidden_size
    from safetensors.torch import save_file

    torch.manual_seed(5)
    gate = {"weight": torch.randn(3, hidden), "bias": torch.tensor([0.0, 0.3, -0.2])}
    save_file(gate, str(root / "router.safetensors"))
    (root / "router.json").write_text(json.dumps({"adapters": ["alpha", "beta", "gamma"]}))
    return root


@pytest.fixture(scope="module")
def peft_greedy(base, root):
    """Greedy tokens of transformers with peft applying `adapter` (None: the base model; a dict: peft's weighted
    combination of adapters, the exact sum of their products)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), root / "alpha",
                                      adapter_name="alpha").eval()
    for name in ("beta", "gamma"):
        model.load_adapter(root / name, adapter_name=name)
    mixes = 0

    def greedy(prompt: str, adapter) -> list[int]:
        nonlocal mixes
        ids = tokenizer(prompt, return_tensors="pt")
        if isinstance(adapter, dict):
            mixes += 1
            model.add_weighted_adapter(list(adapter), list(adapter.values()), f"mix{mixes}", combination_type="cat")
            adapter = f"mix{mixes}"
        with torch.inference_mode():
            if adapter is None:
                with model.disable_adapter():
                    out = model.generate(**ids, max_new_tokens=TOKENS, do_sample=False)
            else:
                model.set_adapter(adapter)
                out = model.generate(**ids, max_new_tokens=TOKENS, do_sample=False)
        out = out[0, ids.input_ids.shape[1]:].tolist()
        return out[:-1] if out and out[-1] == tokenizer.eos_token_id else out
    greedy.embeddings = model.get_input_embeddings().weight.detach()
    greedy.tokenizer = tokenizer
    return greedy


def make_engine(base, root, **overrides) -> LLMEngine:
    config = {"dtype": "fp32", "device": "cpu", "kv_cache_memory_mb": 8, "max_loras": 3, "max_lora_rank": 8,
              "lora_root": str(root), **overrides}
    return LLMEngine(base, EngineConfig(**config))


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]  # on a GPU: decode steps replay CUDA graphs


@pytest.mark.parametrize("device,overlap", [(device, False) for device in DEVICES] + [(DEVICES[-1], True)])
def test_each_row_of_a_mixed_batch_equals_peft_with_its_adapter(base, root, peft_greedy, device, overlap):
    """(`overlap`: decode steps launched ahead of their tokens keep each row's adapters.)"""
    engine = make_engine(base, root, device=device, overlap_steps=overlap)
    router = load_router(root, engine.model.args)
    rows = []  # (prompt, lora_id, what peft applies)
    for i, prompt in enumerate(PROMPTS):
        rows += [(prompt, None, None), (prompt, "alpha", "alpha"), (prompt, "beta", "beta"), (prompt, "gamma", "gamma")]
        ids = peft_greedy.tokenizer(prompt)["input_ids"]
        pooled = peft_greedy.embeddings[ids].mean(0)  # the router's input, computed from transformers' embeddings
        scores = router.weight @ pooled + router.bias
        top = torch.topk(scores, 2)
        rows.append((prompt, "auto", dict(zip([router.adapters[j] for j in top.indices.tolist()],
                                               torch.softmax(top.values, 0).tolist()))))
    seqs = [engine.add(prompt, SamplingParams(max_tokens=TOKENS),
                       lora=engine.choose_adapters(lora_id, prompt) if lora_id else ()) for prompt, lora_id, _ in rows]
    while engine.has_work:
        engine.step()
    assert engine.stats.max_decode_batch == len(rows)  # every kind of row in one step
    for (prompt, lora_id, applied), seq in zip(rows, seqs):
        assert seq.output_ids == peft_greedy(prompt, applied), (prompt, lora_id)
    outputs = {lora_id: seq.output_ids for (prompt, lora_id, _), seq in zip(rows, seqs) if prompt == PROMPTS[0]}
    assert len({tuple(v) for v in outputs.values()}) >= 4  # the adapters change what the model says
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert sum(engine.adapters.slot_users) == 0 and all(a.users == 0 for a in engine.adapters.host.values())


def test_more_adapters_than_slots_wait_for_a_slot_and_still_decode_their_tokens(base, root, peft_greedy):
    """One device slot, three adapters in the queue: each runs when the slot frees (in arrival order), with its own
    weights."""
    engine = make_engine(base, root, max_loras=1, max_cpu_loras=3)
    seqs = [engine.add(PROMPTS[1], SamplingParams(max_tokens=TOKENS), lora=engine.choose_adapters(name, PROMPTS[1]))
            for name in ("alpha", "beta", "gamma", "alpha")]
    base_seq = engine.add(PROMPTS[1], SamplingParams(max_tokens=TOKENS))
    while engine.has_work:
        engine.step()
    for name, seq in zip(("alpha", "beta", "gamma", "alpha"), seqs):
        assert seq.output_ids == peft_greedy(PROMPTS[1], name), name
    assert base_seq.output_ids == peft_greedy(PROMPTS[1], None)
    stats = engine.adapters.stats
    assert (stats.loads, stats.slot_loads, stats.slot_evictions) == (3, 4, 3)  # read once each, placed in turn


def test_prefix_blocks_are_not_shared_between_adapters(base, root, peft_greedy):
    engine = make_engine(base, root, block_size=4)
    prompt = PROMPTS[2]
    first = engine.generate([prompt], SamplingParams(max_tokens=4))[0]
    hits = engine.blocks.hit_tokens
    alpha = engine.add(prompt, SamplingParams(max_tokens=TOKENS), lora=engine.choose_adapters("alpha", prompt))
    while engine.has_work:
        engine.step()
    assert engine.blocks.hit_tokens == hits and alpha.output_ids == peft_greedy(prompt, "alpha")
    again = engine.add(prompt, SamplingParams(max_tokens=4), lora=engine.choose_adapters("alpha", prompt))
    while engine.has_work:
        engine.step()
    assert engine.blocks.hit_tokens > hits and again.output_ids == alpha.output_ids[:4]  # same adapter: shared
    assert first.output_ids == peft_greedy(prompt, None)[:4]


def test_lora_on_an_engine_without_slots_is_refused(base, root):
    engine = make_engine(base, root, max_loras=0)
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        engine.choose_adapters("alpha", "x")
    one_slot = make_engine(base, root, max_loras=1)  # a Top-2 mix needs two slots at once: refused, not queued forever
    with pytest.raises(ValueError, match="mixes 2 adapters; this model has 1 LoRA slot"):
        one_slot.add("x", SamplingParams(max_tokens=2), lora=one_slot.choose_adapters("auto", "x"))


def fake_adapter(name: str, args: ModelArgs) -> LoraAdapter:
    a, b = torch.randn(2, args.hidden_size), torch.randn(args.num_attention_heads * args.head_dim, 2)
    return LoraAdapter(name, 2, 1.0, {(0, "q_proj"): (a, b)})


def test_host_cache_evicts_the_least_recently_used_idle_adapter_and_refuses_when_all_are_in_use(base, root):
    args = ModelArgs.from_checkpoint(base)
    cache = AdapterCache(root, args, LoraSlots(args, 1, 8, torch.float32, "cpu"), host_capacity=2)
    alpha, beta = cache.get("alpha"), cache.get("beta")
    cache.get("alpha")  # beta is now the least recently used
    cache.get("gamma")
    assert list(cache.host) == ["alpha", "gamma"] and cache.stats.evictions == 1
    cache.hold([alpha])
    slot = cache.acquire([cache.get("gamma")])  # gamma on the device: in use too
    from backends.core.errors import Unavailable

    with pytest.raises(Unavailable, match="all 2 adapters of the host cache are in use"):
        cache.get("beta")
    assert cache.acquire([alpha]) is None  # the one slot is busy: no slot, nothing taken
    cache.release(slot)
    assert cache.get("beta") is not beta and list(cache.host) == ["alpha", "beta"]  # gamma (idle) went
    assert cache.acquire([alpha]) == slot  # the freed slot is reused


def test_unload_refuses_new_requests_and_lets_running_ones_finish(base, root, peft_greedy):
    engine = make_engine(base, root)
    running = engine.add(PROMPTS[0], SamplingParams(max_tokens=TOKENS), lora=engine.choose_adapters("beta", PROMPTS[0]))
    engine.step()
    assert engine.adapters.unload("beta").users == 1  # one sequence still uses it
    with pytest.raises(AdapterNotFound, match="unloaded; load it again"):
        engine.choose_adapters("beta", PROMPTS[0])
    while engine.has_work:
        engine.step()
    assert running.output_ids == peft_greedy(PROMPTS[0], "beta") and running.finish_reason in ("length", "stop")
    assert engine.adapters.on_device == 0  # its slot was freed when the last user finished
    engine.adapters.load("beta")
    listing = engine.adapters.listing()
    assert [a["name"] for a in listing["loaded"]] == ["beta"] and listing["available"] == ["alpha", "gamma"]
    with pytest.raises(AdapterNotFound, match="not in the adapter root"):
        engine.choose_adapters("delta", PROMPTS[0])


def step_of(slots: LoraSlots, rows: list[tuple[list[int], list[float]]], device="cpu") -> LoraStep:
    """The step whose row i uses the adapters rows[i] = (slots, weights) (weights 0: none)."""
    plan = plan_tiles((i, 1, s, w) for i, (s, w) in enumerate(rows))
    return LoraStep(slots, *(torch.from_numpy(t).to(device) for t in (plan.perm, plan.tiles, plan.weights)),
                    torch.tensor([len(plan.tiles)], device=device))


def test_the_slot_product_equals_each_rows_own_adapter(base):
    """ProjectionSlots.add_to against x A^T B^T per row, for fused parts, padded ranks and a two-adapter mix."""
    args = ModelArgs.from_checkpoint(base)
    slots = LoraSlots(args, 3, 8, torch.float64, "cpu")
    torch.manual_seed(0)
    q, kv = args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim
    weights = {}
    for index, rank in enumerate((8, 3, 5)):
        weights[index] = {m: (torch.randn(rank, args.hidden_size, dtype=torch.float64),
                              torch.randn(out, rank, dtype=torch.float64))
                          for m, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv))}
        slots.write(index, LoraAdapter(f"a{index}", rank, 1.0, {(0, m): ab for m, ab in weights[index].items()}))
    x = torch.randn(4, args.hidden_size, dtype=torch.float64)
    step = step_of(slots, [([0, 0], [0.5, 0.0]), ([1, 0], [2.0, 0.0]), ([2, 1], [0.25, 0.75]), ([0, 0], [0.0, 0.0])])
    base = torch.randn(4, q + 2 * kv, dtype=torch.float64)
    got = base.clone()
    step.layer(0)["qkv_proj"](got, x)

    def own(row, index):
        return torch.cat([x[row] @ a.t() @ b.t() for a, b in weights[index].values()])
    expected = base + torch.stack([0.5 * own(0, 0), 2.0 * own(1, 1), 0.25 * own(2, 2) + 0.75 * own(2, 1),
                                   torch.zeros(q + 2 * kv, dtype=torch.float64)])
    torch.testing.assert_close(got, expected)


def test_tiles_group_rows_by_their_adapters_and_skip_rows_without():
    """Rows with equal (slots, weights) share tiles of at most TILE_ROWS rows, in first-seen order."""
    rows = [([1, 0], [1.0, 0.0])] * 20 + [([0, 0], [0.0, 0.0])] + [([2, 1], [0.5, 0.5]), ([1, 0], [1.0, 0.0])]
    plan = plan_tiles((i, 1, s, w) for i, (s, w) in enumerate(rows))
    assert plan.tiles.tolist() == [[0, 16, 1, 0], [16, 5, 1, 0], [21, 1, 2, 1]]
    assert plan.weights.tolist() == [[1.0, 0.0], [1.0, 0.0], [0.5, 0.5]]
    assert plan.perm.tolist() == list(range(20)) + [22, 21]
    run = plan_tiles([(3, 40, [1, 0], [2.0, 0.0])])  # a prefill: one run of 40 rows
    assert run.tiles[:, :2].tolist() == [[0, 16], [16, 16], [32, 8]] and run.perm.tolist() == list(range(3, 43))


@pytest.mark.parametrize("k_split,dtype", [(1024, torch.float32), (32, torch.float32)]
                         + ([(1024, torch.bfloat16)] if torch.cuda.is_available() else []))
def test_lora_kernels_equal_each_rows_own_adapters(monkeypatch, k_split, dtype):
    """backends/llm/lora_kernels.py (Triton's interpreter here; the compiled kernel on a GPU) against x A^T B per row:
    shared and distinct adapters, tiles of several rows, a two-adapter mix, rows without adapters, padded ranks,
    parts whose widths are not multiples of the column block, K in several splits, several column blocks a program,
    tile buffers longer than the tiles in use (as a CUDA graph's: the entries past them hold a tile that must not
    run); on a GPU also in bf16 (the engine's dtype), within bf16's rounding of the reference."""
    import backends.llm.lora_kernels as kernels

    monkeypatch.setattr(kernels, "K_SPLIT", k_split)
    monkeypatch.setattr(kernels, "BLOCK_K", min(kernels.BLOCK_K, k_split))
    if k_split < 1024:  # column blocks of 32, two a program: chunks that end inside or past a part
        monkeypatch.setattr(kernels, "BLOCK_N", 32)
        monkeypatch.setattr(kernels, "CHUNK", 2)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1)
    n_in, widths, num_slots, r_max = 96, (160, 48, 48), 4, 8
    a = torch.zeros(len(widths), num_slots, r_max, n_in)
    b = torch.zeros(num_slots, r_max, sum(widths))
    for slot, rank in enumerate((8, 3, 5, 8)):
        a[:, slot, :rank] = torch.randn(len(widths), rank, n_in, generator=g) / n_in ** 0.5
        b[slot, :rank] = torch.randn(rank, sum(widths), generator=g)
    rows = [([i % 2, 0], [1.0 + i % 2, 0.0]) for i in range(19)] + [([3, 2], [0.25, 0.75]), ([0, 0], [0.0, 0.0])] \
        + [([2, 0], [0.5, 0.0])] * 3
    x = torch.randn(len(rows), n_in, generator=g)
    out = torch.randn(len(rows), sum(widths), generator=g)
    expected = out.clone()
    for i, (slots, weights) in enumerate(rows):
        for slot, weight in zip(slots, weights):
            expected[i] += weight * torch.cat([x[i] @ a[p, slot].t() for p in range(len(widths))]
                                              ).view(len(widths), r_max).flatten() @ torch.block_diag(
                *[b[slot, :, sum(widths[:p]):sum(widths[:p + 1])] for p in range(len(widths))])
    step = step_of(None, rows, device)
    stale = torch.tensor([[0, 16, 1, 0]] * 3, device=device)  # tiles past tile_count: 16 rows of adapter 1
    tiles, weights = torch.cat([step.tiles, stale]), torch.cat([step.weights, torch.ones(3, 2, device=device)])
    got = out.to(device, dtype)
    kernels.add_lora(got, *(t.to(device, dtype) for t in (x, a, b)), widths, step.perm, tiles, weights,
                     step.tile_count)
    exact = dtype == torch.float32
    torch.testing.assert_close(got.float().cpu(), expected, rtol=1e-5 if exact else 2e-2, atol=1e-4 if exact else 0.1)


def test_speculation_keeps_each_rows_adapter_tokens(base, root, peft_greedy):
    """Speculative decoding with adapters: the draft (the base model itself here) proposes without them, the verify
    rows apply each row's adapter, so base rows accept every proposal and adapter rows keep peft's tokens."""
    engine = make_engine(base, root, speculative="draft", draft_model=str(base.resolve()), speculative_max_batch=16,
                         speculative_schedule="fixed")
    rows = [(prompt, lora_id) for prompt in PROMPTS[:3] for lora_id in (None, "alpha", "beta", "gamma")]
    seqs = [engine.add(prompt, SamplingParams(max_tokens=TOKENS),
                       lora=engine.choose_adapters(lora_id, prompt) if lora_id else ()) for prompt, lora_id in rows]
    while engine.has_work:
        engine.step()
    for (prompt, lora_id), seq in zip(rows, seqs):
        assert seq.output_ids == peft_greedy(prompt, lora_id), (prompt, lora_id)
    assert 0 < engine.stats.accepted_tokens < engine.stats.proposed_tokens  # the adapters refused some proposals
    assert engine.blocks.num_free == engine.blocks.num_blocks and sum(engine.adapters.slot_users) == 0
