"""Int and bool buffers travel exactly, whatever the float wire dtype (a real server)."""

from __future__ import annotations

import threading

import torch
from test_worker_worker import server_weights

from diloco.server.settings import ServerSettings
from diloco.worker import DiLoCoWorker


class Counting(torch.nn.Module):
    """A layer with an int64 counter and a bool flag, as BatchNorm's num_batches_tracked."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(2, 2)
        self.register_buffer("count", torch.tensor(1000, dtype=torch.int64))
        self.register_buffer("flag", torch.tensor([False, True]))


def test_an_int_buffer_step_of_257_arrives_exact_with_bf16_uploads(live_server) -> None:
    """bf16 has 8 bits of mantissa: -257 cast to bf16 is -256, so the server used to end at
    1256. With outer SGD lr 1 and one worker the server must hold the worker's 1257."""
    settings = ServerSettings(
        sync_every=1, outer_optimizer="sgd", outer_lr=1.0, upload_dtype=torch.bfloat16
    )
    with live_server(settings) as server:
        model = Counting()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        worker = DiLoCoWorker(model, optimizer, server.url, worker_id="counter")
        model.layer(torch.ones(1, 2)).sum().backward()
        model.count += 257
        model.flag.logical_not_()
        optimizer.step()
        optimizer.zero_grad()
        assert worker.rounds == 1
        weights = server_weights(server.url)
        assert weights["count"].dtype == torch.int64
        assert int(weights["count"]) == 1257
        assert weights["flag"].tolist() == [True, False]
        assert int(model.count) == 1257  # the worker's model took the server's result
        worker.close(final_sync=False)


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 4)
        self.head = torch.nn.Linear(4, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(idx))


def test_token_weighting_counts_tokens_the_loop_never_reports(live_server) -> None:
    """The README's three-line loop reports no tokens. Under --weighting tokens two workers
    trained on 2x4 and 2x12 token batches for one step each weigh 8 and 24: the new weights
    are (8 L_a + 24 L_b) / 32 with outer SGD lr 1 (they used to weigh 0: the model never
    moved)."""
    settings = ServerSettings(
        sync_every=1, outer_optimizer="sgd", outer_lr=1.0, weighting="tokens", min_workers=2
    )
    with live_server(settings) as server:
        locals_after: dict[str, dict[str, torch.Tensor]] = {}
        workers = []
        models = {}
        for worker_id, seq in (("a", 4), ("b", 12)):
            model = TinyLM()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
            worker = DiLoCoWorker(model, optimizer, server.url, worker_id=worker_id)
            workers.append(worker)
            models[worker_id] = (model, optimizer, seq)
        threads = []

        def step(worker_id: str) -> None:
            model, optimizer, seq = models[worker_id]
            idx = torch.arange(2 * seq).reshape(2, seq) % 16
            model(idx).logsumexp(-1).mean().backward()
            locals_after[worker_id] = {
                n: (p.detach() - 0.5 * p.grad).clone() for n, p in model.named_parameters()
            }
            optimizer.step()  # the sync happens in here (H = 1)
            optimizer.zero_grad()

        for worker_id in models:
            threads.append(threading.Thread(target=step, args=(worker_id,)))
            threads[-1].start()
        for thread in threads:
            thread.join(timeout=60)
        weights = server_weights(server.url)
        for name in locals_after["a"]:
            expected = (8 * locals_after["a"][name] + 24 * locals_after["b"][name]) / 32
            torch.testing.assert_close(weights[name], expected, rtol=1e-5, atol=1e-6)
        for worker in workers:
            worker.close(final_sync=False)


def test_an_explicit_token_report_replaces_the_count() -> None:
    """The counter's figure for a round is dropped at the first report(tokens=N)."""
    from diloco.worker.data.tokens import TokenCounter, batch_tokens

    assert batch_tokens((torch.zeros(3, 5, dtype=torch.long),), {}) == 15
    assert batch_tokens((torch.zeros(7, 2),), {}) == 7  # float input: samples
    assert batch_tokens((), {"input_ids": torch.zeros(2, 9, dtype=torch.long)}) == 18
    assert batch_tokens(("text",), {}) == 0
    model = TinyLM()
    seen: list[int] = []
    counter = TokenCounter(model, seen.append)
    model(torch.zeros(2, 3, dtype=torch.long))
    with torch.no_grad():
        model(torch.zeros(2, 3, dtype=torch.long))  # evaluation: not trained on
    model.eval()
    model(torch.zeros(2, 3, dtype=torch.long))
    counter.remove()
    model.train()
    model(torch.zeros(2, 3, dtype=torch.long))
    assert seen == [6]


def _one_step(model: TinyLM, optimizer: torch.optim.Optimizer) -> None:
    model(torch.arange(8).reshape(2, 4)).logsumexp(-1).mean().backward()
    optimizer.step()  # a sync happens in here when the window is full
    optimizer.zero_grad()


def _fresh_worker(url: str, directory, worker_id: str = "w") -> tuple[DiLoCoWorker, TinyLM]:
    """A worker as a restarted process builds it: a new model and optimizer, resumed from
    `directory` (a trainer's checkpoint folder: saves are the caller's)."""
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    worker = DiLoCoWorker(
        model, optimizer, url, worker_id=worker_id, checkpoint_dir=directory,
        save_every_round=False,
    )  # fmt: skip
    return worker, model


def test_a_resume_inside_a_round_keeps_the_tokens_trained_before_the_checkpoint(
    live_server, tmp_path
) -> None:
    """--weighting tokens, H = 2, 2x4 tokens a step: step 1, a checkpoint, the process gone;
    the resumed worker trains step 2 and its round carries 16 tokens (it sent 8 before the
    round's count was saved with the checkpoint)."""
    settings = ServerSettings(sync_every=2, outer_optimizer="sgd", weighting="tokens")
    with live_server(settings) as server:
        worker, model = _fresh_worker(server.url, tmp_path)
        _one_step(model, worker.optimizer)
        worker.save_checkpoint()
        worker.close(final_sync=False)
        resumed, model = _fresh_worker(server.url, tmp_path)
        assert resumed.resumed is not None and resumed.round == 0
        _one_step(model, resumed.optimizer)
        assert resumed.rounds == 1
        committed = server.coordinator.journal.state.committed_rounds()
        assert [(r["round"], r["tokens"]) for r in committed] == [(0, 16)]
        resumed.close(final_sync=False)


def test_a_resume_inside_a_round_keeps_the_window_dylu_gave_it(live_server, tmp_path) -> None:
    """Async with DyLU at H = 4: the server had lowered this worker's window to 2 (its advice,
    set here directly); checkpointed after 1 step, the resumed worker syncs after 1 more step,
    not 3."""
    settings = ServerSettings(mode="async", sync_every=4, dylu=True)
    with live_server(settings) as server:
        worker, model = _fresh_worker(server.url, tmp_path)
        worker._schedule.window = 2  # what a heartbeat's advice makes of the next window
        _one_step(model, worker.optimizer)
        worker.save_checkpoint()
        worker.close(final_sync=False)
        resumed, model = _fresh_worker(server.url, tmp_path)
        assert resumed.window_sync_every == 2
        _one_step(model, resumed.optimizer)
        assert resumed.rounds == 1 and resumed.window_sync_every == 4  # the next window: H
        resumed.close(final_sync=False)


def test_a_resume_inside_a_round_keeps_the_tokens_the_loop_reported(live_server, tmp_path) -> None:
    """As above, but the loop reports its tokens (10 a step) after each step: the counter's
    figure is replaced by the report before and after the resume, and the round carries 20."""
    settings = ServerSettings(sync_every=2, outer_optimizer="sgd", weighting="tokens")
    with live_server(settings) as server:
        worker, model = _fresh_worker(server.url, tmp_path)
        _one_step(model, worker.optimizer)
        worker.report(tokens=10)
        worker.save_checkpoint()
        worker.close(final_sync=False)
        resumed, model = _fresh_worker(server.url, tmp_path)
        model(torch.arange(8).reshape(2, 4)).logsumexp(-1).mean().backward()
        resumed.report(tokens=10)  # reported before the step that syncs
        resumed.optimizer.step()
        resumed.optimizer.zero_grad()
        assert resumed.rounds == 1
        committed = server.coordinator.journal.state.committed_rounds()
        assert [(r["round"], r["tokens"]) for r in committed] == [(0, 20)]
        assert resumed._heartbeat_report()["tokens"] == 20  # the run's total, as reported
        resumed.close(final_sync=False)
