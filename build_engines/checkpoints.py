"""Tiny random-init checkpoints of the real architectures, saved as ordinary Hugging Face directories.

They stand in for weights we cannot download: the builder and the tests then load them through exactly the same
`from_pretrained` path a real checkpoint takes. Seeds are fixed so every machine builds the same weights.
"""
from __future__ import annotations

import hashlib
import inspect
import shutil
from functools import partial
from pathlib import Path

TINY_ROOT = Path(".checkpoints")
TINY_WORDS = "a photo of the cat and dog on grass red blue car tree person".split()


def tiny_vit(out: Path, hidden_size: int = 64, num_hidden_layers: int = 2, num_attention_heads: int = 4,
             intermediate_size: int = 128, image_size: int = 224, patch_size: int = 16, num_labels: int = 10) -> Path:
    import torch
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessorPil

    torch.manual_seed(0)
    labels = {i: f"class_{i}" for i in range(num_labels)}
    config = ViTConfig(hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                       num_attention_heads=num_attention_heads, intermediate_size=intermediate_size,
                       image_size=image_size, patch_size=patch_size, num_labels=num_labels, id2label=labels,
                       label2id={v: k for k, v in labels.items()})
    ViTForImageClassification(config).save_pretrained(out)
    ViTImageProcessorPil(size={"height": image_size, "width": image_size}).save_pretrained(out)
    return out


def tiny_clip_tokenizer(model_max_length: int = 77):
    """A real CLIPTokenizer over a byte-level vocabulary with a few word merges (no download needed)."""
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    merges = []
    for word in TINY_WORDS:  # merge each word left to right so common words become single tokens
        left = word[0]
        for j, ch in enumerate(word[1:], start=1):
            right = ch + ("</w>" if j == len(word) - 1 else "")
            merges.append((left, right))
            vocab.setdefault(left + right, len(vocab))
            left = left + right
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def byte_bpe(words) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE vocabulary and merges: every byte, plus one token per word (with its leading space, as
    byte-level BPE spells words), merged left to right."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    vocab = {c: i for i, c in enumerate(byte_chars.values())}
    merges = []
    for word in words:
        spelled = "".join(byte_chars[b] for b in (" " + word).encode())
        left = spelled[0]
        for ch in spelled[1:]:
            merges.append((left, ch))
            vocab.setdefault(left + ch, len(vocab))
            left += ch
    return vocab, merges


def byte_level_tokenizer(words: list[str] = (), specials: tuple[str, str] = ("<|begin_of_text|>", "<|end_of_text|>"),
                         add_bos: bool = False):
    """A GPT-2/Llama-3-style byte-level BPE fast tokenizer: every byte is a token, plus one merged token per word in
    `words` (with its leading space, as byte-level BPE spells words). With no words, N bytes are exactly N tokens.
    `add_bos` prepends the first special token to every encoding, as Llama 3's tokenizer does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab, merges = byte_bpe(words)
    for special in specials:
        vocab[special] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    if add_bos:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{specials[0]} $A", pair=f"{specials[0]} $A $B", special_tokens=[(specials[0], vocab[specials[0]])])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=specials[0], eos_token=specials[1])


TINY_LLM_WORDS = TINY_WORDS + "is in the a to of it that was for with as on be at by this".split()


def tiny_llm(out: Path, model_type: str = "llama", hidden_size: int = 64, num_hidden_layers: int = 2,
             num_attention_heads: int = 4, num_key_value_heads: int = 2, intermediate_size: int = 128,
             max_position_embeddings: int = 512, **extra) -> Path:
    """A Llama (or Qwen2) decoder with grouped-query attention and a byte-level tokenizer that adds BOS."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    tokenizer = byte_level_tokenizer(TINY_LLM_WORDS, add_bos=True)
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False, **extra)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random init is tiny; scale it up so greedy outputs vary instead of repeating one token
        for name, param in model.named_parameters():
            if param.dim() == 2 or name.endswith("bias"):
                param.normal_(0, 0.2)
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def tiny_qwen2(out: Path) -> Path:
    return tiny_llm(out, model_type="qwen2")


TINY_CLIP_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
TINY_CLIP_VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        image_size=224, patch_size=32)


def tiny_clip(out: Path, text: dict = TINY_CLIP_TEXT, vision: dict = TINY_CLIP_VISION, projection_dim: int = 32) -> Path:
    import torch
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel

    tokenizer = tiny_clip_tokenizer()
    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), max_position_embeddings=77, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **text),
        vision_config=vision, projection_dim=projection_dim)
    CLIPModel(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    size = vision["image_size"]
    CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size}).save_pretrained(out)
    return out


TINY_LLAVA_TILE = 56  # 4 x 4 patches of 14 px per tile


# LLaVA's conversation format (USER: / ASSISTANT:); an image part becomes the placeholder, as in LLaVA's templates
LLAVA_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() + ': ' }}{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}{{ '<image>\\n' }}{% else %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def llava_next_tokenizer():
    tokenizer = byte_level_tokenizer(TINY_LLM_WORDS, add_bos=True)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    return tokenizer


def llava_next_config(tokenizer, vision: dict, text: dict, pinpoints: list[list[int]]):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig

    return LlavaNextConfig(
        vision_config=CLIPVisionConfig(**vision),
        text_config=LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                eos_token_id=tokenizer.eos_token_id, **text),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"), image_grid_pinpoints=pinpoints,
        vision_feature_layer=-2, vision_feature_select_strategy="default")


def save_llava_next_processor(out: Path, tokenizer, tile: int, pinpoints: list[list[int]]) -> None:
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

    LlavaNextProcessor(
        image_processor=LlavaNextImageProcessorPil(size={"shortest_edge": tile}, crop_size={"height": tile,
                                                   "width": tile}, image_grid_pinpoints=pinpoints),
        tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default", image_token="<image>",
        num_additional_image_tokens=1).save_pretrained(out)


def tiny_llava_next(out: Path) -> Path:
    """A LLaVA-NeXT-shaped model: tiny CLIP vision tower (56 px tiles), 2-layer projector, tiny Llama, `<image>`,
    LLaVA's chat template."""
    import torch
    from transformers import LlavaNextForConditionalGeneration

    tile = TINY_LLAVA_TILE
    tokenizer = llava_next_tokenizer()
    pinpoints = [[tile, 2 * tile], [2 * tile, tile], [2 * tile, 2 * tile], [3 * tile, tile], [tile, 3 * tile]]
    torch.manual_seed(0)
    config = llava_next_config(
        tokenizer, dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        image_size=tile, patch_size=14),
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=1024), pinpoints)
    model = LlavaNextForConditionalGeneration(config)
    with torch.no_grad():  # as tiny_llm: larger weights, so greedy text varies and parity tests see real margins
        for name, param in model.named_parameters():
            if param.dim() == 2 and "language_model" in name:
                param.normal_(0, 0.2)
    model.save_pretrained(out)
    save_llava_next_processor(out, tokenizer, tile, pinpoints)
    return out


LLAVA_1_6_GRID = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
CLIP_VIT_L14_336 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                        image_size=336, patch_size=14)
LLAMA_3_8B_TEXT = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5)


def random_llama(out: Path, text: dict = LLAMA_3_8B_TEXT) -> Path:
    """A decoder of Llama-3-8B's shapes with random bf16 weights (N(0, 0.02), norms 1), made on the GPU when there
    is one, and the tiny byte-level tokenizer, whose vocabulary it keeps (the LM head is 4096 x V, not Llama 3's
    128256 rows): for served-versus-in-process runs of one checkpoint."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = byte_level_tokenizer(TINY_LLM_WORDS, add_bos=True)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False, **text)
    with torch.device("meta"):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device="cuda" if torch.cuda.is_available() else "cpu")
    _random_fill(model)
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _random_fill(model) -> None:
    """N(0, 0.02) weights, unit norms, zero biases, from a fixed seed on the model's device."""
    import torch

    generator = torch.Generator(model.device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.fill_(1)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0, 0.02, generator=generator)


def random_llava_next(out: Path, vision: dict = CLIP_VIT_L14_336, text: dict = LLAMA_3_8B_TEXT,
                      pinpoints: list[list[int]] = LLAVA_1_6_GRID) -> Path:
    """A real-size LLaVA-NeXT with random bf16 weights (N(0, 0.02), norms 1), made on the GPU when there is one:
    8 B parameters would take minutes to initialise on a CPU. Saved like any checkpoint (sharded safetensors)."""
    import torch
    from transformers import LlavaNextForConditionalGeneration

    tokenizer = llava_next_tokenizer()
    config = llava_next_config(tokenizer, vision, text, pinpoints)
    with torch.device("meta"):
        model = LlavaNextForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device="cuda" if torch.cuda.is_available() else "cpu")
    _random_fill(model)
    model.save_pretrained(out)
    save_llava_next_processor(out, tokenizer, vision["image_size"], pinpoints)
    return out


WHISPER_SUPPRESSED = list('"#()*+/:;<=>@[]^_`{|}~')  # symbol tokens Whisper never emits (its suppress_tokens)


def whisper_tokenizer():
    """A real WhisperTokenizer: byte-level BPE (with the tiny word merges), then Whisper's special tokens in the
    real vocabulary's order: end of text, start of transcript, 100 languages, tasks, ..., 1501 timestamps."""
    from transformers import WhisperTokenizer
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    vocab, merges = byte_bpe(TINY_LLM_WORDS)
    vocab["<|endoftext|>"] = len(vocab)
    specials = ["<|startoftranscript|>", *(f"<|{code}|>" for code in LANGUAGES), "<|translate|>", "<|transcribe|>",
                "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>",
                *(f"<|{i * 0.02:.2f}|>" for i in range(1501))]
    tokenizer = WhisperTokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    return tokenizer


def tiny_whisper(out: Path, num_mel_bins: int = 80, d_model: int = 64, layers: int = 2, heads: int = 4,
                 ffn: int = 128, decoder_std: float | None = 0.2, half: bool = False) -> Path:
    """A multilingual Whisper of the real architecture (80 or 128 mel bins, 1500 encoder positions = 30 s), the
    tokenizer above and a generation config like the released checkpoints' (languages, tasks, suppressed tokens).
    `decoder_std` None keeps transformers' initialisation (real-size presets); `half` saves fp16 weights."""
    import torch
    from transformers import GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    tokenizer = whisper_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    eot, sot = ids("<|endoftext|>"), ids("<|startoftranscript|>")
    suppress = sorted(ids(tokenizer.tokenize(c))[0] for c in WHISPER_SUPPRESSED)
    begin_suppress = [ids(tokenizer.tokenize(" ")[0]), eot]
    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=len(tokenizer), num_mel_bins=num_mel_bins, d_model=d_model,
                           encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=heads,
                           decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn,
                           max_source_positions=1500, max_target_positions=448, decoder_start_token_id=sot,
                           bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, suppress_tokens=suppress,
                           begin_suppress_tokens=begin_suppress)
    model = WhisperForConditionalGeneration(config)
    if decoder_std is not None:
        with torch.no_grad():  # as tiny_llm: larger decoder weights, so greedy text varies ...
            for name, param in model.named_parameters():
                if param.dim() == 2 and "decoder" in name:
                    param.normal_(0, decoder_std)
            # ... but small embeddings (= output rows, they are tied) for the special tokens after <|endoftext|>,
            # so text tokens and the end win the argmax as in a trained model, not the 1501 timestamps
            model.model.decoder.embed_tokens.weight[eot + 1:].normal_(0, 0.02)
            for name, param in model.named_parameters():  # LayerNorms told apart: a mixed-up norm changes tokens
                if "layer_norm" in name:
                    param.add_(torch.randn_like(param), alpha=0.1)
    if half:
        model = model.half()
    model.generation_config = GenerationConfig(
        decoder_start_token_id=sot, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, max_length=448,
        is_multilingual=True, lang_to_id={f"<|{c}|>": ids(f"<|{c}|>") for c in LANGUAGES},
        task_to_id={"transcribe": ids("<|transcribe|>"), "translate": ids("<|translate|>")},
        no_timestamps_token_id=ids("<|notimestamps|>"), prev_sot_token_id=ids("<|startofprev|>"),
        suppress_tokens=suppress, begin_suppress_tokens=begin_suppress, max_initial_timestamp_index=50)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    WhisperFeatureExtractor(feature_size=num_mel_bins).save_pretrained(out)
    return out


def tiny_sam(out: Path, hidden: int = 32, layers: int = 2, heads: int = 2, channels: int = 32,
             global_attn: tuple[int, ...] = (1,), vit_mlp: int = 64, decoder_mlp: int = 64, decoder_heads: int = 2,
             half: bool = False, init_range: float = 0.25) -> Path:
    """SAM's real layout (1024 px input, 16 px patches -> a 64 x 64 embedding, 256 x 256 low-res masks) with a
    tiny ViT, prompt encoder and mask decoder (or real sizes, see RANDOM_INIT), and its SamProcessor.

    `init_range` sets the prompt encoder and mask decoder's weights: 0.25 gives the tiny decoder IoU scores and mask
    logits of order 1 (at transformers' 0.02 they are ~1e-4, too small for a 1e-3 score check to mean anything)."""
    import torch
    from transformers import (
        SamConfig,
        SamImageProcessorPil,
        SamMaskDecoderConfig,
        SamModel,
        SamProcessor,
        SamPromptEncoderConfig,
        SamVisionConfig,
    )

    torch.manual_seed(0)
    config = SamConfig(
        # initializer_range: SamVisionConfig's default (1e-10) makes an encoder whose embedding is ~0 for any image
        vision_config=SamVisionConfig(initializer_range=0.02, hidden_size=hidden, num_hidden_layers=layers,
                                      num_attention_heads=heads, output_channels=channels, mlp_dim=vit_mlp,
                                      global_attn_indexes=list(global_attn), num_pos_feats=channels // 2),
        prompt_encoder_config=SamPromptEncoderConfig(hidden_size=channels),
        mask_decoder_config=SamMaskDecoderConfig(hidden_size=channels, mlp_dim=decoder_mlp,
                                                 num_attention_heads=decoder_heads, iou_head_hidden_dim=channels),
        initializer_range=init_range)
    model = SamModel(config)
    with torch.no_grad():  # the positional tables start at zero: random values exercise them
        for name, param in model.vision_encoder.named_parameters():
            if "pos" in name:
                param.normal_(std=0.02)
    (model.to(torch.bfloat16) if half else model).save_pretrained(out)
    SamProcessor(image_processor=SamImageProcessorPil()).save_pretrained(out)
    return out


TINY_BUILDERS = {"vit": tiny_vit, "clip": tiny_clip, "llm": tiny_llm, "qwen2": tiny_qwen2,
                 "llava_next": tiny_llava_next, "whisper": tiny_whisper, "sam": tiny_sam}

# Real-size architectures with random weights, for GPU benchmarks: preset -> (model family, builder)
RANDOM_INIT = {
    "vit-b16-224": ("vit", partial(tiny_vit, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                   intermediate_size=3072, image_size=224, patch_size=16, num_labels=1000)),
    "clip-vit-l14-336": ("clip", partial(
        tiny_clip, text=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
        vision=CLIP_VIT_L14_336, projection_dim=768)),
    "llama-3-8b": ("llm", random_llama),  # Llama-3-8B shapes, the tiny tokenizer's vocabulary
    "llava-next-8b": ("vlm", random_llava_next),  # CLIP ViT-L/14-336 + Llama-3-8B shapes, LLaVA-1.6 grid
    "sam-vit-h": ("sam", partial(tiny_sam, hidden=1280, layers=32, heads=16, channels=256,
                                 global_attn=(7, 15, 23, 31), vit_mlp=5120, decoder_mlp=2048, decoder_heads=8,
                                 half=True, init_range=0.02)),
    "whisper-large-v3": ("whisper", partial(tiny_whisper, num_mel_bins=128, d_model=1280, layers=32, heads=20,
                                            ffn=5120, decoder_std=None, half=True)),
}


def random_init_checkpoint(preset: str, root: Path = TINY_ROOT) -> tuple[str, Path]:
    """(family, path) of a real-size random-init checkpoint (the text tower keeps the tiny tokenizer's vocabulary)."""
    family, build = RANDOM_INIT[preset]
    out = root / f"random-{preset}"
    if not out.exists():  # written aside, then renamed: an interrupted build (16 GB for 8 B) is never taken as done
        partial = root / f"random-{preset}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        build(partial)
        partial.rename(out)
    return family, out


TINY_SOURCE = {"anyres": "llava_next", "vlm": "llava_next"}  # model families built from another family's checkpoint


def tiny_checkpoint(family: str, root: Path = TINY_ROOT) -> Path:
    """Path of the tiny checkpoint for a model family, created on first use."""
    name = TINY_SOURCE.get(family, family)
    out, build = root / f"tiny-{name}", TINY_BUILDERS[name]
    stamp = hashlib.sha256(inspect.getsource(build).encode()).hexdigest()[:16]  # rebuilt when its builder changes
    if not (out / "config.json").exists() or not (out / ".builder").exists() or \
            (out / ".builder").read_text() != stamp:
        shutil.rmtree(out, ignore_errors=True)
        build(out)
        (out / ".builder").write_text(stamp)
    return out
