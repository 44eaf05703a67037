"""Property tests: the identities DiLoCo's outer step must satisfy whatever the inputs."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.algorithm import (
    Contribution,
    DelayedNesterov,
    OuterOptimizer,
    classify_tensors,
    outer_step,
    pseudo_gradient,
    to_fp32_masters,
)

FEW = settings(max_examples=50, deadline=None)
shapes = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)


@FEW
@given(
    seed=st.integers(0, 2**31 - 1),
    tensor_shapes=st.lists(shapes, min_size=1, max_size=4),
    num_workers=st.integers(1, 6),
    scale=st.sampled_from([1e-3, 1.0, 100.0]),
)
def test_outer_sgd_lr_one_without_momentum_is_fedavg(
    seed: int, tensor_shapes: list[tuple[int, ...]], num_workers: int, scale: float
) -> None:
    generator = torch.Generator().manual_seed(seed)
    masters = {
        f"t{i}": torch.randn(s, generator=generator) * scale for i, s in enumerate(tensor_shapes)
    }
    kinds = dict.fromkeys(masters, "trainable")
    locals_ = [
        {n: t + torch.randn(t.shape, generator=generator) * scale for n, t in masters.items()}
        for _ in range(num_workers)
    ]
    contributions = [Contribution(pseudo_gradient(masters, local)) for local in locals_]
    outer_step(masters, contributions, OuterOptimizer("sgd", lr=1.0, momentum=0.0), kinds)
    for name, value in masters.items():
        fedavg = torch.stack([local[name] for local in locals_]).mean(dim=0)
        torch.testing.assert_close(value, fedavg, atol=1e-5 * scale, rtol=1e-5)


def _make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def _inner_optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch) -> None:
    inputs, targets = batch
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()


@FEW
@given(
    seed=st.integers(0, 2**31 - 1),
    steps=st.integers(1, 8),
    inner=st.sampled_from(["sgd", "adamw"]),
)
def test_h1_one_worker_outer_sgd_lr_one_is_plain_training(
    seed: int, steps: int, inner: str
) -> None:
    generator = torch.Generator().manual_seed(seed)
    batches = [
        (torch.randn(5, 4, generator=generator), torch.randn(5, 3, generator=generator))
        for _ in range(steps)
    ]

    plain = _make_model(seed)
    plain_optimizer = _inner_optimizer(inner, plain)
    for batch in batches:
        _train_step(plain, plain_optimizer, batch)

    worker = _make_model(seed)
    worker_optimizer = _inner_optimizer(inner, worker)
    masters = to_fp32_masters(worker.state_dict())
    kinds = classify_tensors(worker)
    outer = OuterOptimizer("sgd", lr=1.0, momentum=0.0)
    for batch in batches:
        _train_step(worker, worker_optimizer, batch)
        contribution = Contribution(pseudo_gradient(masters, worker.state_dict()))
        outer_step(masters, [contribution], outer, kinds)
        with torch.no_grad():
            for name, tensor in worker.state_dict().items():
                tensor.copy_(masters[name])

    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(masters[name], tensor, atol=1e-6, rtol=0)


@FEW
@given(
    data=st.data(),
    seed=st.integers(0, 2**31 - 1),
    delay=st.integers(1, 4),
    cycles=st.integers(1, 3),
    momentum=st.sampled_from([0.0, 0.5, 0.9]),
)
def test_delayed_nesterov_c0_is_nesterov_on_the_cycle_mean_in_any_order(
    data: st.DataObject, seed: int, delay: int, cycles: int, momentum: float
) -> None:
    generator = torch.Generator().manual_seed(seed)
    start = torch.randn(3, generator=generator)
    delayed_params = {"w": start.clone()}
    nesterov_params = {"w": start.clone()}
    delayed = DelayedNesterov(lr=0.7, momentum=momentum, delay=delay, c=0.0)
    nesterov = OuterOptimizer("nesterov", lr=0.7, momentum=momentum)
    for _ in range(cycles):
        grads = [torch.randn(3, generator=generator) for _ in range(delay)]
        order = data.draw(st.permutations(range(delay)))
        for index in order:
            delayed.step(delayed_params, {"w": grads[index]})
        nesterov.step(nesterov_params, {"w": torch.stack(grads).mean(dim=0)})
        torch.testing.assert_close(delayed_params["w"], nesterov_params["w"], atol=1e-5, rtol=1e-5)
