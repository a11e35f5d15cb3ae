"""FP8 E4M3 (backends/llm/fp8.py): quantization error bounds, the scaled product against float, and an FP8
checkpoint in compressed-tensors' layout loading into the engine as the model its dequantized weights describe."""
from __future__ import annotations

import json

import pytest
import torch

from backends.llm.fp8 import (
    FP8,
    FP8_MAX,
    Fp8Linear,
    Fp8Scheme,
    quantize,
    quantize_weight,
    token_scales,
)
from backends.llm.model import checkpoint_tensors, load_model
from backends.llm.scoring import sequence_logits
from build_engines.checkpoints import tiny_checkpoint
from build_engines.quantize import write_fp8_checkpoint
from tests.conftest import ROOT


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_round_trip_error_is_within_e4m3_precision(strategy):
    weight = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different magnitudes
    q, scale = quantize_weight(weight, strategy)
    assert q.dtype == FP8 and scale.shape == ((64, 1) if strategy == "channel" else (1,))
    restored = q.float() * scale.view(-1, 1)
    # E4M3 keeps 3 mantissa bits: half a step is 2^-4 relative; below its normal range the step is 2^-9 * scale
    bound = weight.abs() * 2 ** -4 + scale.view(-1, 1) * 2 ** -9 + 1e-12
    assert ((restored - weight).abs() <= bound).all()
    assert (q.float().abs().amax(dim=1) == FP8_MAX).any()  # the range is used up to 448


def test_a_row_of_zeros_and_saturation_are_safe():
    q, scale = quantize_weight(torch.zeros(2, 16))
    assert torch.isfinite(scale).all() and (q.float() == 0).all()
    assert quantize(torch.tensor([1e9, -1e9]), torch.tensor(1.0)).float().tolist() == [FP8_MAX, -FP8_MAX]


@pytest.mark.parametrize("static", [False, True])
def test_fp8_linear_computes_the_product_of_its_quantized_operands(static):
    torch.manual_seed(0)
    x, weight, bias = torch.randn(5, 32), torch.randn(24, 32), torch.randn(24)
    layer = Fp8Linear(32, 24, bias=True, activations="tensor" if static else "token")
    layer.weight.data, layer.weight_scale.data = quantize_weight(weight)
    layer.bias.data = bias
    if static:
        layer.input_scale.data = x.abs().amax() / FP8_MAX
    out = layer(x)
    x_scale = layer.input_scale.expand(5, 1) if static else token_scales(x)
    expected = (quantize(x, x_scale).double() * x_scale) @ (layer.weight.double() * layer.weight_scale).t() + bias
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    exact = x @ weight.t() + bias  # and it is the float product up to FP8 rounding of both operands
    assert ((out - exact).abs() <= 0.1 * exact.abs().mean()).float().mean() > 0.95


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs an FP8 GPU (perf/gpu_bench.sh runs it)")
@pytest.mark.parametrize("rows,static,bias,shape", [(1, False, False, (336, 1024)), (3, True, True, (336, 1024)),
                                                    (64, False, True, (336, 1024)), (2, True, False, (333, 1000))])
@pytest.mark.parametrize("ours", [False, True])
def test_fp8_linear_on_the_gpu_computes_its_quantized_operands_product(rows, static, bias, shape, ours, monkeypatch):
    """cuBLAS' FP8 GEMM (both dimensions multiples of 16) and the fallback, or (`ours`) fp8_gemm.py on the FP8
    inputs, against the float product of the quantized operands. (One-token steps run gemv.py instead:
    tests/unit/test_gemv.py.)"""
    import backends.llm.fp8 as fp8

    monkeypatch.setattr(fp8, "W8A8_GEMM_MAX_ROWS", fp8.FP8_GEMM_MAX_ROWS if ours else 0)
    torch.manual_seed(rows)
    n, k = shape
    layer = Fp8Linear(k, n, bias=bias, activations="tensor" if static else "token").cuda()
    layer.weight.data, layer.weight_scale.data = quantize_weight(torch.randn(n, k, device="cuda"))
    x = (torch.randn(rows, k, device="cuda") * torch.logspace(-2, 1, rows, device="cuda")[:, None]).bfloat16()
    if bias:
        layer.bias.data = torch.randn(n, device="cuda")
    if static:
        layer.input_scale.data = x.abs().amax().float() / FP8_MAX
    x_scale = layer.input_scale.expand(rows, 1) if static else token_scales(x)
    expected = (quantize(x, x_scale).double() * x_scale) @ (layer.weight.double() * layer.weight_scale).t()
    expected += layer.bias.double() if bias else 0
    out = layer(x)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2 * expected.abs().mean().item())


def test_scheme_reads_and_writes_compressed_tensors_configs():
    for scheme in (Fp8Scheme("tensor", "tensor"), Fp8Scheme("channel", "none")):
        assert Fp8Scheme.from_config(scheme.to_config()) == scheme
    assert Fp8Scheme("channel", "none").to_config()["config_groups"]["group_0"]["input_activations"] is None
    assert Fp8Scheme.from_config(None) is None
    assert not Fp8Scheme(ignore=("re:.*lm_head",)).quantizes("lm_head") and Fp8Scheme().quantizes("")
    with pytest.raises(ValueError, match="not supported"):
        Fp8Scheme.from_config({"quant_method": "gptq"})


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8") / "tiny-llm-fp8"
    write_fp8_checkpoint(tiny_checkpoint("llm", ROOT / ".checkpoints"), out)
    return out


def test_our_fp8_checkpoint_has_the_compressed_tensors_layout(fp8_checkpoint):
    config = json.loads((fp8_checkpoint / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["format"]) == ("compressed-tensors", "float-quantized")
    tensors = dict(checkpoint_tensors(fp8_checkpoint))
    name = "model.layers.0.self_attn.q_proj"
    assert tensors[f"{name}.weight"].dtype == FP8 and tensors[f"{name}.weight_scale"].shape[1] == 1
    assert tensors["model.embed_tokens.weight"].dtype == torch.float32 and "lm_head.weight_scale" not in tensors
    assert (fp8_checkpoint / "tokenizer.json").exists()


def assert_logits_of_dequantized_weights(fp8_checkpoint, tmp_path, ids: list[int], quantized_inputs: bool = True
                                         ) -> None:
    """The engine's FP8 model (fused q/k/v and gate/up with each part's scales) against a float model holding the
    dequantized weights whose projections quantize their inputs per token the same way (or not at all, for a
    weights-only checkpoint): equal logits."""
    from safetensors.torch import save_file

    tensors = dict(checkpoint_tensors(fp8_checkpoint))
    save_file({name: t.float() * tensors[name + "_scale"].float() if t.dtype == FP8 else t.float()
               for name, t in tensors.items() if not name.endswith("_scale")}, str(tmp_path / "model.safetensors"))
    config = json.loads((fp8_checkpoint / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    fp8 = load_model(fp8_checkpoint, torch.float32, "cpu")
    reference = load_model(tmp_path, torch.float32, "cpu")
    assert isinstance(fp8.layers[0].mlp.down_proj, Fp8Linear) and not isinstance(reference.layers[0].mlp.down_proj,
                                                                                  Fp8Linear)
    for layer in reference.layers if quantized_inputs else ():
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            linear.register_forward_pre_hook(lambda _, args: (quantize(args[0], s := token_scales(args[0])).float() * s,))
    torch.testing.assert_close(sequence_logits(fp8, ids), sequence_logits(reference, ids), rtol=1e-4, atol=1e-4)


def test_fp8_checkpoint_gives_the_logits_of_its_dequantized_weights(fp8_checkpoint, tmp_path):
    assert_logits_of_dequantized_weights(fp8_checkpoint, tmp_path, [5, 17, 3, 42, 8, 11, 9, 30, 2, 7, 12, 40, 6, 3, 1,
                                                                     19, 23, 8])  # two KV blocks


def test_a_weights_only_checkpoint_gives_the_logits_of_its_dequantized_weights(tmp_path):
    """--fp8-activations none: compressed-tensors without input_activations (vLLM reads it as W8A16); the inputs stay
    as they are, the product is theirs with the dequantized weights."""
    out = tmp_path / "w8a16"
    write_fp8_checkpoint(tiny_checkpoint("llm", ROOT / ".checkpoints"), out, Fp8Scheme("channel", "none"))
    assert "input_scale" not in " ".join(name for name, _ in checkpoint_tensors(out))
    layer = load_model(out, torch.float32, "cpu").layers[0].mlp.down_proj
    assert isinstance(layer, Fp8Linear) and layer.activations == "none"
    (tmp_path / "reference").mkdir()
    assert_logits_of_dequantized_weights(out, tmp_path / "reference", [5, 17, 3, 42, 8, 11, 9, 30, 2, 7, 12, 40, 6, 3,
                                                                       1, 19, 23, 8], quantized_inputs=False)


@pytest.mark.parametrize("model", ["tiny llm", "smollm2"])
def test_an_fp8_lm_head_loads_as_its_dequantized_weights(model, smollm2_checkpoint, tmp_path):
    """--fp8-lm-head (`ignore` empty): the head's weight in E4M3 with its scales; SmolLM2 ties it to the embeddings,
    which stay as they were while the head gets an FP8 tensor of its own (config: no longer tied)."""
    source = smollm2_checkpoint if model == "smollm2" else tiny_checkpoint("llm", ROOT / ".checkpoints")
    out = tmp_path / "fp8"
    write_fp8_checkpoint(source, out, Fp8Scheme("channel", "none", ignore=()))
    tensors = dict(checkpoint_tensors(out))
    assert tensors["lm_head.weight"].dtype == FP8 and tensors["lm_head.weight_scale"].shape == (
        tensors["lm_head.weight"].shape[0], 1)
    assert tensors["model.embed_tokens.weight"].dtype == torch.float32
    assert not json.loads((out / "config.json").read_text())["tie_word_embeddings"]
    assert isinstance(load_model(out, torch.float32, "cpu").lm_head, Fp8Linear)
    (tmp_path / "reference").mkdir()
    assert_logits_of_dequantized_weights(out, tmp_path / "reference", [5, 17, 3, 42, 8, 11, 9, 30, 2, 7, 12, 40, 6, 3,
                                                                       1, 19, 23, 8], quantized_inputs=False)


LLM_COMPRESSOR_FP8 = ROOT / ".checkpoints" / "smollm2-fp8-llmcompressor"  # `make fp8-reference` writes it


def test_a_checkpoint_llm_compressor_wrote_loads_as_its_dequantized_weights(smollm2_checkpoint, tmp_path):
    """SmolLM2 quantized by llm-compressor 0.14 itself (FP8_DYNAMIC): the engine reads its scheme, its weights are
    the ones our own quantizer makes from the same model, and it computes the logits its dequantized weights give."""
    if not (LLM_COMPRESSOR_FP8 / "config.json").exists():
        pytest.fail(f"{LLM_COMPRESSOR_FP8} is missing: `make fp8-reference` writes it (make test runs it)")
    config = json.loads((LLM_COMPRESSOR_FP8 / "config.json").read_text())["quantization_config"]
    assert Fp8Scheme.from_config(config) == Fp8Scheme("channel", "token", ("lm_head",))
    theirs = dict(checkpoint_tensors(LLM_COMPRESSOR_FP8))
    name = "model.layers.7.mlp.down_proj"
    ours, scale = quantize_weight(dict(checkpoint_tensors(smollm2_checkpoint))[name + ".weight"].float())
    assert theirs[name + ".weight"].dtype == FP8
    torch.testing.assert_close(theirs[name + ".weight_scale"].float(), scale, rtol=1e-2, atol=0)
    same = (theirs[name + ".weight"].float() == ours.float()).float().mean().item()
    assert same > 0.99, f"only {same:.2%} of the E4M3 weights equal ours"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(LLM_COMPRESSOR_FP8)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=False)
    assert_logits_of_dequantized_weights(LLM_COMPRESSOR_FP8, tmp_path, tokenizer(chat).input_ids)


def test_sequence_logits_equal_transformers():
    from transformers import AutoModelForCausalLM

    checkpoint = tiny_checkpoint("llm", ROOT / ".checkpoints")
    ids = [5, 17, 3, 42, 8, 11, 9, 30, 2, 7, 12, 40, 6, 3, 1, 19, 23, 8]
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(sequence_logits(load_model(checkpoint, torch.float32, "cpu"), ids), expected,
                               rtol=1e-4, atol=1e-4)


def test_static_scales_from_calibration_load_and_bound_the_inputs(tmp_path):
    from build_engines.quantize import calibrate

    source = tiny_checkpoint("llm", ROOT / ".checkpoints")
    prompts = [[5, 17, 3, 42, 8], [11, 9, 30, 2, 7, 12, 40]]
    scales = calibrate(source, prompts)
    assert scales["model.layers.0.self_attn.q_proj"] == scales["model.layers.0.self_attn.v_proj"] > 0
    write_fp8_checkpoint(source, tmp_path, Fp8Scheme("tensor", "tensor"), scales)
    assert Fp8Scheme.from_config(json.loads((tmp_path / "config.json").read_text())["quantization_config"]) == \
        Fp8Scheme("tensor", "tensor")
    model = load_model(tmp_path, torch.float32, "cpu")
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.input_scale.item() == pytest.approx(scales["model.layers.0.self_attn.q_proj"])
    assert torch.isfinite(sequence_logits(model, prompts[1])).all()
    with pytest.raises(ValueError, match="calibration"):
        write_fp8_checkpoint(source, tmp_path / "x", Fp8Scheme("channel", "tensor"))
    write_fp8_checkpoint(source, tmp_path / "head", Fp8Scheme("tensor", "tensor", ignore=()), scales)
    head = load_model(tmp_path / "head", torch.float32, "cpu").lm_head  # its input: the final norm's output
    assert head.input_scale.item() == pytest.approx(scales["lm_head"]) and scales["lm_head"] > 0


def test_fp8_kv_cache_stores_e4m3_at_the_calibrated_scales(tmp_path, monkeypatch):
    """An FP8 KV cache checkpoint: the per-layer key/value scales are the largest key/value the calibration prompts
    produce in the float model / 448, and the model's logits are those of the same model whose cache holds the keys
    and values rounded to E4M3 at those scales (the attention arithmetic is otherwise unchanged)."""
    import backends.llm.model as model_module
    from build_engines.quantize import calibrate

    source = tiny_checkpoint("llm", ROOT / ".checkpoints")
    prompts = [[5, 17, 3, 42, 8], [11, 9, 30, 2, 7, 12, 40]]
    scheme = Fp8Scheme("channel", "token", kv_cache=True)
    write_fp8_checkpoint(source, tmp_path / "kv", scheme, calibrate(source, prompts))
    config = json.loads((tmp_path / "kv" / "config.json").read_text())
    assert Fp8Scheme.from_config(config["quantization_config"]) == scheme
    fp8_kv = load_model(tmp_path / "kv", torch.float32, "cpu")
    assert fp8_kv.kv_cache_dtype == FP8
    config["quantization_config"]["kv_cache_scheme"] = None  # the same FP8 weights over a float cache
    (tmp_path / "float-kv").mkdir()
    (tmp_path / "float-kv" / "config.json").write_text(json.dumps(config))
    (tmp_path / "float-kv" / "model.safetensors").symlink_to(tmp_path / "kv" / "model.safetensors")
    float_kv = load_model(tmp_path / "float-kv", torch.float32, "cpu")
    assert float_kv.kv_cache_dtype == torch.float32
    layers, calls, largest = len(float_kv.layers), [0], torch.zeros(len(float_kv.layers), 2)
    real_write_kv = model_module.write_kv

    def observe(kv, k, v, slots, scales=None):  # the source model's keys and values, as its cache receives them
        layer = calls[0] % layers
        calls[0] += 1
        largest[layer] = torch.maximum(largest[layer], torch.stack([k.abs().max(), v.abs().max()]))
        real_write_kv(kv, k, v, slots, scales)

    monkeypatch.setattr(model_module, "write_kv", observe)
    for ids in prompts:
        sequence_logits(load_model(source, torch.float32, "cpu"), ids)
    attention = [layer.self_attn for layer in fp8_kv.layers]
    found = torch.tensor([[a.k_scale.item(), a.v_scale.item()] for a in attention])
    torch.testing.assert_close(found, largest / FP8_MAX)

    def rounded(kv, k, v, slots, scales=None):  # E4M3 at the FP8 model's scales, stored back in float
        a = attention[calls[0] % layers]
        calls[0] += 1
        real_write_kv(kv, quantize(k, a.k_scale).float() * a.k_scale, quantize(v, a.v_scale).float() * a.v_scale,
                      slots)

    monkeypatch.setattr(model_module, "write_kv", rounded)
    calls[0] = 0
    ids = [5, 17, 3, 42, 8, 11, 9, 30, 2, 7, 12, 40, 6, 3, 1, 19, 23, 8]  # two KV blocks
    expected = sequence_logits(float_kv, ids)
    monkeypatch.setattr(model_module, "write_kv", real_write_kv)
    # the FP8 cache folds its scales into q and the output instead of dequantizing: fp32 rounding in another order
    # (1.6e-4 on one logit of 5778 on this project's CPUs); a wrong scale or rounding is off by orders more
    torch.testing.assert_close(sequence_logits(fp8_kv, ids), expected, rtol=1e-3, atol=1e-3)


def test_an_fp8_kv_cache_holds_more_tokens_in_the_same_memory(tmp_path):
    from backends.llm.engine import EngineConfig, LLMEngine
    from backends.llm.sampling import SamplingParams
    from build_engines.quantize import calibrate

    source = tiny_checkpoint("llm", ROOT / ".checkpoints")
    write_fp8_checkpoint(source, tmp_path, Fp8Scheme(kv_cache=True), calibrate(source, [[5, 17, 3, 42, 8]]))
    config = EngineConfig(dtype="bf16", device="cpu", kv_cache_memory_mb=4)
    fp8_kv, bf16_kv = LLMEngine(tmp_path, config), LLMEngine(source, config)
    assert fp8_kv.kv_cache[0][0].dtype == torch.uint8
    assert fp8_kv.blocks.num_blocks + 1 == 2 * (bf16_kv.blocks.num_blocks + 1)
    (seq,) = fp8_kv.generate(["a photo of the cat"], SamplingParams(max_tokens=6, min_tokens=6))
    assert len(seq.output_ids) == 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (perf/gpu_bench.sh runs it)")
def test_fp8_kv_cache_decodes_the_same_from_cuda_graphs(tmp_path):
    from backends.llm.engine import EngineConfig, LLMEngine
    from backends.llm.sampling import SamplingParams
    from build_engines.quantize import calibrate

    source = tiny_checkpoint("llm", ROOT / ".checkpoints")
    write_fp8_checkpoint(source, tmp_path, Fp8Scheme(kv_cache=True), calibrate(source, [[5, 17, 3, 42, 8]]))
    prompts, params = ["a photo of the cat", "red car", "hello"], SamplingParams(max_tokens=24, min_tokens=24)
    configs = [EngineConfig(dtype="bf16", device="cuda", cuda_graphs=graphs, kv_cache_memory_mb=64)
               for graphs in (True, False)]
    outputs = [[s.output_ids for s in LLMEngine(tmp_path, config).generate(prompts, params)] for config in configs]
    assert outputs[0] == outputs[1]
