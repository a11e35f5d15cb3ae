"""FP8 weights rounded with error feedback (GPTQ, Frantar et al. 2022), not each to its nearest E4M3 value.

Rounding every weight to its nearest E4M3 value (3 mantissa bits) is what costs a small model most of its FP8 error
(perf.fp8_quality's ablation: FP8 weights alone take SmolLM2-135M to KL 0.016). GPTQ rounds a layer's input
columns one at a time and pushes each column's rounding error onto the columns not yet rounded, weighted by the
inverse Hessian H = X^T X of the layer's inputs over a calibration set, so that the layer's outputs on such inputs
move least. Rows are independent, so a fused q/k/v or gate/up weight is rounded as its parts would be. The
result is an ordinary FP8 checkpoint (same scales, same format): only which E4M3 value each weight gets changes.

Layers are rounded in order, each projection from the inputs it sees in the partly quantized model (earlier
projections already rounded, its input quantized as the engine quantizes it), so later layers absorb what the
earlier ones changed.
"""
from __future__ import annotations

from pathlib import Path

import torch

from backends.llm.fp8 import FP8, FP8_MAX, Fp8Linear, quantize

BLOCK = 128  # columns rounded together before their error is pushed onto the rest (GPTQ's lazy batch update)


def gptq_round(weight: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor, damp: float = 0.01
               ) -> torch.Tensor:
    """E4M3 weight [N, K] for float `weight` [N, K] with per-row `scale` [N, 1], rounded column by column (the inputs
    with the largest second moment first) with the error carried forward through the Cholesky factor of the inverse
    of `hessian` [K, K] (damped by `damp` x its mean diagonal; inputs that never occur are rounded to nearest)."""
    order = torch.argsort(hessian.diagonal(), descending=True)  # the inputs that matter most rounded first
    w = weight.double()[:, order]
    h = hessian.double()[order][:, order]
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    h.diagonal().add_(damp * h.diagonal().mean())
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    s = scale.double().view(-1, 1)
    k = w.shape[1]
    for start in range(0, k, BLOCK):
        end = min(start + BLOCK, k)
        errors = torch.empty(w.shape[0], end - start, dtype=torch.float64)
        for j in range(start, end):
            column = w[:, j:j + 1]
            rounded = (column / s).clamp(-FP8_MAX, FP8_MAX).float().to(FP8).double() * s
            error = (column - rounded) / u[j, j]
            w[:, j:end] -= error * u[j, j:end][None, :]
            w[:, j:j + 1] = rounded
            errors[:, j - start:j - start + 1] = error
        w[:, end:] -= errors @ u[start:end, end:]
    return quantize(w[:, torch.argsort(order)], scale.view(-1, 1))


@torch.inference_mode()
def gptq_weights(fp8_checkpoint: Path, float_checkpoint: Path, prompts: list[list[int]], damp: float = 0.01
                 ) -> dict[str, torch.Tensor]:
    """{checkpoint name: E4M3 weight} for every decoder projection of `fp8_checkpoint` (whose scales stay), and its
    LM head where that is FP8, rounded by `gptq_round` from `float_checkpoint`'s weights, with Hessians from `prompts`
    (token ids) run through the FP8 model as it is being rounded. Fused projections come back split into the
    checkpoint's own names."""
    from backends.llm.model import FUSED, _shard_sizes, load_model
    from backends.llm.scoring import LayerStates

    model = load_model(fp8_checkpoint, torch.float32, "cpu")
    reference = load_model(float_checkpoint, torch.float32, "cpu")
    states = LayerStates(model, prompts)
    out = {}

    def rounded(linear: Fp8Linear, weight: torch.Tensor, run) -> torch.Tensor:
        """`weight` rounded for `linear`, with the Hessian of the inputs `linear` sees while `run()` runs."""
        hessian = torch.zeros(linear.in_features, linear.in_features, dtype=torch.float64)

        def accumulate(module: Fp8Linear, args: tuple) -> None:
            x = module.computed_input(args[0]).double()
            hessian.add_(x.T @ x)

        hook = linear.register_forward_pre_hook(accumulate)
        run()
        hook.remove()
        linear.weight.data = gptq_round(weight.float(), hessian, linear.weight_scale, damp)
        return linear.weight.data

    for i, layer in enumerate(model.layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            linear: Fp8Linear = layer.get_submodule(name)
            weight = reference.layers[i].get_submodule(name).weight
            rounded(linear, weight, lambda: states.run(i))
            parts = name.split(".")
            shards = [k for k, (fused, _) in FUSED.items() if fused == parts[1]] or [parts[1]]
            sizes = _shard_sizes(model.args, parts[1], weight.shape[0]) if len(shards) > 1 else [weight.shape[0]]
            for shard, rows in zip(shards, linear.weight.data.split(sizes)):
                out[f"model.layers.{i}.{parts[0]}.{shard}.weight"] = rows.clone()
        states.advance(i)
    if isinstance(model.lm_head, Fp8Linear):  # its inputs: the final norm of what the last layer gave
        out["lm_head.weight"] = rounded(model.lm_head, reference.lm_head.weight,
                                        lambda: [model.logits(model.norm(item[0])) for item in states.items]).clone()
    return out
