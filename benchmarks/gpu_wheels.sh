#!/usr/bin/env bash
# Wheels for an offline GPU machine: run this where pip reaches PyPI, copy the folder over, and
# benchmarks/gpu_check.sh installs from it with `pip install --no-index --find-links`.
#
#   benchmarks/gpu_wheels.sh [DIR] [PYTHON_VERSION]     # default: wheels 3.12
#
# A typical CUDA image (PyTorch's, NVIDIA's) already has torch, numpy, safetensors, typer, rich
# and urllib3; it lacks the server's web stack and xxhash. These are the packages diloco needs
# that such an image lacks, and the small ones it may hold too old; pip installs only those that are
# missing or too old. Versions are this checkout's .venv's where it has one (what the tests
# ran against), else the newest for that Python.
set -euo pipefail
DIR=${1:-wheels}
PY=${2:-3.12}
PACKAGES=(fastapi starlette pydantic pydantic-core annotated-types annotated-doc typing-inspection
  typing-extensions opentelemetry-api uvicorn httptools uvloop h11 click anyio idna
  prometheus-client urllib3 typer rich shellingham markdown-it-py mdurl pygments safetensors
  xxhash)
cd "$(dirname "$0")/.."
mkdir -p "$DIR"
for name in "${PACKAGES[@]}"; do
  version=$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" \
    "$name" 2>/dev/null || true)
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DIR" "$name${version:+==$version}"
done
echo "$(ls "$DIR" | wc -l) wheels in $DIR ($(du -sh "$DIR" | cut -f1)) for Python $PY"
