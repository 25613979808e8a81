"""Every address handed to C++ belongs to a tensor that a local (or an object) holds until the call returns.

A wrapper of a native call passes ``tensor.data_ptr()`` as a plain integer: nothing keeps the tensor alive
for ctypes. When the tensor is a temporary (``t.contiguous().data_ptr()``, ``t.float().data_ptr()``,
``(a + b).data_ptr()``, ``t[index].data_ptr()``), Python frees it as soon as ``data_ptr()`` returns, before
the kernel reads it (issue 43: ``add_lora_cpu`` read freed scales on every call with a strided view).

This test reads the sources of both packages (``ast``) and accepts ``.data_ptr()`` only on a name or an
attribute chain rooted at a name (``x``, ``self.table``, ``w.qkv``): a tensor someone holds. Anything else
(a call, a subscript, arithmetic, a conditional) is reported with its file and line; bind it to a local
first (``scales = scales.contiguous()``) and pass ``scales.data_ptr()``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("tgi_paged_kernels", "tgi_paged_backend")


def _held(node: ast.expr) -> bool:
    """A name, or attributes of a name: a reference that outlives the expression it appears in."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


def temporary_pointers(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: expression`` for each ``.data_ptr()`` taken of an expression that is not a held reference."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "data_ptr"
            and not _held(node.func.value)
        ):
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


def _sources() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


def test_the_walk_reads_the_native_wrappers():
    names = {path.relative_to(ROOT).as_posix() for path in _sources()}
    wrappers = {"cpu_native.py", "cpu_lora.py", "cpu_layer.py", "cpu_prefill.py"}
    assert {f"tgi_paged_kernels/{name}" for name in wrappers} <= names


def test_every_pointer_passed_to_native_code_is_of_a_held_tensor():
    found = [hit for path in _sources() for hit in temporary_pointers(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, (
        "data_ptr() of a temporary tensor: it is freed before the native code reads it; bind the tensor to a "
        "local that lives until the call returns:\n  " + "\n  ".join(found)
    )


@pytest.mark.parametrize(
    "expression",
    [
        "scales.contiguous().data_ptr()",  # issue 43, add_lora_cpu
        "x.float().data_ptr()",
        "x.to(torch.int32).data_ptr()",
        "x.reshape(-1, 4).data_ptr()",
        "self.table(dtype).data_ptr()",
        "torch.empty(3).data_ptr()",
        "(a + b).data_ptr()",
        "x[index].data_ptr()",
        "(a if flag else b.float()).data_ptr()",
    ],
)
def test_a_pointer_of_a_temporary_is_found(expression):
    [hit] = temporary_pointers(f"native.call(1, {expression}, 2)")
    assert hit == f"<source>:1: {ast.unparse(ast.parse(expression, mode='eval'))}"


@pytest.mark.parametrize(
    "expression", ["x.data_ptr()", "self.cache.data_ptr()", "w.qkv.data_ptr()", "None if b is None else b.data_ptr()"]
)
def test_a_pointer_of_a_held_tensor_passes(expression):
    assert temporary_pointers(f"native.call({expression})") == []
