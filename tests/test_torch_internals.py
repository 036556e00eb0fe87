"""Every private torch name dpar reaches (core/torch_internals.py) resolves on the torch this suite runs on.

One test per name, so a torch release that moves one fails a test that says which, before any strategy
meets it at a first step. CI runs the pinned torch and the newest one (see .ci/run).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from dpar.core import torch_internals

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRODUCT_FOLDERS = ("api", "compiler", "core", "inspection", "planner", "runtime", "surgery")


@pytest.mark.parametrize("module,attribute", torch_internals.PRIVATE_NAMES,
                         ids=[f"{m}.{a}" if a else m for m, a in torch_internals.PRIVATE_NAMES])
def test_private_name_resolves(module: str, attribute: str | None) -> None:
    assert torch_internals.resolve(module, attribute) is not None


def test_python_meta_kernels_are_lifted_and_restored() -> None:
    """The one entry that touches private attributes of torch's ops rather than importing a name."""
    import torch
    import torch._meta_registrations  # noqa: F401  (registers torch's Python Meta kernels, as tracing on meta does)

    op = torch.ops.aten.dropout.default  # CompositeImplicitAutograd, with a Python Meta kernel from torch
    before = dict(op.py_kernels)
    assert torch._C.DispatchKey.Meta in before
    with torch_internals.python_meta_kernels_lifted():
        assert torch._C.DispatchKey.Meta not in op.py_kernels
    assert dict(op.py_kernels) == before


def test_a_pre_hook_registered_first_runs_first() -> None:
    import torch

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    ran: list[str] = []
    optimizer.register_step_pre_hook(lambda *_: ran.append("registered before"))
    torch_internals.register_step_pre_hook_first(optimizer, lambda *_: ran.append("first"))
    optimizer.step()
    assert ran == ["first", "registered before"]


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _private_uses(path: pathlib.Path) -> list[str]:
    """Imports of private torch names or modules, and ``torch.x._y`` / ``dist.x._y`` attribute chains, in one file.

    ATen operators (``torch.ops.aten._to_copy``) are operator names, not Python API, and are not counted."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            chain = _dotted(node)
            if chain and chain.split(".")[0] in ("torch", "dist") and not chain.startswith("torch.ops.aten."):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {chain}")
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            private_module = any(part.startswith("_") for part in node.module.split(".")[1:])
            private_names = [a.name for a in node.names if a.name.startswith("_") and a.name != "__future__"]
            if private_module or private_names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [f"{path.relative_to(ROOT)}:{node.lineno} import {a.name}" for a in node.names
                      if a.name.split(".")[0] == "torch" and any(p.startswith("_") for p in a.name.split(".")[1:])]
    return found


def test_product_code_imports_private_torch_only_through_torch_internals() -> None:
    files = [f for folder in PRODUCT_FOLDERS for f in sorted((ROOT / folder).rglob("*.py"))
             if f.name != "torch_internals.py"]
    assert files
    found = [hit for f in files for hit in _private_uses(f)]
    assert found == [], "import these through dpar.core.torch_internals:\n" + "\n".join(found)
