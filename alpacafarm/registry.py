"""A lazy registry of everything plugins provide, typed per kind, and the one place that builds plugin objects.

Names map to objects or to ``"module:attr"`` strings that are imported on first use. The registry is filled
by :func:`alpacafarm.plugins.get_registry` from the plugin hooks; nothing registers into it at import time.
:meth:`Registry.create` validates a config block with the target's ``config_class`` (once: an already
validated config object passes through), builds the object and checks it is of the kind's base class.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any

from alpacafarm.errors import PluginError, UnknownNameError, did_you_mean


@dataclass(frozen=True)
class Kind:
    """One kind of registered thing: its hook, the base class what it builds must be, the runtime arguments."""

    hook: str
    #: ``"module:attr"`` of the base class every built object is an instance of (None: not built, e.g. commands)
    base: str | None
    #: keyword arguments :meth:`Registry.create` may pass besides the config, to targets whose signature names them
    runtime: tuple[str, ...] = ()


#: The kinds of things a plugin can register, by kind name. What a target must be is documented in hookspecs.
KINDS: dict[str, Kind] = {
    "method": Kind("register_methods", "alpacafarm.method:Method"),
    "annotator": Kind("register_annotators", "alpacafarm.annotation:Annotator", ("registry", "cache", "budget")),
    "evaluator": Kind("register_evaluators", "alpacafarm.method:Method"),
    "validator": Kind("register_validators", "alpacafarm.validation:Validator"),
    "generation_backend": Kind("register_generation_backends", "alpacafarm.generation:Generator",
                               ("spec", "model_path")),
    "command": Kind("register_commands", None),
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
    except Exception as exc:  # the plugin's module itself raised while importing: name it, not 40 lines of stack
        first = (str(exc).splitlines() or [""])[0][:200]
        raise PluginError(f"{what}: importing {module_name!r} raised {type(exc).__name__}"
                          f"{': ' + first if first else ''} (a bug in that plugin; --debug shows where)") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise PluginError(f"{what}: {module_name!r} has no attribute {attr_path!r}") from exc
    return obj


class Registry:
    """All registered names, one namespace per kind."""

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}
        #: the installed version of each plugin (by plugin name): part of every stage's fingerprint
        self.plugin_versions: dict[str, str] = {}

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

    def kinds(self) -> list[str]:
        return list(self._entries)

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

    def config(self, kind: str, name: str, data: Any = None, *, source: Any = None, path: tuple = ()) -> Any:
        """``data`` validated by the config class of ``name``'s target (see :mod:`alpacafarm.plugin_config`).

        Errors name ``source``'s file and line for ``path`` (a :class:`~alpacafarm.yamlsource.SourcedDocument`).
        """
        from alpacafarm.plugin_config import validate_plugin_config

        target = self.get(kind, name)
        return validate_plugin_config(getattr(target, "config_class", None), data, source, path)

    def create(self, kind: str, name: str, config: Any = None, *, source: Any = None, path: tuple = (),
               **runtime: Any) -> Any:
        """Build the object registered as ``name``: ``target(config, **runtime)``, checked against the kind's base.

        ``config`` is a config block (validated here) or a config object validated before (passed through).
        ``runtime`` holds the kind's runtime arguments (:data:`KINDS`); a target receives those its signature
        names, so a plugin may accept fewer (as pluggy hook implementations may).
        """
        spec = KINDS[kind]
        entry = self.entry(kind, name)
        if spec.base is None:
            raise PluginError(f"{kind} targets are not built from a config")
        unknown = set(runtime) - set(spec.runtime)
        if unknown:
            raise TypeError(f"create({kind!r}): unexpected runtime arguments {sorted(unknown)}")
        if "registry" in spec.runtime:
            runtime.setdefault("registry", self)  # what a target builds from the registry comes from this one
        target = entry.load()
        config = self.config(kind, name, config, source=source, path=path)
        built = target(config, **_accepted(target, runtime))
        base = import_target(spec.base, what=f"base class of kind {kind!r}")
        if not isinstance(built, base):
            raise PluginError(f"{kind} {name!r} of plugin {entry.plugin!r} built a {type(built).__name__}, "
                              f"not a {base.__module__}.{base.__name__}")
        return built

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


def _accepted(target: Any, offered: dict[str, Any]) -> dict[str, Any]:
    """The ``offered`` keyword arguments that ``target``'s signature takes (all of them with ``**kwargs``)."""
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):  # a builtin without a signature: offer nothing
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(offered)
    return {k: v for k, v in offered.items() if k in parameters}
