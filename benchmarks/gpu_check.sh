#!/usr/bin/env bash
# The prepared GPU check (issue 4, "If your session has a GPU"), one command on a lent CUDA machine, from
# the repository root, with that machine's python3 (its own torch with CUDA; nothing is installed: the
# package runs from src/). About 5 minutes on an H200. Logs go to $OUT (default /tmp/gpu_check).
#   1. tests/test_cuda.py (-m gpu): the model's contracts on the GPU code paths;
#   2. gpu_model.py --baseline: 180M and 440M presets, bf16, T 2048, eager and compiled, vs the Transformer;
#   3. the CLI on cuda: train the tiny preset 30 steps (eager, then compiled), resume to 40.
# Each part has its own time limit, and a failing part does not stop the next; the exit status is
# non-zero if any part failed.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
PY=${PY:-python3}
rc=0
part() {  # part NAME SECONDS CMD...: run CMD with a limit, log to $OUT/NAME.log, remember a failure
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    echo "== $name"
    timeout "$limit" "$@" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$OUT/$name.log"
    local status=${PIPESTATUS[0]}
    echo "== $name: exit $status, $((SECONDS - t0)) s"
    [ "$status" -eq 0 ] || rc=1
}

$PY -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0], \
'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

part pytest_gpu 180 $PY -m pytest tests/test_cuda.py -m gpu -q -p no:cacheprovider
part gpu_model 330 $PY benchmarks/gpu_model.py --baseline --budget-s 240 --json "$OUT/gpu_model.json"

run=$(mktemp -d)
cli=($PY -m mamba3lite train --config tiny --dummy --set training.device=cuda --set training.eval_every=10)
part cli_eager 90 "${cli[@]}" --checkpoint-dir "$run/eager" --max-steps 30 --resume none
part cli_resume 60 "${cli[@]}" --checkpoint-dir "$run/eager" --max-steps 40
part cli_compiled 120 "${cli[@]}" --checkpoint-dir "$run/compiled" --max-steps 30 --resume none \
    --set training.compile=true
echo "gpu_check: exit $rc"
exit $rc
