"""Tests for scripts/setup_env.py: pairing table, planning (online and offline), CLI errors.

No network and no real installs: pip is never run (dry runs, or subprocess.run patched
to refuse pip commands).
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "scripts" / "setup_env.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("setup_env", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while the class is built
    spec.loader.exec_module(module)
    return module


se = _load_script()

CPU_WHEEL = "fbgemm_gpu_cpu-{}-cp311-cp311-manylinux_2_28_x86_64.whl"
GPU_WHEEL = "fbgemm_gpu-{}-cp311-cp311-manylinux_2_28_x86_64.whl"


# --------------------------------------------------------------------------- pairing table


@pytest.mark.parametrize(
    "torch_version, fbgemm_version, torchrec_version",
    [
        ("2.11.0", "1.6.0", "1.6.1"),
        ("2.12.0", "1.7.0", "1.7.0"),
        ("2.13.0", "1.8.0", "1.8.0"),
        ("2.14.0", "1.9.0", "1.9.0"),
    ],
)
@pytest.mark.parametrize("cuda, package", [(True, "fbgemm-gpu"), (False, "fbgemm-gpu-cpu")])
def test_pairing_table(torch_version, fbgemm_version, torchrec_version, cuda, package):
    assert se.pairing_for(torch_version, cuda, "auto") == se.Pairing(package, fbgemm_version, torchrec_version)


@pytest.mark.parametrize(
    "torch_version, cuda, expected",
    [
        ("2.13.0+cpu", False, ("fbgemm-gpu-cpu", "1.8.0", "1.8.0")),
        ("2.11.0+cu130", True, ("fbgemm-gpu", "1.6.0", "1.6.1")),
        ("2.13.1", False, ("fbgemm-gpu-cpu", "1.8.0", "1.8.0")),
        ("2.13.1", True, ("fbgemm-gpu", "1.8.0", "1.8.0")),
        ("2.12.0a0+git1234abc", True, ("fbgemm-gpu", "1.7.0", "1.7.0")),
    ],
)
def test_pairing_version_strings(torch_version, cuda, expected):
    assert se.pairing_for(torch_version, cuda) == se.Pairing(*expected)


def test_fbgemm_override():
    assert se.pairing_for("2.13.0+cpu", False, "gpu").fbgemm_package == "fbgemm-gpu"
    assert se.pairing_for("2.11.0+cu130", True, "cpu").fbgemm_package == "fbgemm-gpu-cpu"
    assert se.pairing_for("2.11.0+cu130", True, "cpu").fbgemm_version == "1.6.0"


@pytest.mark.parametrize("torch_version", ["2.10.0", "3.0.0", "2.1.0", "nonsense"])
def test_unsupported_torch_lists_supported_versions(torch_version):
    with pytest.raises(se.UnsupportedTorch) as info:
        se.pairing_for(torch_version, True)
    message = str(info.value)
    assert torch_version in message
    assert "2.11, 2.12, 2.13, 2.14" in message


# --------------------------------------------------------------------------- offline fallback


def _wheels(tmp_path, *names):
    for name in names:
        (tmp_path / name).write_bytes(b"")
    return tmp_path


def test_offline_gpu_wheel_present_is_kept(tmp_path):
    wheels = _wheels(tmp_path, GPU_WHEEL.format("1.8.0"), CPU_WHEEL.format("1.8.0"))
    pairing = se.Pairing("fbgemm-gpu", "1.8.0", "1.8.0")
    assert se.offline_fbgemm(pairing, wheels, allow_cpu_fallback=True) == (pairing, None)


def test_offline_falls_back_to_cpu_wheel_with_warning(tmp_path):
    wheels = _wheels(tmp_path, CPU_WHEEL.format("1.8.0"), "torchrec-1.8.0-py311-none-any.whl")
    pairing, warning = se.offline_fbgemm(
        se.Pairing("fbgemm-gpu", "1.8.0", "1.8.0"), wheels, allow_cpu_fallback=True
    )
    assert pairing == se.Pairing("fbgemm-gpu-cpu", "1.8.0", "1.8.0")
    assert "WARNING" in warning and "fbgemm-gpu-cpu" in warning and "torchrec import" in warning


def test_offline_cpu_wheel_of_wrong_version_is_not_used(tmp_path):
    wheels = _wheels(tmp_path, CPU_WHEEL.format("1.7.0"))
    with pytest.raises(se.SetupError, match="no fbgemm-gpu 1.8.0 wheel"):
        se.offline_fbgemm(se.Pairing("fbgemm-gpu", "1.8.0", "1.8.0"), wheels, allow_cpu_fallback=True)


def test_offline_no_fallback_when_gpu_was_asked_for(tmp_path):
    wheels = _wheels(tmp_path, CPU_WHEEL.format("1.8.0"))
    with pytest.raises(se.SetupError, match="no fbgemm-gpu 1.8.0 wheel"):
        se.offline_fbgemm(se.Pairing("fbgemm-gpu", "1.8.0", "1.8.0"), wheels, allow_cpu_fallback=False)


@pytest.mark.parametrize(
    "req, version, ok",
    [
        ("hydra-core>=1.3", "1.3.8", True),
        ("hydra-core>=1.3", "1.2.0", False),
        ("hydra-core>=1.3", None, False),
        ("tensordict", "0.15.3", True),
        ("tensordict", None, False),
        ("fbgemm-gpu==1.6.0", "1.6.0+cu130", True),  # local tag ignored
        ("fbgemm-gpu==1.6.0", "1.7.0", False),
        ("tqdm; python_version < '3'", None, True),  # marker does not apply here: nothing needed
    ],
)
def test_satisfies(req, version, ok):
    assert se.satisfies(req, version) is ok


def test_wheel_in_folder_name_matching(tmp_path):
    wheels = _wheels(tmp_path, CPU_WHEEL.format("1.8.0"), "fbgemm_gpu-1.6.0+cu130-cp311-cp311-linux_x86_64.whl")
    assert se.wheel_in_folder(wheels, "fbgemm-gpu-cpu", "1.8.0")
    assert not se.wheel_in_folder(wheels, "fbgemm-gpu", "1.8.0")  # the cpu wheel is not the gpu one
    assert se.wheel_in_folder(wheels, "fbgemm-gpu", "1.6.0")  # local tag ignored


# --------------------------------------------------------------------------- plan_commands

_, PROJECT_REQS = se.project_requirements(test=True)
EVERYTHING = {
    "fbgemm-gpu-cpu": "1.8.0",
    "torchrec": "1.8.0",
    "tensordict": "0.15.3",
    "pyre-extensions": "0.0.32",
    "iopath": "0.1.10",
    "matplotlib": "3.10.0",
    **{se.canon(se.requirement_name(r)): "1.0" for r in PROJECT_REQS},
}
CPU_18 = se.Pairing("fbgemm-gpu-cpu", "1.8.0", "1.8.0")


def _opts(tmp_path, **kw):
    return se.Options(python="PY", workdir=tmp_path, **kw)


def _state(versions, triton_ok=True, project_editable=True):
    return se.EnvState({se.canon(k): v for k, v in versions.items()}, triton_ok, project_editable)


def _installs(cmds):
    return [c for c in cmds if c[:4] == ["PY", "-m", "pip", "install"]]


def test_plan_nothing_to_do_when_all_installed(tmp_path):
    opts = _opts(tmp_path, test=True)
    assert se.plan_commands(CPU_18, _state(EVERYTHING), opts, tmp_path / "c.txt") == []


def test_plan_fresh_environment(tmp_path):
    opts = _opts(tmp_path, test=True)
    c = str(tmp_path / "c.txt")
    cmds = se.plan_commands(CPU_18, _state({}, triton_ok=False, project_editable=False), opts, Path(c))
    assert cmds == [
        ["PY", "-m", "pip", "install", "--no-deps", "fbgemm-gpu-cpu==1.8.0"],
        ["PY", "-m", "pip", "install", "--no-deps", "torchrec==1.8.0"],
        ["PY", "-m", "pip", "install", "-c", c, "tensordict", "pyre-extensions", "iopath"],
        ["PY", "-m", "pip", "install", "-c", c, "triton==3.6.0"],
        ["PY", "-m", "pip", "install", "-c", c, "-e", f"{REPO_ROOT}[test]"],
        ["PY", "-m", "pip", "install", "-c", c, "matplotlib"],
    ]


def test_plan_never_lets_pip_resolve_without_the_torch_constraint(tmp_path):
    for opts in (_opts(tmp_path), _opts(tmp_path, target=tmp_path / "t")):
        cmds = se.plan_commands(CPU_18, _state({}, triton_ok=False, project_editable=False), opts, tmp_path / "c.txt")
        for cmd in _installs(cmds):
            assert "--no-deps" in cmd or "-c" in cmd, cmd
            assert not any(arg.startswith("torch==") for arg in cmd), cmd


def test_plan_skips_right_versions_and_reinstalls_wrong_ones(tmp_path):
    versions = {**EVERYTHING, "torchrec": "1.7.0", "fbgemm-gpu-cpu": "1.8.0+cpu"}
    cmds = se.plan_commands(CPU_18, _state(versions), _opts(tmp_path, test=True), tmp_path / "c.txt")
    assert cmds == [["PY", "-m", "pip", "install", "--no-deps", "torchrec==1.8.0"]]


def test_plan_removes_other_fbgemm_variant_first(tmp_path):
    pairing = se.Pairing("fbgemm-gpu", "1.8.0", "1.8.0")
    cmds = se.plan_commands(pairing, _state(EVERYTHING), _opts(tmp_path, test=True), tmp_path / "c.txt")
    assert cmds == [
        ["PY", "-m", "pip", "uninstall", "-y", "fbgemm-gpu-cpu"],
        ["PY", "-m", "pip", "install", "--no-deps", "fbgemm-gpu==1.8.0"],
    ]


def test_plan_project_not_installed_or_dep_missing(tmp_path):
    c = tmp_path / "c.txt"
    opts = _opts(tmp_path)
    editable = ["PY", "-m", "pip", "install", "-c", str(c), "-e", str(REPO_ROOT)]
    assert se.plan_commands(CPU_18, _state(EVERYTHING, project_editable=False), opts, c) == [editable]
    no_tqdm = {k: v for k, v in EVERYTHING.items() if k != "tqdm"}
    assert se.plan_commands(CPU_18, _state(no_tqdm), opts, c) == [editable]


# --------------------------------------------------------------------------- offline plan

# The wheel folder of the GPU image bug report (torch 2.11.0+cu130, Python 3.12).
IMAGE_WHEELS = [
    "antlr4_python3_runtime-4.9.3-py3-none-any.whl",
    "fbgemm_gpu_cpu-1.6.0-cp312-cp312-manylinux_2_28_x86_64.whl",
    "hydra_core-1.3.8-py3-none-any.whl",
    "iopath-0.1.9-py3-none-any.whl",
    "omegaconf-2.3.1-py3-none-any.whl",
    "pyvers-0.2.3-py3-none-any.whl",
    "tensordict-0.15.3-py3-none-any.whl",
    "torchrec-1.6.1-py312-none-any.whl",
]
# What that image has of what the plan looks at (numpy, pyyaml, ... it has too).
IMAGE_VERSIONS = {"numpy": "2.1.2", "pyre-extensions": "0.0.32", "torchmetrics": "1.8.2", "tqdm": "4.67.1", "pytest": "8.4.1"}
CPU_16 = se.Pairing("fbgemm-gpu-cpu", "1.6.0", "1.6.1")
# ... and after the offline install.
IMAGE_DONE = {**IMAGE_VERSIONS, "fbgemm-gpu-cpu": "1.6.0", "torchrec": "1.6.1", "tensordict": "0.15.3",
              "pyvers": "0.2.3", "iopath": "0.1.9", "hydra-core": "1.3.8", "omegaconf": "2.3.1",
              "antlr4-python3-runtime": "4.9.3"}
OFFLINE_ORDER = [
    "fbgemm-gpu-cpu==1.6.0", "torchrec==1.6.1",
    "tensordict", "pyvers", "iopath", "hydra-core>=1.3", "omegaconf", "antlr4-python3-runtime",
]


def _offline_opts(tmp_path, wheels=IMAGE_WHEELS, **kw):
    folder = tmp_path / "wh"
    folder.mkdir(exist_ok=True)
    _wheels(folder, *wheels)
    return _opts(tmp_path, wheels=folder, **kw)


def test_plan_offline_gpu_image(tmp_path):
    """The bug report's case: one pip call, --no-deps, nothing resolved, nothing pinned."""
    target = tmp_path / "site"
    opts = _offline_opts(tmp_path, target=target, test=True)
    cmds = se.plan_commands(CPU_16, _state(IMAGE_VERSIONS, project_editable=False), opts, None)
    assert cmds == [
        ["PY", "-m", "pip", "install", "--no-index", "--find-links", str(opts.wheels),
         "--no-deps", "--target", str(target), "--upgrade", *OFFLINE_ORDER],
    ]


@pytest.mark.parametrize("target", [False, True])
def test_plan_offline_every_install_is_no_deps_and_no_index(tmp_path, target):
    wheels = [*IMAGE_WHEELS, "triton-3.6.0-cp312-cp312-manylinux_2_27_x86_64.whl",
              "pyre_extensions-0.0.32-py3-none-any.whl", "torchmetrics-1.8.2-py3-none-any.whl",
              "tqdm-4.67.1-py3-none-any.whl", "pytest-8.4.1-py3-none-any.whl",
              "numpy-2.1.2-cp312-cp312-manylinux_2_17_x86_64.whl"]
    opts = _offline_opts(tmp_path, wheels, test=True, target=tmp_path / "site" if target else None)
    cmds = se.plan_commands(CPU_16, _state({}, triton_ok=False, project_editable=False), opts, None)
    installs = _installs(cmds)
    assert installs and len(installs) == len(cmds)
    for cmd in installs:
        assert cmd[4:8] == ["--no-index", "--find-links", str(opts.wheels), "--no-deps"], cmd
        assert not {"-c", "--report", "--dry-run", "-r"} & set(cmd), cmd
    reqs = installs[0][installs[0].index("--upgrade") + 1:] if target else installs[0][8:]
    assert reqs == [*OFFLINE_ORDER[:2], "triton==3.6.0", *OFFLINE_ORDER[2:4], "pyre-extensions",
                    *OFFLINE_ORDER[4:], "torchmetrics>=1.0", "tqdm", "numpy", "pytest>=7"]
    # Without --target the project itself is installed last, editable, also without its deps.
    assert (installs[-1][8:] == ["-e", str(REPO_ROOT)]) is not target


def test_plan_offline_skips_what_is_installed_and_upgrades_what_is_too_old(tmp_path):
    opts = _offline_opts(tmp_path, target=tmp_path / "site", test=True)
    assert se.plan_commands(CPU_16, _state(IMAGE_DONE), opts, None) == []
    too_old = {**IMAGE_DONE, "hydra-core": "1.2.0", "torchrec": "1.5.0"}
    (cmd,) = se.plan_commands(CPU_16, _state(too_old), opts, None)
    assert cmd[cmd.index("--upgrade") + 1:] == ["torchrec==1.6.1", "hydra-core>=1.3"]


def test_plan_offline_missing_wheels_named_in_one_error(tmp_path):
    wheels = [w for w in IMAGE_WHEELS if not w.startswith(("pyvers", "omegaconf"))]
    wheels.append("hydra_core-1.2.0-py3-none-any.whl")  # too old for hydra-core>=1.3
    wheels.remove("hydra_core-1.3.8-py3-none-any.whl")
    opts = _offline_opts(tmp_path, wheels, target=tmp_path / "site")
    with pytest.raises(se.SetupError) as info:
        se.plan_commands(CPU_16, _state(IMAGE_VERSIONS), opts, None)
    message = str(info.value)
    assert f"no wheel in {opts.wheels} for: pyvers, hydra-core>=1.3, omegaconf;" in message
    assert "pip wheel --no-deps -w" in message


def test_plan_target_mode(tmp_path):
    target = tmp_path / "site"
    opts = _opts(tmp_path, target=target, test=True)
    c = str(tmp_path / "c.txt")
    versions = {k: v for k, v in EVERYTHING.items() if k not in ("torchrec", "iopath", "hydra-core")}
    cmds = se.plan_commands(CPU_18, _state(versions, project_editable=False), opts, Path(c))
    report = tmp_path / "torchrec-deps-report.json"
    project_report = tmp_path / "project-deps-report.json"
    hydra_req = next(r for r in PROJECT_REQS if r.startswith("hydra-core"))
    iopath_req = next(r for r in PROJECT_REQS if r.startswith("iopath"))
    assert cmds == [
        ["PY", "-m", "pip", "install", "--no-deps", "--target", str(target), "--upgrade", "torchrec==1.8.0"],
        ["PY", "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report), "-c", c, "iopath"],
        ["PY", "-m", "pip", "install", "--no-deps", "--target", str(target), "--upgrade", "-r", str(report.with_suffix(".txt"))],
        ["PY", "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(project_report), "-c", c, hydra_req, iopath_req],
        ["PY", "-m", "pip", "install", "--no-deps", "--target", str(target), "--upgrade", "-r", str(project_report.with_suffix(".txt"))],
    ]
    assert not any("-e" in cmd for cmd in cmds)  # the project is used from the repo root


def test_report_to_requirements(tmp_path):
    report = tmp_path / "r-report.json"
    report.write_text(json.dumps({"install": [{"metadata": {"name": "iopath", "version": "0.1.10"}},
                                              {"metadata": {"name": "portalocker", "version": "4.4.2"}}]}))
    assert se.write_requirements_from_report(report, torch_pinned=True) == ["iopath==0.1.10", "portalocker==4.4.2"]
    assert (tmp_path / "r-report.txt").read_text() == "iopath==0.1.10\nportalocker==4.4.2\n"
    report.write_text(json.dumps({"install": [{"metadata": {"name": "torch", "version": "2.13.0"}}]}))
    with pytest.raises(se.SetupError, match="refusing"):
        se.write_requirements_from_report(report, torch_pinned=True)


# --------------------------------------------------------------------------- main()


@pytest.fixture
def no_pip(monkeypatch):
    """Fail the test if anything tries to run pip."""
    real_run = subprocess.run

    def guarded_run(cmd, *args, **kwargs):
        assert "pip" not in cmd, f"pip was run: {cmd}"
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(se.subprocess, "run", guarded_run)


@pytest.fixture
def fake_env(monkeypatch):
    """A controlled environment: torch probe, installed versions and triton are injected."""

    def install(torch=("2.13.0+cpu", False), versions=None, triton_ok=True):
        versions = {se.canon(k): v for k, v in (EVERYTHING if versions is None else versions).items()}
        # (version, cuda[, version pip sees]): pip sees torch.__version__ unless told otherwise
        torch_info = se.TorchInfo(*torch, *torch[:1] * (len(torch) == 2)) if torch else None
        monkeypatch.setattr(se, "probe_torch", lambda python, env: torch_info)
        monkeypatch.setattr(se, "installed_version", lambda name, path=None: versions.get(se.canon(name)))
        monkeypatch.setattr(se, "probe_triton", lambda python, env: triton_ok)
        monkeypatch.setattr(se, "project_is_editable", lambda name: True)

    return install


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch installed")
def test_main_dry_run_on_this_machine(capsys, no_pip):
    assert se.main(["--dry-run", "--test"]) == 0
    out = capsys.readouterr().out
    assert "plan" in out and "summary:" in out
    assert "torch is not installed" not in out
    # torch only appears pinned in the constraints file, never as something to install
    plan_lines = [line for line in out.splitlines() if "-m pip" in line]
    assert not any(" torch==" in line for line in plan_lines)
    assert all("--no-deps" in line or " -c " in line for line in plan_lines if " install " in line)


def test_main_unsupported_torch_exits_with_message(capsys, no_pip, fake_env):
    fake_env(torch=("2.10.0+cu128", True))
    assert se.main([]) == 1  # not even a dry run: nothing may be installed before failing
    captured = capsys.readouterr()
    assert "torch 2.10.0+cu128 is not supported" in captured.err
    assert "2.11, 2.12, 2.13, 2.14" in captured.err
    assert "Traceback" not in captured.err + captured.out


def test_script_unsupported_torch_exit_code(tmp_path):
    """Same through the real command line: non-zero exit, one line, no traceback."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = '3.0.0'\nclass version:\n    cuda = None\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], env=env, capture_output=True, text=True)
    assert proc.returncode == 1
    assert "torch 3.0.0 is not supported" in proc.stderr and "2.11, 2.12, 2.13, 2.14" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_main_all_installed_runs_nothing(capsys, no_pip, fake_env):
    fake_env()
    assert se.main(["--test"]) == 0  # real (non-dry) run: must not call pip
    out = capsys.readouterr().out
    assert "ran 0 command(s)" in out
    assert "fbgemm-gpu-cpu==1.8.0" in out and "torchrec==1.8.0" in out and "2.13.0+cpu (cpu)" in out


def test_main_torch_missing_dry_run_plans_torch_install(capsys, no_pip, fake_env):
    fake_env(torch=None, versions={})
    assert se.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would install torch==2.13.0" in out
    assert "-m pip install torch==2.13.0" in out


def test_main_broken_torch_is_not_replaced(capsys, no_pip, fake_env, monkeypatch):
    fake_env(torch=None, versions={"torch": "2.11.0+cu130"})
    monkeypatch.setattr(se, "probe_torch_error", lambda python, env: "ImportError: libcudart.so.13")
    assert se.main([]) == 1
    err = capsys.readouterr().err
    assert "never replaces an installed torch" in err and "libcudart" in err


def test_main_offline_cuda_falls_back_to_cpu_fbgemm(tmp_path, capsys, no_pip, fake_env):
    wheels = _wheels(tmp_path, *IMAGE_WHEELS)
    fake_env(torch=("2.11.0+cu130", True), versions=IMAGE_VERSIONS)
    assert se.main(["--dry-run", "--wheels", str(wheels), "--target", str(tmp_path / "site")]) == 0
    out = capsys.readouterr().out
    assert "WARNING: no fbgemm-gpu 1.6.0 wheel" in out
    args = ["--no-index", "--find-links", str(wheels), "--no-deps", "--target", str(tmp_path / "site"), "--upgrade"]
    assert se.show([*args, *OFFLINE_ORDER]) in out
    assert "constraints" not in out  # offline nothing resolves, so nothing is pinned
    assert "then an import check of: torch fbgemm_gpu torchrec" in out


def test_main_offline_runs_import_check(tmp_path, capsys, no_pip, fake_env, monkeypatch):
    """A real (non-dry) offline run with everything in place: no pip, but the import check."""
    fake_env(torch=("2.11.0+cu130", True, None), versions=IMAGE_DONE)  # pip cannot see this torch: fine offline
    monkeypatch.setattr(se, "VERIFY_MODULES", ["json", "no_such_module_xyz"])
    wheels = _wheels(tmp_path, *IMAGE_WHEELS)
    assert se.main(["--wheels", str(wheels), "--fbgemm", "cpu", "--target", str(tmp_path / "site")]) == 1
    err = capsys.readouterr().err
    assert "import check failed after the offline install" in err
    assert f"missing module 'no_such_module_xyz': add a no-such-module-xyz wheel to {wheels}" in err


def test_main_online_pins_the_version_pip_sees(capsys, no_pip, fake_env):
    no_tqdm = {k: v for k, v in EVERYTHING.items() if k != "tqdm"}
    fake_env(torch=("2.13.0+cpu", False, "2.13.0"), versions=no_tqdm)
    assert se.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "constraints.txt: torch==2.13.0\n" in out
    assert " -c " in out


def test_main_online_torch_invisible_to_pip_fails_clearly(capsys, no_pip, fake_env):
    no_tqdm = {k: v for k, v in EVERYTHING.items() if k != "tqdm"}
    fake_env(torch=("2.11.0+cu130", True, None), versions=no_tqdm)
    assert se.main(["--dry-run"]) == 1
    err = capsys.readouterr().err
    assert "pip sees no installed torch" in err and "--wheels DIR" in err
    fake_env(torch=("2.11.0+cu130", True, None))  # nothing to resolve: fine
    assert se.main(["--dry-run", "--test"]) == 0


def test_main_offline_explicit_gpu_without_wheel_fails(tmp_path, capsys, no_pip, fake_env):
    wheels = _wheels(tmp_path, CPU_WHEEL.format("1.6.0"))
    fake_env(torch=("2.11.0+cu130", True), versions={})
    assert se.main(["--dry-run", "--fbgemm", "gpu", "--wheels", str(wheels)]) == 1
    assert "no fbgemm-gpu 1.6.0 wheel" in capsys.readouterr().err


def test_main_target_prints_pythonpath(tmp_path, capsys, no_pip, fake_env):
    fake_env()
    assert se.main(["--dry-run", "--target", str(tmp_path / "site")]) == 0
    out = capsys.readouterr().out
    assert f"export PYTHONPATH={tmp_path / 'site'}:{REPO_ROOT}" in out


# --------------------------------------------------------------------------- import check


def test_verify_imports_real_interpreter(tmp_path, capsys, no_pip, monkeypatch):
    """Real subprocess: a module that is absent, one whose dependency is absent, one that is broken."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "needs_dep_xyz.py").write_text("import absent_dep_xyz\n")
    (site / "broken_xyz.py").write_text("raise RuntimeError('boom')\n")
    opts = se.Options(python=sys.executable, wheels=tmp_path / "wh", target=site)
    monkeypatch.setattr(se, "VERIFY_MODULES", ["json", "needs_dep_xyz", "absent_xyz", "broken_xyz"])
    with pytest.raises(se.SetupError) as info:
        se.verify_imports(opts, se.pip_env(opts), CPU_16)  # --target dir is on PYTHONPATH
    message = str(info.value)
    assert "import json" not in message
    assert "import needs_dep_xyz: ModuleNotFoundError: No module named 'absent_dep_xyz'" in message
    assert f"missing module 'absent_dep_xyz': add a absent-dep-xyz wheel to {tmp_path / 'wh'}" in message
    assert "missing module 'absent_xyz'" in message
    assert "import broken_xyz: RuntimeError: boom" in message
    assert "missing module 'broken_xyz'" not in message  # present but broken: no wheel to add

    monkeypatch.setattr(se, "VERIFY_MODULES", ["json", "needs_dep_xyz"])
    (site / "absent_dep_xyz.py").write_text("")
    se.verify_imports(opts, se.pip_env(opts), CPU_16)
    assert "import check: json needs_dep_xyz ok" in capsys.readouterr().out


def test_verify_imports_names_the_wheel(tmp_path, monkeypatch):
    failures = [
        ["hydra", "ModuleNotFoundError: No module named 'hydra'", "hydra"],
        ["torchrec", "ModuleNotFoundError: No module named 'fbgemm_gpu'", "fbgemm_gpu"],
        ["fbgemm_gpu", "ModuleNotFoundError: No module named 'fbgemm_gpu'", "fbgemm_gpu"],
        ["torchmetrics", "ModuleNotFoundError: No module named 'lightning_utilities'", "lightning_utilities"],
    ]
    done = subprocess.CompletedProcess([], 0, stdout=json.dumps(failures) + "\n", stderr="")
    monkeypatch.setattr(se.subprocess, "run", lambda *a, **kw: done)
    opts = se.Options(python="PY", wheels=tmp_path)
    with pytest.raises(se.SetupError) as info:
        se.verify_imports(opts, {}, CPU_16)
    lines = str(info.value).splitlines()
    assert lines[-3:] == [
        f"  missing module 'hydra': add a hydra-core wheel to {tmp_path} and re-run",
        f"  missing module 'fbgemm_gpu': add a fbgemm-gpu-cpu wheel to {tmp_path} and re-run",
        f"  missing module 'lightning_utilities': add a lightning-utilities wheel to {tmp_path} and re-run",
    ]


def test_plan_offline_matplotlib_only_with_its_wheels(tmp_path, capsys):
    """matplotlib is optional offline: installed (no deps resolved) when the folder has its wheels, else a warning."""
    opts = _offline_opts(tmp_path, target=tmp_path / "site", test=True)
    assert se.plan_commands(CPU_16, _state(IMAGE_DONE), opts, None) == []
    assert "matplotlib is not installed (optional" in capsys.readouterr().out
    has_numpy = {**IMAGE_DONE, "numpy": "2.3.0", "packaging": "25.0", "six": "1.17.0", "python-dateutil": "2.9.0"}
    _wheels(opts.wheels, "pyparsing-3.2.5-py3-none-any.whl", "cycler-0.12.1-py3-none-any.whl",
            "kiwisolver-1.4.9-cp312-cp312-manylinux_2_17_x86_64.whl", "fonttools-4.60.1-py3-none-any.whl",
            "pillow-12.0.0-cp312-cp312-manylinux_2_27_x86_64.whl",
            "contourpy-1.3.3-cp312-cp312-manylinux_2_27_x86_64.whl",
            "matplotlib-3.10.7-cp312-cp312-manylinux_2_27_x86_64.whl")
    (cmd,) = se.plan_commands(CPU_16, _state(has_numpy), opts, None)
    assert "--no-deps" in cmd and cmd[cmd.index("--upgrade") + 1:] == [
        "pyparsing", "cycler", "kiwisolver", "fonttools", "pillow", "contourpy", "matplotlib"]
