"""The package's shape, held: no import cycle, imports that point only downward by the layer
table of docs/architecture.md (which covers every module), no module over 400 lines and no
class over 250. A limit the next feature would break is a reason to split, not to raise it."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "radixserve"
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 250


def module_imports(package_dir: Path, package: str) -> dict[str, set[str]]:
    """Each module of the package and the package modules it imports, at any depth of its
    code (function-level imports included)."""
    modules = {}
    for path in package_dir.rglob("*.py"):
        parts = list(path.relative_to(package_dir).with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        if is_init:
            parts = parts[:-1]
        modules[".".join([package, *parts])] = (path, is_init)
    graph = {}
    for name, (path, is_init) in modules.items():
        here = name.split(".") if is_init else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                root = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{root}.{alias.name}"
                    targets.add(sub if sub in modules else root)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycle_in(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def layer_table() -> dict[str, int]:
    """docs/architecture.md's layer table above L0 (the kernels, a package of their own): each
    entry of a row's modules column (`tokenizer`, a module; `mem/`, a subpackage;
    `quant/weights`, a module of a subpackage) -> its layer."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    entries = {}
    for layer, modules in re.findall(r"^\| L([1-9]) \| ([^|]+) \|", text, re.M):
        for entry in re.findall(r"`([^`]+)`", modules):
            entries["radixserve." + entry.rstrip("/").replace("/", ".")] = int(layer)
    return entries


def layer_of(module: str, table: dict[str, int]) -> int | None:
    """The layer of the table's most specific entry that contains `module`."""
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        if (layer := table.get(".".join(parts[:n]))) is not None:
            return layer
    return None


def test_the_package_has_no_import_cycle():
    graph = module_imports(PACKAGE, "radixserve")
    assert "radixserve.server.http" in graph
    assert cycle_in(graph) is None, " -> ".join(cycle_in(graph))


def test_the_layer_table_covers_every_module_and_names_only_real_ones():
    graph, table = module_imports(PACKAGE, "radixserve"), layer_table()
    assert len(set(table.values())) == 7, table
    uncovered = [m for m in graph if m != "radixserve" and layer_of(m, table) is None]
    assert not uncovered, f"modules in no layer of docs/architecture.md: {uncovered}"
    unknown = [entry for entry in table if entry not in graph]
    assert not unknown, f"layer table entries that name no module or package: {unknown}"


def test_imports_point_only_downward():
    graph, table = module_imports(PACKAGE, "radixserve"), layer_table()
    upward = [
        f"{module} (L{layer_of(module, table)}) imports {target} (L{layer_of(target, table)})"
        for module, targets in graph.items()
        if module != "radixserve"
        for target in targets
        if target != "radixserve" and layer_of(target, table) > layer_of(module, table)
    ]
    assert not upward, "\n".join(upward)


def test_the_router_depends_on_no_server_route_module():
    graph = module_imports(PACKAGE, "radixserve")
    routes = {"radixserve.server.api", "radixserve.server.openai_api"}
    for name, targets in graph.items():
        if name.startswith("radixserve.router"):
            assert not targets & routes, (name, targets & routes)


def test_no_module_over_400_lines_and_no_class_over_250():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(ROOT)
        if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
            too_long.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                if (lines := node.end_lineno - node.lineno + 1) > MAX_CLASS_LINES:
                    too_long.append(f"{name}: class {node.name}, {lines} lines")
    assert not too_long, "split these along a seam:\n" + "\n".join(too_long)


def test_the_limits_catch_what_they_claim_to(tmp_path):
    """The checks themselves: a cycle, an upward import and an oversized class are found."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "low.py").write_text("from . import high\n")
    (tmp_path / "pkg" / "high.py").write_text("from .low import x\n")
    graph = module_imports(tmp_path / "pkg", "pkg")
    assert cycle_in(graph) is not None
    table = {"pkg.low": 1, "pkg.high": 2}
    assert layer_of("pkg.low", table) < layer_of("pkg.high", table)
    assert "pkg.high" in graph["pkg.low"]  # the upward edge the test above would report


def test_every_subpackage_is_installed():
    """pyproject.toml lists the packages a wheel holds: a subpackage missing there is missing
    from every install that is not editable."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(("radixserve", *p.parent.relative_to(PACKAGE).parts))
        for p in PACKAGE.rglob("__init__.py")
    }
    assert found <= listed, f"add to pyproject.toml's packages: {sorted(found - listed)}"
