"""The ctypes signatures engine/kernels/ops.py declares against the C prototypes of every function
the kernels export (engine/kernels/*.c): a wrong argument count, kind or return type would pass
garbage to C without an error."""

import ctypes
import re
from pathlib import Path

import pytest

from batchrun.engine.kernels import ops

KERNELS = Path(ops.__file__).parent
# A definition that starts at the line's first column with its return type: exported (the
# file's helpers are `static` or SIMD_INLINE).
DEFINITION = re.compile(r"^(void|int|float|int64_t)\s+(\w+)\s*\(([^)]*)\)\s*\{", re.M)
C_KINDS = {"int": "int", "int64_t": "int64", "float": "float"}
CTYPES_KINDS = {ctypes.c_void_p: "pointer", ctypes.c_int: "int", ctypes.c_int64: "int64",
                ctypes.c_float: "float", None: "void"}


def _argument_kind(arg: str) -> str:
    if "*" in arg:
        return "pointer"
    words = arg.replace("const", "").split()
    if len(words) != 2 or words[0] not in C_KINDS:
        raise ValueError(f"an argument of a kind this test does not know: {arg!r}")
    return C_KINDS[words[0]]


def c_prototypes(sources=None) -> dict[str, tuple[str, list[str]]]:
    """name -> (return kind, argument kinds) of each exported function of the kernel sources."""
    found: dict[str, tuple[str, list[str]]] = {}
    for path in sources or sorted(KERNELS.glob("*.c")):
        text = re.sub(r"/\*.*?\*/|//[^\n]*", "", path.read_text(), flags=re.S)
        for ret, name, args in DEFINITION.findall(text):
            args = " ".join(args.split())
            kinds = [] if args in ("", "void") else [_argument_kind(a) for a in args.split(",")]
            signature = ("void" if ret == "void" else C_KINDS[ret], kinds)
            # a function defined once per #if branch must read the same in each
            assert found.setdefault(name, signature) == signature, f"{name} defined two ways"
    return found


def mismatches(signatures, prototypes) -> list[str]:
    """What in `signatures` (name -> (restype, argtypes), as ops.SIGNATURES) disagrees with the C
    prototypes: a function missing on either side, a return type, an argument count or kind."""
    problems = [f"{n}: exported by the C sources, no ctypes signature"
                for n in sorted(set(prototypes) - set(signatures))]
    problems += [f"{n}: a ctypes signature, no such C function"
                 for n in sorted(set(signatures) - set(prototypes))]
    for name in sorted(set(signatures) & set(prototypes)):
        restype, argtypes = signatures[name]
        c_ret, c_args = prototypes[name]
        py_ret, py_args = CTYPES_KINDS[restype], [CTYPES_KINDS[t] for t in argtypes]
        if py_ret != c_ret:
            problems.append(f"{name}: returns {c_ret} in C, {py_ret} in ctypes")
        if len(py_args) != len(c_args):
            problems.append(f"{name}: {len(c_args)} arguments in C, {len(py_args)} in ctypes")
        problems += [f"{name}: argument {i} is {c} in C, {p} in ctypes"
                     for i, (c, p) in enumerate(zip(c_args, py_args)) if c != p]
    return problems


def test_the_parser_reads_the_prototypes():
    protos = c_prototypes()
    assert len(protos) >= 24  # as many as the kernels had when this test was written
    assert protos["add_rms_norm"] == ("void", ["pointer"] * 4 + ["int64"] * 2
                                      + ["float", "int", "int", "int"])
    assert protos["simd_path"] == ("int", [])
    assert protos["cascade_groups"] == ("int", ["pointer"] * 2 + ["int"] * 4 + ["pointer"] * 3)
    assert len(protos["paged_attention_scaled"][1]) == 26  # per_row the last
    assert not any(name.startswith(("score_", "attend_", "run_group")) for name in protos)


def test_every_ctypes_signature_matches_its_c_prototype():
    assert mismatches(ops.SIGNATURES, c_prototypes()) == []


@pytest.mark.parametrize("name,wrong,expected", [
    ("add_rms_norm", lambda r, a: (r, a[:4] + [ctypes.c_int] + a[5:]), "argument 4 is int64"),
    ("kv_write", lambda r, a: (r, a[:-1]), "10 arguments in C, 9"),
    ("rope_inplace", lambda r, a: (None, a), "returns int in C, void"),
    ("scale_rows", lambda r, a: (r, a[:2] + [ctypes.c_float] + a[3:]), "argument 2 is pointer"),
])
def test_a_wrong_signature_is_caught(name, wrong, expected):
    signatures = dict(ops.SIGNATURES)
    signatures[name] = wrong(*signatures[name])
    problems = mismatches(signatures, c_prototypes())
    assert len(problems) == 1 and problems[0].startswith(name) and expected in problems[0]


def test_a_function_without_a_signature_is_caught(tmp_path):
    extra = tmp_path / "extra.c"
    extra.write_text("static int helper(int x) { return x; }\n"
                     "// void commented_out(int x) {}\n"
                     "void new_kernel(const float *x, int64_t n,\n                int threads) {}\n")
    protos = c_prototypes([*sorted(KERNELS.glob("*.c")), extra])
    assert protos["new_kernel"] == ("void", ["pointer", "int64", "int"])
    assert "helper" not in protos and "commented_out" not in protos
    assert mismatches(ops.SIGNATURES, protos) == [
        "new_kernel: exported by the C sources, no ctypes signature"]
