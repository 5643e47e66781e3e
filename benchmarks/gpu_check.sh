#!/usr/bin/env bash
# The prepared GPU check (issues 4 and 16), one command on a lent CUDA machine, from the repository root,
# with that machine's python3 (its own torch with CUDA and triton; the package runs from src/). About
# 9 minutes on an H200 at most: every part has its own time limit, capped by what is left of TOTAL
# seconds (default 540); a part that fails or runs out of time does not stop the next ones, and the
# exit status is non-zero if any required part failed. Logs go to $OUT (default /tmp/gpu_check).
# Before it, where PyPI is reachable: python benchmarks/fetch_official.py, and carry benchmarks/.official
# to the GPU machine with the run (the official kernels for part 2b; the machine reaches no index).
#   1. tests/test_cuda.py (-m gpu): the model's contracts on CUDA, and the Triton scan == the chunked
#      scan in fp32 and bf16, values and gradients, alone and through the LM (eager/compiled/checkpointed);
#   2. gpu_scan.py: the scan alone, Triton beside chunked at the presets' layer shapes (equality in
#      fp32 and bf16, then fwd+bwd time and peak memory with ratios), the decode step (scan_step
#      beside the fused step kernel, 1 and 16 rows), and a profile of the Triton scan's kernels at the
#      440M shape;
#   2b. optional: the official Mamba-3 kernels into a scratch directory. From $OFFICIAL (default
#      benchmarks/.official: `python benchmarks/fetch_official.py` fills it where PyPI is reachable, and
#      the run carries it, since a lent GPU machine reaches no index) the mamba-ssm source release and the
#      einops wheel are unpacked, no pip (its Mamba-3 kernels are Triton; gpu_model.py imports them
#      without the package's compiled extensions). Without that directory: pip install mamba-ssm
#      (MAMBA_SKIP_CUDA_BUILD=TRUE: no nvcc; MAMBA_FORCE_BUILD=TRUE: no prebuilt-wheel download from
#      GitHub; --no-deps: nothing of the machine's torch is touched). Failure is tolerated: the official
#      rows then say why;
#   3. the CLI on cuda: train the tiny preset with the triton scan, resume it with scan_impl=auto (another
#      backend: the checkpoint must resume); on a node with 2 or more GPUs also torchrun on 2 of them with
#      training.context_parallel=2 (each window's halves on two GPUs, the state exchanged over NCCL);
#   4. gpu_model.py --baseline --official: mamba3_440m at 16 x 2048 and 4 x 8192 and mamba3_180m at
#      16 x 2048, triton and chunked (eager, compiled), the Transformer (SDPA, compiled) and the official
#      Mamba-3 layer (where mamba-ssm imports), with the ratios and the issue-16 targets; cases that would
#      start too late are printed as skipped (chunked ones first: earlier sessions measured them);
#   4b. optional: the hybrid preset (mamba3_180m_hybrid) beside mamba3_180m, Triton scan, eager;
#   5. the CLI on cuda: train the tiny preset compiled with the triton scan;
#   optional, only where the machine's python has vLLM's CUDA build (and `pip install -e '.[vllm]'`), before
#      part 4: the vLLM plugin's tests (tests/with_vllm: greedy equality with the model's own decode, `vllm
#      serve`) on the GPU, prefill through the Triton scan; without vLLM, one line says it was skipped;
#   on a node with 2+ GPUs also: context parallelism (C = 2) and mamba3_180m under ddp and fsdp on every
#   GPU (NCCL), tokens/s side by side in $OUT/multi_gpu.log.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
TOTAL=${TOTAL:-540}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
PY=${PY:-python3}
SITE=${SITE:-$(mktemp -d)/site}  # mamba-ssm goes here: not the machine's site-packages, not $OUT
rc=0
part() {  # part [--optional] NAME SECONDS CMD...: run CMD with a limit, log to $OUT/NAME.log
    local optional=0
    if [ "$1" = "--optional" ]; then optional=1; shift; fi
    local name=$1 limit=$2 t0=$SECONDS left=$((TOTAL - SECONDS))
    shift 2
    echo "== $name"
    if [ "$left" -lt 15 ] || [ "$limit" -lt 15 ]; then
        echo "== $name: skipped, ${left} s left of TOTAL=${TOTAL} (limit ${limit} s)"
        [ "$optional" -eq 1 ] || rc=1
        return
    fi
    [ "$limit" -le "$left" ] || limit=$left
    timeout "$limit" "$@" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$OUT/$name.log"
    local status=${PIPESTATUS[0]}
    echo "== $name: exit $status, $((SECONDS - t0)) s (limit $limit s)"
    [ "$status" -eq 0 ] || [ "$optional" -eq 1 ] || rc=1
}

$PY -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0], \
'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
$PY -c "import triton; print('triton', triton.__version__)" || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
git log -1 --format='commit %h %s' 2>/dev/null || true

part pytest_gpu 150 $PY -m pytest tests/test_cuda.py -m gpu -q -p no:cacheprovider -rs
part gpu_scan 70 $PY benchmarks/gpu_scan.py --budget-s 45 --profile siso_440m
OFFICIAL=${OFFICIAL:-benchmarks/.official}
if ls "$OFFICIAL"/mamba_ssm-*.tar.gz "$OFFICIAL"/einops-*.whl >/dev/null 2>&1; then
    part --optional unpack_mamba_ssm 30 $PY -c "
import sys, tarfile, zipfile, pathlib
site = pathlib.Path(sys.argv[1]); site.mkdir(parents=True, exist_ok=True)
src, wheel = sorted(pathlib.Path(sys.argv[2]).glob('mamba_ssm-*.tar.gz'))[-1], sorted(pathlib.Path(sys.argv[2]).glob('einops-*.whl'))[-1]
with tarfile.open(src) as t:  # the package directory only, under site/
    top = t.getnames()[0].split('/')[0]
    members = [m for m in t.getmembers() if m.name.startswith(top + '/mamba_ssm/') and (m.isfile() or m.isdir())]
    for m in members:
        m.name = m.name[len(top) + 1:]
    t.extractall(site, members=members, filter='data')
zipfile.ZipFile(wheel).extractall(site)
print('unpacked', src.name, 'and', wheel.name, 'into', site)
" "$SITE" "$OFFICIAL"
else
    part --optional install_mamba_ssm 60 env MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE \
        $PY -m pip install --no-build-isolation --no-deps --target "$SITE" --retries 0 --timeout 10 \
        --disable-pip-version-check mamba-ssm einops
fi

run=$(mktemp -d)
cli=($PY -m mamba3lite train --config tiny --dummy --set training.device=cuda --set training.eval_every=10)
part cli_triton 60 "${cli[@]}" --checkpoint-dir "$run/triton" --max-steps 20 --resume none \
    --set model.scan_impl=triton
part cli_resume_auto 45 "${cli[@]}" --checkpoint-dir "$run/triton" --max-steps 30 --set model.scan_impl=auto
ngpu=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${ngpu:-0}" -ge 2 ]; then
    part cli_context_parallel 60 $PY -m torch.distributed.run --standalone --nproc_per_node 2 -m mamba3lite \
        train --config tiny --dummy --set training.device=cuda --set training.eval_every=10 \
        --checkpoint-dir "$run/cp" --max-steps 20 --resume none --set model.scan_impl=triton \
        --set training.context_parallel=2
    # Several GPUs (NCCL): the same 180M steps under ddp and under fsdp on every GPU of the node; each
    # run's metrics.jsonl has its tokens/s (all processes) for the side-by-side (RESULTS.md, Scale out).
    for strategy in ddp fsdp; do
        part "multi_gpu_$strategy" 90 $PY -m torch.distributed.run --standalone --nproc_per_node "$ngpu" \
            -m mamba3lite train --config mamba3_180m --dummy --set training.device=cuda --max-steps 12 \
            --set training.log_every=4 --set training.eval_every=0 --set training.save_every=1000 \
            --set training.parallelism=$strategy --set training.global_batch_size=$((16 * ngpu)) \
            --checkpoint-dir "$run/multi_$strategy" --resume none
        $PY -c "import json,sys; rows=[json.loads(l) for l in open(sys.argv[1])]; \
t=[r for r in rows if r.get('kind') == 'train']; print('$strategy tokens/s', t[-1].get('tokens_per_s') if t else None)" \
            "$run/multi_$strategy/metrics.jsonl" 2>&1 | tee -a "$OUT/multi_gpu.log" || true
    done
else
    echo "== cli_context_parallel, multi_gpu_ddp, multi_gpu_fsdp: skipped, ${ngpu:-0} GPU(s) (they need 2)"
fi

if $PY -c "import vllm" >/dev/null 2>&1; then
    part --optional vllm_plugin 120 $PY -m pytest tests/with_vllm -q -p no:cacheprovider -rs
else
    echo "== vllm_plugin: skipped, no vLLM in $PY (pip install vllm, then pip install -e '.[vllm]')"
fi

# The hybrid beside the pure model of (nearly) its size: tokens/s of mamba3_180m_hybrid (attention at one
# layer in four, SDPA) over mamba3_180m, both with the Triton scan, eager, at 16 x 2048.
part --optional hybrid_model 75 env PYTHONPATH="src:$SITE" $PY benchmarks/gpu_model.py \
    --runs mamba3_180m_hybrid:16x2048 mamba3_180m:16x2048 --scan-impls triton --modes eager \
    --steps 5 --warmup 1 --budget-s 50 --json "$OUT/hybrid_model.json"

# The benchmark gets what is left but 100 s (kept for the compiled CLI run after it); it starts no case
# in its last 60 s (a case compiling at T = 8192 takes up to about a minute), so it ends on its own
# with its tables and JSON rather than being cut off. Its most informative cases run first.
left=$((TOTAL - SECONDS))
part gpu_model $((left - 100)) env PYTHONPATH="src:$SITE" $PY benchmarks/gpu_model.py --baseline --official \
    --steps 5 --warmup 1 --budget-s $((left - 160)) --json "$OUT/gpu_model.json"
part cli_compiled_triton 90 "${cli[@]}" --checkpoint-dir "$run/compiled" --max-steps 20 --resume none \
    --set training.compile=true --set model.scan_impl=triton
echo "gpu_check: exit $rc, $SECONDS s"
exit $rc
