"""The package's layout: no import circles, the layers of DESIGN.md point one way, no module past ~400 lines."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "drgrpo_jax"


def _module_name(path: pathlib.Path) -> str:
    """drgrpo_jax.models.hf_io from its path (a package is its __init__)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at top level or inside functions."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}

    def owner(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(owner(a.name) for a in node.names if a.name.startswith("drgrpo_jax"))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("drgrpo_jax"):
                submodules = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                deps |= submodules
                if len(submodules) < len(node.names):  # names defined in the module itself
                    deps.add(owner(node.module))
        graph[name] = deps - {name}
    return graph


def _cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """An import path from start back to start, if there is one."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for dep in graph[node]:
            if dep == start:
                return path + [start]
            if dep not in seen:
                seen.add(dep)
                stack.append((dep, path + [dep]))
    return None


def test_no_import_circles():
    graph = import_graph()
    # A package's __init__ re-exporting its submodules is not a circle with them.
    acyclic = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    circles = [c for m in sorted(acyclic) if (c := _cycle_through(acyclic, m))]
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_layers_point_one_way():
    graph = import_graph()
    assert not graph["drgrpo_jax.errors"], "errors.py is the leaf every layer may import"
    math = {"drgrpo_jax.advantages", "drgrpo_jax.losses", "drgrpo_jax.algorithms", "drgrpo_jax.errors"}
    for name in math:  # the math knows no model, step or host
        assert graph[name] <= math, f"{name} imports {sorted(graph[name] - math)}"
    for name, deps in graph.items():  # models/ and sharding.py know no trainer, step or service (errors: the leaf)
        if name.startswith("drgrpo_jax.models") or name == "drgrpo_jax.sharding":
            others = {d for d in deps if not d.startswith("drgrpo_jax.models")
                      and d not in ("drgrpo_jax.sharding", "drgrpo_jax.errors")}
            assert not others, f"{name} imports {sorted(others)}"


MAX_MODULE_LINES = 400  # README, Layout: past it, a module is split by concept


def test_no_module_grows_past_400_lines():
    sizes = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    large = {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not large, f"split by concept (README, Layout): {large}"
