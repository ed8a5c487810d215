"""The code's structure, checked: the data flows one way and plugins are not each other's libraries.

- the core (``alpacafarm``) never imports a plugin;
- a built-in plugin imports no other plugin (what two plugins share lives in the core);
- no module imports a private name (``_x``) from another module;
- no import circles among modules (imports inside functions and ``TYPE_CHECKING`` blocks count too);
- no source file grows past ~500 lines (one concept per file);
- the core is layered (:data:`LAYERS`): no module imports from a layer above its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted([*REPO.glob("alpacafarm/**/*.py"), *REPO.glob("plugins/*/**/*.py")])
MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO / "plugins" if path.is_relative_to(REPO / "plugins") else REPO)
                 .with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in SOURCES}


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import statement in the file, wherever it stands."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names = [alias.name for alias in node.names]
            submodules = [f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES]
            found.append((base, [n for n in names if f"{base}.{n}" not in MODULES]))
            found.extend((m, []) for m in submodules)
    return found


def top(name: str) -> str:
    return name.split(".")[0]


def test_the_core_never_imports_a_plugin_and_plugins_never_import_each_other():
    offending = []
    for name, path in MODULES.items():
        for imported, _ in imports(path):
            if not top(imported).startswith("alpacafarm_"):
                continue
            if top(name) == "alpacafarm" or top(imported) != top(name):
                offending.append(f"{name} imports {imported}")
    assert offending == []


def test_no_private_name_is_imported_from_another_module():
    offending = [f"{name} takes {n} from {imported}" for name, path in MODULES.items()
                 for imported, names in imports(path) if imported in MODULES and imported != name
                 for n in names if n.startswith("_") and not n.startswith("__")]
    assert offending == []


def test_there_are_no_import_circles():
    graph = {name: {imported for imported, _ in imports(path) if imported in MODULES and imported != name}
             for name, path in MODULES.items()}
    circles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(" -> ".join([*stack[stack.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circles == []


def test_no_source_file_is_over_the_size_limit():
    sizes = {str(p.relative_to(REPO)): len(p.read_text(encoding="utf-8").splitlines()) for p in SOURCES}
    assert {path: n for path, n in sizes.items() if n > MAX_LINES} == {}


def test_the_checks_see_the_code():  # the rules above would pass vacuously on an empty or misread tree
    assert {"alpacafarm.registry", "alpacafarm_methods.preference.dpo", "alpacafarm_evaluation.results"} <= set(MODULES)
    assert (("alpacafarm.errors", ["PluginError", "UnknownNameError", "did_you_mean"])
            in imports(MODULES["alpacafarm.registry"]))


#: The core's layers, lowest first: a module imports only from its own layer or the ones below it, so the data
#: flows one way (docs/architecture.md describes them). A new core module must be placed here.
LAYERS: dict[str, set[str]] = {
    "foundation": {"alpacafarm", "alpacafarm.errors", "alpacafarm.types", "alpacafarm.console", "alpacafarm.seeding",
                   "alpacafarm.paths", "alpacafarm.hookspecs", "alpacafarm.code_identity", "alpacafarm.prompts",
                   "alpacafarm.library_logs", "alpacafarm.validation", "alpacafarm.exit_status",
                   "alpacafarm.validated_input", "alpacafarm.hardware", "alpacafarm.artifact_names"},
    "processes, models and stores": {"alpacafarm.distributed", "alpacafarm.launch_configs",
                                     "alpacafarm.training_progress", "alpacafarm.model_sources",
                                     "alpacafarm.sampling", "alpacafarm.annotation_cache", "alpacafarm.yamlsource",
                                     "alpacafarm.scaffold", "alpacafarm.annotation_batches",
                                     "alpacafarm.processes", "alpacafarm.readings"},
    "plugins and recipes": {"alpacafarm.plugin_config", "alpacafarm.registry", "alpacafarm.plugins",
                            "alpacafarm.annotation", "alpacafarm.recipe", "alpacafarm.data",
                            "alpacafarm.model_loading"},
    "the method contract": {"alpacafarm.generation", "alpacafarm.rewards", "alpacafarm.training",
                            "alpacafarm.artifacts", "alpacafarm.method", "alpacafarm.stage_attempts",
                            "alpacafarm.divergence"},
    "the method helpers": {"alpacafarm.training_rows", "alpacafarm.reward_selection", "alpacafarm.policy_training",
                           "alpacafarm.preference_rows", "alpacafarm.preference_training"},
    "the run": {"alpacafarm.manifest", "alpacafarm.run_directory", "alpacafarm.stage_wiring", "alpacafarm.pipeline"},
    "entry points": {"alpacafarm.cli", "alpacafarm.__main__", "alpacafarm.testing", "alpacafarm.testing.launch",
                     "alpacafarm.testing.openai_server", "alpacafarm.testing.pytest_plugin",
                     "alpacafarm.testing.batch_server"},
}


def layer_of(module: str) -> int:
    return next(i for i, members in enumerate(LAYERS.values()) if module in members)


def test_every_core_module_has_a_layer():
    core = {name for name in MODULES if top(name) == "alpacafarm"}
    placed = set().union(*LAYERS.values())
    assert sorted(core - placed) == [] and sorted(placed - core) == []


def test_no_core_module_imports_from_a_layer_above_its_own():
    names = list(LAYERS)
    upward = [f"{name} ({names[layer_of(name)]}) imports {imported} ({names[layer_of(imported)]})"
              for name, path in MODULES.items() if top(name) == "alpacafarm"
              for imported, _ in imports(path) if imported in MODULES and top(imported) == "alpacafarm"
              and layer_of(imported) > layer_of(name)]
    assert upward == []
