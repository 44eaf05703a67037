"""Codecs give the same bytes on every device: a body coded from CUDA tensors is the body coded
from the same values on the CPU, byte for byte, and a delta applied to CUDA weights moves them
bit for bit as it moves CPU weights.

Why it matters: a worker codes its pseudo-gradient where its model lives (a GPU), the server
decodes and folds on its CPU, and error feedback subtracts what the server will decode; a
worker's copy of the published weights must stay bit-identical to the server's. Any device
difference (a division rounded otherwise, a top-k tie broken otherwise, a piece boundary that
moves a scale) would break those promises silently.

For every codec, tensors of awkward shapes and values (one element, a length no block or chunk
divides, all zeros, ties, magnitudes near fp32's largest and smallest) are coded three ways on
both devices: a plain body, a body with error feedback folded into a residual on the device,
and a delta applied to weights on the device. A fourth check runs three rounds of a worker
(`Anchor` and `UploadCoder` with the anchor and residual on each device: anchor - local, error
feedback, the body, a coded delta's apply into the anchor), and a fifth the same rounds on the
device with the body coded in a staging buffer there (`UploadCoder(stage_on_device=True)`, the
DILOCO_STAGE_ON_DEVICE experiment). Prints one row per codec; exits 1 if any byte or bit
differs.

    python benchmarks/codec_devices.py                      # cpu against cuda
    python benchmarks/codec_devices.py --device cpu --out-dir /tmp   # the script, no GPU
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import typer

from diloco.algorithm import TensorKind
from diloco.algorithm.compression.codecs import parse_codec
from diloco.console import check_output_path, fail, out, summary_table, write_json
from diloco.wire import specs_of
from diloco.wire.compressed.body import apply_delta, encode_compressed
from diloco.worker.anchor import Anchor
from diloco.worker.upload_coder import UploadCoder

RESULTS = Path(__file__).parent / "results"
CODECS = ("fp32", "bf16", "int8", "int4", "int2", "topk:0.03", "topk:0.03+int2", "topk:0.1+int8")


def awkward_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Shapes no piece, block or chunk divides, and values that test rounding and ties."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    ties = torch.randint(-3, 4, (4099,), generator=generator).float() * 0.25
    tiny = normal(3001, scale=1e-38)  # subnormal and near-subnormal values
    huge = normal(2053, scale=1e37)  # near fp32's largest (x 127 would overflow a naive coder)
    return {
        "one": normal(1),
        "matrix": normal(768, 770, scale=1e-3),
        "long": normal((1 << 24) + 12345, scale=1e-2),  # more than one accelerator piece
        "zeros": torch.zeros(1000),
        "ties": ties,
        "tiny": tiny,
        "huge": huge,
        "mixed": torch.cat([normal(300, scale=1e-6), torch.zeros(129), normal(700, scale=10)]),
    }


def compare(codec_text: str, device: torch.device, seed: int) -> dict:
    """Code on the CPU and on `device`; which bytes and bits agree."""
    codec = parse_codec(codec_text)
    tensors = awkward_tensors(seed)
    moved = {name: t.to(device) for name, t in tensors.items()}
    plain = encode_compressed(tensors, codec) == encode_compressed(moved, codec)

    residual_cpu = {name: t.clone() * 0.5 for name, t in tensors.items()}
    residual_dev = {name: t.to(device) for name, t in residual_cpu.items()}
    body_cpu = encode_compressed(tensors, codec, fold_into=residual_cpu, weight=-1.0)
    body_dev = encode_compressed(moved, codec, fold_into=residual_dev, weight=-1.0)
    feedback = body_cpu == body_dev and all(
        torch.equal(residual_cpu[name], residual_dev[name].cpu()) for name in tensors
    )

    weights_cpu = {name: torch.randn_like(t) for name, t in tensors.items()}
    weights_dev = {name: t.to(device) for name, t in weights_cpu.items()}
    apply_delta(body_cpu, weights_cpu, codec)
    apply_delta(body_cpu, weights_dev, codec)
    delta = all(torch.equal(weights_cpu[name], weights_dev[name].cpu()) for name in tensors)
    differing = [  # which tensors, when anything differs: where to look
        name
        for name in tensors
        if not (plain and feedback)
        and encode_compressed({name: tensors[name]}, codec)
        != encode_compressed({name: moved[name]}, codec)
    ]
    return {
        "differing_tensors": differing,
        "codec": codec_text,
        "body_bytes": len(body_cpu),
        "plain_body_identical": plain,
        "error_feedback_identical": feedback,
        "delta_apply_identical": delta,
    }


class _Weights(torch.nn.Module):
    """A model whose parameters are `tensors`, on `device`."""

    def __init__(self, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            self.register_parameter(name, torch.nn.Parameter(tensor.to(device, copy=True)))


def worker_rounds(codec_text: str, device: torch.device, seed: int) -> dict:
    """Three rounds of a worker with its anchor and residual on the CPU, on `device`, and on
    `device` coding each body in a staging buffer there: the bodies it uploads, the residual
    it keeps and the anchor a coded delta leaves."""
    codec = parse_codec(codec_text)
    start = awkward_tensors(seed)
    specs = specs_of(start, dict.fromkeys(start, TensorKind.TRAINABLE))
    coded_delta = codec.is_quantized or codec.is_sparse
    sides = []
    for where, staged in ((torch.device("cpu"), None), (device, None), (device, True)):
        model = _Weights(start, where)
        anchor = Anchor(model, leader=True, download_dtype=torch.float32, device=where)
        anchor.adopt(start, 0)
        coder = UploadCoder(codec, 0.9, specs, device=where, stage_on_device=staged)
        bodies = []
        for round_number in range(1, 4):
            step = awkward_tensors(seed + round_number)
            with torch.no_grad():
                for name, parameter in model.named_parameters():
                    parameter.sub_(step[name].to(where), alpha=0.01)
            if codec.is_identity:
                body = bytes(coder.plain_body(anchor.tensors, model.state_dict()))
            else:
                body = bytes(coder.body_from(anchor.tensors, model.state_dict()))
            coder.settle(folded=True)
            bodies.append(body)
            if coded_delta:  # the body as the round's delta: the new global values
                new = anchor.values_after(bytearray(body), list(start), codec, set(start))
            else:
                new = {name: t.detach() for name, t in model.state_dict().items()}
            anchor.adopt(new, round_number)
        sides.append(
            (
                bodies,
                {name: t.cpu() for name, t in coder.residual.items()},
                {name: t.cpu() for name, t in anchor.tensors.items()},
            )
        )
    (bodies_cpu, residual_cpu, anchor_cpu), (bodies_dev, residual_dev, anchor_dev), staged = sides

    def same_residual(other: dict[str, torch.Tensor]) -> bool:
        return residual_cpu.keys() == other.keys() and all(
            torch.equal(residual_cpu[n], other[n]) for n in residual_cpu
        )

    return {
        "worker_bodies_identical": bodies_cpu == bodies_dev,
        "worker_residual_identical": same_residual(residual_dev),
        "worker_anchor_identical": all(torch.equal(anchor_cpu[n], anchor_dev[n]) for n in start),
        "worker_staged_identical": staged[0] == bodies_cpu
        and same_residual(staged[1])
        and all(torch.equal(anchor_cpu[n], staged[2][n]) for n in start),
    }


def main(
    device: str = typer.Option("cuda", help="The device compared with the CPU."),
    codecs: str = typer.Option(",".join(CODECS), help="Codecs to compare, comma-separated."),
    seed: int = typer.Option(0, help="Seed of the tensors."),
    out_dir: Path = typer.Option(RESULTS, help="Where codec_devices.md and .json go."),
) -> None:
    """Compare each codec's bytes and bits on the CPU and on --device."""
    check_output_path(out_dir / "codec_devices.json", "--out-dir")
    try:
        target = torch.device(device)
    except RuntimeError:
        raise fail(
            f"--device must be a torch device such as cuda or cuda:1, got {device!r}"
        ) from None
    if target.type == "cuda" and not torch.cuda.is_available():
        raise fail(f"--device {device}: torch sees no CUDA device on this machine")
    chosen = [c.strip() for c in codecs.split(",") if c.strip()]
    for text in chosen:
        try:
            parse_codec(text)
        except ValueError as exc:
            raise fail(f"--codecs: {exc}") from None
    if not chosen:
        raise fail("--codecs names no codec")
    rows = [compare(text, target, seed) | worker_rounds(text, target, seed) for text in chosen]
    for row in rows:
        row["worker_rounds_identical"] = (
            row["worker_bodies_identical"]
            and row["worker_residual_identical"]
            and row["worker_anchor_identical"]
        )
    checks = (
        "plain_body_identical",
        "error_feedback_identical",
        "delta_apply_identical",
        "worker_rounds_identical",
        "worker_staged_identical",
    )
    ok = all(row[check] for row in rows for check in checks)
    name = torch.cuda.get_device_name(target) if target.type == "cuda" else str(target)
    write_json(
        out_dir / "codec_devices.json",
        {"device": name, "torch": torch.__version__, "results": rows},
    )
    title = f"Codecs on the CPU and on {name} (torch {torch.__version__}): identical?"
    headers = [
        "codec",
        "body bytes",
        "plain body",
        "error feedback",
        "delta apply",
        "worker rounds",
        "staged worker rounds",
        "differ",
    ]
    table = [
        [
            row["codec"],
            row["body_bytes"],
            *("yes" if row[c] else "NO" for c in checks),
            ", ".join(row["differing_tensors"]) or "-",
        ]
        for row in rows
    ]
    (out_dir / "codec_devices.md").write_text(
        f"# {title}\n\n`python benchmarks/codec_devices.py --device {device}`\n\n"
        + "| "
        + " | ".join(headers)
        + " |\n|"
        + "---|" * len(headers)
        + "\n"
        + "".join("| " + " | ".join(str(c) for c in line) + " |\n" for line in table)
    )
    out.print(summary_table(title, headers, table))
    if not ok:
        raise typer.Exit(1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    typer.run(main)
