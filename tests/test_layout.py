"""The layout keeps the architecture readable (docs/development.md: The code layout): imports go one way, and
each constant and preset has one home. Read from the source with `ast`, so an import inside a function counts too."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cli", "modellab", "api", "worker", "shared", "migrations")

# What each package may import from the project (itself always). `shared/` is the leaf: `migrate.py` only finds
# the `migrations` package's folder with it. `cli` is the top: nothing imports it.
MAY_IMPORT = {
    "cli": {"modellab", "api", "worker", "shared"},
    "modellab": {"worker", "shared"},
    "api": {"shared"},
    "worker": {"shared"},
    "shared": {"migrations"},
    "migrations": {"shared"},
}


def source_files(package: str) -> Iterator[Path]:
    yield from sorted((ROOT / package).rglob("*.py"))


def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted module name) of every import in the file, relative ones resolved."""
    package_parts = list(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                yield node.lineno, ".".join([*base, *([node.module] if node.module else [])])
            else:
                yield node.lineno, node.module


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_the_package_rules_are_complete():
    found = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} - {"tests", "models"}
    assert found == set(PACKAGES) == set(MAY_IMPORT), "a new top-level package needs its place in MAY_IMPORT"


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_go_one_way(package: str):
    """cli -> modellab -> worker -> shared; cli -> api -> shared. Nothing imports cli or tests."""
    allowed = MAY_IMPORT[package] | {package}
    wrong = [f"{rel(path)}:{line} imports {module}"
             for path in source_files(package)
             for line, module in imported_modules(path)
             if module.split(".")[0] in {*PACKAGES, "tests"} and module.split(".")[0] not in allowed]
    assert not wrong, f"{package}/ may import only {sorted(allowed)}:\n" + "\n".join(wrong)


# Inside api/: every module belongs to a package of one concern (docs/development.md: The code layout); only main.py,
# the app factory that includes each package's routers, sits at the top.
API_TOP = {"__init__.py", "main.py"}


def test_the_api_has_no_flat_module_but_main():
    flat = sorted(path.name for path in (ROOT / "api").glob("*.py"))
    assert set(flat) == API_TOP, f"api/ holds only {sorted(API_TOP)}; put {sorted(set(flat) - API_TOP)} in a package"
    assert all((path / "__init__.py").exists() for path in (ROOT / "api").iterdir()
               if path.is_dir() and path.name != "__pycache__" and any(path.rglob("*.py")))


def api_imports() -> dict[str, set[str]]:
    """Each api module and the api modules it imports (`from api.x import y` names module api.x.y where there is one)."""
    modules = {module_name(path): path for path in source_files("api")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = graph.setdefault(name, set())
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    child = f"{node.module}.{alias.name}"
                    found.add(child if child in modules else node.module)
        found &= set(modules)
        found.discard(name)
    return graph


def api_package(module: str) -> str:
    """The api package a module belongs to (`api.openai.chat.routes` -> `api.openai`); `api.main` is its own."""
    return ".".join(module.split(".")[:2])


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, as the nodes along it, or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return [*path[path.index(node):], node]
        if node in done:
            return None
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if found := visit(target):
                return found
        path.pop()
        done.add(node)
        return None

    return next((found for node in sorted(graph) if (found := visit(node))), None)


def test_the_api_packages_import_no_circle():
    """The packages of api/ import one another one way (http at the bottom, main at the top: docs/development.md), and
    so do their modules."""
    modules = api_imports()
    packages: dict[str, set[str]] = {}
    for module, imported in modules.items():
        packages.setdefault(api_package(module), set()).update(
            api_package(target) for target in imported if api_package(target) != api_package(module))
    assert circle(packages) is None, "api packages import in a circle: " + " -> ".join(circle(packages))
    assert circle(modules) is None, "api modules import in a circle: " + " -> ".join(circle(modules))
    assert not any("api.main" in imported for imported in modules.values()), "nothing imports the app factory"


def test_the_circle_check_finds_one():
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


# Inside worker/: what each room may import from the project (itself always; `shared` always, except where said).
# Imports only go down: tasks -> engine -> {ledger, decoder, model, memory} -> generation; the decoder knows
# neither the ledger nor the database (docs/architecture.md §2).
WORKER_ROOMS = {
    "worker.tasks": {"worker.engine", "worker.ledger", "worker.model", "worker.metrics", "shared"},
    "worker.engine": {"worker.ledger", "worker.decoder", "worker.model", "worker.memory", "worker.metrics",
                      "worker.generation", "shared"},
    "worker.ledger": {"worker.generation", "shared"},
    "worker.decoder": {"worker.model.tokens", "worker.generation", "shared.grammar"},  # a row's grammar, plain data
    "worker.model": {"worker.memory", "worker.generation", "shared.manifest", "shared.base_match", "shared.base_source",
                     "shared.calibration", "shared.schemas", "shared.settings", "shared.adapter_identity"},
    "worker.memory": {"worker.decoder"},  # type hints only (under TYPE_CHECKING)
    "worker.metrics": {"worker.generation", "worker.ledger", "shared"},
    "worker.generation": {"shared.grammar"},  # type hints only (under TYPE_CHECKING)
}
# What the decoder must never reach, directly or not: the job ledger, the database and Celery.
DECODER_NEVER = ("worker.ledger", "worker.engine", "worker.tasks", "shared.db", "shared.models", "shared.queue",
                 "sqlalchemy", "celery")


def room(module: str) -> str | None:
    return next((r for r in sorted(WORKER_ROOMS, key=len, reverse=True)
                 if module == r or module.startswith(r + ".")), None)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_worker_module_has_a_room():
    assert [rel(p) for p in source_files("worker") if module_name(p) != "worker" and room(module_name(p)) is None] == []


def test_inside_the_worker_imports_only_go_down():
    wrong = []
    for path in source_files("worker"):
        own = room(module_name(path))
        if own is None:
            continue
        for line, module in imported_modules(path):
            if module.split(".")[0] not in PACKAGES or room(module) == own:
                continue
            if not any(module == allowed or module.startswith(allowed + ".") for allowed in WORKER_ROOMS[own]):
                wrong.append(f"{rel(path)}:{line} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_the_decoder_reaches_neither_the_ledger_nor_the_database():
    """Followed through every project module the decoder imports, and theirs."""
    by_name = {module_name(p): p for package in PACKAGES for p in source_files(package)}
    seen, todo, reached = set(), [m for m in by_name if m.startswith("worker.decoder")], []
    while todo:
        name = todo.pop()
        if name in seen or name not in by_name:
            continue
        seen.add(name)
        for _line, module in imported_modules(by_name[name]):
            if any(module == never or module.startswith(never + ".") for never in DECODER_NEVER):
                reached.append(f"{name} imports {module}")
            todo += [module, module.rsplit(".", 1)[0]]
    assert not reached, "\n".join(reached)


def project_imports(path: Path, known: set[str]) -> set[str]:
    """The project modules importing `path` runs: each module it names (`from a.b import c` names `a.b.c` where that
    is a module, else `a.b`) and the packages above it, whose `__init__` runs first; type hints and imports inside
    functions count too (a cycle through them is one edit away from a circular import)."""
    named = set()
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            named.add(node.module)
            named.update(f"{node.module}.{alias.name}" for alias in node.names)
    reached = {".".join(name.split(".")[:i]) for name in named for i in range(1, name.count(".") + 2)}
    return (reached & known) - {module_name(path)}


def import_cycles(package: str) -> list[list[str]]:
    """The modules of `package` that import each other in a circle, directly or not: each strongly connected
    component of the import graph with more than one module (Tarjan's algorithm), or a module importing itself."""
    paths = {module_name(p): p for p in source_files(package)}
    graph = {name: sorted(project_imports(path, set(paths))) for name, path in paths.items()}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(name: str) -> None:
        order[name] = low[name] = len(order)
        stack.append(name)
        for other in graph[name]:
            if other not in order:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in stack:
                low[name] = min(low[name], order[other])
        if low[name] == order[name]:
            component = stack[stack.index(name):]
            del stack[stack.index(name):]
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in sorted(graph):
        if name not in order:
            visit(name)
    return cycles


def test_no_worker_modules_import_each_other_in_a_circle():
    """The captured step and prefill get what they need handed in (worker/decoder/state.py), not by importing the
    decoder that imports them; likewise everywhere in worker/."""
    assert import_cycles("worker") == []


def test_the_kernels_know_nothing_of_the_decoder_that_installs_them():
    """worker/decoder/kernels/ replaces the model's operations; rows, steps and who runs next are the decoder's and
    the engine's, so a kernel imports only other kernels."""
    kernels = "worker.decoder.kernels"
    wrong = [f"{rel(path)}:{line} imports {module}"
             for path in source_files("worker") if module_name(path).startswith(kernels)
             for line, module in imported_modules(path)
             if module.startswith("worker.") and not (module == kernels or module.startswith(kernels + "."))]
    assert not wrong, "\n".join(wrong)


def test_the_cycle_check_finds_a_circle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    package = tmp_path / "loop"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from loop.b import thing\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from loop import c\n")
    (package / "c.py").write_text("def late():\n    import loop.a\n")
    (package / "d.py").write_text("import loop.a\n")  # imports the circle, is not in it
    monkeypatch.setitem(globals(), "ROOT", tmp_path)  # source_files and module_name read it
    assert import_cycles("loop") == [["loop.a", "loop.b", "loop.c"]]


def assignments(name: str) -> list[str]:
    """Every file (and line) in the packages that binds `name` at any level."""
    found = []
    for package in PACKAGES:
        for path in source_files(package):
            for node in ast.walk(parsed(path)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                    node, ast.AnnAssign) else []
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    found.append(f"{rel(path)}:{node.lineno}")
    return found


def calls(name: str) -> set[str]:
    """The files in the packages that call `name(...)` (plain or as an attribute)."""
    found = set()
    for package in PACKAGES:
        for path in source_files(package):
            for node in ast.walk(parsed(path)):
                if isinstance(node, ast.Call) and name in (getattr(node.func, "id", None),
                                                           getattr(node.func, "attr", None)):
                    found.add(rel(path))
    return found


def test_adapters_are_defined_in_one_place():
    assert [where.split(":")[0] for where in assignments("ADAPTERS")] == ["shared/settings.py"]
    assert [where.split(":")[0] for where in assignments("Adapter")] == ["shared/settings.py"]


def test_the_lora_presets_are_defined_in_one_place():
    assert [where.split(":")[0] for where in assignments("LORA_PRESETS")] == ["modellab/presets.py"]
    assert calls("LoraPreset") == {"modellab/presets.py"}


def test_the_nf4_config_has_one_home():
    assert calls("BitsAndBytesConfig") == {"worker/model/quantization.py"}
