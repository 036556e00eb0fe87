"""dpar's folders import each other downwards only (docs/architecture.md has the picture).

    integrations -> api -> planner | inspect -> compiler -> surgery -> runtime -> core

Every import of a ``dpar`` module is counted, lazy ones and ``TYPE_CHECKING`` ones included; the peers planner
and inspect import neither each other nor anything above. Surgery sits above the runtime: what ``parallelize``
installs on a model (a module class whose attribute calls a tensor-parallel marker op) runs the runtime's code,
and the runtime never reaches back for what installed it. ``python tests/test_layers.py``
prints the folder-to-folder import counts.
"""

from __future__ import annotations

import ast
import collections
import pathlib
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Height of each layer; an import must go to a strictly lower one.
HEIGHT = {"integrations": 6, "api": 5, "planner": 4, "inspect": 4, "compiler": 3, "surgery": 2, "runtime": 1, "core": 0}


def _packages() -> dict[str, pathlib.Path]:
    """Import package -> folder, from pyproject.toml's package-dir."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {package: ROOT / folder for package, folder in config.items()}


def layer_of(module: str) -> str:
    """``dpar.compiler.passes.x`` -> compiler; ``dpar`` and ``dpar.placement`` (the api folder) -> api."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in HEIGHT else "api"


def imports() -> list[tuple[str, str, str]]:
    """(importing module, imported module, file:line) for every import of a dpar module."""
    found = []
    for package, folder in _packages().items():
        for path in sorted(folder.glob("*.py")):
            module = package if path.stem == "__init__" else f"{package}.{path.stem}"
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    targets = [node.module]
                elif isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                else:
                    continue
                found += [(module, t, f"{path.relative_to(ROOT)}:{node.lineno}") for t in targets
                          if t == "dpar" or t.startswith("dpar.")]
    return found


def layer_edges() -> collections.Counter[tuple[str, str]]:
    return collections.Counter((layer_of(a), layer_of(b)) for a, b, _ in imports() if layer_of(a) != layer_of(b))


def test_every_import_points_down() -> None:
    upward = [f"{where}: {a} ({layer_of(a)}) imports {b} ({layer_of(b)})" for a, b, where in imports()
              if layer_of(a) != layer_of(b) and HEIGHT[layer_of(a)] <= HEIGHT[layer_of(b)]]
    assert upward == [], "imports that do not point down:\n" + "\n".join(upward)


def test_every_folder_is_a_layer() -> None:
    """A new folder must be placed in HEIGHT (and in docs/architecture.md), not fall into api silently."""
    folders = {layer_of(package) for package in _packages()}
    assert folders == set(HEIGHT)


if __name__ == "__main__":
    for (a, b), count in sorted(layer_edges().items(), key=lambda e: (-HEIGHT[e[0][0]], e[0])):
        print(f"{a:9s} -> {b:9s} {count:3d}{'' if HEIGHT[a] > HEIGHT[b] else '   UPWARD'}")
    sys.exit(0)
