"""Our own training loops (PPO, Quark) touch no private attribute of the libraries they run on.

A file under ``plugins/alpacafarm_methods/ppo/`` or ``quark/`` may not read, write or override a private name
(``_x``, not a dunder) of transformers, accelerate, deepspeed, torch, TRL or peft:

* ``obj._x`` where ``obj`` is not ``self`` / ``cls`` is refused unless ``_x`` is a name our own code in that folder
  defines (a ``def _x``, or an ``_x`` assigned on ``self``, in a class or at module level) — so
  ``trainer._created_lr_scheduler = True`` or ``accelerator.state._shared_state`` fail, and
  ``trainer._save_checkpoint()`` (ours) passes; on a name bound to a library module (``accelerate.state._x``) it
  is always refused;
* in a class deriving from a library's class (a ``Trainer``, an ``nn.Module``), ``self._x`` and ``def _x`` are
  refused where ``_x`` is a private name of that library class or its bases (read from their source): a subclass
  setting ``self._loss_shifts_labels`` or overriding ``_get_train_sampler`` fails;
* ``from <library> import _x`` is refused.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("plugins/alpacafarm_methods/ppo", "plugins/alpacafarm_methods/quark")
LIBRARIES = ("transformers", "accelerate", "deepspeed", "torch", "trl", "peft")
PRIVATE = re.compile(r"^_[A-Za-z0-9]\w*$")  # not dunders, not a bare "_"
SOURCE_PRIVATE = re.compile(r"(?:self\.|cls\.|def )(_[A-Za-z0-9]\w*)")


def is_private(name: str) -> bool:
    return bool(PRIVATE.match(name)) and not name.endswith("__")


def library_bindings(tree: ast.Module) -> dict[str, str]:
    """Names a module binds to a library's module or object: ``{name: dotted path}``."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in LIBRARIES:
                    bound[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0])
    return bound


def dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def resolve(path: str) -> object | None:
    """The object at a dotted ``path`` (a module, then attributes), or None where it cannot be imported."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj
    return None


def library_private_names(cls: type) -> set[str]:
    """The private names (``self._x``, ``cls._x``, ``def _x``) in the source of ``cls``'s library bases."""
    names: set[str] = set()
    for base in inspect.getmro(cls):
        if base.__module__.split(".")[0] not in LIBRARIES:
            continue
        names |= {name for name in vars(base) if is_private(name)}
        with contextlib.suppress(OSError, TypeError):  # a class without Python source
            names |= set(SOURCE_PRIVATE.findall(inspect.getsource(base)))
    return names


def own_private_names(trees: list[ast.Module]) -> set[str]:
    """The private names our code in these modules defines: functions and methods, and names assigned at module or
    class level or on ``self``."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and is_private(node.name):
                names.add(node.name)
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign | ast.AugAssign) else []
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name) and is_private(leaf.id):
                        names.add(leaf.id)
                    elif (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                          and leaf.value.id in ("self", "cls") and is_private(leaf.attr)):
                        names.add(leaf.attr)
    return names


def private_accesses(sources: dict[str, str]) -> list[str]:
    """Every use of a library's private name in ``sources`` (file name -> text of one folder), one line each."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    ours = own_private_names(list(trees.values()))
    found: list[str] = []
    for file, tree in trees.items():
        bound = library_bindings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
                found += [f"{file}:{node.lineno}: from {node.module} import {a.name}" for a in node.names
                          if is_private(a.name)]
        library_private: dict[int, set[str]] = {}  # id(a self/cls Attribute or a def) -> its class's library names
        for cls_node in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            names: set[str] = set()
            for base in cls_node.bases:
                path = dotted(base)
                root = path.split(".")[0] if path else None
                if root in bound:
                    obj = resolve(bound[root] + path[len(root):])
                    if isinstance(obj, type):
                        names |= library_private_names(obj)
            if not names:
                continue
            for node in ast.walk(cls_node):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in names:
                    found.append(f"{file}:{node.lineno}: def {node.name} overrides a private method of "
                                 f"{', '.join(ast.unparse(b) for b in cls_node.bases)}")
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                        and node.value.id in ("self", "cls") and node.attr in names):
                    library_private[id(node)] = names
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not is_private(node.attr):
                continue
            root = node.value
            while isinstance(root, ast.Attribute | ast.Call | ast.Subscript):
                root = root.func if isinstance(root, ast.Call) else root.value
            name = root.id if isinstance(root, ast.Name) else ""
            if id(node) in library_private:
                found.append(f"{file}:{node.lineno}: {ast.unparse(node)} is the library base class's private name")
            elif name in bound:
                found.append(f"{file}:{node.lineno}: {ast.unparse(node)} is private to {bound[name]}")
            elif name not in ("self", "cls") and node.attr not in ours:
                found.append(f"{file}:{node.lineno}: {ast.unparse(node)} is not a name our code defines")
    return found


def folder_sources(folder: str) -> dict[str, str]:
    return {str(p.relative_to(REPO_ROOT)): p.read_text(encoding="utf-8")
            for p in sorted((REPO_ROOT / folder).glob("*.py"))}


@pytest.mark.parametrize("folder", FOLDERS)
def test_our_training_loops_touch_no_private_name_of_a_library(folder: str):
    sources = folder_sources(folder)
    assert len(sources) >= 4, folder
    assert private_accesses(sources) == []


QUARK_TRAINER = "plugins/alpacafarm_methods/quark/trainer.py"

#: What the Quark trainer did before it was its own loop, each appended to the real trainer file.
BREAKS = {
    "a Trainer's private flag, on the trainer": (
        "\n\ndef build(trainer):\n    trainer._created_lr_scheduler = True\n", "trainer._created_lr_scheduler"),
    "a private attribute of accelerate's state": (
        "\n\ndef shared(trainer):\n    return trainer.accelerator.state._shared_state\n", "_shared_state"),
    "a Trainer subclass setting a private attribute of Trainer": (
        "\n\nfrom transformers import Trainer\n\n\nclass Old(Trainer):\n    def __init__(self, *a, **k):\n"
        "        super().__init__(*a, **k)\n        self._loss_shifts_labels = True\n", "self._loss_shifts_labels"),
    "a Trainer subclass overriding a private method of Trainer": (
        "\n\nfrom transformers import Trainer\n\n\nclass Old(Trainer):\n"
        "    def _get_train_sampler(self, train_dataset=None):\n        return None\n", "def _get_train_sampler"),
    "a private name imported from a library": (
        "\n\nfrom accelerate.state import _shared_state_reset\n", "import _shared_state_reset"),
    "a private attribute of a library module": (
        "\n\nimport torch\n\n\ndef rng():\n    return torch.random._seed\n", "torch.random._seed"),
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_the_check_refuses_what_the_old_quark_trainer_did(name: str):
    """Each break, appended to the real Quark trainer (which passes as it is), is found, in one line naming it."""
    sources = folder_sources("plugins/alpacafarm_methods/quark")
    addition, expected = BREAKS[name]
    sources[QUARK_TRAINER] += addition
    found = private_accesses(sources)
    assert len(found) == 1 and expected in found[0] and found[0].startswith(QUARK_TRAINER), found


def test_our_own_private_names_pass():
    """A private method of our own, called on another object, and a private helper of a plain class pass."""
    sources = {"a.py": "class Loop:\n    def _save(self):\n        self._count = 1\n\n\n"
                       "def run(loop):\n    loop._save()\n    return loop._count\n",
               "b.py": "import torch\n\n\nclass Head(torch.nn.Module):\n    def _scale(self, x):\n        return x\n\n"
                       "    def forward(self, x):\n        return self._scale(x)\n"}
    assert private_accesses(sources) == []
