"""Worker checkpoints on real files: bit-identical resume, mismatch refusal, corruption fallback."""

from __future__ import annotations

import copy
import logging
import os
import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy
import pytest
import torch
from torch import nn

from diloco.checkpoints import CheckpointStore
from diloco.models import GPT
from diloco.worker.state.checkpoint import (
    load_worker_checkpoint,
    restore_worker_checkpoint,
    save_worker_checkpoint,
)
from tiny import TINY_MODEL

Factory = Callable[[], nn.Module]
OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], object]


# ----------------------------------------------------------------- models and training


def make_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))


def make_gpt() -> nn.Module:
    return GPT(replace(TINY_MODEL, dropout=0.2))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: object) -> None:
    """Draws from every RNG a real loop might use: torch (data, dropout), Python, numpy."""
    scale = random.random() + float(numpy.random.rand())
    if isinstance(model, GPT):
        tokens = torch.randint(0, TINY_MODEL.vocab_size, (2, TINY_MODEL.context + 1))
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss = loss * scale
    else:
        loss = model(torch.randn(8, 6)).pow(2).mean() * scale
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if scheduler is not None:
        scheduler.step()


def train(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: object, steps: int):
    model.train()
    for _ in range(steps):
        train_step(model, optimizer, scheduler)


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    numpy.random.seed(seed)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)


def step_lr(optimizer: torch.optim.Optimizer) -> object:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


def lambda_lr(optimizer: torch.optim.Optimizer) -> object:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def save(directory: Path, model, optimizer, scheduler=None, **facts) -> Path:
    defaults = {"worker_id": "w-1", "anchor_round": 3, "local_step": 5}
    return save_worker_checkpoint(
        directory,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        anchor={k: v.float() for k, v in snapshot(model).items()},
        **{**defaults, **facts},
    )


# ----------------------------------------------------------------- bit-identical resume


@pytest.mark.parametrize(
    ("make_model", "make_optimizer", "make_scheduler"),
    [(make_mlp, sgd, step_lr), (make_gpt, adamw, lambda_lr), (make_mlp, adamw, None)],
    ids=["mlp-sgd-steplr", "gpt-adamw-lambdalr", "mlp-adamw"],
)
def test_resume_is_bit_identical_to_never_stopping(
    tmp_path: Path,
    make_model: Factory,
    make_optimizer: OptimizerFactory,
    make_scheduler: SchedulerFactory | None,
) -> None:
    def fresh() -> tuple[nn.Module, torch.optim.Optimizer, object]:
        model = make_model()
        optimizer = make_optimizer(model)
        return model, optimizer, make_scheduler(optimizer) if make_scheduler else None

    seed_everything(0)
    model, optimizer, scheduler = fresh()
    train(model, optimizer, scheduler, 7)
    never_saved = snapshot(model)

    seed_everything(0)
    model, optimizer, scheduler = fresh()
    train(model, optimizer, scheduler, 4)
    save(tmp_path, model, optimizer, scheduler, local_step=4)
    train(model, optimizer, scheduler, 3)
    continued = snapshot(model)

    seed_everything(123)  # another start: only the restore can bring the RNG streams back
    model, optimizer, scheduler = fresh()
    checkpoint = load_worker_checkpoint(
        tmp_path, model=model, optimizer=optimizer, scheduler=scheduler
    )
    assert checkpoint is not None and checkpoint.local_step == 4
    restore_worker_checkpoint(checkpoint, model=model, optimizer=optimizer, scheduler=scheduler)
    train(model, optimizer, scheduler, 3)

    assert_identical(never_saved, continued)  # saving did not perturb training
    assert_identical(continued, snapshot(model))


def test_restore_brings_back_every_rng(tmp_path: Path) -> None:
    model = make_mlp()
    optimizer = sgd(model)
    save(tmp_path, model, optimizer)
    expected = (torch.rand(3), random.random(), numpy.random.rand())
    checkpoint = load_worker_checkpoint(tmp_path, model=model, optimizer=optimizer)
    assert checkpoint is not None
    restore_worker_checkpoint(checkpoint, model=model, optimizer=optimizer)
    got = (torch.rand(3), random.random(), numpy.random.rand())
    assert torch.equal(expected[0], got[0]) and expected[1:] == got[1:]


# ----------------------------------------------------------------- facts, leases, anchor


def test_worker_facts_leases_and_anchor_round_trip(tmp_path: Path) -> None:
    model = make_mlp()
    optimizer = adamw(model)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)  # holds inf values
    train(model, optimizer, None, 2)
    leases = [{"shard": "a", "range": [0, 10], "meta": {"epoch": 1, "done": None}}, {"id": 7}]
    anchor = {name: t.float() + 1 for name, t in snapshot(model).items()}
    path = save_worker_checkpoint(
        tmp_path / "new" / "dir",
        worker_id="worker-9",
        model=model,
        optimizer=optimizer,
        anchor=anchor,
        anchor_round=12,
        local_step=40,
        steps_in_round=3,
        tokens=4096,
        leases=leases,
        scheduler=scheduler,
    )
    fresh = make_mlp()
    fresh_optimizer = adamw(fresh)
    fresh_scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(fresh_optimizer)
    checkpoint = load_worker_checkpoint(
        tmp_path / "new" / "dir", model=fresh, optimizer=fresh_optimizer, scheduler=fresh_scheduler
    )
    assert checkpoint is not None
    assert (checkpoint.worker_id, checkpoint.local_step, checkpoint.anchor_round) == (
        "worker-9",
        40,
        12,
    )
    assert (checkpoint.steps_in_round, checkpoint.tokens, checkpoint.leases) == (3, 4096, leases)
    assert checkpoint.path == path and checkpoint.generation == 0
    assert_identical(checkpoint.anchor, anchor)
    assert_identical(checkpoint.model, snapshot(model))
    assert checkpoint.scheduler_state == scheduler.state_dict()

    restore_worker_checkpoint(
        checkpoint, model=fresh, optimizer=fresh_optimizer, scheduler=fresh_scheduler
    )
    assert_identical(snapshot(fresh), snapshot(model))
    saved_state, restored_state = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert saved_state["param_groups"] == restored_state["param_groups"]
    for index, entry in saved_state["state"].items():
        assert_identical(entry, restored_state["state"][index])
        assert restored_state["state"][index]["step"].dim() == 0  # scalar tensors stay tensors
    assert fresh_scheduler.best == float("inf")


def test_missing_or_empty_directory_is_none_without_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = make_mlp()
    with caplog.at_level(logging.WARNING):
        assert (
            load_worker_checkpoint(tmp_path / "absent", model=model, optimizer=sgd(model)) is None
        )
        assert load_worker_checkpoint(tmp_path, model=model, optimizer=sgd(model)) is None
    assert caplog.records == []
    assert not (tmp_path / "absent").exists()


# ----------------------------------------------------------------- mismatches


def layers(*names: str, width: int = 4) -> nn.Module:
    return nn.Sequential(OrderedDict((name, nn.Linear(width, width)) for name in names))


def two_groups(model: nn.Module) -> torch.optim.Optimizer:
    first, *rest = model.children()
    others = [p for module in rest for p in module.parameters()]
    return torch.optim.AdamW([{"params": first.parameters()}, {"params": others, "lr": 0.1}])


MISMATCHES = [
    (lambda: layers("first", "third"), adamw, None, "'second.weight' (position 2)"),
    (lambda: layers("first", "second", width=5), adamw, None, "has shape [4, 4] in the"),
    (lambda: layers("second", "first"), adamw, None, "order differs: position 0 is"),
    (lambda: layers("first", "second"), sgd, None, "torch.optim.adamw.AdamW in the checkpoint"),
    (lambda: layers("first", "second"), two_groups, None, "has 1 optimizer param groups"),
    (lambda: layers("first", "second"), adamw, step_lr, "no LR scheduler state"),
]


@pytest.mark.parametrize(
    ("make_model", "make_optimizer", "make_scheduler", "expected"),
    MISMATCHES,
    ids=["renamed", "shape", "order", "optimizer-type", "group-count", "scheduler"],
)
def test_a_checkpoint_that_does_not_fit_is_refused_untouched(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    make_model: Factory,
    make_optimizer: OptimizerFactory,
    make_scheduler: SchedulerFactory | None,
    expected: str,
) -> None:
    saved_model = layers("first", "second")
    saved_optimizer = adamw(saved_model)
    train_linear(saved_model, saved_optimizer)
    save(tmp_path, saved_model, saved_optimizer)

    model = make_model()
    optimizer = make_optimizer(model)
    train_linear(model, optimizer)
    scheduler = make_scheduler(optimizer) if make_scheduler else None
    weights, optimizer_state = snapshot(model), copy.deepcopy(optimizer.state_dict())
    with caplog.at_level(logging.WARNING, logger="diloco.worker"):
        checkpoint = load_worker_checkpoint(
            tmp_path, model=model, optimizer=optimizer, scheduler=scheduler
        )
    assert checkpoint is None
    warnings = [r.getMessage() for r in caplog.records if r.name == "diloco.worker"]
    assert len(warnings) == 1 and expected in warnings[0], warnings
    assert_identical(weights, snapshot(model))
    assert_optimizer_state_equal(optimizer_state, optimizer.state_dict())


def train_linear(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    width = next(model.parameters()).shape[1]
    model(torch.randn(3, width)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def assert_optimizer_state_equal(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index in a["state"]:
        assert_identical(a["state"][index], b["state"][index])


def test_another_format_version_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = layers("first", "second")
    optimizer = adamw(model)
    save(tmp_path, model, optimizer)
    store = CheckpointStore(tmp_path, keep=2)
    loaded = store.load_latest()
    assert loaded is not None
    store.write(1, loaded.tensors, {**loaded.metadata, "format": 99})
    with caplog.at_level(logging.WARNING, logger="diloco.worker"):
        assert load_worker_checkpoint(tmp_path, model=model, optimizer=optimizer) is None
    assert "format version 99" in caplog.text


def test_restore_into_a_model_that_does_not_fit_raises(tmp_path: Path) -> None:
    model = layers("first", "second")
    optimizer = adamw(model)
    save(tmp_path, model, optimizer)
    checkpoint = load_worker_checkpoint(tmp_path, model=model, optimizer=optimizer)
    assert checkpoint is not None
    other = layers("first", "third")
    with pytest.raises(ValueError, match=r"'second\.weight'"):
        restore_worker_checkpoint(checkpoint, model=other, optimizer=adamw(other))


# ----------------------------------------------------------------- corruption and saving errors


def test_a_corrupt_newest_generation_falls_back_to_the_previous(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = make_mlp()
    optimizer = adamw(model)
    train(model, optimizer, None, 1)
    save(tmp_path, model, optimizer, local_step=1)
    train(model, optimizer, None, 1)
    save(tmp_path, model, optimizer, local_step=2)
    save(tmp_path, model, optimizer, local_step=3)  # keep=2: the first two generations go
    newest = save(tmp_path, model, optimizer, local_step=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gen-000000000002", "gen-000000000003"]

    target = newest / "optimizer.safetensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        checkpoint = load_worker_checkpoint(tmp_path, model=model, optimizer=optimizer)
    assert checkpoint is not None and checkpoint.local_step == 3
    assert "fails its xxh3_128 check" in caplog.text


def test_a_scheduler_state_that_is_not_json_names_the_key(tmp_path: Path) -> None:
    class Warmup:
        def __init__(self) -> None:
            self.steps = 10
            self.seen = {1, 2}  # a set: no JSON for it

        def __call__(self, step: int) -> float:
            return min(1.0, (step + 1) / self.steps)

    model = make_mlp()
    optimizer = sgd(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, Warmup())
    with pytest.raises(ValueError, match=r"'lr_lambdas\.0\.seen'"):
        save(tmp_path / "ckpt", model, optimizer, scheduler)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_an_unwritable_directory_is_a_value_error(tmp_path: Path) -> None:
    model = make_mlp()
    optimizer = sgd(model)
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="not writable"):
            save(read_only, model, optimizer)
        with pytest.raises(ValueError, match="cannot create"):
            save(read_only / "sub", model, optimizer)
    finally:
        read_only.chmod(0o700)
