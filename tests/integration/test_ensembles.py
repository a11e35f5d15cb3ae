"""Models served as Triton ensembles (`build_engines --ensemble`): a preprocessing model on CPU instances, then the
engine's model; clients call the same name with the same tensors and get the transformers reference's outputs (image
encoders, also through the `clip` pipeline, which calls `clip_vision`; whisper's tokens; vlm's greedy answers, streamed
through the ensemble), and INVALID_ARG naming the problem for a bad image or bad audio, over HTTP and gRPC;
perf_analyzer measures the ensemble. `vit_device` preprocesses with torch on the model's device
(`--preprocess-on-device true`; here the CPU, so the GPU tensor handoff itself is only exercised on a GPU host)."""
from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from backends.server import TritonServer, free_port
from build_engines.cli import main as build_engines
from client.sdk import Client
from perf.analyzer import run_perf_analyzer
from perf.inputs import model_input_data
from tests.conftest import ROOT, encode, random_image
from tests.integration import reference
from tests.integration.reference import ATOL

IMAGES = [encode(random_image(w, h, seed=i), fmt) for i, (w, h, fmt) in
          enumerate([(224, 224, "PNG"), (640, 480, "JPEG"), (50, 1200, "PNG")])]


@pytest.fixture(scope="module")
def server(tmp_path_factory, vit_checkpoint, clip_checkpoint, whisper_checkpoint, llava_checkpoint):
    repository = tmp_path_factory.mktemp("ensembles")
    for family, checkpoint in (("vit", vit_checkpoint), ("clip", clip_checkpoint)):
        assert build_engines([family, "--checkpoint", str(checkpoint), "--repository", str(repository),
                              "--ensemble"]) == 0
    assert build_engines(["vit", "--checkpoint", str(vit_checkpoint), "--repository", str(repository), "--ensemble",
                          "--name", "vit_device", "--preprocess-on-device", "true"]) == 0
    assert build_engines(["whisper", "--checkpoint", str(whisper_checkpoint), "--repository", str(repository),
                          "--ensemble", "--batch-window", "adaptive"]) == 0  # our QoS batcher in both steps
    assert build_engines(["vlm", "--checkpoint", str(llava_checkpoint), "--repository", str(repository),
                          "--ensemble", "--kv-cache-memory-mb", "64"]) == 0  # an engine parameter: not the step's
    log = ROOT / "logs" / "test-ensembles.log"
    with TritonServer(repository, free_port(), free_port(), free_port(), log) as running:
        yield running


@pytest.fixture(params=["http", "grpc"])
def client(request, server):
    return Client(server.http_url if request.param == "http" else server.grpc_url, request.param)


def test_the_models_are_ensembles_of_a_cpu_preprocessing_step_and_the_engine(server):
    triton = grpcclient.InferenceServerClient(server.grpc_url)
    for name in ("vit", "clip_vision"):
        config = triton.get_model_config(name, as_json=True)["config"]
        assert config["platform"] == "ensemble"
        assert [step["model_name"] for step in config["ensemble_scheduling"]["step"]] == \
            [f"{name}_preprocess", f"{name}_encoder"]
        preprocess = triton.get_model_config(f"{name}_preprocess", as_json=True)["config"]
        assert preprocess["instance_group"][0]["kind"] == "KIND_CPU" and preprocess["instance_group"][0]["count"] == 2
        assert [o["name"] for o in preprocess["output"]] == ["pixel_values"]
    whisper = triton.get_model_config("whisper", as_json=True)["config"]
    assert [step["model_name"] for step in whisper["ensemble_scheduling"]["step"]] == ["whisper_audio",
                                                                                        "whisper_decoder"]
    audio = triton.get_model_config("whisper_audio", as_json=True)["config"]
    assert audio["instance_group"][0]["kind"] == "KIND_CPU" and audio["output"][0]["name"] == "_audio"
    decoder = triton.get_model_config("whisper_decoder", as_json=True)["config"]
    assert decoder["input"][0]["name"] == "_audio" and decoder["input"][0]["allow_ragged_batch"]


def test_ensemble_outputs_equal_the_reference(client, vit_checkpoint, clip_checkpoint):
    expected = reference.vit_logits(vit_checkpoint, IMAGES)
    for i, image in enumerate(IMAGES):
        got = client.infer("vit", {"image": np.array([[image]], dtype=object)}, ["logits"])["logits"]
        np.testing.assert_allclose(got[0], expected[i], atol=ATOL)
    batched = client.infer("vit", {"image": np.array([[b] for b in IMAGES], dtype=object)}, ["logits"])["logits"]
    np.testing.assert_allclose(batched, expected, atol=ATOL)
    embeds = client.infer("clip_vision", {"image": np.array([[b] for b in IMAGES], dtype=object)},
                          ["image_embeds"])["image_embeds"]
    for got, image in zip(embeds, IMAGES):
        np.testing.assert_allclose(got, reference.clip_outputs(clip_checkpoint, image, ["a"])[0][0], atol=ATOL)
    texts = ["a photo of a cat", "dog"]  # the clip pipeline calls the clip_vision ensemble
    scores, _ = client.similarity(IMAGES[1], texts)
    np.testing.assert_allclose(scores, reference.clip_outputs(clip_checkpoint, IMAGES[1], texts)[2], atol=10 * ATOL)


def test_preprocessing_on_the_device_gives_the_reference_outputs_within_pixel_rounding(client, server,
                                                                                      vit_checkpoint):
    triton = grpcclient.InferenceServerClient(server.grpc_url)
    preprocess = triton.get_model_config("vit_device_preprocess", as_json=True)["config"]
    encoder = triton.get_model_config("vit_device_encoder", as_json=True)["config"]
    assert preprocess["parameters"]["preprocess_on_device"]["string_value"] == "true"
    assert encoder["parameters"]["FORCE_CPU_ONLY_INPUT_TENSORS"]["string_value"] == "no"
    images = {"image": np.array([[b] for b in IMAGES], dtype=object)}
    got = client.infer("vit_device", images, ["logits"])["logits"]
    np.testing.assert_allclose(got, reference.vit_logits(vit_checkpoint, IMAGES), atol=0.02)
    with pytest.raises(InferenceServerException, match="invalid input: image bytes"):
        client.infer("vit_device", {"image": np.array([[b"not an image"]], dtype=object)}, ["logits"])


def test_a_bad_image_is_invalid_arg_naming_the_problem_and_the_ensemble_keeps_serving(client):
    with pytest.raises(InferenceServerException) as info:
        client.infer("vit", {"image": np.array([[b"not an image"]], dtype=object)}, ["logits"])
    assert str(info.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT"), info.value
    assert "invalid input: image bytes" in info.value.message() and "Traceback" not in info.value.message()
    assert client.infer("vit", {"image": np.array([[IMAGES[0]]], dtype=object)}, ["logits"])["logits"].shape == (1, 10)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_the_ensemble(server, protocol, tmp_path):
    url = server.http_url if protocol == "http" else server.grpc_url
    points = run_perf_analyzer("vit", url, model_input_data("vit", tmp_path), tmp_path / "report.csv",
                               concurrency="1:4:3", protocol=protocol, interval_ms=1500)
    assert [p.load for p in points] == [1, 4]
    assert all(p.throughput > 0 and p.p99_us >= p.p50_us > 0 for p in points)


def test_whisper_ensemble_equals_transformers_with_and_without_its_options(client, whisper_checkpoint):
    from backends.whisper.chunking import merge, split
    from tests.conftest import wav
    from tests.integration.reference import whisper_tokens

    reference = whisper_tokens(whisper_checkpoint)
    rng = np.random.default_rng(7)
    clips = [rng.normal(0, 0.1, int(16000 * s)).astype(np.float32) for s in (2, 35)]  # 35 s: two chunks
    got = client.infer("whisper", {"audio": np.array([[wav(clips[0], subtype="FLOAT")]], dtype=object),
                                   "max_tokens": np.array([[8]], dtype=np.int32)}, ["tokens"])["tokens"][0]
    assert got.tolist() == reference(clips[0], max_new=8)  # no language (detected) nor task (transcribe)
    _, tokens = client.transcribe(wav(clips[1], subtype="FLOAT"), "en", "translate", max_tokens=6)
    assert tokens == merge([reference(chunk, "en", "translate", 6) for chunk in split(clips[1])])
    with pytest.raises(InferenceServerException, match="invalid input: audio bytes"):
        client.transcribe(b"not audio", "en")
    audio = client.api.InferInput("audio", [1, 1], "BYTES")
    audio.set_data_from_numpy(np.array([[wav(clips[0], subtype="FLOAT")]], dtype=object))
    qos = client.triton.infer("whisper", [audio], parameters={"qos_class": "high"})  # passed on to both steps
    assert qos.as_numpy("tokens").size > 0
    with pytest.raises(InferenceServerException, match="invalid input: unknown language 'xx'"):
        client.transcribe(wav(clips[0], subtype="FLOAT"), "xx")


def test_vlm_ensemble_streams_the_greedy_answers_of_llava_next(server, llava_checkpoint):
    from tests.integration.reference import llava_greedy
    from tests.integration.test_vlm import ask

    reference = llava_greedy(llava_checkpoint)
    images = [encode(random_image(640, 480, seed=1)), encode(random_image(90, 400, seed=2), "JPEG")]
    prompts = ["<image> a photo of the cat", "what is in this"]  # the second: no placeholder, the image first
    answers = ask(server, [(image, prompt, 12) for image, prompt in zip(images, prompts)], {"qos_class": "high"})
    for image, prompt, answer in zip(images, prompts, answers):
        assert answer.error is None and len(answer.arrivals) > 1  # streamed, piece by piece
        assert answer.text == reference(image, prompt if "<image>" in prompt else f"<image>\n{prompt}", 12)
    (bad,) = ask(server, [(b"not an image", "<image> hi", 4)])
    assert "invalid input: image bytes" in bad.error
    config = grpcclient.InferenceServerClient(server.grpc_url).get_model_config("vlm", as_json=True)["config"]
    assert [step["model_name"] for step in config["ensemble_scheduling"]["step"]] == ["vlm_anyres", "vlm_engine"]


def test_perf_analyzer_measures_the_whisper_and_vlm_ensembles(server, tmp_path):
    import json

    from perf.inputs import bytes_entry
    from perf.whisper_bench import speech_like
    from perf.whisper_bench import write_input_data as whisper_data

    whisper = run_perf_analyzer("whisper", server.grpc_url, whisper_data(tmp_path / "whisper.json",
                                                                         [(speech_like(1.0, 0), 1.0, 4)]),
                                tmp_path / "whisper.csv", concurrency="2", interval_ms=1500)
    vlm_data = tmp_path / "vlm.json"
    vlm_data.write_text(json.dumps({"data": [{"image": bytes_entry(IMAGES[1]),
                                              "text_input": bytes_entry(b"<image> a photo of"),
                                              "max_tokens": {"content": [4], "shape": [1]}}]}))
    vlm = run_perf_analyzer("vlm", server.grpc_url, vlm_data, tmp_path / "vlm.csv", concurrency="2",
                            interval_ms=1500, extra=["--streaming"])  # decoupled: a gRPC stream per request
    assert all(p.throughput > 0 and p.p99_us >= p.p50_us > 0 for p in whisper + vlm)
