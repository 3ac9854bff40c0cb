#!/usr/bin/env bash
# The GPU checks and timings behind docs/benchmarks.md, on a 2-GPU machine with the wheels of
# ../shared/tools/gpu-wheels.sh in .whl/: set-up (offline), GPU tests, embedding benchmark, DLRM bulk vs fused.
# Results go to $OUT (default ./gpu_out).
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 scripts/setup_env.py --wheels .whl --target /tmp/site > $OUT/setup.log 2>&1 || { tail -20 $OUT/setup.log; exit 1; }
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests
timeout 200 python3 -m pytest -q tests/test_fused_embedding_gpu.py tests/test_embedding_backward_kernel.py tests/test_training.py -k "gpu or fused or backward or torchrun" -p no:warnings > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log
timeout 150 torchrun --nproc_per_node=2 --standalone -m fused_dlrm.bench embedding --out $OUT/bench.json > $OUT/bench.log 2>&1; grep -A6 "copy" $OUT/bench.log
T="model.num_rows=100000 model.embedding_dim=64 model.dense_arch=[512,256,64] model.over_arch=[512,256,1] data.global_batch_size=8192 data.train.mean_pooling=10 trainer.max_steps=300 trainer.log_every=50 trainer.eval_every=300 trainer.checkpoint_every=0 trainer.progress=false"
for c in bulk fused; do timeout 90 torchrun --nproc_per_node=2 --standalone train.py comm=$c $T hydra.run.dir=$OUT/train_$c > $OUT/train_$c.log 2>&1; echo "== $c"; grep -E "step (250|300) |auc|Error" $OUT/train_$c.log | tail -4; done
