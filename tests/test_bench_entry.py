"""The GPU benchmarks' entry points: without CUDA GPUs they say so (not torch's missing `_cuda_setDevice`), and the
TP bench refuses a section it does not have before anything runs."""

import pytest
import torch

from fused_dlrm.bench import embedding, init_gpu_world, tp
from moe import bench as moe_bench


@pytest.mark.parametrize("main, command", [(embedding.main, "python -m fused_dlrm.bench embedding"),
                                           (tp.main, "python -m fused_dlrm.bench tp"),
                                           (moe_bench.main, "python -m moe.bench")])
def test_without_gpus_the_benches_exit_saying_so(monkeypatch, main, command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=rf"^{command} times GPU kernels against NCCL: it needs CUDA GPUs"):
        main(["--quick"])


def test_init_gpu_world_names_the_command(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="^my bench times GPU kernels"):
        init_gpu_world("my bench")


def test_tp_bench_refuses_an_unknown_section(capsys):
    with pytest.raises(SystemExit):
        tp.main(["--sections", "allreduce,gemm_all_reduce"])
    assert "--sections: unknown ['gemm_all_reduce']; the sections: ['gemm_allreduce', 'allgather_gemm', " \
           "'allreduce']" in capsys.readouterr().err
