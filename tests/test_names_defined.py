"""Every global name the project's functions read is defined in its module.

Much of the code runs only on GPUs (benchmarks, CUDA paths), which CI does not have: a missing import there
surfaces as a NameError on the first 2-GPU run (moe.bench lost its `gemm_config` import that way). Python's symbol
tables list the names each scope reads from module globals; after importing the module each must exist there or
among the builtins.
"""

from __future__ import annotations

import builtins
import importlib
import inspect
import pkgutil
import symtable

import pytest

import fused_dlrm
import moe


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
