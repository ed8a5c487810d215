"""The plugin load policy: entry points of group ``alpacafarm`` → a pluggy manager → a :class:`Registry`.

- Every installed distribution may declare ``[project.entry-points.alpacafarm] name = "module"``; the built-ins
  (shipped in the ``alpacafarm`` distribution) are loaded the same way.
- ``ALPACAFARM_DISABLE_PLUGIN_AUTOLOAD=1`` skips third-party entry points (the built-ins still load).
- ``ALPACAFARM_PLUGINS=a,b`` is an allow-list of third-party entry-point names.
- A plugin that fails to import (or whose hook raises) is recorded with its error and skipped; the rest load.
- Built-ins register first, then third-party plugins by entry-point name. Duplicate names are an error naming both
  plugins (ARCHITECTURE.md): a plugin that registers a name another plugin registered (or one name twice, or an
  entry-point name another distribution declared) makes every command stop with one line saying which two
  plugins clash and how to resolve it (uninstall one, or leave it out of ``ALPACAFARM_PLUGINS``); never a silent
  choice of one of them. ``alpacafarm plugins`` still lists what is installed before it stops.
- Nothing happens at import time: the registry is built on the first :func:`get_registry` call.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import pluggy

from alpacafarm import PROJECT_NAME, hookspecs
from alpacafarm.errors import PluginError
from alpacafarm.registry import PLUGIN_KINDS, REGISTER_KEYWORDS, Registry

ENTRY_POINT_GROUP = PROJECT_NAME
DISABLE_AUTOLOAD_ENV = "ALPACAFARM_DISABLE_PLUGIN_AUTOLOAD"
ALLOW_LIST_ENV = "ALPACAFARM_PLUGINS"
BUILTIN_DISTRIBUTION = "alpacafarm"


@dataclass
class PluginInfo:
    """What is known about one plugin, loaded or not."""

    name: str
    distribution: str
    version: str
    module: str
    builtin: bool
    error: str | None = None
    #: set (with ``error`` holding the reason) when the plugin claims a name another plugin registered: an error
    #: for every command (:func:`get_plugins`); none of its names are registered
    clash: bool = False


@dataclass
class LoadedPlugins:
    """The result of loading: the pluggy manager, the filled registry, and every plugin's status."""

    manager: pluggy.PluginManager
    registry: Registry
    plugins: list[PluginInfo] = field(default_factory=list)

    @property
    def failures(self) -> list[PluginInfo]:
        return [p for p in self.plugins if p.error is not None]


_extra_plugins: dict[str, Any] = {}
_loaded: LoadedPlugins | None = None


def _allow_list() -> set[str] | None:
    raw = os.environ.get(ALLOW_LIST_ENV, "").strip()
    return {name.strip() for name in raw.split(",") if name.strip()} if raw else None


def _autoload_disabled() -> bool:
    return os.environ.get(DISABLE_AUTOLOAD_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def load_plugins() -> LoadedPlugins:
    """Build a fresh plugin manager and registry from entry points and explicitly registered plugins."""
    manager = pluggy.PluginManager(PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    infos: list[PluginInfo] = []
    disabled, allowed = _autoload_disabled(), _allow_list()

    def builtin_first(ep: Any) -> tuple[bool, str]:
        return (ep.dist is None or ep.dist.name != BUILTIN_DISTRIBUTION, ep.name)

    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=builtin_first):
        dist_name = ep.dist.name if ep.dist else "?"
        builtin = dist_name == BUILTIN_DISTRIBUTION
        if not builtin and (disabled or (allowed is not None and ep.name not in allowed)):
            continue
        info = PluginInfo(ep.name, dist_name, ep.dist.version if ep.dist else "?", ep.value, builtin)
        infos.append(info)
        if manager.has_plugin(ep.name):
            first = next(i.distribution for i in infos if i.name == ep.name)
            info.error = f"declares entry-point name {ep.name!r}, which distribution {first!r} declares too"
            info.clash = True
            continue
        try:
            _register(manager, ep.load(), ep.name)
        except Exception as exc:  # a broken plugin must not take the others down
            info.error = _describe_error(exc)

    for name, plugin in _extra_plugins.items():
        module = getattr(plugin, "__name__", type(plugin).__name__)
        info = PluginInfo(name, "(registered in-process)", "-", module, builtin=False)
        infos.append(info)
        try:
            _register(manager, plugin, name)
        except Exception as exc:
            info.error = _describe_error(exc)

    registry = Registry()
    registry.plugin_versions = {info.name: info.version for info in infos}
    for info in infos:
        if info.error is None:
            _fill(registry, manager, info)
    return LoadedPlugins(manager, registry, infos)


def _fill(registry: Registry, manager: pluggy.PluginManager, info: PluginInfo) -> None:
    """Add everything plugin ``info`` registers, or nothing: a hook that raises, a bad registration or a name that
    is taken leaves the registry as it was and records why on ``info``.

    Each hook is called through pluggy's hook caller (``pm.hook.<name>``: tracing, monitoring and hookwrappers
    see every call), limited to this plugin's implementation (:func:`plugin_hook_caller`), so that ``register``
    knows which plugin a name comes from."""
    staged = Registry()
    for kind, spec in PLUGIN_KINDS.items():
        caller = plugin_hook_caller(manager, spec.hook, info.name)
        if caller is None:
            continue
        try:
            caller(register=Registration(staged, kind, spec.hook, info.name))
        except _RegisteredTwice as exc:
            info.error, info.clash = str(exc), True
            return
        except _BadRegistration as exc:
            info.error = str(exc)
            return
        except Exception as exc:
            info.error = f"hook {spec.hook} raised {_describe_error(exc)}"
            return
    for kind in staged.kinds():
        for entry in staged.entries(kind):
            if (kind, entry.name) in registry:
                first = registry.entry(kind, entry.name).plugin
                info.error = f"registers {kind} {entry.name!r}, which plugin {first!r} registers too"
                info.clash = True
                return
    for kind in staged.kinds():
        for entry in staged.entries(kind):
            registry.add(kind, entry.name, entry.target, entry.plugin, entry.description, identity=entry.identity,
                         args=entry.args, kwargs=entry.kwargs, runtime=entry.runtime)


def plugin_hook_caller(manager: pluggy.PluginManager, hook: str, plugin: str) -> Any:
    """Pluggy's caller of ``hook`` limited to ``plugin``'s implementation and every plugin's hookwrappers (None:
    ``plugin`` implements no such hook). Calling it runs pluggy's hook execution: ``pm.trace``, hook-call
    monitoring and wrappers work as for ``pm.hook.<name>(...)``."""
    caller = getattr(manager.hook, hook)
    impls = [impl for impl in caller.get_hookimpls() if not (impl.hookwrapper or impl.wrapper)]
    if not any(impl.plugin_name == plugin for impl in impls):
        return None
    return manager.subset_hook_caller(hook, remove_plugins=[i.plugin for i in impls if i.plugin_name != plugin])


class Registration:
    """The ``register`` callback one plugin's hook receives (:class:`alpacafarm.hookspecs.Register`): it stages the
    plugin's names; every keyword is named in the spec, and an unknown one is an error naming the plugin."""

    def __init__(self, staged: Registry, kind: str, hook: str, plugin: str) -> None:
        self.staged, self.kind, self.hook, self.plugin = staged, kind, hook, plugin

    def __call__(self, name: str, target: str | Callable[..., Any], *, description: str = "",
                 identity: str | None = None, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                 runtime: Sequence[str] = (), **unknown: Any) -> None:
        if unknown:
            raise _BadRegistration(
                f"{self.hook}: register({name!r}, ...) got the unknown keyword {sorted(unknown)[0]!r} (the keywords "
                f"of a registration are {', '.join(REGISTER_KEYWORDS)}: alpacafarm.hookspecs.Register)")
        if isinstance(name, str) and (self.kind, name) in self.staged:
            raise _RegisteredTwice(f"registers {self.kind} {name!r} twice")
        try:
            self.staged.add(self.kind, name, target, self.plugin, description, identity=identity, args=args,
                            kwargs=kwargs, runtime=runtime)
        except PluginError as exc:
            raise _BadRegistration(f"{self.hook}: {str(exc).removeprefix(f'plugin {self.plugin!r}: ')}") from None


class _BadRegistration(PluginError):
    """A registration the contract refuses (unknown keyword, bad name or target, runtime the kind lacks)."""


class _RegisteredTwice(PluginError):
    """A plugin registered one name of one kind twice."""


def _register(manager: pluggy.PluginManager, plugin: Any, name: str) -> None:
    """Register one plugin and reject hook implementations that match no hookspec (misspelled hooks)."""
    manager.register(plugin, name=name)
    try:
        manager.check_pending()
    except pluggy.PluginValidationError as exc:
        manager.unregister(name=name)
        raise PluginError(f"{exc}; valid hooks: {', '.join(k.hook for k in PLUGIN_KINDS.values())}") from exc


def clash_error(loaded: LoadedPlugins) -> PluginError | None:
    """The error of the first name clash among the plugins (None: no clash): one line naming both plugins."""
    for info in loaded.plugins:
        if info.clash:
            return PluginError(f"plugin name clash: plugin {info.name!r} ({info.distribution}) {info.error}; "
                               f"duplicate names are an error: uninstall one of the two plugins, or leave "
                               f"{info.name!r} out of {ALLOW_LIST_ENV}")
    return None


def get_plugins() -> LoadedPlugins:
    """The process-wide plugins, loaded on first use; import failures are reported once on stderr (the other
    plugins work), a name clash raises :class:`PluginError` (:func:`clash_error`)."""
    global _loaded
    if _loaded is None:
        loaded = load_plugins()
        clash = clash_error(loaded)
        if clash is not None:
            raise clash
        _loaded = loaded
        report_failures(loaded)
    return _loaded


def report_failures(loaded: LoadedPlugins) -> None:
    """One warning line on stderr per plugin that failed to load (the others work)."""
    for info in loaded.failures:
        if not info.clash:
            print(f"warning: plugin {info.name!r} ({info.distribution}) failed to load: {info.error}",
                  file=sys.stderr)


def get_registry() -> Registry:
    """The process-wide registry of methods, annotators, evaluators, validators, backends and commands."""
    return get_plugins().registry


def reset_plugins() -> None:
    """Forget the loaded plugins; the next :func:`get_registry` reloads them (tests, long-lived sessions)."""
    global _loaded
    _loaded = None


def register_plugin(plugin: Any, name: str) -> None:
    """Add a plugin object (module or instance with ``@hookimpl`` functions) in-process, e.g. from a test."""
    _extra_plugins[name] = plugin
    reset_plugins()


def unregister_plugin(name: str) -> None:
    """Remove a plugin added with :func:`register_plugin`."""
    _extra_plugins.pop(name, None)
    reset_plugins()
