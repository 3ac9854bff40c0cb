#!/usr/bin/env python3
"""Install the torch / fbgemm-gpu / torchrec stack and this project, without touching torch.

Run from anywhere (paths are resolved from this file's location), normally as

    python scripts/setup_env.py [--test] [--fbgemm {auto,gpu,cpu}] [--wheels DIR] [--target DIR] [--dry-run]

Stdlib only: it must run before torch is installed.  Every install goes through
``sys.executable -m pip``.

Why a script and not plain pyproject dependencies: fbgemm-gpu and torchrec are only
ABI-compatible with one torch minor version each, torchrec's metadata asks for the
wrong fbgemm package, and letting pip resolve them would happily replace the torch
already on a machine (GPU images ship a CUDA build that must stay).  So:

1. torch is installed (``torch==2.13.0``) only when ``import torch`` fails; a torch that
   is present is never replaced.
2. The fbgemm / torchrec releases are picked from PAIRINGS by the installed torch
   version; fbgemm-gpu (CUDA) or fbgemm-gpu-cpu follows the torch build.
3. fbgemm and torchrec go in with ``--no-deps``; online, every pip call that does resolve
   dependencies gets ``-c constraints.txt`` pinning torch to the version pip sees installed
   (its distribution metadata, which can differ from ``torch.__version__``).
4. Anything already installed at an acceptable version is skipped (a re-run does no pip call).

Offline (``--wheels DIR``): pip never resolves dependencies (a GPU image's pip refused
its own torch 2.11.0+cu130 against the torch pin).  fbgemm, torchrec and whatever of
OFFLINE_DEPS and the project's requirements is missing or too old go in with one
``pip install --no-index --find-links DIR --no-deps`` call, after checking that DIR has a
wheel for each; then the stack is imported in a fresh interpreter (VERIFY_MODULES), and a
module that is still missing is reported with the wheel to add.  pip only looks in DIR:
the pip config files and PIP_FIND_LINKS / PIP_INDEX_URL / PIP_EXTRA_INDEX_URL are
ignored, since pip would otherwise merge their links into the search.  Packages without
wheels on PyPI (iopath, antlr4-python3-runtime) are turned into wheels beforehand with
``pip wheel --no-deps -w DIR ...``.  ``pip install -e`` of the project (``--no-deps``) also
needs a setuptools>=64 wheel in DIR (pip builds it in an isolated environment).  If torch
itself is missing, it is installed from DIR with its dependencies resolved.

``--target DIR`` (read-only site-packages): packages go into DIR; nothing is written to
site-packages and the project is not installed (put the repo root on PYTHONPATH; the
script prints the line).  pip's ``--target`` ignores everything already installed, so
letting it resolve dependencies would copy a second torch into DIR that shadows the
real one.  Online, pip is therefore first asked (``--dry-run --report``, with DIR on
PYTHONPATH so it sees earlier runs) what the environment is missing, and exactly that list
is installed with ``--target DIR --no-deps``.  Needs pip >= 22.2.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import NamedTuple

REPO_ROOT = Path(__file__).resolve().parent.parent

# torch major.minor -> (fbgemm-gpu / fbgemm-gpu-cpu version, torchrec version)
PAIRINGS = {
    "2.11": ("1.6.0", "1.6.1"),
    "2.12": ("1.7.0", "1.7.0"),
    "2.13": ("1.8.0", "1.8.0"),
    "2.14": ("1.9.0", "1.9.0"),
}
DEFAULT_TORCH = "2.13.0"  # installed only when no torch imports at all
TRITON_PIN = "3.6.0"  # installed only when `import triton` fails
FBGEMM_GPU = "fbgemm-gpu"
FBGEMM_CPU = "fbgemm-gpu-cpu"
# torchrec imports these at runtime; torch does not bring them, and torchrec is installed
# with --no-deps (its metadata would pull fbgemm-gpu and an old torchmetrics pin).
TORCHREC_RUNTIME_DEPS = ["tensordict", "pyre-extensions", "iopath"]
# Offline everything goes in with --no-deps, so this is the dependency closure (beyond what
# the images ship) by hand, in install order; the project's requirements not listed here are
# appended.  verify_imports() catches what it misses.
OFFLINE_DEPS = [
    "tensordict", "pyvers",  # pyvers: tensordict's
    "pyre-extensions", "iopath",
    "hydra-core", "omegaconf", "antlr4-python3-runtime",  # hydra-core -> omegaconf -> antlr4
    "torchmetrics", "tqdm",
]
# report.png (python -m fused_dlrm.report) is drawn with matplotlib, which is optional: online it is installed when
# missing; offline only when the wheel folder has a wheel for it and for each of these (its dependency closure, in
# install order) that is missing, else a warning and the report writes report.md / report.json without the picture.
PLOT_DEPS = ["numpy", "packaging", "six", "python-dateutil", "pyparsing", "cycler", "kiwisolver", "fonttools",
             "pillow", "contourpy", "matplotlib"]
# Imported after an offline install to check the result.
VERIFY_MODULES = [
    "torch", "fbgemm_gpu", "torchrec", "hydra", "omegaconf", "torchmetrics", "tqdm", "tensordict", "iopath", "numpy",
]
# Import name -> distribution, where they differ by more than "_" vs "-" (for error messages).
MODULE_DISTRIBUTIONS = {"hydra": "hydra-core", "antlr4": "antlr4-python3-runtime", "yaml": "PyYAML"}


class SetupError(Exception):
    """A problem reported to the user as one clear message (no traceback)."""


class UnsupportedTorch(SetupError):
    pass


class Pairing(NamedTuple):
    fbgemm_package: str
    fbgemm_version: str
    torchrec_version: str


class TorchInfo(NamedTuple):
    version: str  # torch.__version__, e.g. "2.11.0+cu130"
    cuda: bool  # torch.version.cuda is not None
    dist_version: str | None  # the version pip sees (distribution metadata); None: pip cannot see torch


@dataclasses.dataclass
class Options:
    fbgemm: str = "auto"  # auto | gpu | cpu
    test: bool = False
    wheels: Path | None = None  # offline: install only from this folder
    target: Path | None = None  # pip --target instead of site-packages
    dry_run: bool = False
    workdir: Path = Path(tempfile.gettempdir())  # constraints / pip reports go here
    python: str = sys.executable


@dataclasses.dataclass
class EnvState:
    """What is already installed, as far as the plan cares."""

    versions: dict[str, str]  # canonical distribution name -> installed version
    triton_ok: bool  # `import triton` works
    project_editable: bool  # this repo is pip-installed in editable mode

    def version(self, name: str) -> str | None:
        return self.versions.get(canon(name))


# --------------------------------------------------------------------------- pairing


def supported_versions() -> str:
    return ", ".join(PAIRINGS)


def pairing_for(torch_version: str, cuda: bool, fbgemm: str = "auto") -> Pairing:
    """fbgemm / torchrec releases built for this torch; fbgemm is auto|gpu|cpu."""
    m = re.match(r"(\d+)\.(\d+)", torch_version)
    key = f"{m.group(1)}.{m.group(2)}" if m else None
    if key not in PAIRINGS:
        raise UnsupportedTorch(
            f"torch {torch_version} is not supported: fbgemm-gpu/torchrec releases are known only "
            f"for torch {supported_versions()} (edit PAIRINGS in scripts/setup_env.py to add one)"
        )
    if fbgemm not in ("auto", "gpu", "cpu"):
        raise ValueError(f"fbgemm must be auto, gpu or cpu, not {fbgemm!r}")
    use_gpu = cuda if fbgemm == "auto" else fbgemm == "gpu"
    fbgemm_version, torchrec_version = PAIRINGS[key]
    return Pairing(FBGEMM_GPU if use_gpu else FBGEMM_CPU, fbgemm_version, torchrec_version)


def offline_fbgemm(pairing: Pairing, wheels: Path, allow_cpu_fallback: bool) -> tuple[Pairing, str | None]:
    """Check the wheels folder has the fbgemm we picked; maybe fall back to the CPU wheel.

    Returns (pairing to use, warning or None).  The fallback is only taken when the choice
    was automatic: with an explicit --fbgemm gpu a missing wheel is an error.
    """
    if wheel_in_folder(wheels, pairing.fbgemm_package, pairing.fbgemm_version):
        return pairing, None
    if (
        pairing.fbgemm_package == FBGEMM_GPU
        and allow_cpu_fallback
        and wheel_in_folder(wheels, FBGEMM_CPU, pairing.fbgemm_version)
    ):
        warning = (
            f"WARNING: no {FBGEMM_GPU} {pairing.fbgemm_version} wheel in {wheels}; falling back to "
            f"{FBGEMM_CPU} {pairing.fbgemm_version}. It only lets torchrec import: fbgemm's CUDA "
            f"kernels (sharded embeddings on GPU) will not be available."
        )
        return pairing._replace(fbgemm_package=FBGEMM_CPU), warning
    raise SetupError(f"no {pairing.fbgemm_package} {pairing.fbgemm_version} wheel in {wheels}")


def wheel_versions(folder: Path, name: str) -> list[str]:
    """Versions of the wheels for distribution `name` in folder."""
    versions = []
    for path in folder.glob("*.whl"):
        # Wheel names are {distribution}-{version}(-{build})?-{python}-{abi}-{platform}.whl,
        # with "-" in the distribution name written as "_": fbgemm_gpu_cpu-1.8.0-cp311-...
        parts = path.name.split("-")
        if len(parts) >= 5 and canon(parts[0]) == canon(name):
            versions.append(parts[1])
    return versions


def wheel_in_folder(folder: Path, name: str, version: str) -> bool:
    """Is there a wheel for distribution `name` at `version` (local tag ignored) in folder?"""
    return version in map(public_version, wheel_versions(folder, name))


def canon(name: str) -> str:
    """PEP 503 normalised distribution name: Fbgemm_GPU.cpu -> fbgemm-gpu-cpu."""
    return re.sub(r"[-_.]+", "-", name).lower()


def public_version(version: str) -> str:
    """Drop the local tag: 1.8.0+cu130 -> 1.8.0."""
    return version.split("+", 1)[0]


def satisfies(req: str, version: str | None) -> bool:
    """Does `version` (None: not installed) meet requirement `req`?  Always, if req's marker
    does not apply to this interpreter."""
    from pip._vendor.packaging.requirements import Requirement  # stdlib has no PEP 440

    requirement = Requirement(req)
    if requirement.marker and not requirement.marker.evaluate():
        return True
    return version is not None and requirement.specifier.contains(version, prereleases=True)


def requirement_name(req: str) -> str:
    """Distribution name at the start of a requirement string: 'hydra-core>=1.3' -> 'hydra-core'."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if not m:
        raise SetupError(f"cannot read requirement {req!r}")
    return m.group(1)


# --------------------------------------------------------------------------- probes


def pip_env(opts: Options) -> dict[str, str]:
    """Environment for pip and the probes."""
    env = dict(os.environ)
    if opts.wheels:
        # Only the wheels folder: pip merges configured find-links/indexes with --find-links.
        env["PIP_CONFIG_FILE"] = os.devnull
        for var in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
            env.pop(var, None)
    if opts.target:
        # So the probes, and pip's view of what is installed, include earlier --target runs.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(opts.target), env.get("PYTHONPATH")]))
    return env


PROBE_TORCH = """
import importlib.metadata, json, torch
try:
    dist_version = importlib.metadata.version("torch")
except importlib.metadata.PackageNotFoundError:
    dist_version = None
print(json.dumps([torch.__version__, torch.version.cuda, dist_version]))
"""


def probe_torch(python: str, env: dict[str, str]) -> TorchInfo | None:
    """Installed torch, seen from a fresh interpreter (so a torch installed just now counts)."""
    proc = subprocess.run([python, "-c", PROBE_TORCH], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    version, cuda, dist_version = json.loads(proc.stdout.strip().splitlines()[-1])
    return TorchInfo(version, cuda is not None, dist_version)


def probe_torch_error(python: str, env: dict[str, str]) -> str:
    proc = subprocess.run([python, "-c", "import torch"], env=env, capture_output=True, text=True)
    return (proc.stderr.strip().splitlines() or ["(no error output)"])[-1]


def probe_triton(python: str, env: dict[str, str]) -> bool:
    return subprocess.run([python, "-c", "import triton"], env=env, capture_output=True).returncode == 0


def installed_version(name: str, path: list[str] | None = None) -> str | None:
    """Installed version of a distribution (searching `path`, default sys.path), or None."""
    kwargs = {"name": name} if path is None else {"name": name, "path": path}
    dist = next(iter(importlib.metadata.distributions(**kwargs)), None)
    return dist.version if dist else None


def project_is_editable(name: str) -> bool:
    """Is this repo checkout pip-installed in editable mode (pip's direct_url.json)?"""
    try:
        info = json.loads(importlib.metadata.distribution(name).read_text("direct_url.json") or "{}")
    except importlib.metadata.PackageNotFoundError:
        return False
    url = urllib.parse.urlparse(info.get("url", ""))
    if url.scheme != "file" or not info.get("dir_info", {}).get("editable"):
        return False
    return Path(urllib.request.url2pathname(url.path)).resolve() == REPO_ROOT


def load_pyproject() -> dict:
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # Python 3.10: pip ships the same parser
        from pip._vendor import tomli as tomllib
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def project_requirements(test: bool) -> tuple[str, list[str]]:
    """(project name, requirement strings incl. the test extra when asked) from pyproject.toml."""
    project = load_pyproject()["project"]
    reqs = list(project.get("dependencies", []))
    if test:
        reqs += project.get("optional-dependencies", {}).get("test", [])
    return project["name"], reqs


def inspect_environment(opts: Options, env: dict[str, str]) -> EnvState:
    _, project_reqs = project_requirements(opts.test)
    names = [FBGEMM_GPU, FBGEMM_CPU, "torchrec", *TORCHREC_RUNTIME_DEPS, *OFFLINE_DEPS, *PLOT_DEPS]
    names += [requirement_name(r) for r in project_reqs]
    path = [str(opts.target), *sys.path] if opts.target else None
    versions = {}
    for name in {canon(n) for n in names}:
        version = installed_version(name, path)
        if version is not None:
            versions[canon(name)] = version
    return EnvState(
        versions=versions,
        triton_ok=probe_triton(opts.python, env),
        project_editable=not opts.target and project_is_editable(load_pyproject()["project"]["name"]),
    )


# --------------------------------------------------------------------------- plan


def pip_install(opts: Options, args: list[str]) -> list[str]:
    cmd = [opts.python, "-m", "pip", "install"]
    if opts.wheels:
        cmd += ["--no-index", "--find-links", str(opts.wheels)]
    return cmd + args


def install_no_deps(opts: Options, reqs: list[str]) -> list[list[str]]:
    # --upgrade with --target: otherwise pip keeps an older copy already in the target dir.
    target = ["--target", str(opts.target), "--upgrade"] if opts.target else []
    return [pip_install(opts, ["--no-deps", *target, *reqs])]


def requirements_path(report: Path) -> Path:
    """The requirements file run_commands() writes from a pip --report file."""
    return report.with_suffix(".txt")


def install_resolving(
    opts: Options, label: str, reqs: list[str], constraints: Path | None
) -> list[list[str]]:
    """Install reqs with their dependencies; `constraints` pins the installed torch."""
    pin = ["-c", str(constraints)] if constraints else []
    if not opts.target:
        return [pip_install(opts, [*pin, *reqs])]
    # --target: see the module docstring. Ask what is missing, then install just that.
    report = opts.workdir / f"{label}-report.json"
    missing = requirements_path(report)  # written by run_commands() from the report
    return [
        pip_install(opts, ["--dry-run", "--quiet", "--report", str(report), *pin, *reqs]),
        pip_install(opts, ["--no-deps", "--target", str(opts.target), "--upgrade", "-r", str(missing)]),
    ]


def torch_install_commands(opts: Options) -> list[list[str]]:
    return install_resolving(opts, "torch", [f"torch=={DEFAULT_TORCH}"], constraints=None)


def offline_requirements(state: EnvState, opts: Options) -> list[str]:
    """What the offline install still needs besides fbgemm / torchrec, in install order.

    A project requirement counts as missing when its installed version does not meet its
    specifier (pyproject.toml); the others when they are not installed at all.
    """
    project_reqs = {canon(requirement_name(r)): r for r in project_requirements(opts.test)[1]}
    names = OFFLINE_DEPS + [name for name in project_reqs if name not in OFFLINE_DEPS]
    reqs = [] if state.triton_ok else [f"triton=={TRITON_PIN}"]
    for name in names:
        req = project_reqs.get(name, name)
        if not satisfies(req, state.version(name)):
            reqs.append(req.split(";", 1)[0].strip())  # with its specifier: pip upgrades a too old one
    return reqs


def offline_plot_requirements(state: EnvState, folder: Path) -> list[str]:
    """What of PLOT_DEPS is missing, when folder has a wheel for each of those; else nothing, with a warning."""
    missing = [name for name in PLOT_DEPS if not state.version(name)]
    absent = [name for name in missing if not wheel_versions(folder, name)]
    if absent:
        print(f"WARNING: no wheel in {folder} for {', '.join(absent)}: matplotlib is not installed (optional: "
              "the report then writes report.md and report.json without report.png)")
        return []
    return missing


def check_wheels(folder: Path, reqs: list[str]) -> None:
    """Fail, naming them all, if folder lacks a wheel for some of reqs."""
    missing = [
        r for r in reqs if not any(satisfies(r, v) for v in wheel_versions(folder, requirement_name(r)))
    ]
    if missing:
        fetch = show(["pip", "wheel", "--no-deps", "-w", str(folder), *missing])
        raise SetupError(
            f"no wheel in {folder} for: {', '.join(missing)}; add them "
            f"(on a machine with network and the same Python: {fetch})"
        )


def plan_commands(
    pairing: Pairing, state: EnvState, opts: Options, constraints: Path | None
) -> list[list[str]]:
    """pip commands still needed once torch is installed (empty when all is in place).

    `constraints` (pinning torch) is used online only: offline, nothing resolves dependencies.
    """
    cmds: list[list[str]] = []
    paired = []  # fbgemm / torchrec requirements still needed

    if public_version(state.version(pairing.fbgemm_package) or "") != pairing.fbgemm_version:
        other = FBGEMM_CPU if pairing.fbgemm_package == FBGEMM_GPU else FBGEMM_GPU
        if state.version(other) and not opts.target:
            # Both variants install the same `fbgemm_gpu` package directory: remove the other
            # one first, or uninstalling it later would delete files of the new one.
            cmds.append([opts.python, "-m", "pip", "uninstall", "-y", other])
        paired.append(f"{pairing.fbgemm_package}=={pairing.fbgemm_version}")

    if public_version(state.version("torchrec") or "") != pairing.torchrec_version:
        paired.append(f"torchrec=={pairing.torchrec_version}")

    if opts.wheels:
        reqs = paired + offline_requirements(state, opts)
        check_wheels(opts.wheels, reqs)
        reqs += offline_plot_requirements(state, opts.wheels)
        if reqs:
            cmds += install_no_deps(opts, reqs)
        if not opts.target and not state.project_editable:
            cmds.append(pip_install(opts, ["--no-deps", "-e", str(REPO_ROOT)]))
        return cmds

    for req in paired:
        cmds += install_no_deps(opts, [req])

    missing = [name for name in TORCHREC_RUNTIME_DEPS if not state.version(name)]
    if missing:
        cmds += install_resolving(opts, "torchrec-deps", missing, constraints)

    if not state.triton_ok:
        cmds += install_resolving(opts, "triton", [f"triton=={TRITON_PIN}"], constraints)

    # The project: only presence of its dependencies is checked (pip judges versions when
    # it runs).  A requirement with an environment marker that does not apply here would
    # count as missing and just cost a (no-op) pip call.
    _, project_reqs = project_requirements(opts.test)
    missing_reqs = [r for r in project_reqs if not state.version(requirement_name(r))]
    if opts.target:
        if missing_reqs:  # the project itself is used from the repo root via PYTHONPATH
            cmds += install_resolving(opts, "project-deps", missing_reqs, constraints)
    elif missing_reqs or not state.project_editable:
        spec = f"{REPO_ROOT}[test]" if opts.test else str(REPO_ROOT)
        cmds += install_resolving(opts, "project", ["-e", spec], constraints)

    if not state.version("matplotlib"):
        cmds += install_resolving(opts, "plot", ["matplotlib"], constraints)

    return cmds


# --------------------------------------------------------------------------- run


def show(cmd: list[str]) -> str:
    return shlex.join(cmd)


def write_requirements_from_report(report: Path, torch_pinned: bool) -> list[str]:
    """Turn a pip --report file into `name==version` lines (the --target second pass)."""
    items = json.loads(report.read_text()).get("install", [])
    reqs = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in items]
    if torch_pinned and any(canon(requirement_name(r)) == "torch" for r in reqs):
        # Cannot happen with the constraint in place; refuse rather than shadow the real torch.
        raise SetupError(f"pip wants to install torch ({report}); refusing to replace the installed torch")
    requirements_path(report).write_text("".join(r + "\n" for r in reqs))
    return reqs


VERIFY_IMPORTS = """
import importlib, importlib.util, json, sys
failures = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as e:
        missing = None
        if isinstance(e, ModuleNotFoundError) and e.name:
            top = e.name.split(".")[0]
            missing = top if importlib.util.find_spec(top) is None else None
        failures.append([name, f"{type(e).__name__}: {e}", missing])
print(json.dumps(failures))
"""


def verify_imports(opts: Options, env: dict[str, str], pairing: Pairing) -> None:
    """Import VERIFY_MODULES in a fresh interpreter; fail naming what is missing and its wheel."""
    proc = subprocess.run(
        [opts.python, "-c", VERIFY_IMPORTS, *VERIFY_MODULES], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SetupError(f"import check crashed (exit code {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    failures = json.loads(proc.stdout.strip().splitlines()[-1])
    if not failures:
        print(f"import check: {' '.join(VERIFY_MODULES)} ok")
        return
    distributions = {**MODULE_DISTRIBUTIONS, "fbgemm_gpu": pairing.fbgemm_package}
    lines = [f"  import {name}: {error}" for name, error, _ in failures]
    missing = list(dict.fromkeys(m for _, _, m in failures if m))
    for module in missing:
        wheel = distributions.get(module, canon(module))
        lines.append(f"  missing module {module!r}: add a {wheel} wheel to {opts.wheels} and re-run")
    raise SetupError("import check failed after the offline install:\n" + "\n".join(lines))


def run_commands(cmds: list[list[str]], env: dict[str, str]) -> None:
    for cmd in cmds:
        if "-r" in cmd:  # second --target pass: skip when the report found nothing missing
            if not Path(cmd[cmd.index("-r") + 1]).read_text().strip():
                print("  (nothing missing)")
                continue
        print("+ " + show(cmd), flush=True)
        proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0:
            raise SetupError(f"command failed with exit code {proc.returncode}: {show(cmd)}")
        if "--report" in cmd:
            reqs = write_requirements_from_report(Path(cmd[cmd.index("--report") + 1]), "-c" in cmd)
            print(f"  missing: {' '.join(reqs) or '(nothing)'}")


def ensure_torch(opts: Options, env: dict[str, str]) -> TorchInfo:
    torch = probe_torch(opts.python, env)
    if torch is not None:
        return torch
    path = [str(opts.target), *sys.path] if opts.target else None
    if installed_version("torch", path) is not None:
        # Installed but broken: installing over it could replace a CUDA build with a CPU one.
        raise SetupError(
            f"torch is installed but `import torch` fails ({probe_torch_error(opts.python, env)}); "
            "fix it first, this script never replaces an installed torch"
        )
    cmds = torch_install_commands(opts)
    if opts.dry_run:
        print(f"torch is not installed; would install torch=={DEFAULT_TORCH}:")
        for cmd in cmds:
            print("  " + show(cmd))
        print(f"(dry run: planning the rest for torch {DEFAULT_TORCH}, cuda assumed {opts.fbgemm == 'gpu'})")
        return TorchInfo(DEFAULT_TORCH, opts.fbgemm == "gpu", DEFAULT_TORCH)
    print(f"torch is not installed; installing torch=={DEFAULT_TORCH}")
    run_commands(cmds, env)
    torch = probe_torch(opts.python, env)
    if torch is None:
        raise SetupError(f"torch=={DEFAULT_TORCH} was installed but `import torch` still fails")
    return torch


def parse_args(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="setup_env.py",
        description="Install fbgemm-gpu + torchrec paired with the installed torch, and this project.",
    )
    parser.add_argument(
        "--fbgemm", choices=["auto", "gpu", "cpu"], default="auto",
        help="fbgemm-gpu (CUDA) or fbgemm-gpu-cpu; auto follows the torch build (default)",
    )
    parser.add_argument("--test", action="store_true", help="also install the project's test extra")
    parser.add_argument("--wheels", type=Path, metavar="DIR", help="offline: install only from wheels in DIR")
    parser.add_argument(
        "--target", type=Path, metavar="DIR",
        help="install into DIR (pip --target) instead of site-packages; prints the PYTHONPATH to use",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the pip commands, run nothing")
    args = parser.parse_args(argv)
    return Options(
        fbgemm=args.fbgemm,
        test=args.test,
        wheels=args.wheels.resolve() if args.wheels else None,
        target=args.target.resolve() if args.target else None,
        dry_run=args.dry_run,
    )


def setup(opts: Options) -> None:
    start = time.monotonic()
    if opts.wheels and not opts.wheels.is_dir():
        raise SetupError(f"--wheels {opts.wheels}: no such directory")
    env = pip_env(opts)

    torch = ensure_torch(opts, env)
    pairing = pairing_for(torch.version, torch.cuda, opts.fbgemm)
    if pairing.fbgemm_package == FBGEMM_GPU and not torch.cuda:
        print(f"WARNING: {FBGEMM_GPU} (CUDA) requested with a CPU torch ({torch.version})")

    state = inspect_environment(opts, env)
    if opts.wheels and public_version(state.version(pairing.fbgemm_package) or "") != pairing.fbgemm_version:
        pairing, warning = offline_fbgemm(pairing, opts.wheels, allow_cpu_fallback=opts.fbgemm == "auto")
        if warning:
            print(warning)

    constraints = None if opts.wheels else opts.workdir / "constraints.txt"
    cmds = plan_commands(pairing, state, opts, constraints)
    pinned = any("-c" in cmd for cmd in cmds)  # some pip call resolves dependencies (online only)
    if pinned:
        # Pin the version pip compares against, which need not be torch.__version__.
        if torch.dist_version is None:
            raise SetupError(
                f"torch {torch.version} imports, but pip sees no installed torch (no distribution "
                "metadata): any install that resolves dependencies would fail or pull a second torch; "
                "install from a wheel folder instead (--wheels DIR never resolves dependencies)"
            )
        constraints.write_text(f"torch=={torch.dist_version}\n")

    if opts.wheels and not opts.target and any("-e" in c for c in cmds):
        if not any(opts.wheels.glob("setuptools-*.whl")):
            print(f"WARNING: no setuptools wheel in {opts.wheels}; `pip install -e` needs setuptools>=64")

    if opts.dry_run:
        if pinned:
            print(f"constraints file (temporary) {constraints}: torch=={torch.dist_version}")
        changes = [f"{k}={v}" for k, v in env.items() if os.environ.get(k) != v]
        changes += [f"unset {k}" for k in os.environ if k not in env]
        if changes:
            print("pip environment: " + " ".join(changes))
        print("plan:" if cmds else "plan: nothing to install")
        for cmd in cmds:
            print("  " + show(cmd))
        if opts.wheels:
            print(f"then an import check of: {' '.join(VERIFY_MODULES)}")
    else:
        run_commands(cmds, env)
        if opts.wheels:
            verify_imports(opts, env, pairing)
        elif cmds and not opts.target:
            # pip's resolver prints this as an ERROR after the fact; it is the intended state.
            print(
                "note: pip's complaint that torchrec requires fbgemm-gpu / torchmetrics==1.0.3 is expected "
                "(torchrec's metadata is wrong for us; it is installed with --no-deps on purpose)"
            )

    print()
    print("summary:")
    print(f"  torch     {torch.version} ({'cuda' if torch.cuda else 'cpu'})")
    print(f"  fbgemm    {pairing.fbgemm_package}=={pairing.fbgemm_version}")
    print(f"  torchrec  torchrec=={pairing.torchrec_version}")
    print(f"  triton    {'already importable' if state.triton_ok else f'triton=={TRITON_PIN}'}")
    ran = "would run" if opts.dry_run else "ran"
    print(f"  pip       {ran} {len(cmds)} command(s), {time.monotonic() - start:.1f}s")
    if opts.target:
        pythonpath = os.pathsep.join([str(opts.target), str(REPO_ROOT)])
        print("  target mode: the project is used from the repo root, not installed; use:")
        print(f"  export PYTHONPATH={shlex.quote(pythonpath)}${{PYTHONPATH:+:$PYTHONPATH}}")
    else:
        print(f"  project   editable install of {REPO_ROOT}{' [test]' if opts.test else ''}")


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="setup_env-") as workdir:
            setup(dataclasses.replace(opts, workdir=Path(workdir)))
    except SetupError as e:
        print(f"setup_env.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
