"""Compressed uploads in the simulator (issue 12): error feedback per worker, exact bytes.

Expected values come from hand counts written out here and from few-line reference codecs in
this file (top-k per chunk, bf16 round to nearest even by bit arithmetic, blockwise absmax
int8), never from the codec code under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_sim_modes import tiny

import diloco.sim.runner as runner
from diloco.algorithm import TensorKind
from diloco.algorithm.compression.codecs import parse_codec
from diloco.algorithm.fragments import plan_fragments
from diloco.models import GPT, block_prefixes
from diloco.server.settings import ServerSettings
from diloco.sim import SimConfig, simulate
from diloco.sim.compression import UploadCodec
from tiny import TINY_MODEL

# The tiny GPT (width 32, depth 2, context 32, 256 byte values), tensor by tensor, by hand:
# token and position embeddings, per block LayerNorm (2 x 32), qkv (96 x 32 and 96), proj
# (32 x 32 and 32), LayerNorm (2 x 32), MLP (128 x 32 and 128, 32 x 128 and 32); the final
# LayerNorm (2 x 32) and the head (256 x 32). Every one is a trainable parameter.
BLOCK_SIZES = [32, 32, 96 * 32, 96, 32 * 32, 32, 32, 32, 128 * 32, 128, 32 * 128, 32]
TINY_SIZES = [256 * 32, 32 * 32, *BLOCK_SIZES, *BLOCK_SIZES, 32, 32, 256 * 32]
TINY_PARAMETERS = 42_880


def int8_bytes(numel: int, block: int) -> int:
    """One byte per value and one fp32 scale per block of values."""
    return numel + 4 * math.ceil(numel / block)


def topk_int2_bytes(numel: int, fraction: float, chunk: int, block: int) -> int:
    """k = round(F * chunk) values per chunk (the tail keeps min(k, its length)), each 2 bits
    plus a log2(chunk)-bit index, and one fp32 scale per block of kept values."""
    k = round(fraction * chunk)
    values = numel // chunk * k + min(k, numel % chunk)
    index_bits = int(math.log2(chunk))
    return (
        math.ceil(2 * values / 8)
        + 4 * math.ceil(values / block)
        + math.ceil(index_bits * values / 8)
    )


def test_the_hand_list_of_tensors_is_the_tiny_model(small_corpus: bytes) -> None:
    assert sum(TINY_SIZES) == TINY_PARAMETERS
    result = simulate(tiny(steps=4), corpus=small_corpus)
    assert result.parameters == TINY_PARAMETERS
    assert sorted(t.numel() for t in result.final_state.values()) == sorted(TINY_SIZES)


def test_defaults_and_messages_are_the_servers() -> None:
    server, sim = ServerSettings(), SimConfig()
    assert (sim.upload_codec, sim.codec_block, sim.topk_chunk, sim.error_feedback_beta) == (
        server.upload_codec,
        server.codec_block,
        server.topk_chunk,
        server.error_feedback_beta,
    )
    for bad in (
        dict(upload_codec="int3"),
        dict(upload_codec="topk:0"),
        dict(upload_codec="topk:0.1+int3"),
        dict(codec_block=100),
        dict(topk_chunk=1),
        dict(error_feedback_beta=1.0),
        dict(error_feedback_beta=-0.5),
        dict(upload_codec="topk:0.0001"),  # k = round(0.0128) = 0
        dict(upload_codec="topk:0.03+int2", outer_momentum=0.9),  # the codec picks sgd
    ):
        with pytest.raises(ValueError) as from_server:
            ServerSettings(**bad)
        with pytest.raises(ValueError) as from_sim:
            SimConfig(**bad)
        assert str(from_sim.value) == str(from_server.value)


@pytest.mark.parametrize(
    "given",
    [
        {},
        {"upload_codec": "int8"},
        {"upload_codec": "topk:0.03+int2"},
        {"upload_codec": "topk:0.03+int2", "outer_lr": 0.5},
        {"upload_codec": "topk:0.03+int2", "outer_optimizer": "nesterov"},
        {"upload_codec": "int2", "outer_optimizer": "sgd"},
        {"mode": "async", "upload_codec": "topk:0.03+int2"},
        {"mode": "streaming", "fragments": 2, "upload_codec": "topk:0.03+int2"},
    ],
)
def test_outer_settings_follow_the_upload_codec_as_the_server_s(given: dict) -> None:
    """Issue 30, item 1: each outer setting not given follows the codec, in both."""
    server_mode = {"diloco": "sync"}.get(given.get("mode", "diloco"), given.get("mode"))
    server = ServerSettings(**{**given, "mode": server_mode, "sync_every": 10})
    sim = SimConfig(**{**given, "sync_every": 10})
    resolved = ("outer_optimizer", "outer_lr", "outer_momentum", "outer_defaults_from_codec")
    assert [getattr(sim, n) for n in resolved] == [getattr(server, n) for n in resolved]
    assert sim.outer_warnings() == server.outer_warnings()


ALL_THREE = ("outer_optimizer", "outer_lr", "outer_momentum")


def test_a_top_k_run_s_outer_settings_are_sparseloco_s_and_survive_json() -> None:
    config = SimConfig(upload_codec="topk:0.03+int2", outer_lr=0.5)
    assert (config.outer_optimizer, config.outer_lr, config.outer_momentum) == ("sgd", 0.5, 0.0)
    assert config.aggregation == "sparse_mean"
    data = config.to_dict()
    assert data["outer_defaults_from_codec"] == ["outer_optimizer", "outer_momentum", "aggregation"]
    assert (data["outer_optimizer"], data["outer_lr"], data["outer_momentum"]) == ("sgd", 0.5, 0)
    assert SimConfig.from_dict(data) == config  # a sweep's child process runs the same run
    assert SimConfig(mode="ddp").outer_warnings() == []
    assert SimConfig(mode="ddp").outer_defaults_from_codec == ()  # no outer step at all
    # the mean given is kept; async and the dense codecs average with the mean
    given = SimConfig(upload_codec="topk:0.03+int2", aggregation="mean")
    assert (given.aggregation, given.outer_defaults_from_codec) == ("mean", ALL_THREE)
    assert SimConfig(mode="async", upload_codec="topk:0.03+int2").aggregation == "mean"
    assert SimConfig(mode="streaming", upload_codec="topk:0.03+int2").aggregation == "sparse_mean"
    assert SimConfig(upload_codec="int8").aggregation == "mean"
    assert SimConfig.from_dict(given.to_dict()) == given


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(upload_codec="zip"), "unknown codec 'zip'; allowed: fp32, bf16, int8"),
        (dict(upload_codec="topk:1.5+int2"), r"top-k fraction must be in \(0, 1\], got 1.5"),
        (dict(codec_block=4), r"block size must be a positive power of two in \[8, 65536\]"),
        (dict(topk_chunk=96), r"chunk size must be a positive power of two in \[2, 65536\]"),
        (dict(error_feedback_beta=1.0), r"error_feedback_beta must be in \[0, 1\)"),
        (dict(error_feedback_beta=math.nan), r"error_feedback_beta must be in \[0, 1\)"),
        (dict(mode="ddp", upload_codec="int8"), "upload_codec int8 applies to modes diloco"),
        (dict(mode="single", upload_codec="bf16"), "mode single sends no pseudo-gradients"),
    ],
)
def test_bad_codec_settings_raise_value_error(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny(**overrides)


def test_the_codec_spec_is_stored_canonical() -> None:
    assert tiny(upload_codec=" TopK:0.03+INT2 ").upload_codec == "topk:0.03+int2"
    assert tiny(upload_codec="bfloat16").upload_codec == "bf16"
    assert tiny(mode="ddp", upload_codec="float32").upload_codec == "fp32"


# ------------------------------------------------------------------ bytes


def test_int8_upload_bytes_are_codes_and_block_scales(small_corpus: bytes) -> None:
    result = simulate(tiny(upload_codec="int8", codec_block=64), corpus=small_corpus)
    per_upload = sum(int8_bytes(n, 64) for n in TINY_SIZES)
    assert per_upload == 45_592  # 42,880 codes + 678 scales of 4 bytes
    assert result.outer_steps == 2
    assert result.bytes_sent_per_worker == 2 * per_upload
    assert result.bytes_received_per_worker == 2 * 4 * TINY_PARAMETERS  # fp32 weights down
    document = result.to_json()
    # int8's own default: no error feedback (recipes.error_feedback_default)
    assert document["upload_codec"] == "int8" and document["error_feedback_beta"] == 0.0
    assert document["config"]["codec_block"] == 64


def test_topk_int2_upload_bytes_are_codes_scales_and_indices(small_corpus: bytes) -> None:
    result = simulate(tiny(upload_codec="topk:0.03+int2"), corpus=small_corpus)
    per_upload = sum(topk_int2_bytes(n, 0.03, 128, 128) for n in TINY_SIZES)
    # k = 4 of 128: 296 bytes for an 8192-element matrix (256 values: 64 bytes of codes, two
    # scales, 224 bytes of 7-bit indices), 9 for a 32-element vector.
    assert per_upload == 1_690
    assert result.bytes_sent_per_worker == 2 * per_upload
    assert 4 * TINY_PARAMETERS / per_upload > 100


def test_streaming_and_async_count_coded_uploads_too(small_corpus: bytes) -> None:
    per_upload = sum(int8_bytes(n, 128) for n in TINY_SIZES)
    assert per_upload == 44_264
    streaming = simulate(tiny(mode="streaming", upload_codec="int8"), corpus=small_corpus)
    assert streaming.outer_steps == 2  # one fragment, merged at steps 4 and 8
    assert streaming.bytes_sent_per_worker == 2 * per_upload
    assert streaming.bytes_received_per_worker == 2 * 4 * TINY_PARAMETERS
    asynchronous = simulate(
        tiny(mode="async", async_delay=1, upload_codec="int8"), corpus=small_corpus
    )
    assert len(asynchronous.arrivals) == 4  # 2 workers x 2 arrivals
    assert asynchronous.bytes_sent_per_worker == 4 * per_upload / 2


def test_only_trainable_floating_tensors_are_coded() -> None:
    """Frozen tensors and buffers go as plain entries of the pseudo-gradient's dtype (fp32,
    int64) in a compressed body; a bf16 body is plain and casts every floating entry."""
    kinds = {
        "w": TensorKind.TRAINABLE,
        "frozen": TensorKind.FROZEN,
        "running": TensorKind.FLOAT_BUFFER,
        "count": TensorKind.INT_BUFFER,
        "mask": TensorKind.BOOL_BUFFER,
    }
    torch.manual_seed(0)
    gradient = {
        "w": torch.randn(300),
        "frozen": torch.randn(10) * 1e-3,
        "running": torch.randn(7),
        "count": torch.tensor([1, -2, 300], dtype=torch.int64),
        "mask": torch.tensor([0, 1, -1, 0, 1], dtype=torch.int64),
    }
    int8 = UploadCodec(parse_codec("int8"), 0.9, kinds)
    assert int8.nbytes(gradient) == (300 + 4 * 3) + 4 * 10 + 4 * 7 + 8 * 3 + 8 * 5
    bf16 = UploadCodec(parse_codec("bf16"), 0.9, kinds)
    assert bf16.nbytes(gradient) == 2 * 300 + 2 * 10 + 2 * 7 + 8 * 3 + 8 * 5
    fp32 = UploadCodec(parse_codec("fp32"), 0.9, kinds)
    assert fp32.nbytes(gradient) == 4 * 317 + 8 * 8

    link = int8.uplink()
    received = link.send(gradient)
    for name in ("frozen", "running", "count", "mask"):
        assert torch.equal(received[name], gradient[name])
    assert not torch.equal(received["w"], gradient["w"])
    assert set(link.residual) == {"w"}
    received = bf16.uplink().send(gradient)
    assert torch.equal(received["running"], bf16_reference(gradient["running"]))
    assert torch.equal(received["count"], gradient["count"])


# ------------------------------------------------------------------ error feedback


def topk_reference(x: torch.Tensor, fraction: float, chunk: int = 128) -> torch.Tensor:
    """The k = round(F * chunk) largest |x| of each chunk kept, the rest zero."""
    flat, kept = x.reshape(-1), torch.zeros(x.numel())
    k = round(fraction * chunk)
    for start in range(0, flat.numel(), chunk):
        part = flat[start : start + chunk]
        top = part.abs().topk(min(k, part.numel())).indices
        kept[start + top] = part[top]
    return kept.view(x.shape)


def bf16_reference(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest even on the fp32 bits: add 0x7FFF plus the lowest kept bit, cut."""
    bits = x.float().contiguous().view(torch.int32).to(torch.int64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & ~0xFFFF
    rounded = torch.where(rounded >= 2**31, rounded - 2**32, rounded)
    return rounded.to(torch.int32).view(torch.float32).view(x.shape)


def int8_reference(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Per block: s = absmax / 127, q = clamp(round(x / s)), decoded q * s (s = 0: zeros)."""
    flat, out = x.reshape(-1), torch.zeros(x.numel())
    for start in range(0, flat.numel(), block):
        part = flat[start : start + block]
        scale = part.abs().max() / 127
        if scale > 0:
            out[start : start + block] = torch.round(part / scale).clamp(-127, 127) * scale
    return out.view(x.shape)


REFERENCES = {
    "topk:0.05": lambda x: topk_reference(x, 0.05),
    "bf16": bf16_reference,
    "int8": int8_reference,
}


def spy_on_pseudo_gradients(monkeypatch: pytest.MonkeyPatch) -> list[tuple[dict, dict]]:
    """(anchor, pseudo-gradient) of every upload the simulator makes, in order."""
    calls: list[tuple[dict, dict]] = []
    real = runner.pseudo_gradient

    def spy(anchor, local):
        gradient = real(anchor, local)
        calls.append(({n: t.clone() for n, t in anchor.items()}, gradient))
        return gradient

    monkeypatch.setattr(runner, "pseudo_gradient", spy)
    return calls


@pytest.mark.parametrize(
    ("spec", "beta"), [("topk:0.05", 0.9), ("topk:0.05", 0.0), ("bf16", 0.9), ("int8", 0.5)]
)
def test_each_worker_keeps_its_residual_and_the_server_applies_what_was_sent(
    spec: str, beta: float, small_corpus: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three rounds, two workers, outer SGD with lr 1: the global model moves by exactly the
    mean of what was sent, and each worker ends with its own e, both as a reference computes
    them from the pseudo-gradients the workers made: e <- beta e + g; s = C(e); e <- e - s."""
    calls = spy_on_pseudo_gradients(monkeypatch)
    config = tiny(
        steps=12,
        upload_codec=spec,
        error_feedback_beta=beta,
        outer_optimizer="sgd",
        outer_lr=1.0,
        outer_momentum=0.0,
        aggregation="mean",  # sparse_mean, a top-k codec's default, has its own test
    )
    result = simulate(config, corpus=small_corpus)
    assert len(calls) == 3 * 2  # rounds x workers, worker 0 first
    code = REFERENCES[spec]
    residuals: list[dict[str, torch.Tensor]] = [{}, {}]
    masters = calls[0][0]
    for r in range(3):
        sent = []
        for w in range(2):
            anchor, gradient = calls[2 * r + w]
            for name, value in anchor.items():
                torch.testing.assert_close(value, masters[name], rtol=1e-6, atol=1e-7)
            coded = {}
            for name, g in gradient.items():
                e = beta * residuals[w].get(name, torch.zeros_like(g)) + g
                coded[name] = code(e)
                residuals[w][name] = e - coded[name]
            sent.append(coded)
        masters = {n: t - (sent[0][n] + sent[1][n]) / 2 for n, t in masters.items()}
    for name, value in result.final_state.items():
        torch.testing.assert_close(value, masters[name], rtol=1e-6, atol=1e-7)
    if beta == 0:
        assert result.residuals == [{}, {}]
        return
    for w in range(2):
        assert set(result.residuals[w]) == set(residuals[w])
        for name, e in residuals[w].items():
            assert torch.equal(result.residuals[w][name], e), (w, name)
    assert not torch.equal(result.residuals[0]["head.weight"], result.residuals[1]["head.weight"])


def test_after_one_round_sent_plus_residual_is_the_fp32_pseudo_gradient(
    small_corpus: bytes,
) -> None:
    """Round 1 starts from the same weights either way, so the fp32 run's pseudo-gradients g_w
    are the compressed run's. With outer SGD lr 1 the fp32 run ends at initial - mean(g_w) and
    the top-k run at initial - mean(s_w), and e_w = g_w - s_w (beta has nothing to decay yet)."""
    one_round = dict(
        steps=4, outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0, aggregation="mean"
    )
    fp32 = simulate(tiny(**one_round), corpus=small_corpus)
    topk = simulate(tiny(**one_round, upload_codec="topk:0.05"), corpus=small_corpus)
    k, chunk = round(0.05 * 128), 128
    for name, final in topk.final_state.items():
        e0, e1 = topk.residuals[0][name], topk.residuals[1][name]
        # mean(s_w) + mean(e_w) = mean(g_w)
        torch.testing.assert_close(final - fp32.final_state[name], (e0 + e1) / 2, atol=2e-7, rtol=0)
        # fp32 values are sent as they are: e_w is exactly 0 at the k kept places of a chunk
        for e in (e0, e1):
            flat = e.reshape(-1)
            for start in range(0, flat.numel(), chunk):
                part = flat[start : start + chunk]
                assert int((part == 0).sum()) >= min(k, part.numel())


# ------------------------------------------------------------------ every mode, loss


def test_streaming_with_one_fragment_equals_diloco_with_int8_and_error_feedback(
    small_corpus: bytes,
) -> None:
    int8 = {"upload_codec": "int8", "error_feedback_beta": 0.95, "steps": 12}
    sync = simulate(tiny(**int8), corpus=small_corpus)
    streaming = simulate(tiny(mode="streaming", **int8), corpus=small_corpus)
    assert sync.residuals[0]  # (error feedback kept: its residuals are compared below)
    assert streaming.bytes_sent_per_worker == sync.bytes_sent_per_worker
    for name, tensor in sync.final_state.items():
        torch.testing.assert_close(streaming.final_state[name], tensor, rtol=1e-5, atol=1e-6)
    for w in range(2):
        for name, e in sync.residuals[w].items():
            torch.testing.assert_close(streaming.residuals[w][name], e, rtol=1e-4, atol=1e-6)


def test_async_with_a_grace_window_and_equal_speeds_equals_diloco_with_int8(
    small_corpus: bytes,
) -> None:
    int8 = {"upload_codec": "int8", "error_feedback_beta": 0.95, "steps": 12}
    sync = simulate(tiny(**int8), corpus=small_corpus)
    assert sync.residuals[0]
    grace = simulate(
        tiny(mode="async", async_delay=1, grace=0.5, **int8),
        corpus=small_corpus,
    )
    assert grace.outer_steps == sync.outer_steps == 3
    assert grace.bytes_sent_per_worker == sync.bytes_sent_per_worker
    for name, tensor in sync.final_state.items():
        torch.testing.assert_close(grace.final_state[name], tensor, rtol=1e-5, atol=1e-6)
    assert [sorted(r) for r in grace.residuals] == [sorted(r) for r in sync.residuals]


def test_int8_and_bf16_at_their_defaults_end_close_to_fp32(small_corpus: bytes) -> None:
    runs = {
        spec: simulate(tiny(upload_codec=spec, steps=24), corpus=small_corpus).final_eval_loss
        for spec in ("fp32", "bf16", "int8")
    }
    assert abs(runs["int8"] - runs["fp32"]) <= 0.005 * runs["fp32"]
    assert abs(runs["bf16"] - runs["fp32"]) <= 0.005 * runs["fp32"]


def test_error_feedback_recovers_what_top_k_leaves_out(small_corpus: bytes) -> None:
    """Top 3 % with 2-bit values over 6 rounds: without feedback 97 % of every pseudo-gradient
    is dropped for good; with it the dropped part is sent later."""
    losses = {
        beta: simulate(
            tiny(upload_codec="topk:0.03+int2", error_feedback_beta=beta, steps=24),
            corpus=small_corpus,
        ).final_eval_loss
        for beta in (0.0, 0.95)
    }
    assert losses[0.95] < losses[0.0] - 0.1


# ------------------------------------------------------------------ delta downloads


def test_delta_download_bytes_are_the_codec_s_in_every_mode(small_corpus: bytes) -> None:
    per_step = sum(int8_bytes(n, 128) for n in TINY_SIZES)
    sync = simulate(tiny(upload_codec="int8", download_codec="int8"), corpus=small_corpus)
    assert sync.bytes_received_per_worker == 2 * per_step  # two rounds of int8 deltas
    streaming = simulate(
        tiny(mode="streaming", download_codec="int8", fragments=2, sync_every=4),
        corpus=small_corpus,
    )
    # H = 4, two fragments: fragment 0 merges at steps 2 and 6, fragment 1 at 4 and 8; at the
    # end fragment 0 (trained since step 6) syncs once more. Each sync downloads its
    # fragment's int8 delta: every tensor twice, fragment 0's tensors three times.
    torch.manual_seed(3)
    model = GPT(TINY_MODEL)
    sizes = [(n, t.numel()) for n, t in model.state_dict().items()]
    first = plan_fragments(sizes, 2, block_prefixes(model))[0]
    first_bytes = sum(int8_bytes(n, 128) for name, n in sizes if name in first)
    assert 0 < first_bytes < per_step
    assert streaming.bytes_received_per_worker == 2 * per_step + first_bytes
    # Async, equal speeds, one grace window per round: each arrival's worker holds the weights
    # the step started from, so every download is a delta.
    grace = simulate(
        tiny(mode="async", async_delay=1, grace=0.5, download_codec="int8"), corpus=small_corpus
    )
    assert grace.outer_steps == 2
    assert grace.bytes_received_per_worker == 2 * per_step


def test_async_arrivals_one_step_late_download_full_weights(small_corpus: bytes) -> None:
    """Without a grace window each arrival is its own step (versions 1 to 4). Only the first
    arrival holds the version its step starts from (0): w1 then holds 0 when step 2 starts
    from 1, w0 holds 1 when step 3 starts from 2, w1 holds 2 when step 4 starts from 3, so
    those three download the weights whole."""
    result = simulate(tiny(mode="async", async_delay=1, download_codec="int8"), corpus=small_corpus)
    per_step = sum(int8_bytes(n, 128) for n in TINY_SIZES)
    assert len(result.arrivals) == 4 and result.outer_steps == 4
    expected = (per_step + 3 * 4 * TINY_PARAMETERS) / 2  # per worker
    assert result.bytes_received_per_worker == expected


def test_published_weights_move_on_the_int8_grid_of_the_step(small_corpus: bytes) -> None:
    """One round: the workers' weights are P1 = P0 + D(C(M1 - P0)), so each block of 128
    values of P1 - P0 is a whole multiple of its own absmax / 127, and within half of one
    such step of the fp32 run's masters M1."""
    exact = simulate(tiny(steps=4), corpus=small_corpus)
    coded = simulate(tiny(steps=4, download_codec="int8"), corpus=small_corpus)
    torch.manual_seed(3)  # the seed's initial weights, built as the simulator builds them
    initial = GPT(TINY_MODEL).state_dict()
    moved = 0
    for name, p1 in coded.final_state.items():
        p0 = initial[name].float().flatten()
        m1 = exact.final_state[name].float().flatten()
        delta = m1 - p0
        step_p = p1.flatten() - p0
        for lo in range(0, delta.numel(), 128):
            d = delta[lo : lo + 128]
            step = d.abs().max() / 127
            if step == 0:
                assert torch.equal(step_p[lo : lo + 128], torch.zeros_like(d))
                continue
            codes = step_p[lo : lo + 128] / step
            # atol: fp32 rounding of p0 + c s
            assert torch.allclose(codes, codes.round(), atol=0.02), name
            assert (p1.flatten()[lo : lo + 128] - m1[lo : lo + 128]).abs().max() <= 0.52 * step
            moved += 1
    assert moved > 300


def test_error_feedback_not_given_follows_the_upload_codec_as_the_server_s() -> None:
    from diloco.server.settings import ServerSettings

    for codec in ("int8", "bf16", "int4", "int2", "topk:0.03+int2", "fp32"):
        expected = ServerSettings(upload_codec=codec).error_feedback_beta
        assert SimConfig(upload_codec=codec).error_feedback_beta == expected, codec
    assert SimConfig(upload_codec="int8").error_feedback_beta == 0.0
    assert SimConfig(upload_codec="int4").error_feedback_beta == 0.95
    assert SimConfig(upload_codec="int8", error_feedback_beta=0.9).error_feedback_beta == 0.9
    # a sweep's child gets the same run back
    config = SimConfig(upload_codec="int8")
    assert SimConfig.from_dict(config.to_dict()).error_feedback_beta == 0.0
