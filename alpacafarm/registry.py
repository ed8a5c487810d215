"""A lazy registry of everything plugins provide, typed per kind, and the one place that builds plugin objects.

Names map to objects or to ``"module:attr"`` strings that are imported on first use. The registry is filled
by :func:`alpacafarm.plugins.get_registry` from the plugin hooks; nothing registers into it at import time.
What a registration may say is :class:`alpacafarm.hookspecs.Register`, keyword by keyword; each is a field of
:class:`Entry`. :meth:`Registry.create` validates a config block with the target's ``config_class`` (once: an
already validated config object passes through), builds the object with exactly the runtime arguments its
registration declares (``runtime=``: the registration is the declaration, never the target's signature), and
checks it is of the kind's base class.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from alpacafarm.errors import PluginError, UnknownNameError, did_you_mean


@dataclass(frozen=True)
class Kind:
    """One kind of registered thing: its hook, the base class what it builds must be, the runtime arguments."""

    hook: str
    #: ``"module:attr"`` of the base class every built object is an instance of (None: not built, e.g. commands)
    base: str | None
    #: keyword arguments :meth:`Registry.create` offers besides the config; a target receives those its
    #: registration declares (``runtime=``), each ``None`` when the caller has none (``registry``: the registry)
    runtime: tuple[str, ...] = ()
    #: whether a registration of this kind may say ``identity=`` (what the built object's results depend on)
    identity: bool = False


#: The kinds of things a plugin can register, by kind name. What a target must be is documented in hookspecs.
PLUGIN_KINDS: dict[str, Kind] = {
    "method": Kind("register_methods", "alpacafarm.method:Method"),
    "annotator": Kind("register_annotators", "alpacafarm.annotation:Annotator", ("registry", "cache", "budget"),
                      identity=True),
    "evaluator": Kind("register_evaluators", "alpacafarm.method:Method"),
    "validator": Kind("register_validators", "alpacafarm.validation:Validator"),
    "generation_backend": Kind("register_generation_backends", "alpacafarm.generation:Generator",
                               ("spec", "model_path")),
    "command": Kind("register_commands", None),
}

#: The keywords of a registration besides ``name`` and ``target`` (:class:`alpacafarm.hookspecs.Register`).
REGISTER_KEYWORDS = ("description", "identity", "args", "kwargs", "runtime")


@dataclass
class Entry:
    """One registered name: what it points to, which plugin registered it, and how the target is made and called.

    ``args``/``kwargs``: the imported object is called once with them, on first use, and the result is the target
    (a factory taking, e.g., the name of a config file); without them the imported object is the target.
    ``runtime``: the runtime arguments of the kind the target takes. ``identity``: ``"module:function"``,
    ``function(registry, name)`` returning what the built object's results depend on beyond its config.
    """

    kind: str
    name: str
    target: Any
    plugin: str
    description: str = ""
    identity: str | None = None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    runtime: tuple[str, ...] = ()
    _loaded: Any = field(default=None, repr=False)
    _made: bool = field(default=False, repr=False)

    @property
    def is_lazy(self) -> bool:
        return isinstance(self.target, str)

    @property
    def what(self) -> str:
        """How errors name this entry: its kind, name and plugin."""
        return f"{self.kind} {self.name!r} of plugin {self.plugin!r}"

    def load(self) -> Any:
        """The target: the ``"module:attr"`` string imported, then called with ``args``/``kwargs`` if it has any
        (once); errors name the plugin and the target."""
        if self._made:
            return self._loaded
        obj = import_target(self.target, what=self.what) if self.is_lazy else self.target
        if self.args or self.kwargs:
            try:
                obj = obj(*self.args, **self.kwargs)
            except PluginError:
                raise
            except Exception as exc:
                first = (str(exc).splitlines() or [""])[0][:200]
                raise PluginError(f"{self.what}: making the target {_target_name(self.target)}(*args, **kwargs) "
                                  f"raised {type(exc).__name__}{': ' + first if first else ''}") from exc
        self._loaded, self._made = obj, True
        return obj


def _target_name(target: Any) -> str:
    return target if isinstance(target, str) else getattr(target, "__qualname__", type(target).__name__)


def config_class_of(target: Any) -> Any:
    """The target's ``config_class`` (a pydantic model or dataclass; None without one): the one attribute the
    registry reads from every target (:mod:`alpacafarm.hookspecs`). The base classes declare it (None)."""
    return getattr(target, "config_class", None)


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
        self._entries: dict[str, dict[str, Entry]] = {kind: {} for kind in PLUGIN_KINDS}
        #: the installed version of each plugin (by plugin name): part of every stage's fingerprint
        self.plugin_versions: dict[str, str] = {}

    def add(self, kind: str, name: str, target: Any, plugin: str, description: str = "", *,
            identity: str | None = None, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
            runtime: Sequence[str] = ()) -> Entry:
        """Add one registration (the keywords are those of :class:`alpacafarm.hookspecs.Register`)."""
        if kind not in self._entries:
            raise PluginError(f"plugin {plugin!r}: unknown kind {kind!r}")
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {plugin!r}: a {kind} name must be a non-empty string, got {name!r}")
        what = f"plugin {plugin!r}: {kind} {name!r}"
        if not isinstance(target, str) and not callable(target):
            raise PluginError(f"{what}: target must be 'module:attr' or callable")
        if not isinstance(description, str):
            raise PluginError(f"{what}: description= must be a string, got {type(description).__name__}")
        spec = PLUGIN_KINDS[kind]
        if identity is not None and not spec.identity:
            raise PluginError(f"{what}: identity= applies to annotators only")
        if identity is not None and not (isinstance(identity, str) and identity.count(":") == 1):
            raise PluginError(f"{what}: identity= must be a 'module:function' string, got {identity!r}")
        if isinstance(args, str | bytes) or not isinstance(args, Sequence):
            raise PluginError(f"{what}: args= must be a tuple or list, got {type(args).__name__}")
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise PluginError(f"{what}: kwargs= must be a dict, got {type(kwargs).__name__}")
        if isinstance(runtime, str) or not isinstance(runtime, Sequence):
            raise PluginError(f"{what}: runtime= must be a tuple of names, got {runtime!r}")
        for argument in runtime:
            if argument not in spec.runtime:
                offered = ", ".join(spec.runtime) or "none"
                raise PluginError(f"{what}: target {_target_name(target)} declares runtime argument {argument!r}, "
                                  f"which {kind.replace('_', ' ')}s are not offered (offered: {offered})")
        existing = self._entries[kind].get(name)
        if existing is not None:
            raise PluginError(
                f"{kind} {name!r} is registered by two plugins: {existing.plugin!r} and {plugin!r}; "
                f"uninstall one or disable it with ALPACAFARM_PLUGINS"
            )
        entry = Entry(kind, name, target, plugin, description, identity, tuple(args), dict(kwargs or {}),
                      tuple(dict.fromkeys(runtime)))
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

    def target_class(self, kind: str, name: str) -> type:
        """The class registered as ``name`` for a kind whose targets are classes of its base (methods,
        evaluators): anything else is one line naming the plugin, before a recipe reads what the class declares."""
        entry = self.entry(kind, name)
        target = entry.load()
        base = import_target(PLUGIN_KINDS[kind].base or "", what=f"base class of kind {kind!r}")
        if not (isinstance(target, type) and issubclass(target, base)):
            raise PluginError(f"{entry.what}: its target {_target_name(entry.target)} is not a subclass of "
                              f"{base.__module__}.{base.__name__}")
        return target

    def config(self, kind: str, name: str, data: Any = None, *, source: Any = None, path: tuple = ()) -> Any:
        """``data`` validated by the config class of ``name``'s target (see :mod:`alpacafarm.plugin_config`).

        Errors name ``source``'s file and line for ``path`` (a :class:`~alpacafarm.yamlsource.SourcedDocument`).
        """
        from alpacafarm.plugin_config import validate_plugin_config

        return validate_plugin_config(config_class_of(self.get(kind, name)), data, source, path)

    def create(self, kind: str, name: str, config: Any = None, *, source: Any = None, path: tuple = (),
               **runtime: Any) -> Any:
        """Build the object registered as ``name``: ``target(config, **declared)``, checked against the kind's base.

        ``config`` is a config block (validated here) or a config object validated before (passed through).
        ``runtime`` holds the kind's runtime arguments (:data:`PLUGIN_KINDS`) the caller has; the target receives
        exactly those its registration declares (``runtime=``), a declared one the caller lacks as ``None``
        (``registry``: this registry). A target that cannot be called that way (a declared argument it has no
        parameter for, a required one its registration does not declare) is one line naming its plugin, the target
        and the call.
        """
        spec = PLUGIN_KINDS[kind]
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
        built = call_target(entry, target, config, {argument: runtime.get(argument) for argument in entry.runtime})
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


def call_target(entry: Entry, target: Any, config: Any, runtime: dict[str, Any]) -> Any:
    """``target(config, **runtime)``. A ``TypeError`` out of it (the call not matching the target's parameters, or
    a bug inside the target) is a plugin error: one line naming the plugin, the target and how it was called."""
    try:
        return target(config, **runtime)
    except TypeError as exc:
        first = (str(exc).splitlines() or [""])[0][:200]
        declared = ", ".join(runtime) or "none"
        raise PluginError(f"{entry.what}: calling {_target_name(entry.target)}(config, **runtime) with the runtime "
                          f"arguments its registration declares ({declared}; runtime=) raised TypeError: {first}"
                          ) from exc
