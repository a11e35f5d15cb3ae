"""Health, readiness and metadata over HTTP and gRPC; the launcher's lifecycle."""
from pathlib import Path

import pytest
import tritonclient.grpc as grpc
import tritonclient.http as http
from tritonclient.utils import InferenceServerException

MODELS = {"vit": ["image"], "clip_vision": ["image"], "clip_text": ["text"], "clip": ["image", "text"]}  # inputs
BACKENDS = {"vit": "mm_encoder", "clip_vision": "mm_encoder", "clip_text": "mm_encoder", "clip": "mm_clip"}


@pytest.fixture(params=["http", "grpc"])
def triton(request, server):
    if request.param == "http":
        return http.InferenceServerClient(server.http_url)
    return grpc.InferenceServerClient(server.grpc_url)


def test_live_ready_and_server_metadata(triton):
    assert triton.is_server_live() and triton.is_server_ready()
    meta = triton.get_server_metadata()
    version = meta["version"] if isinstance(meta, dict) else meta.version
    assert version == "2.51.0"


@pytest.mark.parametrize("model", MODELS)
def test_model_ready_and_metadata(triton, model):
    assert triton.is_model_ready(model)
    meta = triton.get_model_metadata(model)
    inputs = meta["inputs"] if isinstance(meta, dict) else [{"name": i.name, "datatype": i.datatype} for i in meta.inputs]
    assert [(i["name"], i["datatype"]) for i in inputs] == [(name, "BYTES") for name in MODELS[model]]
    config = triton.get_model_config(model)
    assert (config["backend"] if isinstance(config, dict) else config.config.backend) == BACKENDS[model]


def test_unknown_model_is_not_ready(server):
    assert not http.InferenceServerClient(server.http_url).is_model_ready("no_such_model")


def test_python_stub_runs_in_the_venv_with_numpy_below_2(server):
    """numpy 2.x in the 2.51 stub makes outputs arrive with 0 bytes; the stub must see the venv's numpy<2."""
    import numpy

    assert int(numpy.__version__.split(".")[0]) < 2
    config = http.InferenceServerClient(server.http_url).get_model_config("vit")
    env = config["parameters"]["EXECUTION_ENV_PATH"]["string_value"]
    assert env.startswith("$$TRITON_MODEL_DIRECTORY/")  # relative to the model folder: no machine paths
    venv = Path(env.replace("$$TRITON_MODEL_DIRECTORY", str(server.repository / "vit")))
    assert (venv / "bin" / "python").exists()


def test_model_folders_hold_no_code_and_name_one_of_our_backends(repository):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from backends.server import our_backends

    assert not list(repository.rglob("*.py"))
    for config in repository.glob("*/config.pbtxt"):
        backend = text_format.Parse(config.read_text(), mc.ModelConfig()).backend
        assert backend in our_backends(), f"{config}: backend {backend!r}"


def test_explicit_model_control_loads_and_unloads_on_request(repository, tmp_path):
    """A second server, started by the same launcher in explicit mode with only `vit` loaded."""
    from backends.server import TritonServer, free_port

    server = TritonServer(repository, free_port(), free_port(), free_port(), tmp_path / "explicit.log",
                          model_control="explicit", load_models=["vit"])
    with server:
        triton = http.InferenceServerClient(server.http_url)
        assert triton.is_model_ready("vit") and not triton.is_model_ready("clip_text")
        triton.load_model("clip_text")
        assert triton.is_model_ready("clip_text")
        triton.unload_model("clip_text")
        assert not triton.is_model_ready("clip_text")
        triton.close()  # an open keep-alive connection would hold shutdown for the whole exit timeout
    assert server.process.returncode == 0  # SIGINT: a clean shutdown
    assert "successfully unloaded 'vit'" in (tmp_path / "explicit.log").read_text()


def test_launcher_refuses_a_port_in_use(server, repository):
    from backends.server import TritonServer

    with pytest.raises(RuntimeError, match="already in use"):
        TritonServer(repository, server.http_port, server.grpc_port, server.metrics_port).start()


def test_a_model_that_fails_to_load_is_named_with_its_error(tmp_path):
    """The launcher's startup error quotes Triton's error lines, where the cause is written whole (the status table
    at the log's end cuts it to its column width)."""
    from backends.server import TritonServer, free_port

    model = tmp_path / "repository" / "broken" / "1"
    model.mkdir(parents=True)
    (model / "model.py").write_text("class TritonPythonModel:\n    def initialize(self, args):\n"
                                    f"        raise ValueError('the weights do not fit: {'x' * 300} end of reason')\n")
    (model.parent / "config.pbtxt").write_text('backend: "python"\nmax_batch_size: 0\n'
                                               'input [{ name: "x", data_type: TYPE_FP32, dims: [1] }]\n'
                                               'output [{ name: "y", data_type: TYPE_FP32, dims: [1] }]\n')
    with pytest.raises(RuntimeError, match="(?s)its errors:\n.*failed to load 'broken' version 1: [^\n]*end of reason.*\nlog "):
        TritonServer(tmp_path / "repository", free_port(), free_port(), free_port(), tmp_path / "broken.log").start()


def listening_addresses(port: int) -> set[str]:
    """Local addresses a socket listens on at `port`, from /proc/net/tcp{,6} (state 0A: LISTEN)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def test_the_launcher_listens_on_loopback_unless_asked_and_keeps_model_control_off(server):
    """Safe defaults: nothing listens beyond this machine, and the repository API (load/unload) is refused."""
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, as IPv4 or IPv4-mapped IPv6
    for port in (server.http_port, server.grpc_port, server.metrics_port):
        assert listening_addresses(port) and listening_addresses(port) <= loopback, (port, listening_addresses(port))
    client = http.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException, match="explicit model load / unload is not allowed"):
        client.unload_model("vit")
    assert client.is_model_ready("vit")
