#!/usr/bin/env bash
# Gather the wheels the GPU tests need, for a GPU machine with no network.
#
#   ops/gpu/gather-wheels.sh [DEST] [PYTHON_VERSION]     # on a machine that reaches PyPI
#
# DEST (default .whl/) gets megatron-core and the pure-Python packages rlstream's
# trainer imports beyond what a CUDA PyTorch image already has (pydantic and its
# three helpers). It does NOT bundle torch, numpy, PyYAML, safetensors, msgpack,
# transformers or tokenizers: the GPU image's own are used (docs/gpu.md lists the
# versions the tests need). PYTHON_VERSION is the GPU machine's (default 3.12,
# what the validation machines run). The versions are the ones this checkout's
# .venv resolved, so CPU and GPU runs test the same libraries. It also builds
# rlstream's own wheel from this checkout (pure Python): the package is installed as
# `rlstream` (ops/, common/, producer/, consumer/ mapped into one namespace), so a
# checkout on PYTHONPATH alone no longer imports it. Gather again after a change.
#
# On the GPU machine (docs/gpu.md):
#   python3 -m pip install --no-index --no-deps --target /tmp/site DEST/*.whl
#   PYTHONPATH=/tmp/site:. make test-gpu PY=python3
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=${1:-.whl}
pyver=${2:-3.12}
venv_py=.venv/bin/python
[ -x "$venv_py" ] || { echo "run 'make install' first: the versions come from .venv" >&2; exit 2; }
version() { "$venv_py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
pkgs=(megatron-core pydantic pydantic-core annotated-types typing-inspection)
specs=()
for p in "${pkgs[@]}"; do specs+=("$p==$(version "$p")"); done
mkdir -p "$dest"
python3 -m pip download --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$dest" "${specs[@]}"
"$venv_py" -m pip wheel --quiet --no-deps --no-build-isolation -w "$dest" .
du -sh "$dest"
ls -1 "$dest"
