"""The house keeps its shape: perfsdk's import graph, read from the source with ``ast``, has no
import cycle at import time, and no module imports against the layers of docs/architecture.md;
``torch.cuda`` is used only behind the device interface, and no private name is imported across
modules.

A module's imports are every ``import`` / ``from ... import`` in it; those inside functions and
under ``if TYPE_CHECKING:`` count for the layers (a lazy import is still a dependency) but not
for cycles (they run after every module has loaded).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "perfsdk"

LAYERS: dict[str, int] = {
    # 0 foundation: settings, clocks, the device door, plain data
    "perfsdk._version": 0, "perfsdk.errors": 0, "perfsdk.config": 0, "perfsdk.context": 0,
    "perfsdk.clocks": 0, "perfsdk._device": 0, "perfsdk.markers": 0, "perfsdk.memory": 0,
    "perfsdk._fastpath": 0,
    "perfsdk.nvml": 0, "perfsdk._progress": 0,
    "perfsdk.sync.report": 0, "perfsdk.sync.ops": 0, "perfsdk.testing.fake_cuda": 0,
    "perfsdk.testing.fake_nvml": 0, "perfsdk.testing.fake_tensor": 0,
    "perfsdk.testing.models": 0,
    # 1 engine: records, the pipeline, regions and their shells, GPU telemetry
    "perfsdk.record": 1, "perfsdk.pipeline": 1, "perfsdk.region": 1, "perfsdk.decorator": 1,
    "perfsdk.timing": 1, "perfsdk.phases": 1, "perfsdk.gpu": 1, "perfsdk.distributed": 1,
    # 2 sinks
    "perfsdk.export": 2,
    # 3 capabilities built on regions
    "perfsdk.auto": 3, "perfsdk.sync": 3, "perfsdk.advisor": 3, "perfsdk.bench": 3,
    "perfsdk.compare": 3, "perfsdk.optimize": 3, "perfsdk.flops": 3,
    # 4 the composition root
    "perfsdk.lifecycle": 4,
    # 5 front ends: the package face, the command, test helpers, the integration contract
    "perfsdk": 5, "perfsdk.__main__": 5, "perfsdk.testing": 5, "perfsdk.cli": 5,
    "perfsdk.demo": 5, "perfsdk.instrumentor": 5,
}
"""Module or package prefix -> layer; the longest prefix wins. A module may import its own
layer and those below, never one above."""

UPWARD: dict[tuple[str, str], str] = {}
"""Imports that go up a layer on purpose, each with its reason."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
# A compiled module (perfsdk/_fastpath.c) is known by its typing stub, and imports nothing.
MODULES.update({module_name(p): p for p in sorted(PACKAGE.rglob("*.pyi"))
                if module_name(p) not in MODULES})
PACKAGES = {m for m, p in MODULES.items() if p.name == "__init__.py"}


def layer(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in LAYERS:
            return LAYERS[prefix]
    raise AssertionError(f"{module} has no layer in LAYERS: add it (and to docs/architecture.md)")


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if module in PACKAGES else module.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def imports(module: str) -> tuple[set[str], set[str]]:
    """``(at import time, all)``: the perfsdk modules ``module`` imports."""
    tree = ast.parse(MODULES[module].read_text())
    eager: set[str] = set()
    every: set[str] = set()

    def visit(node: ast.AST, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            later = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.Lambda))
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                later = True
            found: list[str] = []
            if isinstance(child, ast.Import):
                found = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                source = _resolve(module, child)
                found = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source
                         for a in child.names]
            for name in found:
                while name and name not in MODULES:  # import a.b.c binds a.b.c's package too
                    name = name.rpartition(".")[0]
                if name.startswith("perfsdk") and name != module:
                    every.add(name)
                    if not later:
                        eager.add(name)
            visit(child, later)

    visit(tree, False)
    return eager, every


GRAPH = {m: imports(m) for m in MODULES}


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        layer(module)


def test_no_import_against_the_layers() -> None:
    wrong = []
    for module, (_, every) in GRAPH.items():
        for target in sorted(every):
            if target.startswith(module + "."):  # a package's face re-exports its own modules
                continue
            if layer(target) > layer(module) and (module, target) not in UPWARD:
                wrong.append(f"{module} (layer {layer(module)}) imports {target} "
                             f"(layer {layer(target)})")
    assert not wrong, "imports against docs/architecture.md's layers:\n" + "\n".join(wrong)


def test_no_import_cycle() -> None:
    eager = {m: e for m, (e, _) in GRAPH.items()}
    seen: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def walk(node: str) -> None:
        seen[node] = 1
        stack.append(node)
        for nxt in sorted(eager[node]):
            if nxt == "perfsdk":
                continue  # the root is lazy: importing it runs none of the others
            if seen.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt):], nxt]))
            elif nxt not in seen:
                walk(nxt)
        stack.pop()
        seen[node] = 2

    for module in MODULES:
        if module not in seen:
            walk(module)
    assert not cycles, "import cycles at import time:\n" + "\n".join(cycles)


@pytest.mark.parametrize("doc_line", sorted({k for k in LAYERS if k != "perfsdk"}))
def test_the_architecture_page_names_every_layer_entry(doc_line: str) -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    short = doc_line.removeprefix("perfsdk.")
    assert re.search(rf"(?<![\w.]){re.escape(short)}(?![\w])", text), (
        f"docs/architecture.md does not place {short} in a layer")


# -- the doors: torch.cuda only through _device, private names stay home -------------------------
CUDA_DOORS = ("perfsdk._device", "perfsdk.sync.debug", "perfsdk.testing")
"""The modules (or packages) that may touch ``torch.cuda`` in code: the device interface, the
sync guard's patching of ``torch.cuda.synchronize``, and the fakes that stand in for it."""


def _is_door(module: str) -> bool:
    return any(module == door or module.startswith(door + ".") for door in CUDA_DOORS)


def torch_cuda_uses(module: str) -> list[str]:
    """``file:line: code`` for each reference to ``torch.cuda`` in ``module``'s code (an import
    of it, or an attribute of a name bound to torch); docstrings and strings do not count."""
    tree = ast.parse(MODULES[module].read_text())
    path = MODULES[module].relative_to(ROOT)
    torch_names: set[str] = set()
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch.cuda" or alias.name.startswith("torch.cuda."):
                    found.append((node.lineno, f"import {alias.name}"))
                elif alias.name == "torch" or alias.name.startswith("torch."):
                    torch_names.add(alias.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module == "torch.cuda" or node.module.startswith("torch.cuda."):
                found.append((node.lineno, f"from {node.module} import ..."))
            elif node.module == "torch" and any(a.name == "cuda" for a in node.names):
                found.append((node.lineno, "from torch import cuda"))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr == "cuda"
                and isinstance(node.value, ast.Name) and node.value.id in torch_names):
            outer: ast.AST = node
            while isinstance(parents.get(outer), ast.Attribute):
                outer = parents[outer]
            found.append((node.lineno, ast.unparse(outer)))
    return [f"{path}:{line}: {code}" for line, code in sorted(found)]


def test_torch_cuda_only_through_the_device_interface() -> None:
    wrong = [use for module in MODULES if not _is_door(module)
             for use in torch_cuda_uses(module)]
    assert not wrong, ("torch.cuda outside perfsdk._device (add what is needed to its "
                       "CudaBackend and to testing.FakeCuda):\n" + "\n".join(wrong))


@pytest.mark.parametrize("source", [
    "import torch\nx = torch.cuda.is_available()",
    "import torch as th\nth.cuda.synchronize()",
    "from torch import cuda",
    "import torch.cuda.memory",
    "from torch.cuda import Event",
    "import torch.nn\ndef f():\n    return torch.cuda.device_count()",
])
def test_the_torch_cuda_check_sees(source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                   ) -> None:
    (tmp_path / "m.py").write_text(source)
    monkeypatch.setitem(MODULES, "perfsdk.m", tmp_path / "m.py")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert len(torch_cuda_uses("perfsdk.m")) == 1


def test_the_torch_cuda_check_ignores_strings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    (tmp_path / "m.py").write_text('"""Uses ``torch.cuda.Event``."""\nimport torch\n'
                                   'x = "torch.cuda.is_available()"\ny = torch.backends.cuda\n')
    monkeypatch.setitem(MODULES, "perfsdk.m", tmp_path / "m.py")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert torch_cuda_uses("perfsdk.m") == []


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(module: str) -> list[str]:
    """Each import in ``module`` of a private name from another perfsdk module, or of a private
    module from outside the package that holds it (``perfsdk._device`` belongs to all of
    perfsdk, ``perfsdk.optimize._marks`` to ``perfsdk.optimize``)."""
    tree = ast.parse(MODULES[module].read_text())
    wrong: list[str] = []

    def check_module(target: str, line: int) -> None:
        parts = target.split(".")
        for i, part in enumerate(parts):
            owner = ".".join(parts[:i])
            if _private(part) and not (module == owner or module.startswith(owner + ".")):
                wrong.append(f"{module}:{line} imports {target}, private to {owner}")
                return

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "perfsdk":
                    check_module(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            if source.split(".")[0] != "perfsdk":
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in MODULES:  # from a package import a module
                    check_module(full, node.lineno)
                    continue
                check_module(source, node.lineno)
                if _private(alias.name):
                    wrong.append(f"{module}:{node.lineno} imports {alias.name}, private to "
                                 f"{source}")
    return wrong


def test_no_private_name_imported_across_modules() -> None:
    wrong = [line for module in MODULES for line in private_imports(module)]
    assert not wrong, ("private names imported from another module (promote the name or move "
                       "the code):\n" + "\n".join(wrong))


@pytest.mark.parametrize(("module", "source", "found"), [
    ("perfsdk.auto.m", "from perfsdk.optimize._marks import region_attributes", 1),
    ("perfsdk.auto.m", "from perfsdk.optimize import _marks", 1),
    ("perfsdk.auto.m", "import perfsdk.optimize._marks", 1),
    ("perfsdk.auto.m", "from perfsdk.export.metrics import _placeholder", 1),
    ("perfsdk.auto.m", "from .steps import _helper", 1),
    ("perfsdk.auto.m", "def f():\n    from ..optimize._marks import mark", 1),
    ("perfsdk.optimize.m", "from perfsdk.optimize._marks import mark", 0),
    ("perfsdk.optimize.m", "from ._marks import mark", 0),
    ("perfsdk.auto.m", "from perfsdk import _device", 0),
    ("perfsdk.auto.m", "from perfsdk._version import __version__", 0),
    ("perfsdk.auto.m", "from perfsdk.optimize import region_attributes", 0),
])
def test_the_private_import_check_sees(module: str, source: str, found: int, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "m.py").write_text(source)
    monkeypatch.setitem(MODULES, module, tmp_path / "m.py")
    assert len(private_imports(module)) == found
