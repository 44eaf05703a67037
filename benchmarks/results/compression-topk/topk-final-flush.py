"""What a final dense flush of the workers' error-feedback residuals does to top-k's final
eval loss: the 137k GPT, K = 4, H = 50, 5000 inner steps, top-k's defaults (chunk: argv[1],
default 128); writes argv[2] (default topk-h50-100-final-flush.json)."""

import json
import sys

import torch

from diloco.models import GPTConfig
from diloco.sim.config import SimConfig
from diloco.sim.runner import prepare, run

chunk = int(sys.argv[1]) if len(sys.argv) > 1 else 128
path = sys.argv[2] if len(sys.argv) > 2 else "topk-h50-100-final-flush.json"
torch.set_num_threads(1)
config = SimConfig(
    workers=4,
    steps=5000,
    sync_every=50,
    batch_size=8,
    seq_len=64,
    model=GPTConfig(context=64, width=64, depth=2),
    eval_every=1000,
    upload_codec="topk:0.03+int2",
    topk_chunk=chunk,
)
setup = prepare(config)
result = run(setup)
out = {"chunk": chunk, "final": result.final_eval_loss, "curve": result.eval_curve}
for scale in (0.25, 0.5, 1.0):  # final weights - scale * outer lr * mean residual
    flushed = {k: v.clone() for k, v in result.final_state.items()}
    for name in flushed:
        residuals = [r[name] for r in result.residuals if name in r]
        if residuals:
            flushed[name] -= scale * torch.stack(residuals).mean(0) * config.outer_lr
    out[f"flush{scale}"] = setup.evaluator.loss(flushed)
print(json.dumps(out))
with open(path, "w") as file:
    json.dump(out, file)
