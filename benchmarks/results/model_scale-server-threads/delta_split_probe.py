"""Scratch: a server's 85M int8 delta (PublishedCopy.advance) at 1 thread, at 2 intra-op
threads, and split by tensor over 2 Python threads at 1 torch thread each."""
import sys, time, statistics, torch
from concurrent.futures import ThreadPoolExecutor
from diloco.models import GPTConfig
from diloco.algorithm.compression.codecs import parse_codec
from diloco.server.model.published_copy import PublishedCopy
from diloco.wire.compressed.body import compressed_frame, write_entry

mode = sys.argv[1]
torch.manual_seed(0)
model = GPTConfig(context=16, width=768, depth=12, heads=12).build()
state = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
codec = parse_codec("int8")
coded = {k for k, v in state.items() if v.is_floating_point()}
published = PublishedCopy(state, {k: torch.float32 for k in state}, codec, coded)
names = list(state)
pool = ThreadPoolExecutor(2)
torch.set_num_threads(2 if mode == "intra2" else 1)

def advance_parallel(masters):
    p = published._writable()
    exact = {n for n in names if n not in published.coded}
    shapes = {n: (tuple(p[n].shape), p[n].dtype) for n in names}
    body, views = compressed_frame(shapes, codec, exact)
    big = sorted(names, key=lambda n: -p[n].numel())
    halves = [[], []]; load = [0, 0]
    for n in big:
        i = 0 if load[0] <= load[1] else 1
        halves[i].append(n); load[i] += p[n].numel()
    def work(ns):
        for name in ns:
            if name in exact:
                v = masters[name].to(p[name].dtype); write_entry(views, name, v, codec, exact); p[name].copy_(v)
            else:
                write_entry(views, name, masters[name], codec, exact, fold_into=p[name], less=p[name])
    list(pool.map(work, halves))
    return body

times = []
for r in range(6):
    masters = {k: v + 1e-3 * torch.randn_like(v) for k, v in published.tensors.items()}
    s = time.perf_counter()
    body = advance_parallel(masters) if mode == "split2" else published.advance(masters, names)
    times.append(time.perf_counter() - s)
import hashlib
print(mode, "delta s", [round(x, 3) for x in times], "median", round(statistics.median(times[1:]), 3),
      "P sha", hashlib.sha256(published.current.lend()).hexdigest()[:12], "body", hashlib.sha256(body).hexdigest()[:12])
