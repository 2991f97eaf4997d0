"""The import contracts of .importlinter, and no private names imported across modules.

A contract that breaks prints the import chain that breaks it.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "batchrun"

CONTRACTS = ["layers", "cli-on-top", "engine-knows-no-callers", "options-are-a-schema",
             "openai-knows-no-scheduling", "models-use-attention-only",
             "attention-backends-independent", "no-cycles", "batch-by-concern"]


def lint(contract: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
         "lint_imports_command()", "--no-cache", "--no-logo", "--contract", contract],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_every_contract_is_tested():
    text = (ROOT / ".importlinter").read_text()
    ids = {line.split(":")[-1].strip("] \n") for line in text.splitlines()
           if line.startswith("[importlinter:contract:")}
    assert ids == set(CONTRACTS)


@pytest.mark.parametrize("contract", CONTRACTS)
def test_import_contract_is_kept(contract):
    result = lint(contract)
    assert result.returncode == 0, result.stdout + result.stderr


def private_imports() -> set[tuple[str, str, str]]:
    """(file, module, name) of each `from <batchrun module> import _name` in batchrun."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT)
        package = list(rel.parts[:-1])  # what `from . import` means, in a module or __init__
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package[:len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module != "batchrun" and not module.startswith("batchrun."):
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.add((rel.as_posix(), module, alias.name))
    return found


def test_no_private_imports_across_modules():
    assert private_imports() == set()


def test_no_import_cycle_between_any_two_modules():
    """Stronger than the acyclic_siblings contract: no cycle through any chain of modules,
    function-level imports included (grimp sees them)."""
    import grimp

    graph = grimp.build_graph("batchrun", include_external_packages=False, cache_dir=None)
    imports = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(imports[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target] if target in path else [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(imports):
        if module not in state:
            visit(module, [module])
