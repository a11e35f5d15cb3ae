"""build_engines/gptq.py: FP8 weights rounded with error feedback, against nearest rounding with the same scales."""
from __future__ import annotations

import pytest
import torch

from backends.llm.fp8 import FP8, Fp8Scheme, quantize_weight
from backends.llm.model import checkpoint_tensors, load_model
from backends.llm.scoring import sequence_logits
from build_engines.checkpoints import tiny_checkpoint
from build_engines.gptq import gptq_round
from build_engines.quantize import write_fp8_checkpoint
from tests.conftest import ROOT


def output_error(weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> float:
    """||x W^T - x Q^T||^2 for E4M3 weights Q with per-row scales."""
    return float((x.double() @ (weight.double() - q.double() * scale.double()).t()).square().sum())


def test_with_uncorrelated_inputs_it_is_nearest_rounding():
    """A diagonal Hessian carries no error from one input to another: every weight keeps its nearest E4M3 value."""
    weight = torch.randn(16, 64)
    nearest, scale = quantize_weight(weight)
    rounded = gptq_round(weight, torch.diag(torch.rand(64) + 0.5), scale)
    assert rounded.dtype == FP8 and torch.equal(rounded.view(torch.uint8), nearest.view(torch.uint8))


def test_it_lowers_the_output_error_on_correlated_inputs_seen_and_unseen():
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(64, 64, generator=g)  # correlated input features, as a layer's inputs are
    seen, unseen = (torch.randn(1024, 64, generator=g) @ mix for _ in range(2))
    weight = torch.randn(48, 64, generator=g)
    nearest, scale = quantize_weight(weight)
    rounded = gptq_round(weight, seen.double().T @ seen.double(), scale)
    assert (rounded.float().abs() <= 448).all()
    for x in (seen, unseen):
        assert output_error(weight, rounded, scale, x) < 0.7 * output_error(weight, nearest, scale, x)


def test_inputs_that_never_occur_do_not_break_it():
    weight = torch.randn(8, 32)
    x = torch.randn(256, 32)
    x[:, 5] = 0
    nearest, scale = quantize_weight(weight)
    rounded = gptq_round(weight, x.T @ x, scale)
    assert torch.isfinite(rounded.float()).all()


@pytest.mark.parametrize("scheme", [Fp8Scheme(), Fp8Scheme(ignore=())], ids=["bf16 head", "fp8 head"])
def test_a_gptq_checkpoint_keeps_the_layout_and_scales_and_lowers_the_logit_error(scheme, tmp_path):
    """End to end on the tiny model: the same tensors, dtypes and scales as the nearest-rounded checkpoint, other
    E4M3 values, and logits closer to the float model's on the calibration prompts; with the LM head in FP8 too
    (--fp8-lm-head), the head rounded as well."""
    source = tiny_checkpoint("llm", ROOT / ".checkpoints")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (40,), generator=g).tolist() for _ in range(6)]
    write_fp8_checkpoint(source, tmp_path / "nearest", scheme)
    write_fp8_checkpoint(source, tmp_path / "gptq", scheme, gptq_prompts=prompts)
    nearest, gptq = dict(checkpoint_tensors(tmp_path / "nearest")), dict(checkpoint_tensors(tmp_path / "gptq"))
    assert nearest.keys() == gptq.keys()
    assert all(gptq[n].dtype == t.dtype for n, t in nearest.items())
    assert all(torch.equal(gptq[n], t) for n, t in nearest.items() if n.endswith("_scale"))
    changed = [n for n, t in nearest.items() if t.dtype == FP8 and not torch.equal(gptq[n].view(torch.uint8),
                                                                                     t.view(torch.uint8))]
    assert len(changed) == sum(t.dtype == FP8 for t in nearest.values())  # every projection's rounding moved
    assert ("lm_head.weight" in changed) == scheme.quantizes("lm_head")
    models = {name: load_model(path, torch.float32, "cpu")
              for name, path in (("float", source), ("nearest", tmp_path / "nearest"), ("gptq", tmp_path / "gptq"))}
    error = {name: sum(float((sequence_logits(m, ids) - sequence_logits(models["float"], ids)).square().sum())
                       for ids in prompts) for name, m in models.items() if name != "float"}
    assert error["gptq"] < error["nearest"], error
