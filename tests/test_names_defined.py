"""Every global name the project's functions read is defined in its module; in the code only GPUs run, every call
of a project function or class fits its signature.

Much of the code runs only on GPUs (benchmarks, CUDA paths, the GPU tests), which CI does not have: a missing import
there surfaces as a NameError on the first 2-GPU run (moe.bench lost its `gemm_config` import that way), a call left
behind by a signature change as a TypeError (test_tp_gpu.py's `_workspace(tp)` after the allocation bound joined its
arguments, found by a GPU run in the sixty-third session). Python's symbol tables list the names each scope reads
from module globals; after importing the module each must exist there or among the builtins. The calls are checked
where the callee is known without running the code: a name the file imports or defines, or an attribute of one.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
import symtable
import sys
from pathlib import Path

import pytest

import fused_dlrm
import moe
from test_gpu_check_script import _listed

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> list[str]:
    names = []
    for package in (fused_dlrm, moe):
        names.append(package.__name__)
        names += [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
                  if not m.name.endswith("__main__")]  # running it would start the command
    return names


def _global_reads(table: symtable.SymbolTable) -> set[str]:
    names = {s.get_name() for s in table.get_symbols() if s.is_global() and s.is_referenced()}
    for child in table.get_children():
        names |= _global_reads(child)
    return names


def test_the_check_finds_a_missing_name():
    table = symtable.symtable("def f():\n    return gemm_config()\n", "<test>", "exec")
    assert "gemm_config" in _global_reads(table)


@pytest.mark.parametrize("name", _modules())
def test_every_global_a_function_reads_is_defined(name):
    module = importlib.import_module(name)
    reads = _global_reads(symtable.symtable(inspect.getsource(module), module.__file__, "exec"))
    missing = sorted(n for n in reads if n not in vars(module) and not hasattr(builtins, n))
    assert not missing, f"{name} reads undefined names {missing}"


def _gpu_only_files() -> list[Path]:
    """Code no CI run executes whole: the GPU test files, the CPU test files holding GPU tests (gpu_check.sh's
    GPU_CASES), the one-GPU scripts, loop_parts.py, the benchmarks and the report (its fused columns)."""
    return sorted({*ROOT.glob("tests/test_*_gpu.py"), *(ROOT / "tests" / f"test_{n}.py" for n in _listed("GPU_CASES")),
                   ROOT / "scripts" / "loop_parts.py", *ROOT.glob("scripts/one_gpu/*.py"), ROOT / "moe" / "bench.py",
                   *ROOT.glob("fused_dlrm/bench/*.py"), *ROOT.glob("fused_dlrm/report/*.py")})


GPU_ONLY = pytest.mark.parametrize("path", _gpu_only_files(), ids=lambda p: str(p.relative_to(ROOT)))


@GPU_ONLY
def test_every_global_gpu_only_code_reads_is_defined(path):
    """Statically (the one-GPU scripts run when imported): read from globals, defined at module level."""
    table = symtable.symtable(path.read_text(), str(path), "exec")
    defined = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    missing = sorted(n for n in _global_reads(table) if n not in defined and not hasattr(builtins, n)
                     and n != "__file__")
    assert not missing, f"{path.name} reads undefined names {missing}"


def _signature(fn: ast.FunctionDef) -> inspect.Signature:
    """A function's signature from its definition (defaults stand in as None)."""
    a, P = fn.args, inspect.Parameter
    positional = [(x, P.POSITIONAL_ONLY) for x in a.posonlyargs] + [(x, P.POSITIONAL_OR_KEYWORD) for x in a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + a.defaults
    params = [P(x.arg, kind, default=P.empty if d is None else None) for (x, kind), d in zip(positional, defaults)]
    params += [P(a.vararg.arg, P.VAR_POSITIONAL)] if a.vararg else []
    params += [P(x.arg, P.KEYWORD_ONLY, default=P.empty if d is None else None) for x, d in zip(a.kwonlyargs,
                                                                                                a.kw_defaults)]
    params += [P(a.kwarg.arg, P.VAR_KEYWORD)] if a.kwarg else []
    return inspect.Signature(params)


def _locals(fn: ast.FunctionDef | ast.Lambda) -> set[str]:
    """The names a function binds itself: arguments, assignments, nested definitions (not its imports: the check
    resolves those)."""
    a = fn.args
    names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x is not None}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node is not fn:
            names.add(node.name)
    return names


def _calls(node: ast.AST, shadowed: frozenset = frozenset()):
    """(call, names bound by the functions around it) of every call under node."""
    if isinstance(node, (ast.FunctionDef, ast.Lambda)):
        shadowed = shadowed | _locals(node)
    if isinstance(node, ast.Call):
        yield node, shadowed
    for child in ast.iter_child_nodes(node):
        yield from _calls(child, shadowed)


def _project(obj) -> bool:
    """Whether obj (a function, class or module) is the project's: its packages' or a test helper's."""
    name = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None) or ""
    module = sys.modules.get(name)
    return name.split(".")[0] in ("fused_dlrm", "moe") or Path(getattr(module, "__file__", None) or "/").resolve(
        ).is_relative_to(ROOT / "tests")


def _callee(func: ast.expr, imported: dict, own: dict, shadowed: frozenset) -> inspect.Signature | str | None:
    """The signature of the project function or class a call names (a function the file defines, a name it imports
    or an attribute chain from one), a sentence if a project module lacks the attribute, or None: unknown here."""
    chain = []
    while isinstance(func, ast.Attribute):
        chain.insert(0, func.attr)
        func = func.value
    if not isinstance(func, ast.Name) or func.id in shadowed:
        return None
    if func.id in own:
        return None if chain else own[func.id]
    if func.id not in imported:
        return None
    obj = imported[func.id]
    for name in chain:
        if not hasattr(obj, name):
            return f"{obj.__name__} has no {name!r}" if inspect.ismodule(obj) and _project(obj) else None
        obj = getattr(obj, name)
    if inspect.ismodule(obj) or not callable(obj) or not _project(obj):
        return None
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):  # no signature to read (a builtin's)
        return None


def _wrong_calls(source: str, name: str) -> list[str]:
    """The calls of `source` that do not fit their callees: each call of a project function or class that the file
    defines at module level or imports (at module level or in a function) must bind to the callee's signature as
    it is now, and an attribute it calls of a project module must exist."""
    tree = ast.parse(source)
    imported: dict = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
            exec(compile(ast.Module([node], []), name, "exec"), imported)
    defs = [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    own = {n.name: _signature(n) for n in tree.body if isinstance(n, ast.FunctionDef) and defs.count(n.name) == 1}
    imported = {k: v for k, v in imported.items() if k not in defs}  # a name the file defines again is its own
    wrong = []
    for call, shadowed in _calls(tree):
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            continue
        callee = _callee(call.func, imported, own, shadowed)
        where = f"{name}:{call.lineno} {ast.unparse(call)[:100]}"
        if isinstance(callee, str):
            wrong.append(f"{where}: {callee}")
        elif callee is not None:
            try:
                callee.bind(*[None] * len(call.args), **{k.arg: None for k in call.keywords})
            except TypeError as error:
                wrong.append(f"{where}: {error}")
    return wrong


def test_the_call_check_finds_a_call_left_behind():
    """test_tp_gpu.py before b8449b6, and a function renamed away."""
    source = ("def f(tp):\n    from fused_dlrm.tp.linear import _workspace\n    return _workspace(tp)\n"
              "import fused_dlrm.tp.linear as linear\nlinear._workspaces(None, 1.0)\n")
    wrong = _wrong_calls(source, "<test>")
    assert len(wrong) == 2 and "missing a required argument: 'allocation_timeout_s'" in wrong[0], wrong
    assert "fused_dlrm.tp.linear has no '_workspaces'" in wrong[1], wrong


@GPU_ONLY
def test_gpu_only_calls_fit_their_callees(path):
    wrong = _wrong_calls(path.read_text(), str(path.relative_to(ROOT)))
    assert not wrong, "\n".join(wrong)
