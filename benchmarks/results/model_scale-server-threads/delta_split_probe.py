"""A server's 85M int8 delta (`PublishedCopy.advance`) at 1 torch thread (`serial1`), at 2
intra-op threads (`intra2`), or split by tensor over 2 Python threads at 1 torch thread each
(`split2`); prints the times and the SHA-256 of the body and of P."""

import hashlib
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from diloco.algorithm.compression.codecs import parse_codec
from diloco.models import GPTConfig
from diloco.server.model.published_copy import PublishedCopy
from diloco.wire.compressed.body import compressed_frame, write_entry

mode = sys.argv[1]
torch.manual_seed(0)
model = GPTConfig(context=16, width=768, depth=12, heads=12).build()
state = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
codec = parse_codec("int8")
coded = {k for k, v in state.items() if v.is_floating_point()}
published = PublishedCopy(state, dict.fromkeys(state, torch.float32), codec, coded)
names = list(state)
pool = ThreadPoolExecutor(2)
torch.set_num_threads(2 if mode == "intra2" else 1)


def advance_split(masters: dict[str, torch.Tensor]) -> bytearray:
    """`PublishedCopy.advance`, its tensors shared out over the pool by size."""
    p = published._writable()
    exact = {n for n in names if n not in published.coded}
    shapes = {n: (tuple(p[n].shape), p[n].dtype) for n in names}
    body, views = compressed_frame(shapes, codec, exact)
    halves: list[list[str]] = [[], []]
    load = [0, 0]
    for name in sorted(names, key=lambda n: -p[n].numel()):
        i = 0 if load[0] <= load[1] else 1
        halves[i].append(name)
        load[i] += p[name].numel()

    def work(part: list[str]) -> None:
        for name in part:
            if name in exact:
                value = masters[name].to(p[name].dtype)
                write_entry(views, name, value, codec, exact)
                p[name].copy_(value)
            else:
                target = p[name]
                write_entry(views, name, masters[name], codec, exact, fold_into=target, less=target)

    list(pool.map(work, halves))
    return body


times = []
for _ in range(6):
    masters = {k: v + 1e-3 * torch.randn_like(v) for k, v in published.tensors.items()}
    started = time.perf_counter()
    body = advance_split(masters) if mode == "split2" else published.advance(masters, names)
    times.append(time.perf_counter() - started)
print(
    mode,
    "delta s",
    [round(x, 3) for x in times],
    "median",
    round(statistics.median(times[1:]), 3),
    "P sha",
    hashlib.sha256(published.current.lend()).hexdigest()[:12],
    "body",
    hashlib.sha256(body).hexdigest()[:12],
)
