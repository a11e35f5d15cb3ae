"""build_engines: generated configs are valid Triton protobuf, engines match PyTorch, unavailable runtimes fail
with one clear line, and up-to-date builds are skipped."""
import json

import numpy as np
import pytest
import torch
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from backends.core.runtime import TorchRuntime, load_runtime
from backends.vision.encoders import EncoderParams, ImageEncoder, TextEncoder
from build_engines.cli import main as build
from build_engines.repository import PythonModelConfig, Tensor, read_parameters, serialize_bytes_tensor
from tests.conftest import encode, random_image


def test_config_renders_to_valid_triton_protobuf():
    text = PythonModelConfig("vit", "mm_encoder", [Tensor("image", "BYTES", [1])],
                             [Tensor("logits", "FP32", [10], "labels.txt")], EncoderParams(runtime="torch"),
                             "$$TRITON_MODEL_DIRECTORY/../../.venv", max_batch_size=8, max_queue_delay_us=500,
                             instances=2, warmup_file="image", priority_levels=True).render()
    config = text_format.Parse(text, mc.ModelConfig())
    assert config.backend == "mm_encoder" and config.max_batch_size == 8
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["EXECUTION_ENV_PATH"] == "$$TRITON_MODEL_DIRECTORY/../../.venv"
    assert EncoderParams.from_config(params) == EncoderParams(runtime="torch")
    assert config.dynamic_batching.max_queue_delay_microseconds == 500
    assert config.output[0].label_filename == "labels.txt"
    assert config.instance_group[0].count == 2
    assert config.model_warmup[0].inputs["image"].input_data_file == "image"
    # the QoS classes as Triton's priority levels: 1 high, 2 normal (the default), 3 low, each limited and timed
    batching = config.dynamic_batching
    assert (batching.priority_levels, batching.default_priority_level) == (3, 2)
    queues = {level: (q.max_queue_size, q.default_timeout_microseconds, q.timeout_action, q.allow_timeout_override)
              for level, q in batching.priority_queue_policy.items()}
    assert queues == {1: (256, 30_000_000, mc.ModelQueuePolicy.REJECT, True),
                      2: (512, 120_000_000, mc.ModelQueuePolicy.REJECT, True),
                      3: (512, 600_000_000, mc.ModelQueuePolicy.REJECT, True)}


@pytest.mark.parametrize("window", ["adaptive", "fixed"])
def test_a_model_batched_by_our_batcher_has_no_dynamic_batcher(window):
    text = PythonModelConfig("vit", "mm_encoder", [Tensor("image", "BYTES", [1])], [Tensor("logits", "FP32", [10])],
                             EncoderParams(batch_window=window), max_batch_size=8, max_queue_delay_us=500).render()
    config = text_format.Parse(text, mc.ModelConfig())
    assert not config.HasField("dynamic_batching") and config.max_batch_size == 8
    assert config.parameters["batch_window"].string_value == window



def test_an_ensemble_build_writes_its_steps_and_a_single_rebuild_removes_them(tmp_path, vit_checkpoint, capsys):
    args = ["vit", "--checkpoint", str(vit_checkpoint), "--repository", str(tmp_path)]
    assert build([*args, "--ensemble", "--preprocess-instances", "3"]) == 0
    config = text_format.Parse((tmp_path / "vit" / "config.pbtxt").read_text(), mc.ModelConfig())
    assert config.platform == "ensemble" and config.output[0].label_filename == "labels.txt"
    assert [(s.model_name, dict(s.input_map), dict(s.output_map)) for s in config.ensemble_scheduling.step] == [
        ("vit_preprocess", {"image": "image"}, {"pixel_values": "pixels"}),
        ("vit_encoder", {"pixel_values": "pixels"}, {"logits": "logits"})]
    preprocess = text_format.Parse((tmp_path / "vit_preprocess" / "config.pbtxt").read_text(), mc.ModelConfig())
    assert preprocess.instance_group[0].count == 3 and preprocess.output[0].dims == [3, 224, 224]
    assert (tmp_path / "vit_encoder" / "1" / "engine.json").exists() and (tmp_path / "vit" / "labels.txt").exists()
    capsys.readouterr()
    assert build([*args, "--ensemble", "--preprocess-instances", "3"]) == 0
    assert "vit: up to date" in capsys.readouterr().out
    assert build(args) == 0
    assert not (tmp_path / "vit_preprocess").exists() and not (tmp_path / "vit_encoder").exists()
    assert text_format.Parse((tmp_path / "vit" / "config.pbtxt").read_text(), mc.ModelConfig()).backend == "mm_encoder"
    with pytest.raises(SystemExit):
        build(["llm", "--ensemble"])


def test_unknown_config_keys_are_rejected():
    with pytest.raises(ValueError):
        mc.ModelConfig(name="x", no_such_field=1)


def test_bytes_serialization_is_length_prefixed():
    assert serialize_bytes_tensor([b"ab", b""]) == b"\x02\x00\x00\x00ab\x00\x00\x00\x00"


def test_tensorrt_unavailable_exits_nonzero_with_one_line(tmp_path, vit_checkpoint, capsys):
    code = build(["vit", "--checkpoint", str(vit_checkpoint), "--runtime", "tensorrt",
                  "--repository", str(tmp_path)])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 1
    assert out[-1].startswith("build_engines vit: --runtime tensorrt needs")


def test_bf16_onnx_is_refused_with_a_reason(tmp_path, vit_checkpoint, capsys):
    assert build(["vit", "--checkpoint", str(vit_checkpoint), "--precision", "bf16", "--repository",
                  str(tmp_path)]) == 1
    assert "use --runtime torch for bf16" in capsys.readouterr().out


def test_checkpoint_must_be_a_hf_directory(tmp_path):
    with pytest.raises(SystemExit):
        build(["vit", "--checkpoint", str(tmp_path)])


@pytest.mark.parametrize("runtime, precision, atol", [("torch", "fp32", 1e-4), ("torch", "bf16", 0.15),
                                                      ("onnxruntime", "fp16", 2e-2)])
def test_vit_engines_match_reference(tmp_path, vit_checkpoint, runtime, precision, atol, capsys):
    from tests.integration.reference import vit_logits

    assert build(["vit", "--checkpoint", str(vit_checkpoint), "--runtime", runtime, "--precision", precision,
                  "--repository", str(tmp_path)]) == 0
    version_dir = tmp_path / "vit" / "1"
    meta = json.loads((version_dir / "engine.json").read_text())
    assert meta["precision"] == precision and meta["max_error_vs_torch"] <= atol
    encoder = ImageEncoder(version_dir)
    assert encoder.engine.name == runtime
    if runtime == "torch":  # attention without a mask (images are never padded): SDPA may take its flash kernel
        import torch

        program = torch.export.load(str(version_dir / "model.pt2"))
        attention = [n for n in program.graph.nodes if "scaled_dot_product_attention" in str(n.target)]
        assert attention and all(len(n.args) == 3 and "attn_mask" not in n.kwargs for n in attention)
    images = [encode(random_image(320, 240, seed=s)) for s in range(3)]
    (got,) = encoder.infer([[encoder.prepare_item(x) for x in images]])
    np.testing.assert_allclose(got, vit_logits(vit_checkpoint, images), atol=atol)
    # same options again: skipped
    assert build(["vit", "--checkpoint", str(vit_checkpoint), "--runtime", runtime, "--precision", precision,
                  "--repository", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip().endswith("vit: up to date")


def test_torch_runtime_clip_text_handles_any_length(tmp_path, clip_checkpoint):
    from tests.integration.reference import clip_outputs

    assert build(["clip", "--checkpoint", str(clip_checkpoint), "--runtime", "torch",
                  "--repository", str(tmp_path)]) == 0
    encoder = TextEncoder(tmp_path / "clip_text" / "1")
    assert isinstance(encoder.engine, TorchRuntime)
    texts = ["a", "a photo of the cat and dog on grass", "red " * 40]
    (got,) = encoder.infer([[encoder.prepare_item(t.encode()) for t in texts]])
    _, expected, _ = clip_outputs(clip_checkpoint, encode(random_image(64, 64)), texts)
    np.testing.assert_allclose(got, expected, atol=1e-4)


def test_load_runtime_reports_missing_engine(tmp_path):
    with pytest.raises(FileNotFoundError, match="no engine"):
        load_runtime(tmp_path)
    with pytest.raises(ValueError, match="unknown runtime"):
        load_runtime(tmp_path, "tvm")


def test_engine_parameters_are_written_under_another_name(tmp_path, llm_checkpoint):
    from backends.llm.engine import EngineConfig

    assert build(["llm", "--checkpoint", str(llm_checkpoint), "--repository", str(tmp_path), "--name", "llm_b",
                  "--block-size", "32", "--max-batch", "8", "--cuda-graphs", "false",
                  "--kv-cache-memory-mb", "64"]) == 0
    config = text_format.Parse((tmp_path / "llm_b" / "config.pbtxt").read_text(), mc.ModelConfig())
    assert config.name == "llm_b" and config.backend == "mm_llm"
    engine = EngineConfig.from_config(read_parameters(tmp_path / "llm_b" / "config.pbtxt"))
    assert (engine.block_size, engine.max_batch, engine.cuda_graphs, engine.kv_cache_memory_mb) == (32, 8, False, 64)


def test_bad_engine_parameter_fails_the_build_with_its_name(tmp_path, llm_checkpoint, capsys):
    assert build(["llm", "--checkpoint", str(llm_checkpoint), "--repository", str(tmp_path),
                  "--block-size", "many"]) == 1
    assert "parameter 'block_size' = 'many': expected an integer" in capsys.readouterr().out
    assert not (tmp_path / "llm" / "config.pbtxt").exists()


def test_a_parameter_of_another_backend_is_a_usage_error(vit_checkpoint, capsys):
    with pytest.raises(SystemExit):
        build(["vit", "--checkpoint", str(vit_checkpoint), "--block-size", "32"])
    assert "--block-size is not a parameter of vit" in capsys.readouterr().err


def test_gguf_and_pretrained_sources_are_checked(tmp_path, capsys):
    with pytest.raises(SystemExit):
        build(["vit", "--pretrained", "smollm2"])
    assert "--pretrained smollm2 is a llm model, not vit" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build(["llm", "--checkpoint", str(tmp_path / "missing.gguf")])
    assert "no such GGUF file" in capsys.readouterr().err


def test_fp8_build_writes_a_quantized_checkpoint_the_engine_serves(tmp_path, llm_checkpoint):
    """The default FP8 build (weights only, rounded by GPTQ over the builder's calibration requests and the model's
    answers), a nearest-rounded one with per-token activations, and a static one with an FP8 KV cache."""
    from backends.llm.engine import EngineConfig, LLMEngine
    from backends.llm.fp8 import FP8, Fp8Linear
    from backends.llm.model import checkpoint_tensors
    from backends.llm.sampling import SamplingParams

    assert build(["llm", "--checkpoint", str(llm_checkpoint), "--precision", "fp8", "--repository",
                  str(tmp_path)]) == 0
    assert EngineConfig.from_config(read_parameters(tmp_path / "llm" / "config.pbtxt")).dtype == "bf16"
    engine = LLMEngine(tmp_path / "llm" / "1", EngineConfig(dtype="fp32", device="cpu", kv_cache_memory_mb=8))
    assert isinstance(engine.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert engine.model.layers[0].mlp.down_proj.activations == "none"
    (seq,) = engine.generate(["a photo of the cat"], SamplingParams(max_tokens=4))
    assert len(seq.output_ids) == 4
    assert build(["llm", "--checkpoint", str(llm_checkpoint), "--precision", "fp8", "--fp8-rounding", "nearest",
                  "--fp8-activations", "token", "--fp8-lm-head", "--repository", str(tmp_path), "--name",
                  "llm_nearest"]) == 0
    nearest = LLMEngine(tmp_path / "llm_nearest" / "1", EngineConfig(dtype="fp32", device="cpu",
                                                                      kv_cache_memory_mb=8))
    assert nearest.model.layers[0].mlp.down_proj.activations == "token"
    assert isinstance(nearest.model.lm_head, Fp8Linear) and not isinstance(engine.model.lm_head, Fp8Linear)
    rounded = dict(checkpoint_tensors(tmp_path / "llm" / "1"))
    to_nearest = dict(checkpoint_tensors(tmp_path / "llm_nearest" / "1"))
    name = "model.layers.0.mlp.down_proj"
    assert torch.equal(rounded[name + ".weight_scale"], to_nearest[name + ".weight_scale"])
    assert not torch.equal(rounded[name + ".weight"].view(torch.uint8), to_nearest[name + ".weight"].view(torch.uint8))
    (tmp_path / "prompts.txt").write_text("a photo of the cat\nred car on the grass\n")
    assert build(["llm", "--checkpoint", str(llm_checkpoint), "--precision", "fp8", "--fp8-activations", "tensor",
                  "--kv-cache-dtype", "fp8", "--calibration", str(tmp_path / "prompts.txt"), "--repository",
                  str(tmp_path), "--name", "llm_static"]) == 0
    static = LLMEngine(tmp_path / "llm_static" / "1", EngineConfig(dtype="fp32", device="cpu", kv_cache_memory_mb=8))
    assert static.model.layers[0].mlp.down_proj.input_scale.item() > 0
    assert static.model.kv_cache_dtype == FP8 and static.kv_cache[0][0].dtype == torch.uint8
    assert static.model.layers[0].self_attn.k_scale.item() > 0
    (seq,) = static.generate(["a photo of the cat"], SamplingParams(max_tokens=4))
    assert len(seq.output_ids) == 4
    with pytest.raises(SystemExit):  # nothing here reads calibration requests
        build(["llm", "--checkpoint", str(llm_checkpoint), "--precision", "fp8", "--fp8-rounding", "nearest",
               "--calibration", str(tmp_path / "prompts.txt")])
    with pytest.raises(SystemExit):  # FP8 options without FP8
        build(["llm", "--checkpoint", str(llm_checkpoint), "--fp8-rounding", "gptq"])
    with pytest.raises(SystemExit):
        build(["llm", "--checkpoint", str(llm_checkpoint), "--fp8-lm-head"])
    with pytest.raises(SystemExit):
        build(["vit", "--checkpoint", str(llm_checkpoint), "--precision", "fp8"])


def test_calibration_sequences_are_the_requests_and_the_models_answers(tmp_path, llm_checkpoint):
    """Each request (the checkpoint's chat template where it has one; the tiny one has none) followed by the model's
    own greedy answer; the default file holds the builder's 64 requests."""
    from transformers import AutoTokenizer

    from build_engines.llm import DEFAULT_CALIBRATION, calibration_prompts

    (tmp_path / "requests.txt").write_text("a photo of the cat\n\nred car on the grass\n")
    sequences = calibration_prompts(llm_checkpoint, tmp_path / "requests.txt", answer_tokens=5)
    tokenizer = AutoTokenizer.from_pretrained(llm_checkpoint)
    assert tokenizer.chat_template is None and len(sequences) == 2
    for line, ids in zip(["a photo of the cat", "red car on the grass"], sequences):
        prompt = tokenizer(line)["input_ids"]
        assert ids[:len(prompt)] == prompt and 0 < len(ids) - len(prompt) <= 5
    assert len([line for line in DEFAULT_CALIBRATION.read_text().splitlines() if line.strip()]) == 64
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        calibration_prompts(llm_checkpoint, tmp_path / "empty.txt")
