"""Encoders replayed from CUDA graphs compute what they compute op by op, at every batch size (GPU parts run on
the H200 through perf/gpu_bench.sh)."""
import json

import numpy as np
import pytest
import torch

from backends.core.cuda_graphs import GraphedBatches, batch_sizes, try_graphs
from backends.core.runtime import load_runtime

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (perf/gpu_bench.sh runs it)")


class Patches(torch.nn.Module):
    """A stand-in image encoder: per-row work only, as ViT's."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(48, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, pixel_values):
        return self.norm(self.proj(pixel_values.flatten(1).reshape(pixel_values.shape[0], -1, 48))).mean(1)


def test_batch_sizes_are_powers_of_two_up_to_the_largest():
    assert batch_sizes(1) == [1]
    assert batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_sizes(64, step=8) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_sizes(20, step=8) == [1, 2, 4, 8, 16, 20]
    assert batch_sizes(4, step=8) == [1, 2, 4]


def export(tmp_path, device: str):
    module = Patches().to(device).eval()
    example = torch.randn(2, 3, 4, 4, device=device)
    program = torch.export.export(module, (example,), dynamic_shapes=({0: torch.export.Dim("batch", max=1024)},))
    torch.export.save(program, str(tmp_path / "model.pt2"))
    (tmp_path / "engine.json").write_text(json.dumps({"outputs": ["embedding"]}))
    return module


def test_graph_batch_is_ignored_on_the_cpu(tmp_path):
    module = export(tmp_path, "cpu")
    engine = load_runtime(tmp_path, "torch", "cpu", graph_batch=8)
    assert engine.graphs == {}
    pixels = np.random.default_rng(0).standard_normal((3, 3, 4, 4), dtype=np.float32)
    with torch.inference_mode():
        expected = module(torch.from_numpy(pixels)).numpy()
    np.testing.assert_allclose(engine.run({"pixel_values": pixels})["embedding"], expected, rtol=1e-5, atol=1e-5)


@CUDA
@pytest.mark.parametrize("rows", [1, 3, 8, 11, 17])
def test_graphs_equal_op_by_op_at_any_batch(tmp_path, rows):
    export(tmp_path, "cuda")
    eager = load_runtime(tmp_path, "torch", "cuda")
    graphed = load_runtime(tmp_path, "torch", "cuda", graph_batch=8)
    (graphs,) = graphed.graphs.values()
    assert isinstance(graphs, GraphedBatches) and sorted(graphs.graphs) == [1, 2, 4, 8]
    pixels = np.random.default_rng(rows).standard_normal((rows, 3, 4, 4), dtype=np.float32)
    on_device = torch.from_numpy(pixels).cuda()
    expected = eager.run({"pixel_values": pixels})["embedding"]
    for feed in (pixels, on_device):  # numpy from the CPU, or a tensor from a GPU preprocessing step
        np.testing.assert_allclose(graphed.run({"pixel_values": feed})["embedding"], expected, rtol=1e-5, atol=1e-5)


@CUDA
def test_a_module_that_cannot_be_captured_runs_op_by_op(caplog):
    def synchronises(x):
        return x * float(x.sum().item())  # a device-to-host copy: refused during capture

    assert try_graphs(synchronises, [(4,)], [torch.float32], torch.device("cuda"), 4) is None
    assert "CUDA graphs unavailable" in caplog.text
    x = torch.ones(2, 4, device="cuda")
    torch.testing.assert_close(synchronises(x), x * 8)  # the device still works after the failed capture
    # random ops too: the failed capture left the generator marked as capturing (they raised) until try_graphs
    # cleared it
    assert torch.randn(3, device="cuda").isfinite().all()


@CUDA
def test_two_graphed_modules_replayed_at_once_on_two_streams_equal_op_by_op():
    """Each GraphedBatches captures on a stream of its own. Captured on torch's one capture stream, whisper's join
    and decoder graphs, replayed at once from two streams, hung an H100 (2026-12-07; our reading: the kernels share
    that stream's cuBLAS workspace at replay). Long-K products, which cuBLAS may split over K through its workspace."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    weights = [torch.randn(8192, 64, device=device, dtype=torch.bfloat16) / 90 for _ in range(2)]
    graphed = [GraphedBatches(lambda x, w=w: x @ w, [(8192,)], [torch.bfloat16], device, 4) for w in weights]
    inputs = [torch.randn(4, 8192, device=device, dtype=torch.bfloat16) for _ in range(2)]
    streams = [torch.cuda.Stream(device) for _ in range(2)]
    outputs: list[list[torch.Tensor]] = [[], []]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream(device))
    for _ in range(50):
        for i, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                outputs[i].append(graphed[i](inputs[i])[0])
    torch.cuda.synchronize(device)
    for x, w, replayed in zip(inputs, weights, outputs):
        expected = x @ w
        for out in replayed:
            torch.testing.assert_close(out, expected)
