"""docs/architecture.md's claims: no import circles, layers that point one way, no re-export shims, modules sized
by concept, error types and seeds each in one module, the service reached only over HTTP, imports at the top, tests
that mirror the packages."""

import ast
import builtins
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "drgrpo_jax"


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


# The packages from the bottom up (docs/architecture.md): a module imports only from its own layer or below,
# and a layer's packages do not import each other unless listed together in one tuple.
LAYERS = (
    ("errors",),
    ("advantages", "losses", "algorithms"),  # the public math: usable in any JAX trainer
    ("sharding", "hosts", "host_memory", "weight_folders", "hub_ids", "named_tensors", "checkpoint", "seeds",
     "jsonl"),  # shared infrastructure
    ("models",),
    ("sampler",), ("step",),
    ("config",), ("serve",),
    ("data",), ("rewards",),
    ("rollout",), ("environments",), ("actor",),
    ("plan",), ("evaluate",),
    ("train",),
    ("integrations",),  # adapters for other trainers: only the public math (test_integrations_use_only_the_math)
    ("launch",),  # the run config as each cluster engine's files: nothing imports it
)
RANK = {package: rank for rank, layer in enumerate(LAYERS) for package in layer}


def _package(module: str) -> str | None:
    """drgrpo_jax.rollout.client -> rollout; the package's own __init__ (the public face) -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_package_has_a_layer():
    packages = {p for m in import_graph() if (p := _package(m)) is not None}
    assert packages == set(RANK), f"unplaced: {sorted(packages - set(RANK))}; gone: {sorted(set(RANK) - packages)}"


def test_no_package_reaches_up():
    upward = []
    for module, deps in import_graph().items():
        own = _package(module)
        if own is None:
            continue
        for dep in deps:
            other = _package(dep)
            if other is not None and other != own and RANK[other] > RANK[own]:
                upward.append(f"{module} -> {dep}")
    assert not upward, "imports that climb a layer: " + "; ".join(sorted(upward))


def test_the_math_imports_nothing_but_itself():
    graph = import_graph()
    math = {"drgrpo_jax.errors", "drgrpo_jax.advantages", "drgrpo_jax.losses", "drgrpo_jax.algorithms"}
    assert not graph["drgrpo_jax.errors"], "errors.py is the leaf every layer may import"
    for name in math:
        assert graph[name] <= math, f"{name} imports {sorted(graph[name] - math)}"


def test_integrations_use_only_the_math():
    # An adapter hands the library's math to another trainer: it must not pull the trainer, service or models in.
    math = {"drgrpo_jax.errors", "drgrpo_jax.advantages", "drgrpo_jax.losses", "drgrpo_jax.algorithms"}
    for name, deps in import_graph().items():
        if name.startswith("drgrpo_jax.integrations."):
            assert deps <= math, f"{name} imports {sorted(deps - math)}"


def _defined_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_no_module_re_exports_what_it_does_not_define():
    """Only a package's __init__ hands names on; every other `__all__` lists the module's own definitions."""
    shims = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                foreign = set(ast.literal_eval(node.value)) - _defined_names(tree)
                if foreign:
                    shims[_module_name(path)] = sorted(foreign)
    assert not shims, f"re-exported names (import them from where they are defined): {shims}"


def test_imports_name_the_defining_module():
    """`from drgrpo_jax.X import name` finds name defined in X (or a submodule), never passed through X."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    defined = {m: _defined_names(ast.parse(p.read_text())) for m, p in modules.items()}
    passed_on = []
    for module, path in modules.items():
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("drgrpo_jax"):
                for alias in node.names:
                    own = alias.name in defined.get(node.module, set())
                    if not own and f"{node.module}.{alias.name}" not in modules:
                        passed_on.append(f"{module}: {node.module}.{alias.name}")
    assert not passed_on, "imported through another module: " + "; ".join(sorted(passed_on))


SOFT_MAX_LINES = 600  # docs/architecture.md: a module is sized by concept; past this it says why it is larger


def test_modules_past_the_soft_limit_say_why():
    """A module over ~600 lines carries a `# Size:` comment saying why it is one concept."""
    unexplained = {}
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if len(text.splitlines()) > SOFT_MAX_LINES and "# Size:" not in text:
            unexplained[str(path.relative_to(PACKAGE.parent))] = len(text.splitlines())
    assert not unexplained, f"split by concept, or say why it is one (# Size: ...): {unexplained}"


def test_nothing_outside_serve_imports_serve():
    """The trainer, the planner and evaluation reach a generation service only over HTTP."""
    reaching = [f"{module} -> {dep}" for module, deps in import_graph().items() if _package(module) != "serve"
                for dep in deps if _package(dep) == "serve"]
    assert not reaching, "imports of serve/ from outside it: " + "; ".join(sorted(reaching))


def _base_names(node: ast.ClassDef) -> set[str]:
    return {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
            if isinstance(b, (ast.Name, ast.Attribute))}


def test_every_error_type_is_in_errors():
    """errors.py holds every exception class of the package (a class whose base is a built-in exception or one
    of errors.py's)."""
    errors_tree = ast.parse((PACKAGE / "errors.py").read_text())
    ours = {node.name for node in errors_tree.body if isinstance(node, ast.ClassDef)}
    builtin = {name for name, value in vars(builtins).items() if isinstance(value, type)
               and issubclass(value, BaseException)}
    elsewhere = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and _base_names(node) & (builtin | ours):
                elsewhere.append(f"{path.relative_to(PACKAGE.parent)}: {node.name}")
    assert not elsewhere, "error types outside errors.py: " + "; ".join(sorted(elsewhere))


# What starts a random stream: only seeds.py derives seeds from run.seed, and the sampler turns a request's seed
# into per-token keys (sampler/draws.py).
SEED_SOURCES = {"SeedSequence", "default_rng", "PRNGKey", "key", "Random", "getrandbits", "randbits", "seed"}
SEED_MODULES = {"drgrpo_jax.seeds", "drgrpo_jax.sampler.draws"}


def test_seeds_are_derived_in_one_module():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    found = []
    for module, path in modules.items():
        if module in SEED_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            func = node.func if isinstance(node, ast.Call) else None
            if isinstance(func, ast.Attribute) and func.attr in SEED_SOURCES and (
                    ast.unparse(func.value).endswith(("random", "secrets"))):  # np.random.X, jax.random.X, secrets.X
                found.append(f"{module}:{node.lineno} {ast.unparse(func)}")
    assert not found, "random streams started outside drgrpo_jax/seeds.py: " + "; ".join(sorted(found))


def _imports_in_functions(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    yield inner


def _has_reason(lines: list[str], lineno: int) -> bool:
    """A `#` comment on the import's line, or on a line of the run of imports and comments just above it."""
    index = lineno - 1
    if "#" in lines[index]:
        return True
    while index > 0:
        index -= 1
        text = lines[index].strip()
        if text.startswith("#"):
            return True
        if not text.startswith(("import ", "from ")):
            return False
    return False


def test_imports_inside_functions_say_why():
    """A module's header shows what it depends on: an import stays inside a function only for an optional extra
    or a start-up cost, and says which beside it."""
    silent = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        lines = text.splitlines()
        for node in _imports_in_functions(ast.parse(text)):
            if not _has_reason(lines, node.lineno):
                silent.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not silent, "imports inside functions with no reason beside them: " + ", ".join(sorted(silent))


TESTS = PACKAGE.parent / "tests"
# tests/<package>/ for each package; the top-level modules by layer: the math (layer 1) and the infrastructure
# (layer 2); the repository as a whole; support code.
TEST_DIRS_OF_MODULES = {"math": LAYERS[1], "infra": LAYERS[2], "project": (), "support": ()}


def test_tests_mirror_the_packages():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    dirs = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert dirs - set(TEST_DIRS_OF_MODULES) == packages, (
        f"test folders without a package: {sorted(dirs - packages - set(TEST_DIRS_OF_MODULES))}; "
        f"packages without a test folder: {sorted(packages - dirs)}")
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    assert modules == {m for layer in LAYERS[:3] for m in layer}, "a top-level module with no layer"
