"""The transformers Trainer as a DiLoCo worker: examples/transformers_trainer.py against a real
server, with a kill -9 after a Trainer checkpoint and a resume that must continue the same run."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from example_runs import (
    EXAMPLES,
    assert_leased_samples_once,
    assert_same_global_weights,
    example_worker,
    finished,
    torchrun_example,
)

from diloco.integrations.transformers import (
    DiLoCoCallback,
    DiLoCoCallbackError,
    same_data_warning,
    torch_optimizer,
    worker_data_seed,
)
from diloco.worker import DiLoCoClient, RetryPolicy
from processes import global_weights


def trainer_worker(url: str, worker_id: str, out: Path, *extra: str, **kwargs):
    return example_worker("transformers_trainer.py", url, worker_id, out, *extra, **kwargs)


def eval_of_checkpoint(checkpoint: Path, corpus: Path) -> float:
    """The example's eval loss of the weights a Trainer checkpoint holds (its options as
    example_worker gives them: windows of 32 bytes, batches of 4)."""
    from transformers import AutoModelForCausalLM

    from diloco.data import load_named_corpus, split_train_val

    spec = importlib.util.spec_from_file_location(
        "trainer_example", EXAMPLES / "transformers_trainer.py"
    )
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    val = example.ByteWindows(split_train_val(load_named_corpus(str(corpus))).val, 32)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    return example.eval_loss(model, val, 4, "a checkpoint", say=False)


def test_two_trainers_train_one_model_through_a_real_server(
    server_process, corpus_file: Path, tmp_path: Path
) -> None:
    server = server_process("--sync-every", "3", "--min-workers", "2")
    workers = {w: trainer_worker(server.url, w, tmp_path, corpus=corpus_file) for w in ("a", "b")}
    for worker_id, process in workers.items():
        finished(process, tmp_path, worker_id)
    reports = [json.loads((tmp_path / f"{w}.json").read_text()) for w in workers]
    _, round_number = global_weights(server.url)
    assert round_number == 2  # 6 optimizer steps at H = 3
    assert [r["worker"]["rounds"] for r in reports] == [2, 2]
    assert [r["global_step"] for r in reports] == [6, 6]
    # Both Trainers end on the global weights: the same eval loss, well below the start
    assert reports[0]["final_eval_loss"] == reports[1]["final_eval_loss"]
    assert reports[0]["final_eval_loss"] < reports[0]["initial_eval_loss"] - 0.5
    saved = tmp_path / "a" / "checkpoint-3" / "diloco"
    assert json.loads((saved / "trainer_run.json").read_text()) == {
        "gradient_accumulation_steps": 1,
        "per_device_train_batch_size": 4,
        "global_step": 3,
    }


@pytest.mark.slow  # in `make test-slow`; two Trainers through a server are the default's sample
def test_a_killed_trainer_resumes_from_its_checkpoint_and_ends_as_an_unbroken_run(
    server_process, corpus_file: Path, tmp_path: Path
) -> None:
    """H = 2 and a checkpoint at step 3: the kill -9 lands in the middle of round 2."""
    broken_dir, unbroken_dir = tmp_path / "broken", tmp_path / "unbroken"
    broken_dir.mkdir(), unbroken_dir.mkdir()
    broken = server_process("--sync-every", "2", "--min-workers", "1")
    unbroken = server_process("--sync-every", "2", "--min-workers", "1")

    killed = trainer_worker(broken.url, "w", broken_dir, corpus=corpus_file,
                            crash_at="trainer_checkpoint_saved:1")  # fmt: skip
    finished(killed, broken_dir, "w", code=-signal.SIGKILL)
    assert global_weights(broken.url)[1] == 1  # round 1 (steps 1-2) committed, round 2 not

    # A resume with other Trainer settings is refused, and changes nothing
    refused = trainer_worker(broken.url, "w", broken_dir, "--resume", "--grad-accum", "2",
                             corpus=corpus_file)  # fmt: skip
    finished(refused, broken_dir, "w", code=2)
    log = (broken_dir / "w.log").read_text()
    assert "gradient_accumulation_steps 1 -> 2" in log and "Traceback" not in log

    resumed = trainer_worker(broken.url, "w", broken_dir, "--resume", corpus=corpus_file)
    straight = trainer_worker(unbroken.url, "w", unbroken_dir, corpus=corpus_file)
    finished(resumed, broken_dir, "w")
    finished(straight, unbroken_dir, "w")
    report = json.loads((broken_dir / "w.json").read_text())
    assert report["resumed_from"].endswith("checkpoint-3/diloco")
    # Its "eval loss A -> B" starts where it resumed (the server still at its round), not
    # at the random initial weights the fresh run starts from
    fresh = json.loads((unbroken_dir / "w.json").read_text())
    assert fresh["initial_step"] == 0 and report["initial_step"] == 3
    assert report["initial_eval_loss"] == pytest.approx(
        eval_of_checkpoint(broken_dir / "w" / "checkpoint-3", corpus_file), rel=1e-5
    )
    assert report["initial_eval_loss"] < fresh["initial_eval_loss"]
    # rounds end at steps 2, 4 and 6 on both servers: none repeated, none lost
    assert_same_global_weights(broken.url, unbroken.url, rounds=3)


@pytest.mark.slow  # kills and resumes leasing once: tests/e2e/test_e2e_samples_once.py (default)
def test_leased_data_trains_every_sample_once_through_two_trainers_a_kill_and_a_resume(
    server_process, tmp_path: Path
) -> None:
    """Trainer v is killed at its step-3 checkpoint, when accelerate has fetched step 4's
    batch already (see example_runs.assert_leased_samples_once)."""
    assert_leased_samples_once(
        "transformers_trainer.py", server_process, tmp_path, "trainer_checkpoint_saved:1"
    )
    v = json.loads((tmp_path / "v.json").read_text())
    assert v["resumed_from"].endswith("checkpoint-3/diloco")
    # Each evaluation says what it reads; the resumed run's first is of where it resumed
    log = (tmp_path / "v.log").read_text()
    evals = [line for line in log.splitlines() if line.startswith("eval of ")]
    assert v["initial_step"] == 3
    assert re.fullmatch(r"eval of the weights it starts from: \d+ batches of 4 windows", evals[0])
    assert re.fullmatch(r"eval of the weights it starts from: loss \d+\.\d{4} \(\d+ s\)", evals[1])
    resumed = r"eval of the weights it resumes from \(step 3\): \d+ batches of 4 windows"
    assert any(re.fullmatch(resumed, line) for line in evals), evals


class _Args:
    output_dir = "/nonexistent"
    gradient_accumulation_steps = 1
    per_device_train_batch_size = 1


class _State:
    global_step = 0


def test_a_trainer_without_an_optimizer_yet_is_named() -> None:
    callback = DiLoCoCallback("http://127.0.0.1:9")
    with pytest.raises(DiLoCoCallbackError, match="the Trainer has no optimizer yet"):
        callback.on_train_begin(_Args(), _State(), None, model=torch.nn.Linear(2, 2))


def test_an_optimizer_that_cannot_be_hooked_is_named() -> None:
    with pytest.raises(DiLoCoCallbackError, match=r"cannot hook the trainer's optimizer \(dict\)"):
        torch_optimizer({"lr": 1.0})
    inner = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)

    class Wrapper:  # as accelerate's AcceleratedOptimizer keeps the real one
        optimizer = inner

    assert torch_optimizer(Wrapper()) is inner
    assert torch_optimizer(inner) is inner


def test_a_deepspeed_optimizer_is_refused_before_anything_is_hooked() -> None:
    """accelerate's DeepSpeedOptimizerWrapper (a torch Optimizer whose __init__ never ran)
    over ZeRO's optimizer (not one): the check let it through and hooking it failed with an
    AttributeError once the worker had registered; and under Lightning the unwrap reached
    ZeRO's inner torch optimizer, whose step ZeRO follows by copying its own weights back
    over the global ones. The real wrapper class, made as DeepSpeed leaves it (no
    Accelerator in this process)."""
    from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper

    class DeepSpeedZeroOptimizer:  # DeepSpeed's ZeRO stage optimizer: not a torch Optimizer
        optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)

    wrapper = object.__new__(DeepSpeedOptimizerWrapper)
    wrapper.optimizer = DeepSpeedZeroOptimizer()
    for given in (wrapper, DeepSpeedZeroOptimizer()):
        with pytest.raises(DiLoCoCallbackError, match=r"DeepSpeed \(ZeRO\) optimizers"):
            torch_optimizer(given)


def test_options_the_callback_owns_are_refused() -> None:
    with pytest.raises(DiLoCoCallbackError, match="checkpoint_dir is the callback's to set"):
        DiLoCoCallback("http://127.0.0.1:9", checkpoint_dir="/tmp/x")


def torchrun_trainer(url: str, out: Path, corpus: Path, *extra: str, crash_at: str = ""):
    return torchrun_example("transformers_trainer.py", url, out, corpus, *extra, crash_at=crash_at)


@pytest.mark.slow  # the same line in the default suite: test_worker_worker, test_cli_worker_log
def test_a_trainer_held_by_min_workers_says_why(
    server_process, corpus_file: Path, tmp_path: Path
) -> None:
    """Alone under --min-workers 2, the Trainer's first sync waits, and its log says for what
    (the library's line, as `diloco worker` prints it) after DILOCO_WAIT_REPORT_SECONDS."""
    server = server_process("--sync-every", "2", "--min-workers", "2")
    trainer = trainer_worker(server.url, "w", tmp_path, "--eval-batches", "2", corpus=corpus_file,
                             env={"DILOCO_WAIT_REPORT_SECONDS": "1"})  # fmt: skip
    log = tmp_path / "w.log"
    deadline = time.monotonic() + 120
    while "still open" not in log.read_text():
        assert time.monotonic() < deadline and trainer.poll() is None, log.read_text()[-3000:]
        time.sleep(0.1)
    trainer.kill()
    trainer.wait(timeout=30)
    [line] = [line for line in log.read_text().splitlines() if "still open" in line]
    assert re.fullmatch(
        r"round 0 still open after \d+ s, waiting for: 1 more submission \(--min-workers\); "
        r"the round commits once more workers join and submit",
        line,
    )


@pytest.mark.slow  # in `make test-slow`: torchrun starts 2 more interpreters
def test_a_trainer_under_torchrun_is_one_worker(
    server_process, corpus_file: Path, tmp_path: Path
) -> None:
    server = server_process("--sync-every", "3", "--min-workers", "1")
    code = torchrun_trainer(server.url, tmp_path, corpus_file)
    assert code == 0, (tmp_path / "g0.log").read_text()[-3000:]
    report = json.loads((tmp_path / "g0.json").read_text())  # rank 0 alone writes it
    assert report["worker"]["rounds"] == 2 and report["global_step"] == 6
    assert report["final_eval_loss"] < report["initial_eval_loss"] - 0.5
    with DiLoCoClient(server.url, retry=RetryPolicy(attempts=3), read_timeout=30) as client:
        workers = client.status()["workers"]
    # The two ranks are one worker: one registration, in both rounds
    assert [(w["worker_id"], w["rounds_contributed"]) for w in workers] == [("g0", 2)]
    assert global_weights(server.url)[1] == 2


@pytest.mark.slow  # in `make test-slow`: three 2-rank torchrun groups
def test_a_killed_torchrun_group_resumes_from_the_trainer_checkpoint_as_an_unbroken_run(
    server_process, corpus_file: Path, tmp_path: Path
) -> None:
    """Rank 0 saves the group's worker state with checkpoint-3 (H = 2: inside round 2) and
    dies there with kill -9 (torchrun then ends rank 1); the resumed group puts the step
    trained into round 2 back on every rank and ends where an unbroken group does."""
    broken_dir, unbroken_dir = tmp_path / "broken", tmp_path / "unbroken"
    broken_dir.mkdir(), unbroken_dir.mkdir()
    broken = server_process("--sync-every", "2", "--min-workers", "1")
    unbroken = server_process("--sync-every", "2", "--min-workers", "1")
    code = torchrun_trainer(broken.url, broken_dir, corpus_file,
                            crash_at="trainer_checkpoint_saved:1")  # fmt: skip
    assert code != 0
    assert global_weights(broken.url)[1] == 1  # round 1 (steps 1-2) committed, round 2 not
    saved = broken_dir / "g0" / "checkpoint-3" / "diloco"
    assert json.loads((saved / "trainer_run.json").read_text())["global_step"] == 3
    resumed = torchrun_trainer(broken.url, broken_dir, corpus_file, "--resume")
    assert resumed == 0, (broken_dir / "g0.log").read_text()[-3000:]
    assert torchrun_trainer(unbroken.url, unbroken_dir, corpus_file) == 0
    report = json.loads((broken_dir / "g0.json").read_text())
    assert report["resumed_from"].endswith("checkpoint-3/diloco")
    assert report["worker"]["rounds"] == 3  # round 1 before the kill, 2 and 3 after it
    assert "step(s) into that round are dropped" not in (broken_dir / "g0.log").read_text()
    assert_same_global_weights(broken.url, unbroken.url, rounds=3)


@pytest.mark.slow  # in `make test-slow`
def test_a_resume_from_an_older_checkpoint_rejoins_the_run_the_server_went_on_with(
    server_process, corpus_file: Path, tmp_path: Path
) -> None:
    """Killed at its second checkpoint (step 6, round 3 committed), resumed from the first
    (step 3, inside round 2): the server is past that round, so the worker takes its weights,
    drops the step trained into the old round (saying so) and goes on."""
    server = server_process("--sync-every", "2", "--min-workers", "1")
    steps = ("--steps", "8")
    killed = trainer_worker(server.url, "w", tmp_path, *steps, corpus=corpus_file,
                            crash_at="trainer_checkpoint_saved:2")  # fmt: skip
    finished(killed, tmp_path, "w", code=-signal.SIGKILL)
    assert global_weights(server.url)[1] == 3  # rounds end at steps 2, 4, 6
    shutil.rmtree(tmp_path / "w" / "checkpoint-6")  # as if that checkpoint were never written
    resumed = trainer_worker(server.url, "w", tmp_path, *steps, "--resume", corpus=corpus_file)
    finished(resumed, tmp_path, "w")
    report = json.loads((tmp_path / "w.json").read_text())
    assert report["resumed_from"].endswith("checkpoint-3/diloco") and report["global_step"] == 8
    assert "step(s) into that round are dropped" in (tmp_path / "w.log").read_text()
    # Steps 4-8 from the server's round-3 weights: rounds end at steps 5 and 7, then 8
    assert global_weights(server.url)[1] == 6


def test_worker_state_saved_at_another_step_is_refused(tmp_path: Path) -> None:
    saved = tmp_path / "checkpoint-3" / "diloco"
    saved.mkdir(parents=True)
    settings = {"gradient_accumulation_steps": 1, "per_device_train_batch_size": 1}
    (saved / "trainer_run.json").write_text(json.dumps({**settings, "global_step": 2}))

    class State:
        global_step = 3

    with pytest.raises(DiLoCoCallbackError, match="saved at step 2, the Trainer resumed at step 3"):
        DiLoCoCallback._check_same_settings(saved, _Args(), State())


def test_load_best_model_at_end_is_refused_before_joining() -> None:
    class Args(_Args):
        load_best_model_at_end = True

    callback = DiLoCoCallback("http://127.0.0.1:9")
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(DiLoCoCallbackError, match="load_best_model_at_end loads an old local"):
        callback.on_train_begin(Args(), _State(), None, model=model, optimizer=optimizer)
    assert callback.worker is None


def test_leased_data_refuses_what_it_cannot_serve(live_server) -> None:
    from types import SimpleNamespace

    from diloco.server.settings import ServerSettings

    callback = DiLoCoCallback("http://127.0.0.1:9", "w")
    args = SimpleNamespace(ignore_data_skip=False, world_size=1)
    trainer = SimpleNamespace(args=args, train_dataset=[0, 1, 2])
    with pytest.raises(DiLoCoCallbackError, match=r"ignore_data_skip=True\): on a resume"):
        callback.lease_data(trainer, "ds")
    args.ignore_data_skip, args.world_size = True, 2
    with pytest.raises(DiLoCoCallbackError, match="single-process Trainer"):
        callback.lease_data(trainer, "ds")
    args.world_size, trainer.train_dataset = 1, iter([0, 1, 2])
    with pytest.raises(DiLoCoCallbackError, match="a train_dataset with a length"):
        callback.lease_data(trainer, "ds")
    assert not hasattr(trainer, "_get_train_sampler")  # nothing was put in the Trainer

    # A streaming server takes whole units only: refused once the worker has joined, and
    # the worker leaves again
    settings = ServerSettings(mode="streaming", sync_every=2, fragments=1)
    with live_server(settings) as server:
        callback = DiLoCoCallback(server.url, "w")
        trainer.train_dataset = list(range(10))
        callback.lease_data(trainer, "ds")
        assert len(trainer._get_train_sampler()) == 10
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(DiLoCoCallbackError, match="streaming server takes whole units"):
            callback.on_train_begin(_Args(), _State(), None, model=model, optimizer=optimizer)
        assert callback.worker is None
        assert [w["live"] for w in server.coordinator.status()["workers"]] in ([], [False])


def test_binding_leased_data_to_a_worker_of_several_processes_is_refused_and_it_leaves() -> None:
    from types import SimpleNamespace

    from diloco.integrations.common import LeasedTrainSampler

    closed: list[bool] = []
    worker = SimpleNamespace(
        settings=SimpleNamespace(mode="sync"), close=lambda final_sync: closed.append(final_sync)
    )
    with pytest.raises(DiLoCoCallbackError, match="one process per worker"):
        LeasedTrainSampler(10, "ds").bind(worker, processes=2)
    assert closed == [False]  # the worker left the run, with no last sync


def the_example():
    """examples/transformers_trainer.py as a module (its main() is not run)."""
    import importlib.util

    from example_runs import EXAMPLES

    spec = importlib.util.spec_from_file_location(
        "transformers_trainer_example", EXAMPLES / "transformers_trainer.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Indices(torch.utils.data.Dataset):
    """Sample i is the number i: a batch shows which samples the Trainer drew."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor([index]), "labels": torch.tensor([index])}


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)

    def forward(self, input_ids, labels=None):  # the columns the Trainer keeps
        return {"loss": self.linear(input_ids.float()).sum()}


def first_batch(args) -> list[int]:
    """The samples of the first batch that a Trainer with `args` trains."""
    from transformers import Trainer, set_seed

    trainer = Trainer(model=_Model(), args=args, train_dataset=_Indices())
    set_seed(args.seed)  # as train() does before it draws
    return next(iter(trainer.get_train_dataloader()))["input_ids"].flatten().tolist()


def test_the_example_s_workers_train_different_batches(tmp_path: Path) -> None:
    """Issue 27: the README's two Trainer workers (w0, w1, one --seed) logged identical loss
    lines: --data-dispatch local shuffled with --seed alone, the same on every worker."""
    example = the_example()

    def args(*worker: str):
        return example.training_arguments(example.parse_options(
            ["--server", "http://127.0.0.1:9", "--output-dir", str(tmp_path), *worker]
        ))  # fmt: skip

    w0, w1 = args("--worker-id", "w0"), args("--worker-id", "w1")
    assert w0.seed == w1.seed == 0  # the same initial weights
    assert first_batch(w0) != first_batch(w1)
    assert first_batch(w0) == first_batch(args("--worker-id", "w0"))  # a resume: the same
    assert same_data_warning(w0, "w0") is None
    # Without --worker-id the server names the worker: the order is --seed's, and it says so
    anonymous = args()
    assert anonymous.data_seed == 0
    assert same_data_warning(anonymous, "w-1a2b") == (
        "worker w-1a2b: the Trainer shuffles its train data with TrainingArguments data_seed=0, "
        "which is not the worker's own: every worker started with it trains the same batches "
        "in the same order. Give each worker its own, data_seed=worker_data_seed(0, 'w-1a2b') "
        "(diloco.integrations.transformers), or train leased data (callback.lease_data); a "
        "train_dataset that is a shard of this worker's own needs neither"
    )


def test_a_trainer_that_shuffles_like_every_other_worker_is_warned(live_server, caplog) -> None:
    """The integration's default: TrainingArguments' seed (42) orders every worker's data."""
    from transformers import TrainingArguments

    from diloco.server.settings import ServerSettings

    plain = TrainingArguments(output_dir="/nonexistent", report_to=[], use_cpu=True)
    assert same_data_warning(plain, "w0").startswith(
        "worker w0: the Trainer shuffles its train data with TrainingArguments seed=42, which "
        "is not the worker's own"
    )
    own = TrainingArguments(output_dir="/nonexistent", report_to=[], use_cpu=True,
                            data_seed=worker_data_seed(42, "w0"))  # fmt: skip
    assert same_data_warning(own, "w0") is None

    with live_server(ServerSettings(sync_every=2)) as server:
        for args, warned in ((plain, True), (own, False)):
            caplog.clear()
            callback = DiLoCoCallback(server.url, "w0")
            model = torch.nn.Linear(2, 2)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            with caplog.at_level("WARNING", logger="diloco.integrations.transformers"):
                callback.on_train_begin(args, _State(), None, model=model, optimizer=optimizer)
            callback.on_train_end(args, _State(), None)
            shown = [r.getMessage() for r in caplog.records if "shuffles" in r.getMessage()]
            assert shown == ([same_data_warning(args, "w0")] if warned else [])


def test_a_train_after_one_that_failed_joins_with_a_worker_of_its_own(live_server, caplog) -> None:
    """trainer.train() raised (no on_train_end), and the same callback goes into a second
    train() (a retry in a notebook, from the last checkpoint): it kept the first worker,
    whose anchor, round and scheduler belong to the model before the restore, so its next
    pseudo-gradient folded the outer update back in. Now that worker leaves without a last
    sync, and the second train() joins with its own, at the server's current round."""
    from diloco.server.settings import ServerSettings

    with live_server(ServerSettings(sync_every=100)) as server:
        callback = DiLoCoCallback(server.url, "w0")
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        callback.on_train_begin(_Args(), _State(), None, model=model, optimizer=optimizer)
        first = callback.worker
        assert first is not None
        with caplog.at_level("WARNING", logger="diloco.integrations.transformers"):
            callback.on_train_begin(_Args(), _State(), None, model=model, optimizer=optimizer)
        second = callback.worker
        assert second is not None and second is not first
        assert first.client is not None and first.client.closed  # it left
        assert len(optimizer._optimizer_step_post_hooks) == 1  # its step hook went with it
        assert server.coordinator.membership.is_live("w0")  # the second is w0 now
        assert any("the last train() did not end" in r.getMessage() for r in caplog.records)
        callback.on_train_end(_Args(), _State(), None)
        assert second.client is not None and second.client.closed
