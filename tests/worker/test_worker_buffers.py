"""Int and bool buffers travel exactly, whatever the float wire dtype (a real server)."""

from __future__ import annotations

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
