"""Model folders are configuration only: one backend serves two `llm` models built from two checkpoints at once, and
a config whose parameters the backend's schema refuses fails its load with the key named (the server keeps serving
the others)."""
from __future__ import annotations

import re
import shutil

import pytest
import torch
import tritonclient.http as http
from tritonclient.utils import InferenceServerException

from backends.server import TritonServer, free_port
from build_engines.checkpoints import tiny_checkpoint
from build_engines.cli import main as build_engines
from client.sdk import Client
from tests.conftest import ROOT

PROMPT, TOKENS = "a photo of the cat", 8


@pytest.fixture(scope="module")
def checkpoints(llm_checkpoint):
    return {"llm_llama": llm_checkpoint, "llm_qwen": tiny_checkpoint("qwen2", ROOT / ".checkpoints")}


@pytest.fixture(scope="module")
def explicit_server(tmp_path_factory, checkpoints):
    repository = tmp_path_factory.mktemp("configs")
    for name, checkpoint in checkpoints.items():
        assert build_engines(["llm", "--checkpoint", str(checkpoint), "--repository", str(repository),
                              "--name", name, "--kv-cache-memory-mb", "16"]) == 0
    for name, parameter, value in (("llm_typo", "blok_size", "32"), ("llm_malformed", "block_size", "abc")):
        shutil.copytree(repository / "llm_llama", repository / name)  # same depth: EXECUTION_ENV_PATH still holds
        config = (repository / name / "config.pbtxt").read_text().replace('name: "llm_llama"', f'name: "{name}"')
        (repository / name / "config.pbtxt").write_text(
            config + f'parameters {{\n  key: "{parameter}"\n  value {{\n    string_value: "{value}"\n  }}\n}}\n'
            if parameter == "blok_size" else re.sub(r'(key: "block_size"\s+value \{\s+string_value: )"16"',
                                                    rf'\1"{value}"', config))
    with TritonServer(repository, free_port(), free_port(), free_port(), ROOT / "logs" / "test-configs.log",
                      model_control="explicit", load_models=list(checkpoints)) as server:
        yield server


def greedy_text(checkpoint) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer(PROMPT, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=TOKENS, do_sample=False)[0, ids.input_ids.shape[1]:]
    return tokenizer.decode(out, skip_special_tokens=True)


def test_one_backend_serves_two_llm_models_from_two_checkpoints(explicit_server, checkpoints):
    client = Client(explicit_server.grpc_url, "grpc")
    try:
        texts = {name: "".join(client.generate(PROMPT, TOKENS, model=name)) for name in checkpoints}
        config = client.triton.get_model_config("llm_qwen", as_json=True)["config"]
    finally:
        client.close()
    assert config["backend"] == "mm_llm"
    assert texts == {name: greedy_text(checkpoint) for name, checkpoint in checkpoints.items()}
    assert texts["llm_llama"] != texts["llm_qwen"]


@pytest.mark.parametrize("model, message", [
    ("llm_typo", "unknown parameter(s) ['blok_size'] in the model config"),
    ("llm_malformed", "parameter 'block_size' = 'abc': expected an integer"),
])
def test_a_bad_parameter_fails_the_load_naming_it(explicit_server, model, message):
    client = http.InferenceServerClient(explicit_server.http_url)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.load_model(model)
        assert message in info.value.message(), info.value.message()
        assert not client.is_model_ready(model)
        assert client.is_model_ready("llm_llama")  # the others keep serving
    finally:
        client.close()
