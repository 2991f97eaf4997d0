"""The import contracts of .importlinter, and no private names used across modules: neither
imported (`from batchrun.x import _name`) nor reached on another module's object
(`self.owner._submit(...)`).

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


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_private_names(tree: ast.AST) -> set[str]:
    """The private names a module defines: its functions, classes and module or class level
    names, and the attributes it assigns on `self` / `cls` (a write to another object's `_x`
    defines nothing)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
    return {n for n in names if _private(n)}


def _third_party_names(tree: ast.AST) -> set[str]:
    """Names bound by importing another package (`torch` of `import torch`): their private
    attributes are that package's business, not a contract between batchrun's modules."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names
                         if a.name.split(".")[0] != "batchrun")
        elif isinstance(node, ast.ImportFrom) and not node.level \
                and (node.module or "").split(".")[0] != "batchrun":
            names.update(a.asname or a.name for a in node.names)
    return names


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


# Private names of third-party objects the AST cannot tell from ours (held in an attribute).
THIRD_PARTY_PRIVATE = {
    "_call_s3",  # s3fs: fsspec's async API names each coroutine `_<method>`
    "_location",  # gcsfs: the JSON API's endpoint, which its own `call` does not prefix
    # transformers: a config's attention implementation, which set_attn_implementation refuses
    # to change on the families whose attention does not go through AttentionInterface
    "_attn_implementation",
    "_split_heads",  # transformers' FalconAttention method (inline/ binds our forward to it)
}


def private_attribute_uses(source: str) -> list[str]:
    """Each `<expr>._name` in `source` whose `_name` the module does not define itself (as
    `code` at `line`): a reach into another module's object."""
    tree = ast.parse(source)
    own, foreign = _own_private_names(tree), _third_party_names(tree)
    uses = [node for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and _private(node.attr)
            and node.attr not in own and node.attr not in THIRD_PARTY_PRIVATE
            and _root(node.value) not in foreign]
    return [f"{ast.unparse(n)} at line {n.lineno}" for n in sorted(uses, key=lambda n: n.lineno)]


def test_private_attribute_rule_catches_reach_ins():
    source = """
import torch
from batchrun.engine.async_engine import AsyncEngine


class Client:
    def __init__(self, owner: AsyncEngine):
        self.owner, self._open = owner, set()

    def add(self, other: "Client"):
        self.owner._submit(("add",))   # another module's private method
        other._open.add(1)             # this module's own attribute: fine
        owner_queue = self.owner._inbox  # another module's private attribute
        self._open.clear()
        torch.ops.mkldnn._linear_pointwise  # a third-party private op: not our contract
        self.owner._stats = None       # writing another object's private is a reach-in too
"""
    assert private_attribute_uses(source) == [
        "self.owner._submit at line 11", "self.owner._inbox at line 13",
        "self.owner._stats at line 16"]


def test_no_private_attributes_across_modules():
    found = {path.relative_to(ROOT).as_posix(): private_attribute_uses(path.read_text())
             for path in sorted(PACKAGE.rglob("*.py"))}
    assert {path: uses for path, uses in found.items() if uses} == {}


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
