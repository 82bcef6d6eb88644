"""The benchmark's models: sizes as documented, one training step each, per-rank batches."""

from __future__ import annotations

import pytest
import torch

from tools.bench.workloads import PRECISIONS, SIZE_TIERS, WORKLOADS, precision_scope

CPU = torch.device("cpu")


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_tier_counts_its_parameters(name: str) -> None:
    for tier in SIZE_TIERS:
        workload = WORKLOADS[name][tier]
        model = workload.build(torch.device("meta"))
        assert sum(p.numel() for p in model.parameters()) == workload.parameters, (name, tier)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_small_tier_trains_one_step_with_a_gradient_on_every_parameter(name: str) -> None:
    workload = WORKLOADS[name]["small"]
    model = workload.build(CPU)
    with precision_scope("fp32", CPU):
        loss = workload.loss(model, workload.make_batch(CPU))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_real_models_have_many_tensors_of_mixed_sizes() -> None:
    for name in ("transformer", "cnn"):
        params = list(WORKLOADS[name]["large"].build(torch.device("meta")).parameters())
        assert len(params) >= 100, name
        assert min(p.numel() for p in params) * 1000 < max(p.numel() for p in params), name


def test_the_cnn_is_resnet34_shaped_with_a_batchnorm_after_every_convolution() -> None:
    model = WORKLOADS["cnn"]["large"].build(torch.device("meta"))
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(convs) == len(norms) == 1 + 2 * (3 + 4 + 6 + 3) + 3  # stem, blocks, 3 projections
    assert all(conv.bias is None for conv in convs)


def test_precision_scope_refuses_an_unknown_precision() -> None:
    with pytest.raises(ValueError, match="precision"), precision_scope("fp8", CPU):
        pass
    assert "bf16-autocast" in PRECISIONS
