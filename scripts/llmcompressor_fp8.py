"""SOURCE -> OUT: an FP8 checkpoint written by llm-compressor itself (its FP8_DYNAMIC scheme: per-channel E4M3
weights, per-token dynamic activations, LM head kept), so the engine's tests load a checkpoint made by the tool
users quantize with, not only by our own writer. Runs in llm-compressor's own venv (`make fp8-reference`): it pins
numpy>=2 and transformers<=5.17, which the serving venv cannot take. FP8_DYNAMIC needs no calibration data, so this
runs on the CPU in about a minute for SmolLM2-135M.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main(source: Path, out: Path) -> int:
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        print(f"{out}: up to date")
        return 0
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(source)
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]))
    partial = out.with_name(out.name + ".partial")
    model.save_pretrained(partial, save_compressed=True)
    tokenizer.save_pretrained(partial)
    partial.rename(out)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    print(f"{out}: written by llm-compressor ({config['quant_method']}, {config['format']})")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
