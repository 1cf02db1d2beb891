# Shared by setup_*.sh (sourced, not run): make a Python 3.11 venv for one peer and pin the local
# CPU torch wheel into it before anything else, so no dependency can pull a CUDA torch.
# Usage: source _venv.sh PEER  -> sets VENV, PY; creates the venv if missing.
set -euo pipefail
PEER="$1"
PEERS_DIR="${AGENTX_PEERS_DIR:-$HOME/.cache/agentx/peers}"
VENV="$PEERS_DIR/$PEER"
PYTHON_BIN="${AGENTX_PEERS_PYTHON:-python3.11}"  # the torch 2.13.0 wheel is cp311
TORCH_PIN="torch==2.13.0"
mkdir -p "$PEERS_DIR"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON_BIN" -m venv "$VENV" >&2
fi
PY="$VENV/bin/python"
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@" >&2; }
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    pip_install "$TORCH_PIN"
fi
# Every later install sees the pin as a constraint, so nothing can swap torch out.
CONSTRAINTS="$VENV/agentx-constraints.txt"
echo "$TORCH_PIN" > "$CONSTRAINTS"
