"""python -m build_engines.draft CHECKPOINT OUT --layers N: a draft model for speculative decoding cut from the model
itself (its embeddings, first N decoder layers, final norm and LM head; the same tokenizer), saved as a Hugging Face
checkpoint. Untrained it already agrees with the model on easy tokens; perf/train_draft.py distils it further."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch


def truncated_draft(checkpoint: Path, out: Path, layers: int) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    total = model.config.get_text_config().num_hidden_layers
    if not 1 <= layers < total:
        raise ValueError(f"a draft keeps 1 to {total - 1} of the model's {total} layers, not {layers}")
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(checkpoint).save_pretrained(out)
    if (checkpoint / "generation_config.json").exists():
        (out / "generation_config.json").write_bytes((checkpoint / "generation_config.json").read_bytes())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, required=True, help="decoder layers the draft keeps")
    args = parser.parse_args(argv)
    truncated_draft(args.checkpoint, args.out, args.layers)
    print(f"draft with {args.layers} layers written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
