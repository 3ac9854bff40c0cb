#!/usr/bin/env bash
# The GPU checks and timings behind docs/benchmarks.md, on a machine with 2 GPUs (or more: the first two, see LANES)
# and the wheels of ../shared/tools/gpu-wheels.sh in .whl/: set-up (offline), every GPU test, the benchmarks,
# DLRM and MoE training bulk vs fused. Results go to $OUT (default ./gpu_out); a summary is printed at the end.
# On one GPU the test steps still run every test that needs one GPU, the two-rank tests' ONE_GPU cases among them
# (tests/world.py: both ranks on that GPU, results only); the benchmarks and training runs need two.
# All of it takes longer than one 10-minute device call: name the steps to run, e.g.
#   bash scripts/gpu_check.sh test_tp test_quantized_allreduce bench_tp
# (steps: test_<name> for tests/test_<name>_gpu.py, test_gpu_cases (the GPU tests of GPU_CASES' CPU test files,
# selected by "gpu" in their names), bench_embedding, bench_embedding_nvshmem, bench_moe, bench_tp, bench_dlrm_step,
# train; none named: all of them).
# LANES=2 on a machine with 4 GPUs or more (CUDA_VISIBLE_DEVICES unset): the tests on GPUs 0,1 while the
# benchmarks and training runs go on GPUs 2,3, side by side (the timings then share the host's cores with the
# tests: say so where you quote them).
GPU_TESTS="launch symmetric_workspace simulated_world arch_nodes direct_step batch_header segment_gather fused_embedding torchrec_sharder moe_fused moe_fused_dispatch moe_graphs quantized_allreduce tp allgather"
# CPU test files that also hold GPU tests (skipped on CI): their tests named *gpu* run in the step test_gpu_cases
GPU_CASES="batches_ahead batch_not_made embedding_backward_kernel sorted_segments_kernel moe_experts moe_grouped_weight_grad report bench_dlrm_step graphed_step checkpoint lr_schedule"
KNOWN=" $(for f in $GPU_TESTS; do printf 'test_%s ' $f; done)test_gpu_cases bench_embedding bench_embedding_nvshmem"
KNOWN="$KNOWN bench_moe bench_tp bench_dlrm_step train "
for s in "$@"; do  # a misspelt step would otherwise run nothing and report nothing
  [[ "$KNOWN" == *" $s "* ]] || { echo "unknown step '$s'; the steps:$KNOWN" >&2; exit 2; }
done
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
TEST_GPUS=${CUDA_VISIBLE_DEVICES:-0,1}; RUN_GPUS=$TEST_GPUS
[ "${LANES:-1}" = 2 ] && [ -z "${CUDA_VISIBLE_DEVICES:-}" ] && [ "$(nvidia-smi -L | wc -l)" -ge 4 ] && RUN_GPUS=2,3
python3 scripts/setup_env.py --wheels .whl --target /tmp/site > $OUT/setup.log 2>&1 || { tail -20 $OUT/setup.log; exit 1; }
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests
STEPS=" $* "
want() { [ "$STEPS" = "  " ] || [[ "$STEPS" == *" $1 "* ]]; }
T() { local t=$1 name=$2; shift 2; want $name || return 0
      CUDA_VISIBLE_DEVICES=$TEST_GPUS timeout $t python3 -m pytest -v -p no:warnings "$@" > $OUT/$name.log 2>&1
      echo "rc=$? (GPUs $TEST_GPUS)" >> $OUT/$name.log; }
R() { local t=$1 name=$2; shift 2; want ${STEP:-$name} || return 0
      CUDA_VISIBLE_DEVICES=$RUN_GPUS timeout $t torchrun --nproc_per_node=2 --standalone "$@" > $OUT/$name.log 2>&1
      echo "rc=$? (GPUs $RUN_GPUS)" >> $OUT/$name.log; }
tests() {
  for f in $GPU_TESTS; do
    T 300 test_$f tests/test_${f}_gpu.py
  done
  T 600 test_gpu_cases $(for f in $GPU_CASES; do printf 'tests/test_%s.py ' $f; done) -k gpu
}
# Issue 6's two training configs; the DLRM loop timed in its parts (scripts/loop_parts.py: steps 60-119), the MoE
# loop by its intervals of 20 steps ending at steps 40 and 60 (scripts/step_times.py): logged every 20 steps, as
# the loop runs by default (logging every step would sync the host with the GPU at every step's loss check).
DLRM="model=dlrm_paper trainer.max_steps=150 trainer.log_every=50 trainer.eval_every=150 trainer.checkpoint_every=0 trainer.progress=false"
MOE="model=moe_transformer_finegrained model.precision=bf16 trainer.max_steps=60 trainer.log_every=20 trainer.eval_every=60 trainer.checkpoint_every=0 trainer.progress=false"
runs() {
  R 200 bench_embedding -m fused_dlrm.bench embedding --out $OUT/bench_embedding.json
  R 60 bench_embedding_nvshmem -m fused_dlrm.bench embedding --quick --transport nvshmem --out $OUT/bench_nvshmem.json
  R 450 bench_moe -m moe.bench --iters 10 --out $OUT/bench_moe.json  # three fused layers (two dispatches, two combines)
  R 200 bench_tp -m fused_dlrm.bench tp --out $OUT/bench_tp.json
  # torchrec's own sharder against ours under DMP + TrainPipelineSparseDist; torchrec's row needs fbgemm-gpu's
  # CUDA build (../shared/GPU.md), else it says why and is left out. That wheel (465 MB) fits no single call:
  # `split -b 58m` it locally, carry one part per call and copy it to a folder outside the tree while the
  # machine stays warm; FBGEMM_PARTS=that folder joins them and installs the CUDA build into a target of its
  # own, ahead of /tmp/site for this step only. With `train` in the same call, issue 6's torchrec ratio: its
  # step here against the fused dlrm loop's.
  if want bench_dlrm_step && [ -n "${FBGEMM_PARTS:-}" ] && [ ! -d /tmp/site_fbgemm_cuda/torchrec ]; then
    mkdir -p /tmp/wheels_fbgemm_cuda && cp .whl/*.whl /tmp/wheels_fbgemm_cuda/ && rm -f /tmp/wheels_fbgemm_cuda/fbgemm_gpu_cpu-*
    cat "$FBGEMM_PARTS"/part* > /tmp/wheels_fbgemm_cuda/fbgemm_gpu-1.6.0-cp312-cp312-manylinux_2_28_x86_64.whl
    PYTHONPATH= python3 scripts/setup_env.py --wheels /tmp/wheels_fbgemm_cuda --target /tmp/site_fbgemm_cuda \
      > $OUT/setup_fbgemm_cuda.log 2>&1 || tail -5 $OUT/setup_fbgemm_cuda.log
  fi
  PYTHONPATH=$( [ -d /tmp/site_fbgemm_cuda/torchrec ] && echo /tmp/site_fbgemm_cuda: )$PYTHONPATH \
    R 300 bench_dlrm_step -m fused_dlrm.bench dlrm_step --out $OUT/bench_dlrm_step.json
  # DLRM in pairs, one of each order (the host's speed moves between runs by more than a ratio's last digit)
  for run in 1_bulk 1_fused 2_fused 2_bulk; do
    STEP=train R 120 dlrm_$run scripts/loop_parts.py comm=${run#*_} $DLRM hydra.run.dir=$OUT/dlrm_$run
  done
  for c in bulk fused; do
    STEP=train R 180 moe_$c train.py comm=$c $MOE hydra.run.dir=$OUT/moe_$c
  done
}
if [ "$RUN_GPUS" != "$TEST_GPUS" ]; then tests & runs; wait; else tests; runs; fi
for f in $OUT/test_*.log; do [ -e "$f" ] || continue; echo "== $(basename $f)"; grep -E "PASSED|FAILED|ERROR|rc=" $f | cut -c1-160; done
for f in bench_embedding bench_embedding_nvshmem bench_moe bench_tp bench_dlrm_step; do
  [ -e $OUT/$f.log ] || continue; echo "== $f"; grep -vE "Warning|warn|^\s*$" $OUT/$f.log | tail -14
done
for run in 1_bulk 1_fused 2_fused 2_bulk; do
  [ -e $OUT/dlrm_$run.log ] && { echo "== dlrm $run"; grep -E "== rank|step (100|150) |auc|Error" $OUT/dlrm_$run.log | cut -c1-520; }
done
step_ms() { grep -hoE "step 150 loss [0-9.]+ step_ms [0-9.]+" $OUT/dlrm_$1.log 2>/dev/null | awk '{print $NF}'; }
for pair in 1 2; do
  bulk=$(step_ms ${pair}_bulk) fused=$(step_ms ${pair}_fused)
  [ -n "$bulk" ] && [ -n "$fused" ] && echo "DLRM pair $pair: bulk / fused step_ms at step 150 = $bulk / $fused = $(awk "BEGIN {printf \"%.2fx\", $bulk / $fused}")"
done
for c in bulk fused; do
  [ -e $OUT/moe_$c.log ] && { echo "== moe $c"; grep -E "step (20|60) |Error" $OUT/moe_$c.log | cut -c1-160
    python3 scripts/step_times.py $OUT/moe_$c --from 21
    echo "dispatched again: $(grep -c outgrew $OUT/moe_$c.log), symmetric buffers grown: $(grep -c 'INFO.*symmetric buffer' $OUT/moe_$c.log)"; }
done
exit 0
