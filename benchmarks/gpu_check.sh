#!/usr/bin/env bash
# The GPU check, in one run of under 8 minutes on one H100 and with no network:
#   1. every codec codes the same bytes from CUDA tensors as from CPU ones, and a delta moves
#      CUDA weights bit for bit as CPU ones (benchmarks/codec_devices.py); then the server's
#      int8 round work (fold, outer step, delta) on this host's CPU at several thread budgets
#      (benchmarks/server_threads.py, about a minute at 125M);
#   2. two CUDA workers of a 125M GPT (bf16 autocast, batch 16 x 256 tokens, H = 100, int8
#      both ways) train against a real server for about two minutes in sync mode, then in
#      streaming mode (4 fragments, delay 1), and print the share of their time blocked in
#      syncs beside the round's physical limit (benchmarks/model_scale.py);
#   3. `diloco demo --device $GPU_CHECK_DEVICE --dtype bf16` on a generated corpus: the CLI's
#      GPU path end to end, a real server, two workers and the simulator's baselines on the
#      GPU (GPU_CHECK_DEMO_STEPS inner steps per worker, default 200; 0 skips it), then
#      `diloco simulate` in streaming mode on the GPU for as many steps.
#
#   benchmarks/gpu_check.sh [RESULTS_DIR]          # default: benchmarks/results/gpu_check
#
# Offline machines: a CUDA image has torch but not the server's web stack. Where PyPI is
# reachable run `benchmarks/gpu_wheels.sh wheels 3.12` (the GPU machine's Python version),
# copy the wheels folder beside the checkout; this script installs from it with
# `pip install --no-index` into a temporary folder (nothing of the machine's changes).
# Environment: DILOCO_WHEELS (the folder, default: wheels), PYTHON (default: python3),
# GPU_CHECK_SECONDS (per mode, default 120), GPU_CHECK_DEVICE and GPU_CHECK_SIZE (default cuda
# and 125M), GPU_CHECK_BATCH, GPU_CHECK_CONTEXT and GPU_CHECK_H (16, 256, 100). The script
# itself runs on a machine without a GPU with: GPU_CHECK_DEVICE=cpu GPU_CHECK_SIZE=2M
# GPU_CHECK_BATCH=1 GPU_CHECK_CONTEXT=16 GPU_CHECK_H=8 GPU_CHECK_SECONDS=20.
# GPU_CHECK_MODES (default "sync streaming") and GPU_CHECK_ANCHORS (where the workers keep
# their anchor, default auto: beside the model; "cpu,auto" measures both, one after the other).
# GPU_CHECK_DELAYS (streaming: the inner steps a fragment's sync overlaps, default 1; "1,20"
# runs both, the second into streaming-delay20/: about PER_MODE + 35 s more; each must be
# below GPU_CHECK_H / fragments, the steps of a fragment's window: 4 fragments, or the
# model's blocks where fewer).
# GPU_CHECK_SERVER_THREADS (the server's torch threads, default auto: up to 4 beside GPU
# workers; "1,4,8" compares them, one run each per mode).
# GPU_CHECK_SERVER_WORK (the torch thread counts server_threads.py times, default "1,4,8";
# empty skips it) and GPU_CHECK_SERVER_POOL (its Python-thread pools for the delta, "4,8").
# GPU_CHECK_FUSED_THREADS (default "4"; empty skips): server_threads.py again with the fused
# int8 kernels (DILOCO_FUSED_INT8=1, a compiled experiment: algorithm/compression/fused_int8.py), one
# process per thread count (a kernel runs only at the count it was compiled at), into
# fused-int8-tN/.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${1:-benchmarks/results/gpu_check}
PYTHON=${PYTHON:-python3}
WHEELS=${DILOCO_WHEELS:-wheels}
PER_MODE=${GPU_CHECK_SECONDS:-120}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
SIZE=${GPU_CHECK_SIZE:-125M}
BATCH=${GPU_CHECK_BATCH:-16}
CONTEXT=${GPU_CHECK_CONTEXT:-256}
H=${GPU_CHECK_H:-100}
MODES=${GPU_CHECK_MODES:-sync streaming}
ANCHORS=${GPU_CHECK_ANCHORS:-auto}
DELAYS=${GPU_CHECK_DELAYS:-1}
SERVER_THREADS=${GPU_CHECK_SERVER_THREADS:-auto}
SERVER_WORK=$(tr -d ' ' <<<"${GPU_CHECK_SERVER_WORK-1,4,8}")  # (blank: skipped)
SERVER_POOL=$(tr -d ' ' <<<"${GPU_CHECK_SERVER_POOL-4,8}")
FUSED_THREADS=$(tr -d ' ' <<<"${GPU_CHECK_FUSED_THREADS-4}")
DEMO_STEPS=${GPU_CHECK_DEMO_STEPS:-200}
# model_scale runs per mode and delay: one per anchor device and server thread count
RUNS=$(( ($(tr -cd , <<<"$ANCHORS" | wc -c) + 1) * ($(tr -cd , <<<"$SERVER_THREADS" | wc -c) + 1) ))
mkdir -p "$RESULTS" || exit 2
export PYTHONUNBUFFERED=1 PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
started=$(date +%s)

if ! "$PYTHON" -c "import diloco.server.http.app, diloco.worker" 2>/dev/null; then
  if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
    echo "gpu_check: diloco's dependencies are missing and $WHEELS holds no wheels: prepare" \
      "them with benchmarks/gpu_wheels.sh $WHEELS <python version> where PyPI is reachable" >&2
    exit 2
  fi
  site=$(mktemp -d)
  "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
    --target "$site" "$WHEELS"/*.whl || { echo "gpu_check: installing $WHEELS failed" >&2; exit 2; }
  export PYTHONPATH="$PYTHONPATH:$site"
  "$PYTHON" -c "import diloco.server.http.app, diloco.worker" || exit 2
  echo "installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS in $(($(date +%s) - started)) s"
fi
"$PYTHON" - <<'PY' | tee "$RESULTS/machine.txt"
import os, platform, torch
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"{platform.node()}: {os.cpu_count()} cores, torch {torch.__version__}, {gpu}")
PY

status=0
echo "== 1. codecs: CPU against $DEVICE"
timeout 180 "$PYTHON" benchmarks/codec_devices.py --device "$DEVICE" \
  --out-dir "$RESULTS" || status=1
if [ -n "$SERVER_WORK" ]; then
  echo "== 1b. the server's int8 round work at $SERVER_WORK torch threads, $SIZE GPT"
  timeout 300 "$PYTHON" benchmarks/server_threads.py --size "$SIZE" --threads "$SERVER_WORK" \
    --pool "$SERVER_POOL" --out-dir "$RESULTS" || status=1
fi
for threads in ${FUSED_THREADS//,/ }; do
  echo "== 1c. the same with the fused int8 kernels at $threads torch threads"
  mkdir -p "$RESULTS/fused-int8-t$threads"
  DILOCO_FUSED_INT8=1 timeout 180 "$PYTHON" benchmarks/server_threads.py --size "$SIZE" \
    --threads "$threads" --pool "" --out-dir "$RESULTS/fused-int8-t$threads" || status=1
done
for mode in $MODES; do
  delays=1
  [ "$mode" = streaming ] && delays=${DELAYS//,/ }  # (commas too, as the other lists)
  for delay in $delays; do
    out="$RESULTS/$mode"
    [ "$delay" != 1 ] && out="$RESULTS/$mode-delay$delay"
    echo "== 2. two $DEVICE workers of a $SIZE GPT, $mode mode" \
      "$([ "$mode" = streaming ] && echo "(delay $delay) ")about $PER_MODE s"
    mkdir -p "$out"
    timeout $(((PER_MODE + 150) * RUNS)) "$PYTHON" benchmarks/model_scale.py --device "$DEVICE" \
      --sizes "$SIZE" --codecs int8 --modes "$mode" --delay "$delay" --dtype bf16 \
      --batch-size "$BATCH" --context "$CONTEXT" --sync-every "$H" --rounds 1000 \
      --max-seconds "$PER_MODE" --anchor-devices "$ANCHORS" --server-threads "$SERVER_THREADS" \
      --out-dir "$out" || status=1
  done
done
if [ "$DEMO_STEPS" != 0 ]; then
  echo "== 3. diloco demo on $DEVICE, bf16 autocast, $DEMO_STEPS steps per worker"
  timeout 300 "$PYTHON" -m diloco.cli demo --device "$DEVICE" --dtype bf16 \
    --steps "$DEMO_STEPS" --corpus generated --json "$RESULTS/demo.json" || status=1
  timeout 120 "$PYTHON" -m diloco.cli simulate --device "$DEVICE" --dtype bf16 \
    --mode streaming --fragments 2 --sync-every 20 --steps "$DEMO_STEPS" --corpus generated \
    --json "$RESULTS/simulate-streaming.json" || status=1
fi
echo "gpu_check: $([ $status = 0 ] && echo passed || echo FAILED) in $(($(date +%s) - started)) s;" \
  "results in $RESULTS"
exit $status
