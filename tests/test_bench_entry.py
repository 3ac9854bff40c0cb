"""The GPU benchmarks' entry points: without CUDA GPUs they say so (not torch's missing `_cuda_setDevice`), and the
TP bench refuses a section it does not have before anything runs, and every bench an --out rank 0 cannot write."""

import re
from pathlib import Path

import pytest
import torch

from fused_dlrm.bench import embedding, init_gpu_world, tp
from moe import bench as moe_bench
from world import run_world


@pytest.mark.parametrize("main, command", [(embedding.main, "python -m fused_dlrm.bench embedding"),
                                           (tp.main, "python -m fused_dlrm.bench tp"),
                                           (moe_bench.main, "python -m moe.bench")])
def test_without_gpus_the_benches_exit_saying_so(monkeypatch, main, command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=rf"^{command} times GPU kernels against NCCL: it needs CUDA GPUs"):
        main(["--quick"])


@pytest.mark.parametrize("count", ["0", "-3"])
def test_embedding_bench_refuses_a_bad_program_count_before_it_starts(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # reaching the GPU check would exit otherwise
    with pytest.raises(ValueError, match=rf"^comm.num_programs={count}: expected a whole number >= 1"):
        embedding.main(["--quick", "--num-programs", count])


def test_init_gpu_world_names_the_command(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="^my bench times GPU kernels"):
        init_gpu_world("my bench")


def test_tp_bench_refuses_an_unknown_section(capsys):
    with pytest.raises(SystemExit):
        tp.main(["--sections", "allreduce,gemm_all_reduce"])
    assert "--sections: unknown ['gemm_all_reduce']; the sections: ['gemm_allreduce', 'allgather_gemm', " \
           "'allreduce']" in capsys.readouterr().err


def _a_bad_out_stops_every_rank(rank: int, world: int, tmp: str) -> None:
    import importlib

    from fused_dlrm.bench import dlrm_step
    from fused_dlrm.dist import DistEnv
    from test_bench_dlrm_step import TINY

    def ran(*args, **kwargs):
        raise AssertionError("the bench ran before its --out was found unwritable")
    out = Path(tmp) / "a_file" / "out.json"  # a_file is a file: rank 0 cannot write below it
    refused = rf"rank 1: rank\(s\) \[0\] cannot write --out {re.escape(str(out))}: NotADirectoryError"
    # the GPU benches on run_world's gloo world (no GPU here), everything after the check stood in for by `ran`
    for name, timed, argvs in (("fused_dlrm.bench.embedding", ["use_nvshmem_backend", "sweep_lookup", "hbm_bandwidth"],
                                [["--quick"], ["--sweep"]]),
                               ("fused_dlrm.bench.tp", [], [["--quick"]]),
                               ("moe.bench", ["run_config"], [["--quick"]])):
        module = importlib.import_module(name)
        module.init_gpu_world = lambda command: None
        for attribute in timed:
            setattr(module, attribute, ran)
        for section in getattr(module, "SECTIONS", {}).values():
            section.run = ran
        for argv in argvs:
            with pytest.raises(NotADirectoryError if rank == 0 else ValueError, match=None if rank == 0 else refused):
                module.main([*argv, "--out", str(out)])
    dlrm_step.run_suite = ran
    args = dlrm_step.parse_args(["--out", str(out), *TINY, "trainer.device=cpu"])
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    with pytest.raises(NotADirectoryError if rank == 0 else ValueError, match=None if rank == 0 else refused):
        dlrm_step.run(args, dlrm_step.config(args), env)


def test_an_out_file_rank_0_cannot_write_stops_every_rank_before_the_bench_runs(tmp_path):
    """--out is written by rank 0 after the whole run (minutes on GPUs): each bench tries it first, and where rank 0
    cannot write it every rank stops there (the others' error naming rank 0's), not rank 0 alone at the end."""
    (tmp_path / "a_file").write_text("not a directory")
    run_world(2, _a_bad_out_stops_every_rank, str(tmp_path), timeout=180)


@pytest.mark.parametrize("argv, named", [(["--iters", "0"], "--iters 0: expected a count >= 1"),
                                         (["--iters", "-2"], "--iters -2: expected a count >= 1"),
                                         (["--configs", "5"], "--configs 5: there are configs 1 to 4"),
                                         (["--quick", "--configs", "3"], "--configs 3: there are configs 1 to 2"),
                                         (["--configs", "1,,2"], "--configs 1,,2: there are configs 1 to 4"),
                                         (["--configs", "2,1,2"], "--configs 2,1,2: config 2 named twice"),
                                         (["--fused", "rows", "tokens", "rows"], "--fused: rows named twice")])
def test_moe_bench_refuses_bad_options_before_it_starts(monkeypatch, capsys, argv, named):
    """Before the GPUs are asked for (on GPUs --iters 0 ran every layer's warm-up, then failed in a median of no
    times; --configs 1,,2 in int(''))."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # reaching the GPU check would exit otherwise
    with pytest.raises(SystemExit) as exit_:
        moe_bench.main(argv)
    assert exit_.value.code == 2 and named in capsys.readouterr().err


def _each_bench_writes_its_environment(rank: int, world: int, tmp: str) -> None:
    import importlib
    import json

    from fused_dlrm.dist import DistEnv

    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    torch.cuda.get_device_name = lambda *device: "a GPU"
    embedding_result = {"config": "c", "num_programs": 1, "sol_ms": 1.0, "pct_sol": {"fused": 1.0},
                        "gathered_GBps": {"fused": 1.0, "lookup": 1.0},
                        "fwd_ms": {"torch": 1.0, "bulk": 1.0, "fused": 1.0, "lookup": 1.0},
                        "fwd_bwd_ms": {"bulk": 1.0, "fused": 1.0}, "fwd_host_start_ms": {"bulk": 1.0, "fused": 1.0},
                        "fwd_b2b_ms": {"bulk": 1.0, "fused": 1.0, "lookup": 1.0}}
    tp_row = {"op": "op", "shape": "s", "dtype": "bf16", "bulk_us": 1.0, "fused_us": 1.0, "baseline_name": None,
              "baseline_us": None, "speedup": 1.0, "sol_pct": 1.0}
    # the GPU benches on a gloo world, their timed parts stood in for by canned results
    stand_ins = {"fused_dlrm.bench.embedding": {"hbm_bandwidth": lambda: 1e12, "peer_bandwidth": lambda: 1e11,
                                                "run_config": lambda *args: embedding_result,
                                                "sweep_lookup": lambda *args: [{"ms": 1.0}]},
                 "fused_dlrm.bench.tp": {},
                 "moe.bench": {"run_config": lambda *args: {}, "table": lambda results: ""}}
    for name, argv in (("fused_dlrm.bench.embedding", ["--quick"]), ("fused_dlrm.bench.embedding", ["--sweep"]),
                       ("fused_dlrm.bench.tp", ["--quick"]), ("moe.bench", ["--quick"])):
        module = importlib.import_module(name)
        module.init_gpu_world = lambda command: env
        module.dist.destroy_process_group = lambda: None  # the world's own end destroys it
        for attribute, stand_in in stand_ins[name].items():
            setattr(module, attribute, stand_in)
        for section in getattr(module, "SECTIONS", {}).values():
            section.run = lambda quick: [tp_row]
        out = Path(tmp) / f"{name}{'_'.join(argv)}.json"
        module.main([*argv, "--out", str(out)])
        if rank == 0:
            environment = json.loads(out.read_text())["environment"]
            assert environment["machine"]["world_size"] == world, (name, argv)
            assert len(environment["commit"]) == 40 and environment["versions"]["torch"] == torch.__version__


def test_every_bench_writes_the_machine_commit_and_versions_it_ran_with(tmp_path):
    """As dlrm_step's and the report's JSON (report/render.environment): a number without its commit and versions
    cannot be compared with another run's."""
    run_world(2, _each_bench_writes_its_environment, str(tmp_path), timeout=180)


def test_tp_bench_refuses_a_section_named_twice(capsys):
    """Its rows would be timed and printed twice over."""
    with pytest.raises(SystemExit):
        tp.main(["--sections", "allreduce,allgather_gemm,allreduce"])
    assert "--sections: allreduce named twice" in capsys.readouterr().err
