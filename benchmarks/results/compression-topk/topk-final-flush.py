"""Scratch: what a final dense flush of the workers' error-feedback residuals would do to
top-k's final eval loss (137k GPT, K=4, H=50, 5000 steps, defaults)."""
import json, sys
import torch
from diloco.sim.config import SimConfig
from diloco.models import GPTConfig
from diloco.sim.runner import prepare, run

chunk = int(sys.argv[1]) if len(sys.argv) > 1 else 128
torch.set_num_threads(1)
cfg = SimConfig(workers=4, steps=5000, sync_every=50, batch_size=8, seq_len=64,
                model=GPTConfig(context=64, width=64, depth=2), eval_every=1000,
                upload_codec="topk:0.03+int2", topk_chunk=chunk)
setup = prepare(cfg)
res = run(setup)
final = res.final_state
out = {"chunk": chunk, "final": res.final_eval_loss, "curve": res.eval_curve}
for scale in (0.25, 0.5, 1.0):
    flushed = {k: v.clone() for k, v in final.items()}
    for name in flushed:
        rs = [r[name] for r in res.residuals if name in r]
        if rs:
            flushed[name] -= scale * torch.stack(rs).mean(0) * cfg.outer_lr
    out[f"flush{scale}"] = setup.evaluator.loss(flushed)
print(json.dumps(out))
json.dump(out, open(f"/tmp/flush/flush-{chunk}.json", "w"))
