"""A lazy, typed registry of everything plugins provide.

Names map to objects or to ``"module:attr"`` strings that are imported on first use. The registry is filled
by :func:`alpacafarm.plugins.get_registry` from the plugin hooks; nothing registers into it at import time.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass, field
from typing import Any

from alpacafarm.errors import PluginError, UnknownNameError

#: The kinds of things a plugin can register, keyed by kind, valued by the hook that registers them.
KINDS: dict[str, str] = {
    "method": "register_methods",
    "annotator": "register_annotators",
    "evaluator": "register_evaluators",
    "validator": "register_validators",
    "generation_backend": "register_generation_backends",
    "command": "register_commands",
}


@dataclass
class Entry:
    """One registered name: what it points to and which plugin registered it."""

    kind: str
    name: str
    target: Any
    plugin: str
    description: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    _loaded: Any = field(default=None, repr=False)

    @property
    def is_lazy(self) -> bool:
        return isinstance(self.target, str)

    def load(self) -> Any:
        """Import the target if it is a ``"module:attr"`` string; errors name the plugin and the target."""
        if not self.is_lazy:
            return self.target
        if self._loaded is None:
            self._loaded = import_target(self.target, what=f"{self.kind} {self.name!r} of plugin {self.plugin!r}")
        return self._loaded



def import_target(spec: str, what: str = "target") -> Any:
    """Resolve ``"package.module:attr.sub"`` to the object it names."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise PluginError(f"{what}: target {spec!r} is not of the form 'module:attr'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(f"{what}: cannot import {module_name!r}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise PluginError(f"{what}: {module_name!r} has no attribute {attr_path!r}") from exc
    return obj


def did_you_mean(name: str, choices: list[str]) -> str:
    """A suffix such as ``"; did you mean 'offline'?"`` (empty when nothing is close)."""
    close = difflib.get_close_matches(name, choices, n=3, cutoff=0.6)
    if not close:
        return ""
    # Only the near-best: 'split_instruction' suggests 'split_instructions', not also 'expert_iteration'.
    best = difflib.SequenceMatcher(None, name, close[0]).ratio()
    close = [c for c in close if difflib.SequenceMatcher(None, name, c).ratio() >= best - 0.05]
    return "; did you mean " + " or ".join(repr(c) for c in close) + "?"


class Registry:
    """All registered names, one namespace per kind."""

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}

    def add(
        self, kind: str, name: str, target: Any, plugin: str, description: str = "", **metadata: Any
    ) -> Entry:
        if kind not in self._entries:
            raise PluginError(f"plugin {plugin!r}: unknown kind {kind!r}")
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {plugin!r}: a {kind} name must be a non-empty string, got {name!r}")
        if not isinstance(target, str) and not callable(target):
            raise PluginError(f"plugin {plugin!r}: {kind} {name!r} target must be 'module:attr' or callable")
        existing = self._entries[kind].get(name)
        if existing is not None:
            raise PluginError(
                f"{kind} {name!r} is registered by two plugins: {existing.plugin!r} and {plugin!r}; "
                f"uninstall one or disable it with ALPACAFARM_PLUGINS"
            )
        entry = Entry(kind, name, target, plugin, description, dict(metadata))
        self._entries[kind][name] = entry
        return entry

    def names(self, kind: str) -> list[str]:
        return sorted(self._entries[kind])

    def entries(self, kind: str) -> list[Entry]:
        return [self._entries[kind][n] for n in self.names(kind)]

    def __contains__(self, key: tuple[str, str]) -> bool:
        """``("method", "sft") in registry``."""
        kind, name = key
        return name in self._entries.get(kind, {})

    def entry(self, kind: str, name: str) -> Entry:
        """The entry for ``name``; an unknown name raises with "did you mean" and the full list."""
        try:
            return self._entries[kind][name]
        except KeyError:
            known = self.names(kind)
            listing = ", ".join(known) if known else "(none registered)"
            raise UnknownNameError(
                f"unknown {kind.replace('_', ' ')} {name!r}{did_you_mean(name, known)} (known: {listing})"
            ) from None

    def get(self, kind: str, name: str) -> Any:
        """The loaded object registered as ``name`` (imports a lazy target)."""
        return self.entry(kind, name).load()

    def by_plugin(self) -> dict[str, dict[str, list[str]]]:
        """``{plugin: {kind: [names]}}`` for listings."""
        out: dict[str, dict[str, list[str]]] = {}
        for kind, entries in self._entries.items():
            for entry in entries.values():
                out.setdefault(entry.plugin, {}).setdefault(kind, []).append(entry.name)
        for kinds in out.values():
            for names in kinds.values():
                names.sort()
        return out
