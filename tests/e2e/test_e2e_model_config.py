"""`diloco worker --model-config`: a transformers causal LM from its config, as a user runs it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diloco.models.causal_lm import CausalLMConfig, ModelConfigError
from diloco.sim import SimConfig, simulate
from processes import global_weights, run_cli_in_process, start_worker, wait_all
from tiny import LLAMA

pytest.importorskip("transformers")

GPT2_TIED = {
    "model_type": "gpt2",
    "vocab_size": 256,
    "n_embd": 32,
    "n_layer": 1,
    "n_head": 2,
    "n_positions": 32,
    "bos_token_id": None,
    "eos_token_id": None,
}
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "model_configs"


def write_config(tmp_path: Path, fields: dict | list | str, name: str = "model.json") -> Path:
    path = tmp_path / name
    path.write_text(fields if isinstance(fields, str) else json.dumps(fields))
    return path


def two_workers(server_process, config: Path, h: int, steps: int, corpus: Path, out: Path):
    """A real server at H = h and two `diloco worker --model-config` processes; the global
    weights and round at the end."""
    server = server_process("--sync-every", str(h), "--min-workers", "2")
    extra = ("--model-config", str(config))
    workers = [start_worker(server.url, f"w{i}", i, 2, steps, corpus, out, extra=extra)
               for i in range(2)]  # fmt: skip
    wait_all(workers)
    for i, worker in enumerate(workers):
        assert worker.returncode == 0, (out / f"w{i}.log").read_text()
    return global_weights(server.url)


def test_the_same_seed_builds_the_same_weights_and_an_untrained_loss_near_ln_256(
    tmp_path: Path,
) -> None:
    spec = CausalLMConfig.from_file(write_config(tmp_path, LLAMA))
    assert spec.context == 64
    states = []
    for _ in range(2):
        torch.manual_seed(11)
        states.append(spec.build().state_dict())
    assert states[0].keys() == states[1].keys()
    for name, tensor in states[0].items():
        assert torch.equal(tensor, states[1][name]), name
    # Hand-computed shapes: head_dim 32 / 4 = 8, two key/value heads -> 16 rows
    assert states[0]["model.layers.0.self_attn.k_proj.weight"].shape == (16, 32)
    assert states[0]["model.embed_tokens.weight"].shape == (256, 32)
    assert states[0]["lm_head.weight"].shape == (256, 32)
    torch.manual_seed(11)
    model = spec.build()
    tokens = torch.randint(0, 256, (4, 17))
    loss = spec.loss(model, tokens[:, :-1], tokens[:, 1:])
    # Small random init: the next byte is about uniform over 256 values
    assert abs(loss.item() - math.log(256)) < 0.2


def test_the_shipped_example_configs_build(tmp_path: Path) -> None:
    for path in sorted(EXAMPLES.glob("*.json")):
        spec = CausalLMConfig.from_file(path)
        assert spec.context is not None and spec.context >= 64, path


@pytest.mark.slow  # make test-slow; the Trainer resume test trains an HF model through a server
def test_two_workers_train_a_llama_config_through_a_real_server(
    server_process, corpus_file: Path, tmp_path: Path
) -> None:
    config = write_config(tmp_path, LLAMA)
    weights, round_number = two_workers(server_process, config, 3, 6, corpus_file, tmp_path)
    assert round_number == 2
    torch.manual_seed(5)  # the workers' --seed
    initial = CausalLMConfig.from_file(config).build().state_dict()
    assert weights.keys() == initial.keys()
    assert any(not torch.equal(weights[k], initial[k]) for k in initial)
    reports = [json.loads((tmp_path / f"w{i}.json").read_text()) for i in range(2)]
    assert [r["rounds"] for r in reports] == [2, 2]
    assert reports[0]["final_eval_loss"] == reports[1]["final_eval_loss"]
    assert reports[0]["final_eval_loss"] < math.log(256) - 0.1


@pytest.mark.slow  # in `make test-slow`; the llama run above is the default suite's sample
def test_tied_gpt2_embeddings_stay_tied_through_rounds(
    server_process, corpus_file: Path, tmp_path: Path
) -> None:
    config = write_config(tmp_path, GPT2_TIED)
    weights, round_number = two_workers(server_process, config, 2, 4, corpus_file, tmp_path)
    assert round_number == 2
    # Both names of the one tied tensor get the same pseudo-gradient, so they stay equal
    assert torch.equal(weights["transformer.wte.weight"], weights["lm_head.weight"])


BAD_CONFIGS = [
    (None, "cannot read it"),
    ("{not json", "is not JSON"),
    ([1, 2], "must be a JSON object with a 'model_type'"),
    ({"vocab_size": 256}, "must be a JSON object with a 'model_type'"),
    ({"model_type": "bogus"}, "model_type 'bogus' is not a causal LM that this transformers knows"),
    ({**LLAMA, "vocab_size": 100}, "vocab_size must be >= 256 to hold byte tokens, got 100"),
    ({**LLAMA, "hidden_size": 33}, "is not a multiple of the number of attention heads"),
    ({**LLAMA, "max_position_embeddings": 16}, "--seq-len 32 is longer than the model takes (16"),
]


def worker_with_config(path: Path, corpus: Path) -> list[str]:
    return ["worker", "--server", "http://127.0.0.1:9", "--steps", "2", "--seq-len", "32",
            "--corpus", str(corpus), "--model-config", str(path)]  # fmt: skip


def one_error_line(result: subprocess.CompletedProcess, needle: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --"), result.stderr
    assert needle in lines[0]


@pytest.mark.parametrize(("fields", "needle"), BAD_CONFIGS, ids=[n[:30] for _, n in BAD_CONFIGS])
def test_a_bad_model_config_is_one_line_and_exit_2(
    fields, needle: str, tmp_path: Path, corpus_file: Path
) -> None:
    """`diloco worker` run in this process (typer's runner): one line, exit 2, per case."""
    path = tmp_path / "missing.json" if fields is None else write_config(tmp_path, fields)
    one_error_line(run_cli_in_process(*worker_with_config(path, corpus_file)), needle)


def test_a_bad_model_config_is_one_line_from_a_real_process(
    tmp_path: Path, corpus_file: Path
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "diloco.cli", *worker_with_config(tmp_path / "x", corpus_file)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    one_error_line(result, "cannot read it")


def test_bad_configs_raise_model_config_errors_in_process(tmp_path: Path) -> None:
    for fields, needle in BAD_CONFIGS[:-1]:  # the last one is the worker's --seq-len check
        path = tmp_path / "missing.json" if fields is None else write_config(tmp_path, fields)
        with pytest.raises(ModelConfigError) as caught:
            CausalLMConfig.from_file(path)
        assert needle in str(caught.value)


def test_the_simulator_trains_a_model_config_and_counts_its_bytes(
    tmp_path: Path, small_corpus: bytes
) -> None:
    config = str(write_config(tmp_path, LLAMA))
    common = dict(workers=1, steps=4, batch_size=4, seq_len=32, warmup=1, model_config=config)
    plain = simulate(SimConfig(mode="single", **common), corpus=small_corpus)
    # DiLoCo with K = 1, H = 1 and outer SGD at lr 1 is plain training (DiLoCo paper, Sec. 2)
    diloco = simulate(
        SimConfig(mode="diloco", sync_every=1, outer_optimizer="sgd", outer_lr=1.0,
                  outer_momentum=0.0, **common),
        corpus=small_corpus,
    )  # fmt: skip
    assert diloco.final_eval_loss == pytest.approx(plain.final_eval_loss, abs=1e-5)
    assert plain.final_eval_loss < math.log(256)
    # By hand: embeddings and head 2 x 256 x 32; per layer q, o 32 x 32, k, v 16 x 32, three
    # MLP matrices 48 x 32 and two norms of 32; the final norm 32
    parameters = 2 * 256 * 32 + 2 * (2 * 1024 + 2 * 512 + 3 * 1536 + 2 * 32) + 32
    assert diloco.parameters == parameters == 31_904
    assert diloco.bytes_sent_per_worker == 4 * 4 * parameters  # 4 rounds of fp32
