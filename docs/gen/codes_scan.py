"""The error codes batchrun's source can give a request or a line, found by reading the source
(no registry to forget): `code="..."` arguments, `{"code": "..."}` literals, MediaError's code
argument and the codes a `*_error_code` function returns."""

from __future__ import annotations

import ast
from pathlib import Path


def _str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _name(func: ast.AST) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def scan(package: Path) -> dict[str, set[str]]:
    """code -> the modules (dotted, under the package) that give it."""
    found: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            codes: list[str | None] = []
            if isinstance(node, ast.Call):
                codes += [_str(k.value) for k in node.keywords if k.arg == "code"]
                if _name(node.func) == "MediaError" and len(node.args) >= 2:
                    codes.append(_str(node.args[1]))
            elif isinstance(node, ast.Dict):
                codes += [_str(v) for k, v in zip(node.keys, node.values)
                          if k is not None and _str(k) == "code"]
            elif isinstance(node, ast.FunctionDef):
                if node.name.endswith("error_code"):
                    codes += [_str(n.value) for n in ast.walk(node)
                              if isinstance(n, ast.Return) and n.value is not None]
                if node.name == "__init__" and any(a.arg == "code" for a in node.args.args):
                    codes += [_str(d) for d in node.args.defaults]
            for code in codes:
                if code and code.isidentifier() and code.islower():
                    found.setdefault(code, set()).add(module)
    return found
