"""Robust aggregation and a bad worker in the simulator: the attacks' arithmetic by hand, and
what each rule does to a run with a worker that sends 100x its update."""

from __future__ import annotations

import pytest
import torch

from diloco.algorithm import TensorKind
from diloco.models import GPTConfig
from diloco.sim import SimConfig, simulate
from diloco.sim.hostile import corrupt

KINDS = {"w": TensorKind.TRAINABLE, "b": TensorKind.FLOAT_BUFFER}


def test_each_attack_changes_the_trainable_tensors_only() -> None:
    gradient = {"w": torch.tensor([3.0, -4.0]), "b": torch.tensor([1.0])}
    generator = torch.Generator().manual_seed(0)
    assert corrupt(gradient, "scale100", KINDS, generator)["w"].tolist() == [300.0, -400.0]
    assert corrupt(gradient, "sign_flip", KINDS, generator)["w"].tolist() == [-3.0, 4.0]
    noise = corrupt(gradient, "noise", KINDS, generator)
    assert float(noise["w"].norm()) == pytest.approx(5.0)  # the honest norm, sqrt(9 + 16)
    assert noise["w"].tolist() not in ([3.0, -4.0], [-3.0, 4.0])
    assert all(corrupt(gradient, k, KINDS, generator)["b"].tolist() == [1.0]
               for k in ("scale100", "sign_flip", "noise"))  # fmt: skip


def small(**overrides) -> SimConfig:
    model = GPTConfig(context=32, width=32, depth=1, heads=4)
    base = dict(workers=4, steps=40, sync_every=10, batch_size=4, seq_len=32, corpus="generated",
                model=model, eval_batches=2)  # fmt: skip
    return SimConfig(**{**base, **overrides})


def test_a_worker_sending_100x_ruins_the_mean_and_is_refused_by_the_median() -> None:
    honest = simulate(small())
    attacked = simulate(small(hostile="scale100"))
    robust = simulate(small(hostile="scale100", aggregation="median"))
    assert attacked.final_eval_loss > honest.final_eval_loss + 1.0
    # refused in each of the 4 rounds, so the run is the 3 honest workers' median
    assert robust.refused_contributions == 4 and attacked.refused_contributions == 0
    assert robust.final_eval_loss == pytest.approx(honest.final_eval_loss, rel=0.02)


def test_with_nobody_bad_a_robust_rule_refuses_nothing() -> None:
    result = simulate(small(aggregation="clipped_mean"))
    assert result.refused_contributions == 0
    assert result.to_json()["aggregation"] == "clipped_mean"


def test_sparse_mean_is_the_mean_for_dense_uploads_and_differs_for_top_k() -> None:
    """fp32 pseudo-gradients hold no zeros, so every element has all K senders: the plain
    mean's run (to rounding); top-k ones leave most elements to fewer workers."""
    plain, sparse = simulate(small()), simulate(small(aggregation="sparse_mean"))
    assert sparse.final_eval_loss == pytest.approx(plain.final_eval_loss, rel=1e-4)
    assert sparse.to_json()["aggregation"] == "sparse_mean" and sparse.refused_contributions == 0
    codec = {"upload_codec": "topk:0.1", "outer_optimizer": "sgd", "outer_lr": 1.0}
    top_k = simulate(small(aggregation="mean", **codec))
    top_k_sparse = simulate(small(**codec))  # a top-k codec's default
    assert top_k_sparse.to_json()["aggregation"] == "sparse_mean"
    assert abs(top_k_sparse.final_eval_loss - top_k.final_eval_loss) > 1e-3


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"aggregation": "trimmed_mean:0.5"}, "the trimmed fraction F must be in [0, 0.5)"),
        ({"aggregation": "mode"}, "aggregation must be one of mean, clipped_mean"),
        ({"hostile": "evil"}, "hostile must be one of none, scale100, sign_flip, noise"),
        ({"mode": "async", "aggregation": "median"}, "apply to --mode diloco in the simulator"),
        (
            {"upload_codec": "int8", "aggregation": "sparse_mean"},
            "upload codec int8 codes every small value as 0",
        ),
        ({"mode": "ddp", "hostile": "noise"}, "apply to --mode diloco in the simulator"),
    ],
)
def test_bad_robust_settings_name_the_problem(overrides: dict, says: str) -> None:
    with pytest.raises(ValueError) as raised:
        small(**overrides)
    assert says in str(raised.value)
