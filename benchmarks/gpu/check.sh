#!/usr/bin/env bash
# The GPU check (issue 13), one command for the H200 machine, under 8 minutes:
#   1. the Triton kernel tests (tests/kernels/triton_cases.py) compiled on CUDA, in bfloat16
#   2. decode attention bandwidth as a share of HBM peak (attention_bandwidth.py)
#   3. engine prefill / decode tok/s on SmolLM2-135M's and Llama-1B's shapes (random weights),
#      with and without CUDA graphs (engine_gpu.py)
# The image has torch (CUDA) and triton 3.6; agentx's other dependencies travel as wheels in
# .gpu-payload/, which benchmarks/gpu/prepare.sh fills (run it first, where PyPI is reachable).
# With the device tool:  run(command="bash benchmarks/gpu/check.sh", carry=[".gpu-payload"],
# timeout_s=540). Logs and JSON land in $OUT (or ./gpu-out when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
status=0

if [ ! -d .gpu-payload/wheels ]; then
	echo "no .gpu-payload/: run benchmarks/gpu/prepare.sh first and carry .gpu-payload" >&2
	exit 2
fi
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
	--target /tmp/agentx-site .gpu-payload/wheels/*.whl || exit 2
export PYTHONPATH="$PYTHONPATH:/tmp/agentx-site"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
	| tee -a "$OUT/gpu.txt"

echo "== 1. kernel tests on CUDA (bfloat16)"
TRITON_TEST_DEVICE=cuda AGENTX_KERNELS=triton timeout 150 $PY -m pytest -q -p no:cacheprovider \
	tests/kernels/triton_cases.py 2>&1 | tee "$OUT/kernel_tests.log" | tail -25 || status=1

echo "== 2. decode attention bandwidth"
timeout 90 $PY benchmarks/gpu/attention_bandwidth.py --json "$OUT/attention.json" 2>&1 \
	| tee "$OUT/attention.log" || status=1

echo "== 3. engine tok/s, with and without CUDA graphs"
timeout 230 $PY benchmarks/gpu/engine_gpu.py --payload .gpu-payload --json "$OUT/engine.json" \
	2>&1 | tee "$OUT/engine.log" | tail -30 || status=1
exit $status
