"""backends/llm/adapters.py: PEFT LoRA folders read from an adapter root, and everything a hostile or mistaken
adapter can do refused with the reason before a tensor is read."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from backends.llm.adapters import AdapterError, AdapterLimits, load_adapter
from backends.llm.model import ModelArgs
from build_engines.checkpoints import tiny_checkpoint
from tests.conftest import ROOT

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base() -> Path:
    return tiny_checkpoint("llm", ROOT / ".checkpoints")


def save_peft_adapter(base: Path, out: Path, rank: int = 4, alpha: int = 8, targets=TARGETS, **options) -> dict:
    """A real adapter: peft wraps the base model (random A and B, as after training) and saves it; its state dict."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(rank)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                                      **options))
    model.save_pretrained(out)
    return {k: v for k, v in model.state_dict().items() if "lora_" in k}


@pytest.fixture()
def root(tmp_path, base) -> Path:
    root = tmp_path / "adapters"
    save_peft_adapter(base, root / "french")
    return root


def test_a_peft_adapter_loads_with_its_weights_rank_and_scaling(tmp_path, base):
    args = ModelArgs.from_checkpoint(base)
    theirs = save_peft_adapter(base, tmp_path / "a", rank=4, alpha=16)
    adapter = load_adapter(tmp_path, "a", args)
    assert (adapter.name, adapter.rank, adapter.scaling) == ("a", 4, 4.0)
    assert set(adapter.weights) == {(i, m) for i in range(args.num_hidden_layers) for m in TARGETS}
    a, b = adapter.weights[(1, "down_proj")]
    prefix = "base_model.model.model.layers.1.mlp.down_proj"
    assert torch.equal(a, theirs[f"{prefix}.lora_A.default.weight"])
    assert torch.equal(b, theirs[f"{prefix}.lora_B.default.weight"])
    save_peft_adapter(base, tmp_path / "rs", rank=4, alpha=16, use_rslora=True)
    assert load_adapter(tmp_path, "rs", args).scaling == 8.0  # alpha / sqrt(r)


@pytest.mark.parametrize("name", ["../adapters", "a/b", "", ".", "..", "x" * 65, "naïve", "a b", None])
def test_names_that_are_not_plain_folder_names_are_refused(root, base, name):
    with pytest.raises(AdapterError, match="adapter name"):
        load_adapter(root, name, ModelArgs.from_checkpoint(base))


def test_an_unknown_adapter_is_refused(root, base):
    with pytest.raises(AdapterError, match="not in the adapter root"):
        load_adapter(root, "german", ModelArgs.from_checkpoint(base))


def test_symlinks_leaving_the_root_are_refused_before_reading(tmp_path, root, base):
    args = ModelArgs.from_checkpoint(base)
    outside = tmp_path / "outside"
    shutil.copytree(root / "french", outside)
    (root / "linked").symlink_to(outside, target_is_directory=True)
    with pytest.raises(AdapterError, match="outside the adapter root"):
        load_adapter(root, "linked", args)
    (root / "file_linked").mkdir()
    shutil.copy(root / "french" / "adapter_config.json", root / "file_linked")
    (root / "file_linked" / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="outside the adapter root"):
        load_adapter(root, "file_linked", args)
    (root / "inner").symlink_to(root / "french", target_is_directory=True)  # a link that stays inside is fine
    assert load_adapter(root, "inner", args).rank == 4


def test_pickled_weights_are_refused(root, base):
    folder = root / "pickled"
    folder.mkdir()
    shutil.copy(root / "french" / "adapter_config.json", folder)
    torch.save({"x": torch.zeros(1)}, folder / "adapter_model.bin")
    with pytest.raises(AdapterError, match=r"only safetensors are read, not \['adapter_model.bin'\]"):
        load_adapter(root, "pickled", ModelArgs.from_checkpoint(base))


def test_rank_targets_and_options_beyond_the_engine_are_refused(tmp_path, root, base):
    args = ModelArgs.from_checkpoint(base)
    with pytest.raises(AdapterError, match="rank 4; this model takes ranks 1 to 2"):
        load_adapter(root, "french", args, AdapterLimits(max_rank=2))
    with pytest.raises(AdapterError, match=r"target modules \['down_proj'\] are not supported"):
        load_adapter(root, "french", args, AdapterLimits(targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                   "up_proj")))
    config = json.loads((root / "french" / "adapter_config.json").read_text())
    for key, value, reason in [("use_dora", True, "DoRA"), ("rank_pattern", {"q_proj": 8}, "per-module ranks"),
                               ("peft_type", "IA3", "peft_type"), ("lora_alpha", "8", "lora_alpha")]:
        folder = tmp_path / "adapters" / f"bad-{key}"
        shutil.copytree(root / "french", folder)
        (folder / "adapter_config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(AdapterError, match=reason):
            load_adapter(root, folder.name, args)
    (root / "french" / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="not JSON"):
        load_adapter(root, "french", args)


def test_an_adapter_for_another_base_model_is_refused(tmp_path, root, base):
    """Trained on a model of other dimensions: the shapes do not fit, and the message names the tensor."""
    from dataclasses import replace

    args = ModelArgs.from_checkpoint(base)
    with pytest.raises(AdapterError, match=r"has shape .* the model needs .* \(another base model\?\)"):
        load_adapter(root, "french", replace(args, intermediate_size=args.intermediate_size * 2))
    with pytest.raises(AdapterError, match="is for layer 1; the model has 1"):
        load_adapter(root, "french", replace(args, num_hidden_layers=1))
