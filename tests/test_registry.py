"""The registry and the plugin load policy, with in-process plugins (always unregistered afterwards)."""

from __future__ import annotations

import sys

import pytest

import alpacafarm
from alpacafarm.errors import PluginError, UnknownNameError
from alpacafarm.plugins import get_plugins, get_registry, load_plugins
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
        register("own_name", "alpacafarm.method:Method")
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


def test_a_plugin_claiming_a_taken_name_is_an_error_naming_both_plugins(register_test_plugin):
    register_test_plugin(ClashingPlugin(), "clasher")
    with pytest.raises(PluginError) as info:
        get_plugins()
    assert str(info.value) == (
        "plugin name clash: plugin 'clasher' ((registered in-process)) registers method 'split_instructions', which "
        "plugin 'data' registers too; duplicate names are an error: uninstall one of the two plugins, or leave "
        "'clasher' out of ALPACAFARM_PLUGINS")
    with pytest.raises(PluginError):  # every time: a clash is never forgotten after the first report
        get_registry()
    loaded = load_plugins()  # what ``alpacafarm plugins`` lists before it stops
    (clasher,) = [p for p in loaded.plugins if p.name == "clasher"]
    assert clasher.clash and "own_name" not in loaded.registry.names("method")


def test_a_plugin_registering_one_name_twice_is_an_error(register_test_plugin):
    class Twice:
        @alpacafarm.hookimpl
        def register_annotators(self, register):
            register("twice", "alpacafarm.annotation:Annotator")
            register("twice", "alpacafarm.annotation:Annotator")

    register_test_plugin(Twice(), "twice")
    with pytest.raises(PluginError, match=r"plugin 'twice' .* registers annotator 'twice' twice; duplicate names"):
        get_plugins()


def test_a_bad_registration_fails_only_its_plugin(register_test_plugin):
    class Bad:
        @alpacafarm.hookimpl
        def register_methods(self, register):
            register("fine_name", "alpacafarm.method:Method")
            register("", "alpacafarm.method:Method")

    register_test_plugin(Bad(), "bad")
    (info,) = [p for p in get_plugins().plugins if p.name == "bad"]
    assert not info.clash and "non-empty string" in info.error
    assert "fine_name" not in get_registry().names("method") and "split_instructions" in get_registry().names("method")


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


# ------------------------------------------------------------------------------------------ Registry.create


def _registry_with(kind: str, name: str, target) -> Registry:
    registry = Registry()
    registry.add(kind, name, target, "test-plugin")
    return registry


def test_create_validates_a_block_once_and_passes_a_validated_config_through():
    from pydantic import BaseModel, ConfigDict

    from alpacafarm.annotation import Annotator
    from alpacafarm.errors import RecipeError

    validations = []

    class JudgeConfig(BaseModel):
        model_config = ConfigDict(extra="forbid")
        margin: int = 0

        def model_post_init(self, _context) -> None:
            validations.append(self.margin)

    class Judge(Annotator):
        config_class = JudgeConfig

        def __init__(self, config):
            self.config = config

    registry = _registry_with("annotator", "judge", Judge)
    judge = registry.create("annotator", "judge", {"margin": "3"})
    assert isinstance(judge.config, JudgeConfig) and judge.config.margin == 3 and validations == [3]
    again = registry.create("annotator", "judge", judge.config)  # a config object is not validated again
    assert again.config is judge.config and validations == [3]
    with pytest.raises(RecipeError, match=r"stages\[0\]\.config\.margn: unknown key 'margn'; did you mean 'margin'"):
        registry.create("annotator", "judge", {"margn": 1}, path=("stages", 0, "config"))


def test_create_passes_exactly_the_runtime_arguments_a_registration_declares():
    from alpacafarm.generation import Generator

    seen = {}

    def narrow(config, model_path):  # declares model_path, not spec
        seen["narrow"] = (config, model_path)
        return Generator()

    def wide(config, **runtime):
        seen["wide"] = runtime
        return Generator()

    registry = Registry()
    registry.add("generation_backend", "narrow", narrow, "p", runtime=("model_path",))
    registry.add("generation_backend", "wide", wide, "p", runtime=("spec", "model_path"))
    registry.create("generation_backend", "narrow", None, spec="S", model_path="M")
    registry.create("generation_backend", "wide", {}, model_path="M")  # a declared one the caller lacks: None
    assert seen == {"narrow": (None, "M"), "wide": {"spec": None, "model_path": "M"}}
    with pytest.raises(TypeError, match="unexpected runtime arguments"):
        registry.create("generation_backend", "wide", None, cache="C")


def test_a_misspelt_runtime_parameter_is_an_error_naming_the_target():
    from alpacafarm.annotation import Annotator

    class Pool(Annotator):
        def __init__(self, config, *, regsitry=None):  # a misspelt parameter must never silently get nothing
            self.registry = regsitry

    registry = Registry()
    registry.add("annotator", "pool", Pool, "p", runtime=("registry",))
    with pytest.raises(PluginError, match=r"^annotator 'pool' of plugin 'p': calling .*Pool\(config, \*\*runtime\) "
                                          r"with the runtime arguments its registration declares \(registry; "
                                          r"runtime=\) raised TypeError: .*unexpected keyword argument 'registry'$"):
        registry.create("annotator", "pool")


def test_a_required_parameter_the_registration_does_not_declare_is_an_error_naming_the_target():
    from alpacafarm.generation import Generator

    def backend(config, spec, model_path):
        return Generator()

    registry = Registry()
    registry.add("generation_backend", "b", backend, "p", runtime=("spec",))
    with pytest.raises(PluginError, match=r"^generation_backend 'b' of plugin 'p': calling .*backend\(config, "
                                          r"\*\*runtime\) with the runtime arguments its registration declares "
                                          r"\(spec; runtime=\) raised TypeError: .*missing 1 required positional "
                                          r"argument: 'model_path'$"):
        registry.create("generation_backend", "b", spec="S", model_path="M")


def test_a_runtime_argument_the_kind_does_not_offer_is_refused_at_registration(register_test_plugin):
    class Offers:
        @alpacafarm.hookimpl
        def register_validators(self, register):
            register("v", "pkg.module:Validator", runtime=("registry",))

    register_test_plugin(Offers(), "offers")
    (info,) = [p for p in get_plugins().plugins if p.name == "offers"]
    assert info.error == ("register_validators: validator 'v': target pkg.module:Validator declares runtime argument "
                          "'registry', which validators are not offered (offered: none)")


def test_an_unknown_registration_keyword_is_an_error_naming_the_plugin_and_the_keyword(register_test_plugin, capsys):
    class Typo:
        @alpacafarm.hookimpl
        def register_annotators(self, register):
            register("judge", "alpacafarm.annotation:Annotator", identiy="pkg.mod:weights")  # silently kept before

    register_test_plugin(Typo(), "typo-plugin")
    loaded = get_plugins()
    (info,) = [p for p in loaded.plugins if p.name == "typo-plugin"]
    assert "judge" not in loaded.registry.names("annotator")
    assert info.error == ("register_annotators: register('judge', ...) got the unknown keyword 'identiy' (the keywords "
                          "of a registration are description, identity, args, kwargs, runtime: "
                          "alpacafarm.hookspecs.Register)")
    assert "plugin 'typo-plugin'" in capsys.readouterr().err


def test_identity_is_an_annotators_keyword():
    registry = Registry()
    with pytest.raises(PluginError, match=r"method 'm': identity= applies to annotators only"):
        registry.add("method", "m", "alpacafarm.method:Method", "p", identity="pkg.mod:fn")


def test_the_register_protocol_names_every_keyword_a_registration_takes():
    import inspect

    from alpacafarm.hookspecs import Register
    from alpacafarm.plugins import Registration
    from alpacafarm.registry import REGISTER_KEYWORDS

    spec = inspect.signature(Register.__call__).parameters
    assert [n for n, p in spec.items() if p.kind is p.KEYWORD_ONLY] == list(REGISTER_KEYWORDS)
    assert not [p for p in spec.values() if p.kind is p.VAR_KEYWORD]  # no untyped **metadata
    implemented = inspect.signature(Registration.__call__).parameters
    assert [n for n, p in implemented.items() if p.kind is p.KEYWORD_ONLY] == list(REGISTER_KEYWORDS)


def test_args_make_the_target_once_on_first_use(register_test_plugin, tmp_path, monkeypatch):
    (tmp_path / "tests_factory_module.py").write_text(
        "from alpacafarm.annotation import Annotator\n"
        "MADE = []\n"
        "class Judge(Annotator):\n"
        "    def __init__(self, config, *, cache=None):\n"
        "        self.cache = cache\n"
        "class Preset:\n"
        "    def __init__(self, file, *, strict=False):\n"
        "        MADE.append((file, strict))\n"
        "    def __call__(self, config, *, cache=None):\n"
        "        return Judge(config, cache=cache)\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))

    class Presets:
        @alpacafarm.hookimpl
        def register_annotators(self, register):
            register("preset_a", "tests_factory_module:Preset", args=("a.yaml",), kwargs={"strict": True},
                     runtime=("cache",))

    register_test_plugin(Presets(), "presets")
    registry = get_registry()
    assert "tests_factory_module" not in sys.modules  # registered, not imported
    judge = registry.create("annotator", "preset_a", None, cache="C")
    registry.create("annotator", "preset_a")
    made = sys.modules["tests_factory_module"].MADE
    assert judge.cache == "C" and made == [("a.yaml", True)]  # one factory call, then the target is kept
    sys.modules.pop("tests_factory_module")


def test_the_builtin_presets_are_made_from_their_registration_not_attribute_names():
    import alpacafarm_annotators.alpaca_eval_source as source
    import alpacafarm_annotators.presets as presets

    assert not hasattr(presets, "__getattr__") and not hasattr(source, "__getattr__")
    registry = get_registry()
    entry = registry.entry("annotator", "alpaca_eval:alpaca_farm")
    assert entry.target == "alpacafarm_annotators.alpaca_eval_source:AlpacaEvalSource"
    assert entry.args == ("alpaca_farm",) and entry.runtime == ("cache", "budget")
    assert registry.get("annotator", "alpaca_eval:alpaca_farm").alpaca_eval_config == "alpaca_farm"
    assert registry.entry("annotator", "gpt4_b5").args == ("gpt4_b5",)
    assert registry.get("annotator", "gpt4_b5").name == "gpt4_b5"
    assert registry.get("annotator", "alpacafarm_ann").alpaca_eval_config == "alpaca_farm"  # a kind: alpaca_eval file


def test_create_rejects_an_object_that_is_not_of_the_kinds_base_class():
    class NotAnAnnotator:  # the shape of the old example plugin: annotate(list[dict]) -> list[int]
        def __init__(self, config):
            pass

    registry = _registry_with("annotator", "odd", NotAnAnnotator)
    with pytest.raises(PluginError, match=r"annotator 'odd' of plugin 'test-plugin' built a NotAnAnnotator, "
                                          r"not a alpacafarm\.annotation\.Annotator"):
        registry.create("annotator", "odd")


def test_a_target_without_config_class_takes_no_config():
    from alpacafarm.errors import RecipeError
    from alpacafarm.method import Method

    class Plain(Method):
        pass

    registry = _registry_with("method", "plain", Plain)
    assert registry.create("method", "plain", {}).config is None
    with pytest.raises(RecipeError, match="this plugin takes no config"):
        registry.create("method", "plain", {"lr": 1})


def test_every_builtin_kind_builds_through_create():
    registry = get_registry()
    from alpacafarm.annotation import Annotator
    from alpacafarm.validation import Validator

    pool = registry.create("annotator", "alpacafarm_ann", {"overrides": {"max_concurrency": 2}})
    assert isinstance(pool, Annotator) and len(pool.members) == 13  # members built by the same registry
    assert {m.config.max_concurrency for m in pool.members} == {2}  # the pool's overrides reach every member
    assert len({id(m.cache) for m in pool.members}) == 1  # one cache (and ledger) for the crowd
    validator = registry.create("validator", "rank_correlation", {"x": "a", "y": "b", "n_bootstrap": 0})
    assert isinstance(validator, Validator) and validator.config.x == "a"
    method = registry.create("method", "split_instructions", {"eval_size": 3})
    assert method.config.eval_size == 3


# ------------------------------------------------------------------------------------------ pluggy's hook caller


def test_registration_hooks_run_through_pluggys_caller_so_hookwrappers_see_each_plugins_call(register_test_plugin):
    calls: list[str] = []

    class Watcher:  # a hookwrapper only: it registers nothing, it sees every plugin's call
        @alpacafarm.hookimpl(wrapper=True)
        def register_methods(self, register):
            calls.append(register.plugin)
            return (yield)

    register_test_plugin(Watcher(), "watcher")
    register_test_plugin(LazyPlugin(), "lazy")
    loaded = get_plugins()
    implementing = {p.name for p in loaded.plugins if "method" in loaded.registry.by_plugin().get(p.name, {})}
    assert sorted(calls) == sorted(implementing) and {"data", "methods", "lazy"} <= implementing
    assert not [p for p in loaded.plugins if p.name == "watcher" and p.error]


def test_pluggy_tracing_sees_the_registration_hooks(monkeypatch):
    import pluggy

    lines: list[str] = []

    class TracedManager(pluggy.PluginManager):
        def __init__(self, project_name: str) -> None:
            super().__init__(project_name)
            self.trace.root.setwriter(lines.append)
            self.enable_tracing()

    monkeypatch.setattr("alpacafarm.plugins.pluggy.PluginManager", TracedManager)
    loaded = load_plugins()
    assert "split_instructions" in loaded.registry.names("method")
    traced = [line for line in lines if "register_methods" in line]
    assert traced and any("register_generation_backends" in line for line in lines), lines[:5]
