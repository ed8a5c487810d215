"""Which code a stage ran: a hash of the source files of the plugin packages behind its method and judge.

Part of every stage's fingerprint (:mod:`alpacafarm.pipeline`): a method whose code changed re-runs even when its
plugin's version was not bumped, so a run directory (and the CI gate, ``alpacafarm bench``) never reuses outputs
that other code produced. The packages are the top-level packages of every class in the method's (or judge's)
class hierarchy — a subclass of a built-in method counts both — except the core ``alpacafarm`` and the libraries
it depends on (:data:`NOT_HASHED`: their versions are recorded in every manifest) and Python's own modules.
A package is all its ``*.py`` files (``__pycache__`` left out); a single-module plugin is its one file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

#: Top-level packages whose code is not hashed (besides Python's own modules): the core and the libraries it
#: depends on, which a method may subclass (their versions are recorded in every manifest).
NOT_HASHED = frozenset({"alpacafarm", "torch", "transformers", "trl", "peft", "accelerate", "datasets", "openai",
                        "pluggy", "rich", "scipy", "numpy", "yaml", "pydantic", "pydantic_core", "gguf",
                        "matplotlib"})


def code_packages(*objects: Any) -> list[str]:
    """The top-level packages of the classes (and their bases) of ``objects``, sorted, :data:`NOT_HASHED` left out."""
    found = set()
    for obj in objects:
        cls = obj if isinstance(obj, type) else type(obj)
        for klass in cls.__mro__:
            top = klass.__module__.split(".")[0]
            if top not in NOT_HASHED and top not in sys.stdlib_module_names:
                found.add(top)
    return sorted(found)


def source_files(package: str) -> list[tuple[str, Path]]:
    """``(path inside the package, file)`` of every ``*.py`` file of a top-level package (or of a single-module
    plugin's one file), in a stable order; none for a name that is not importable. ``__main__`` (a method defined
    in the script that runs the pipeline) is that script's file; an interactive session has none."""
    if package == "__main__":
        main_file = getattr(sys.modules.get("__main__"), "__file__", None)
        return [(Path(main_file).name, Path(main_file))] if main_file and Path(main_file).is_file() else []
    spec = importlib.util.find_spec(package)
    if spec is None:
        return []
    if spec.submodule_search_locations:
        files = []
        for location in spec.submodule_search_locations:
            root = Path(location)
            files += [(str(p.relative_to(root)), p) for p in root.rglob("*.py") if "__pycache__" not in p.parts]
        return sorted(files)
    origin = Path(spec.origin) if spec.origin else None
    return [(origin.name, origin)] if origin is not None and origin.is_file() else []


def package_digest(package: str) -> str:
    """A SHA-256 over the package's source files: each file's path inside the package and its bytes."""
    digest = hashlib.sha256()
    for name, path in source_files(package):
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def code_identity(*objects: Any) -> dict[str, str]:
    """``{package: digest}`` of the code behind ``objects`` (classes or instances): see the module docstring."""
    return {package: package_digest(package) for package in code_packages(*objects)}


def stage_code_identity(method_cls: Any, recipe: Any, registry: Any, stage: str | None = None) -> dict[str, str]:
    """The code behind a stage: its method class and, when it has an ``annotator_role``, its judge for it (the
    stage's own or the recipe's: a judge whose code changed re-labels, so the stage re-runs)."""
    classes: list[Any] = [method_cls]
    role = method_cls.annotator_role
    ref = recipe.annotator_for(role, stage) if role is not None else None
    if ref is not None:
        classes.append(registry.get("annotator", ref.name))
    return code_identity(*classes)
