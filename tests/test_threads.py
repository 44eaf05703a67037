"""Thread budgets: a positive count or one error naming the option; the server's small default
(OMP_NUM_THREADS respected); the cores of one machine split between its processes."""

from __future__ import annotations

import os

import pytest
import torch

from diloco.commands.threads import apply_thread_budget, check_threads, server_threads, split_cores


@pytest.mark.parametrize(("processes", "cores", "each"), [(3, 8, 2), (4, 2, 1), (1, 16, 16)])
def test_cores_are_split_evenly_and_nobody_gets_none(processes, cores, each) -> None:
    assert split_cores(processes, cores) == each


@pytest.mark.parametrize("bad", [0, -2, True, 1.5, "2"])
def test_a_count_that_is_not_a_positive_integer_names_the_option(bad) -> None:
    with pytest.raises(ValueError, match=r"^--threads must be a positive integer, got"):
        check_threads(bad)
    check_threads(None)
    check_threads(3)


def test_the_server_default_is_small_unless_omp_num_threads_says(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert server_threads(None) == min(4, len(os.sched_getaffinity(0)))
    assert server_threads(7) == 7
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert server_threads(None) is None  # torch's default, which follows the variable
    assert server_threads(2) == 2


def test_a_budget_sets_torch_threads_and_none_leaves_them() -> None:
    before = torch.get_num_threads()
    try:
        assert apply_thread_budget(1) == 1 and torch.get_num_threads() == 1
        assert apply_thread_budget(None) == 1
        with pytest.raises(ValueError):
            apply_thread_budget(0)
    finally:
        torch.set_num_threads(before)
