"""The package's import graph, read from the sources: no circle among fdc_ops' modules, and the vLLM plugin reads
nothing of the Hugging Face integration (both build on the model-neutral artifact)."""

from __future__ import annotations

import ast
from pathlib import Path

import fdc_ops

PACKAGE = Path(fdc_ops.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, module: str, module_level: bool) -> set[str]:
    """The fdc_ops modules ``module`` (at ``path``) imports: at module level only (what runs on import), or
    anywhere, function bodies included. ``from X import Y`` counts X, and X.Y where that is a module."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    if module_level:  # the statements that run on import: the module's own, and those in its ifs and trys
        statements, nodes = list(tree.body), []
        while statements:
            node = statements.pop()
            if isinstance(node, (ast.If, ast.Try)):
                statements += node.body + node.orelse + getattr(node, "finalbody", [])
                statements += [s for handler in getattr(node, "handlers", []) for s in handler.body]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                nodes.append(node)
    else:
        nodes = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - node.level + 1]
            base = ".".join(anchor + ([node.module] if node.module else []))
        found.add(base)
        found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] == "fdc_ops"}


def graph(module_level: bool) -> dict[str, set[str]]:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        targets = {target for target in imported(path, name, module_level) if target in modules}
        # A module's own ancestors are initialised before it (Python imports the parents first): not edges.
        edges[name] = {t for t in targets if t != name and not name.startswith(t + ".")}
    return edges


def test_no_import_circle():
    edges = graph(module_level=True)
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges[node]):
            if state.get(target) == 1:
                circle = path[path.index(target):] + [target]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert "fdc_ops.artifact" in edges and "fdc_ops.hf" in edges["fdc_ops.calibration"]


def reached(edges: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen, stack = set(), [start]
    while stack:
        for target in edges.get(stack.pop(), ()):
            if target not in seen:
                seen.add(target)
                stack.append(target)
    return seen


def test_the_vllm_plugin_needs_nothing_from_the_hugging_face_side():
    """Not in its own modules, and not on import through the modules it imports (fdc_ops.parallel once loaded the HF
    side through fdc_ops.calibration): the plugin and the HF integration share only the model-neutral artifact."""
    edges, on_import = graph(module_level=False), graph(module_level=True)
    hf_side = ("fdc_ops.hf", "fdc_ops.calibration")
    for name in edges:
        if name.startswith("fdc_ops.vllm"):
            assert not any(t.startswith(hf_side) for t in edges[name]), (name, edges[name])
            loaded = reached(on_import, name)
            assert not any(t.startswith(hf_side) for t in loaded), (name, loaded)
    for name in ("fdc_ops.artifact", "fdc_ops.identity", "fdc_ops.model_families"):
        assert not any(t.startswith(("fdc_ops.hf", "fdc_ops.vllm", "fdc_ops.calibration")) for t in
                       graph(module_level=True)[name]), name
