"""The codec part of benchmarks/wire.py: a round as a real worker sees it under the server's
upload and download codecs (the worker's own coding work inside the clock), its table rows,
the issue's target line, and each round projected onto slower links."""

from __future__ import annotations

import math
import time
import urllib.request

import torch

from diloco.algorithm.compression.codecs import parse_codec
from diloco.console import fail
from diloco.wire import decode_tensors, specs_of
from diloco.wire.compressed.body import apply_delta
from diloco.worker import DiLoCoClient, RetryPolicy
from diloco.worker.upload_coder import UploadCoder

DEFAULT_CODECS = "fp32/fp32,int8/fp32,int8/int8,topk:0.03+int2/topk:0.03+int2"
PHASES = ("encode", "submit", "wait", "apply")  # a codec round's parts, as a worker sees them


def codec_pairs(text: str) -> list[tuple[str, str]]:
    """`--codecs`: comma-separated UPLOAD/DOWNLOAD pairs, each codec as the server spells it."""
    pairs = []
    for item in text.split(","):
        if not item.strip():
            continue
        upload, slash, download = item.strip().partition("/")
        if not slash:
            raise fail(f"--codecs takes UPLOAD/DOWNLOAD pairs (e.g. int8/int8), got {item!r}")
        try:
            pairs.append((str(parse_codec(upload)), str(parse_codec(download))))
        except ValueError as exc:
            raise fail(f"--codecs: {exc}") from None
    if not pairs:
        raise fail("--codecs must not be empty")
    return pairs


def _gradient_source(state, index: int) -> dict[str, torch.Tensor]:
    """A worker's own noise (its seed), shifted every round into a new pseudo-gradient."""
    generator = torch.Generator().manual_seed(1000 + index)
    return {n: torch.randn(t.shape, generator=generator) * 1e-3 for n, t in state.items()}


def _pseudo_gradient(source: dict[str, torch.Tensor], r: int) -> dict[str, torch.Tensor]:
    return {n: torch.roll(t, 7919 * (r + 1) % t.numel()) for n, t in source.items()}


def codec_worker(url, index, state, rounds, barrier, shared, times) -> None:
    """A worker's rounds with the server's codecs, its own work inside the clock.

    Each round: a new pseudo-gradient (made before the clock) becomes the upload body with
    error feedback (`UploadCoder`), goes up, and the answer moves the worker's fp32 anchor:
    `apply_delta` when it is a coded delta against round r (asked with have=r), a copy out of
    the full weights otherwise. At the end the anchor is compared with the server's published
    weights, which it must equal bit for bit.
    """
    torch.set_num_threads(1)
    specs = specs_of(state, dict.fromkeys(state, "trainable"))
    source = _gradient_source(state, index)
    with DiLoCoClient(url, retry=RetryPolicy(attempts=3), read_timeout=600) as client:
        settings = client.info()["settings"]
        block, chunk = int(settings["codec_block"]), int(settings["topk_chunk"])
        upload = parse_codec(settings["upload_codec"], block=block, chunk=chunk)
        download = parse_codec(settings["download_codec"], block=block, chunk=chunk)
        coder = UploadCoder(upload, float(settings["error_feedback_beta"]), specs)
        exact = set(state) - coder.coded_names
        worker_id = client.register(f"bench{index}", [s.to_json() for s in specs])["worker_id"]
        buffer, have = client.get_weights()
        anchor = {n: t.to(torch.float32, copy=True) for n, t in decode_tensors(buffer).items()}
        for r in range(rounds):
            gradient = _pseudo_gradient(source, r)
            before = client.stats
            barrier.wait()
            started = time.perf_counter()
            body = coder.body(gradient)
            encoded = time.perf_counter()
            client.submit(r, worker_id, body)
            submitted = time.perf_counter()
            ask = None if download.is_identity else have
            while (got := client.wait_result(r, worker_id, wait=60, into=buffer, have=ask)) is None:
                pass
            received = time.perf_counter()
            if got.delta_from is not None:
                if got.delta_from != have:
                    raise RuntimeError(f"a delta against {got.delta_from}, our anchor is {have}")
                apply_delta(got.body, anchor, download, exact=exact)
            else:
                for name, tensor in decode_tensors(got.body).items():
                    anchor[name].copy_(tensor)
            ended = time.perf_counter()
            buffer, have = got.body, got.round
            after = client.stats
            slot = r * 8 + index
            times[slot] = ended - started
            for phase, seconds in zip(
                PHASES,
                (encoded - started, submitted - encoded, received - submitted, ended - received),
                strict=True,
            ):
                shared[phase][slot] = seconds
            shared["up_bytes"][slot] = after.bytes_sent - before.bytes_sent
            shared["down_bytes"][slot] = after.bytes_received - before.bytes_received
            shared["up_body"][slot] = len(body)
            shared["down_body"][slot] = len(got.body)
            shared["delta"][slot] = float(got.delta_from is not None)
            del body, gradient
        published = decode_tensors(client.get_weights()[0])
        shared["anchor_equal"][index] = float(
            all(torch.equal(anchor[n], published[n]) for n in anchor)
        )


def server_metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return math.nan


def project_onto_links(
    results: list[dict], codec_results: list[dict], size: int, links: list[float]
) -> list[dict]:
    """Each measured round moved onto links of `links` Mbit/s (full duplex, one per machine):
    the loopback round plus the time its bytes need on the busiest link. Through the server
    that is the server's own link, which carries all K uploads and then all K downloads:
    K (up + down) / B. A gloo ring all_reduce sends and receives 2 (K - 1) / K of the model
    on every worker's link at once: 2 (K - 1) / K S / B. A model, not a measurement: it leaves
    out latency, TCP's ramp-up and any overlap of compute with transfer."""
    gloo = {r["workers"]: r["gloo"]["median_round_seconds"] for r in results if r["gloo"]}
    rows = []
    for mbit in links:
        rate = mbit * 1e6 / 8  # bytes per second
        for k, gloo_s in gloo.items():
            ring = gloo_s + 2 * (k - 1) / k * size / rate
            pairs = {}
            for coded in codec_results:
                if coded["workers"] != k:
                    continue
                moved = k * (
                    coded["up_bytes_per_worker_round"] + coded["down_bytes_per_worker_round"]
                )
                seconds = coded["median_round_seconds"] + moved / rate
                pair = f"{coded['upload_codec']}/{coded['download_codec']}"
                pairs[pair] = {"round_seconds": seconds, "gloo_ratio": seconds / ring}
            rows.append({"link_mbit": mbit, "workers": k, "gloo_seconds": ring, "pairs": pairs})
    return rows


def projection_table(projections: list[dict]) -> tuple[list[str], list[list[object]]]:
    names = list(dict.fromkeys(n for p in projections for n in p["pairs"]))
    columns = ["link Mbit/s", "K", "gloo fp32 all_reduce s", *(f"{n} s (x gloo)" for n in names)]
    rows = []
    for p in projections:
        cells = []
        for name in names:
            got = p["pairs"].get(name)
            cells.append(f"{got['round_seconds']:.2f} ({got['gloo_ratio']:.2f}x)" if got else "-")
        rows.append([f"{p['link_mbit']:g}", p["workers"], f"{p['gloo_seconds']:.2f}", *cells])
    return columns, rows


CODEC_COLUMNS = [
    "up / down",
    "K",
    "round s",
    "round / gloo",
    "up MB",
    "down MB",
    "encode ms",
    "submit ms",
    "wait ms",
    "apply ms",
    "server commit ms",
    "deltas",
    "server peak RSS MB",
    "(peak - runtime) / model",
]


def codec_row(coded: dict, model_multiple) -> list[object]:
    phase = coded["phase_median_seconds"]
    commit = coded["server_commit_mean_seconds"]
    ratio = coded["gloo_ratio"]
    return [
        f"{coded['upload_codec']} / {coded['download_codec']}",
        coded["workers"],
        f"{coded['median_round_seconds']:.3f}",
        f"{ratio:.2f}x" if ratio else "-",
        f"{coded['up_bytes_per_worker_round'] / 1e6:.2f}",
        f"{coded['down_bytes_per_worker_round'] / 1e6:.2f}",
        *(f"{phase[p] * 1000:.1f}" for p in PHASES),
        f"{commit * 1000:.1f}" if commit is not None else "-",
        f"{coded['delta_downloads']}/{coded['downloads']}",
        f"{coded['server_peak_rss_mb']:.0f}",
        model_multiple(coded["server_peak_rss_mb"]),
    ]


def target_line(codec_results: list[dict], document: dict) -> str:
    """The issue's target: int8 up with int8 deltas down at or under 1.0x gloo (K = 2, 4),
    the server's peak memory under 5x the fp32 model."""
    int8 = [
        c
        for c in codec_results
        if c["upload_codec"] == "int8" and c["download_codec"] == "int8" and c["gloo_ratio"]
    ]
    if not int8:
        return ""
    baseline = document["runtime_baseline_rss_mb"]
    parts = []
    for c in int8:
        memory = (c["server_peak_rss_mb"] - baseline) * 1.048576 / document["model_mb"]
        parts.append(f"K = {c['workers']}: {c['gloo_ratio']:.2f}x gloo, memory {memory:.2f}x model")
    met = all(c["gloo_ratio"] <= 1.0 for c in int8)
    memory_ok = all(
        (c["server_peak_rss_mb"] - baseline) * 1.048576 / document["model_mb"] < 5 for c in int8
    )
    return (
        f"Target (int8 up, int8 deltas down, <= 1.0x the gloo fp32 all_reduce; server peak "
        f"< 5x the model): {'; '.join(parts)}. Time: {'met' if met else 'missed'}; "
        f"memory: {'met' if memory_ok else 'missed'}."
    )
