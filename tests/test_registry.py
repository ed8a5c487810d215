"""The registry and the plugin load policy, with in-process plugins (always unregistered afterwards)."""

from __future__ import annotations

import sys

import pytest

import alpacafarm
from alpacafarm.errors import PluginError, UnknownNameError
from alpacafarm.plugins import get_plugins, get_registry
from alpacafarm.registry import Registry, import_target


class LazyPlugin:
    @alpacafarm.hookimpl
    def register_methods(self, register):
        register("lazy_method", "tests_lazy_target_module:Thing", description="never imported unless used")

    @alpacafarm.hookimpl
    def register_evaluators(self, register):
        register("ev", "alpacafarm.method:Method")


class ClashingPlugin:
    @alpacafarm.hookimpl
    def register_methods(self, register):
        register("split_instructions", "alpacafarm.method:Method")


class BrokenHookPlugin:
    @alpacafarm.hookimpl
    def register_methods(self, register):
        raise RuntimeError("boom in hook")


class MisspelledHookPlugin:
    @alpacafarm.hookimpl
    def register_method(self, register):  # missing "s": must be rejected, not silently ignored
        register("x", "alpacafarm.method:Method")


def test_builtins_are_registered_through_entry_points():
    loaded = get_plugins()
    builtin = {p.name for p in loaded.plugins if p.builtin}
    assert {"data", "models"} <= builtin
    assert loaded.registry.entry("method", "split_instructions").plugin == "data"


def test_lazy_targets_are_not_imported_until_used(register_test_plugin):
    register_test_plugin(LazyPlugin(), "lazy")
    registry = get_registry()
    entry = registry.entry("method", "lazy_method")
    assert entry.is_lazy and entry.plugin == "lazy" and entry.description == "never imported unless used"
    assert "tests_lazy_target_module" not in sys.modules
    with pytest.raises(PluginError, match=r"method 'lazy_method' of plugin 'lazy'.*tests_lazy_target_module"):
        entry.load()
    assert registry.get("evaluator", "ev") is alpacafarm.method.Method


def test_duplicate_name_names_both_plugins(register_test_plugin):
    register_test_plugin(ClashingPlugin(), "clasher")
    with pytest.raises(PluginError) as info:
        get_registry()
    message = str(info.value)
    assert "split_instructions" in message and "'data'" in message and "'clasher'" in message


def test_a_hook_that_raises_is_reported_and_the_rest_load(register_test_plugin, capsys):
    register_test_plugin(BrokenHookPlugin(), "broken")
    loaded = get_plugins()
    (failure,) = [p for p in loaded.plugins if p.name == "broken"]
    assert "boom in hook" in failure.error
    assert "split_instructions" in loaded.registry.names("method")
    assert "plugin 'broken'" in capsys.readouterr().err


def test_misspelled_hook_is_rejected_with_the_valid_names(register_test_plugin):
    register_test_plugin(MisspelledHookPlugin(), "typo")
    (failure,) = [p for p in get_plugins().plugins if p.name == "typo"]
    assert "register_method" in failure.error and "register_methods" in failure.error
    assert "x" not in get_registry().names("method")


def test_unknown_name_gets_did_you_mean_and_the_list():
    with pytest.raises(UnknownNameError) as info:
        get_registry().entry("method", "split_instruction")
    message = str(info.value)
    assert "did you mean 'split_instructions'" in message
    assert "known: " in message and "inspect_model" in message


def test_registry_rejects_bad_registrations():
    registry = Registry()
    with pytest.raises(PluginError, match="non-empty string"):
        registry.add("method", "", "a:b", "p")
    with pytest.raises(PluginError, match="unknown kind"):
        registry.add("widget", "w", "a:b", "p")
    with pytest.raises(PluginError, match="module:attr"):
        import_target("no_colon_here")


def test_hook_implementations_may_take_fewer_arguments(register_test_plugin):
    class NoArgs:
        @alpacafarm.hookimpl
        def register_validators(self):
            return None

    register_test_plugin(NoArgs(), "noargs")
    assert not [p for p in get_plugins().failures if p.name == "noargs"]
