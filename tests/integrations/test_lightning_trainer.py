"""A Lightning Trainer as a DiLoCo worker: examples/lightning_trainer.py against a real server,
with a kill -9 right after a checkpoint and a resume that must continue the same run."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from example_runs import (
    assert_leased_samples_once,
    assert_same_global_weights,
    example_worker,
    finished,
    torchrun_example,
)

from diloco.integrations.lightning import DiLoCoCallback, DiLoCoCallbackError
from processes import global_weights


def lightning_worker(url: str, worker_id: str, out: Path, *extra: str, **kwargs):
    return example_worker("lightning_trainer.py", url, worker_id, out, *extra, **kwargs)


@pytest.mark.slow  # in `make test-slow`, with the rest of this file
def test_two_lightning_fits_train_one_model_through_a_real_server(
    server_process, corpus_file: Path, tmp_path: Path
) -> None:
    server = server_process("--sync-every", "3", "--min-workers", "2")
    workers = {w: lightning_worker(server.url, w, tmp_path, corpus=corpus_file) for w in "ab"}
    for worker_id, process in workers.items():
        finished(process, tmp_path, worker_id)
    reports = [json.loads((tmp_path / f"{w}.json").read_text()) for w in workers]
    assert global_weights(server.url)[1] == 2  # 6 optimizer steps at H = 3
    assert [r["worker"]["rounds"] for r in reports] == [2, 2]
    assert reports[0]["final_eval_loss"] == reports[1]["final_eval_loss"]
    assert reports[0]["final_eval_loss"] < reports[0]["initial_eval_loss"] - 0.5


@pytest.mark.slow  # in `make test-slow`, with the rest of this file
def test_a_killed_fit_resumes_from_its_checkpoint_and_ends_as_an_unbroken_run(
    server_process, corpus_file: Path, tmp_path: Path
) -> None:
    """H = 2, gradient accumulation 2, a checkpoint at step 3: the kill lands inside round 2."""
    broken_dir, unbroken_dir = tmp_path / "broken", tmp_path / "unbroken"
    broken_dir.mkdir(), unbroken_dir.mkdir()
    broken = server_process("--sync-every", "2", "--min-workers", "1")
    unbroken = server_process("--sync-every", "2", "--min-workers", "1")
    accumulate = ("--grad-accum", "2")

    killed = lightning_worker(broken.url, "w", broken_dir, *accumulate, corpus=corpus_file,
                              crash_at="lightning_checkpoint_saved:1")  # fmt: skip
    finished(killed, broken_dir, "w", code=-signal.SIGKILL)
    assert global_weights(broken.url)[1] == 1  # round 1 (steps 1-2) committed, round 2 not

    refused = lightning_worker(broken.url, "w", broken_dir, "--resume", corpus=corpus_file)
    finished(refused, broken_dir, "w", code=2)
    log = (broken_dir / "w.log").read_text()
    assert "accumulate_grad_batches 2 -> 1" in log and "Traceback" not in log

    resumed = lightning_worker(broken.url, "w", broken_dir, "--resume", *accumulate,
                               corpus=corpus_file)  # fmt: skip
    straight = lightning_worker(unbroken.url, "w", unbroken_dir, *accumulate, corpus=corpus_file)
    finished(resumed, broken_dir, "w")
    finished(straight, unbroken_dir, "w")
    report = json.loads((broken_dir / "w.json").read_text())
    assert report["resumed_from"].endswith("diloco-w/step-3")
    assert_same_global_weights(broken.url, unbroken.url, rounds=3)


@pytest.mark.slow  # the Trainer's twin (test_transformers_trainer.py) is the default's sample
def test_leased_data_trains_every_sample_once_through_two_fits_a_kill_and_a_resume(
    server_process, tmp_path: Path
) -> None:
    """Fit v is killed as its step-3 checkpoint is written, when Lightning has fetched the
    next batch already (see example_runs.assert_leased_samples_once)."""
    assert_leased_samples_once(
        "lightning_trainer.py", server_process, tmp_path, "lightning_checkpoint_saved:1"
    )
    assert json.loads((tmp_path / "v.json").read_text())["resumed_from"].endswith("step-3")


@pytest.mark.slow  # in `make test-slow`: three 2-rank torchrun groups
def test_a_killed_ddp_fit_resumes_from_its_checkpoint_as_an_unbroken_one(
    server_process, corpus_file: Path, tmp_path: Path
) -> None:
    """A 2-rank DDP fit under torchrun is one worker: rank 0 saves the worker state with the
    step-3 checkpoint (H = 2: inside round 2) and dies with kill -9 as it is written; the
    resumed group ends where an unbroken group does, every rank on the same weights."""
    broken_dir, unbroken_dir = tmp_path / "broken", tmp_path / "unbroken"
    broken_dir.mkdir(), unbroken_dir.mkdir()
    broken = server_process("--sync-every", "2", "--min-workers", "1")
    unbroken = server_process("--sync-every", "2", "--min-workers", "1")
    ddp = ("--devices", "2")
    code = torchrun_example("lightning_trainer.py", broken.url, broken_dir, corpus_file, *ddp,
                            crash_at="lightning_checkpoint_saved:1")  # fmt: skip
    assert code != 0
    assert global_weights(broken.url)[1] == 1  # round 1 (steps 1-2) committed, round 2 not
    resumed = torchrun_example(
        "lightning_trainer.py", broken.url, broken_dir, corpus_file, *ddp, "--resume"
    )
    assert resumed == 0, (broken_dir / "g0.log").read_text()[-3000:]
    straight = torchrun_example(
        "lightning_trainer.py", unbroken.url, unbroken_dir, corpus_file, *ddp
    )
    assert straight == 0, (unbroken_dir / "g0.log").read_text()[-3000:]
    report = json.loads((broken_dir / "g0.json").read_text())
    assert report["resumed_from"].endswith("step-3")
    assert report["worker"]["rounds"] == 3  # round 1 before the kill, 2 and 3 after it
    assert_same_global_weights(broken.url, unbroken.url, rounds=3)


def test_options_the_callback_owns_are_refused() -> None:
    with pytest.raises(DiLoCoCallbackError, match="save_every_round is the callback's to set"):
        DiLoCoCallback("http://127.0.0.1:9", save_every_round=True)


def test_a_resume_whose_worker_state_is_gone_is_named(tmp_path: Path) -> None:
    class Trainer:
        accumulate_grad_batches = 1
        global_step = 3

    callback = DiLoCoCallback("http://127.0.0.1:9")
    callback.load_state_dict({"dir": str(tmp_path / "gone"), "step": 3,
                              "accumulate_grad_batches": 1})  # fmt: skip
    with pytest.raises(DiLoCoCallbackError, match=r"worker state .*gone is gone"):
        callback._resume_dir(Trainer())
    callback.load_state_dict({"dir": str(tmp_path), "step": 2, "accumulate_grad_batches": 1})
    with pytest.raises(DiLoCoCallbackError, match="saved at step 2, Lightning resumed at step 3"):
        callback._resume_dir(Trainer())


def test_a_resume_under_a_gradient_accumulation_schedule_is_not_refused(tmp_path: Path) -> None:
    """GradientAccumulationScheduler({0: 1, 2: 4}) sets accumulate_grad_batches at each
    epoch's start, after on_train_start, where a resume is checked: a checkpoint saved at
    epoch 2 recorded 4 and the check saw 1, so every such resume was refused. The schedule
    is what is kept now; another schedule is still refused."""
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    def trainer(schedule: dict[int, int]) -> L.Trainer:
        return L.Trainer(
            callbacks=[GradientAccumulationScheduler(schedule)], logger=False,
            enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu",
            default_root_dir=str(tmp_path),
        )  # fmt: skip

    callback = DiLoCoCallback("http://127.0.0.1:9")
    # what a checkpoint saved at epoch 2 (accumulate_grad_batches 4 then) holds, as JSON
    saved = {"accumulate_grad_batches": {"0": 1, "2": 4}}
    callback.load_state_dict({"dir": str(tmp_path), "step": 0, **saved})
    resuming = trainer({0: 1, 2: 4})  # on_train_start: accumulate_grad_batches is 1 again
    assert resuming.accumulate_grad_batches == 1 and resuming.global_step == 0
    assert callback._resume_dir(resuming) == tmp_path
    with pytest.raises(DiLoCoCallbackError, match="other Trainer settings"):
        callback._resume_dir(trainer({0: 1, 2: 8}))
