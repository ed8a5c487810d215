"""What the pipeline asks of a plugin's method, and what it promises back."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import alpacafarm
from alpacafarm.errors import RecipeError
from alpacafarm.method import Artifact, Method, StageContext
from alpacafarm.pipeline import Pipeline
from alpacafarm.plugins import get_registry
from alpacafarm.recipe import load_recipe

RUNS: list[str] = []


@dataclass
class CountConfig:
    start: int = 0
    step: int = 1


class Count(Method):
    config_class = CountConfig
    provides = "count"

    def run(self, context: StageContext) -> Artifact:
        RUNS.append(context.stage)
        return Artifact("report", None, {"value": self.config.start + self.config.step})


class Forgetful(Method):  # declares no ``provides``
    def run(self, context: StageContext) -> Artifact:
        return Artifact("report")


class ForgetfulNone(Forgetful):  # ``provides`` set to None: still none (never the name 'None')
    provides = None


class Plugin:
    @alpacafarm.hookimpl
    def register_methods(self, register):
        register("count", Count)
        register("forgetful", Forgetful)
        register("forgetful_none", ForgetfulNone)


@pytest.fixture
def counting(register_test_plugin, tmp_path: Path) -> Path:
    register_test_plugin(Plugin(), "counting-plugin")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: c\nstages:\n  - {name: one, method: count, config: {start: 2}}\n", encoding="utf-8")
    return recipe


def test_a_new_plugin_version_reruns_its_stages(counting: Path, tmp_path: Path):
    registry = get_registry()
    RUNS.clear()
    Pipeline(load_recipe(counting, registry=registry), registry, tmp_path / "run").run()
    Pipeline(load_recipe(counting, registry=registry), registry, tmp_path / "run").run()
    assert RUNS == ["one"]  # unchanged: skipped
    registry.plugin_versions["counting-plugin"] = "2.0"  # the plugin was upgraded
    outcomes = Pipeline(load_recipe(counting, registry=registry), registry, tmp_path / "run").run()
    assert RUNS == ["one", "one"] and outcomes[0].status == "ran"


@pytest.mark.parametrize("method", ["forgetful", "forgetful_none"])
def test_a_method_without_provides_is_refused_naming_its_plugin(counting: Path, tmp_path: Path, method: str):
    recipe = tmp_path / "f.yaml"
    recipe.write_text(f"name: f\nstages:\n  - {{name: x, method: {method}}}\n", encoding="utf-8")
    with pytest.raises(RecipeError, match=rf"f\.yaml:3: stages\[0\]\.method: method '{method}' of plugin "
                                          r"'counting-plugin' declares no 'provides'"):
        load_recipe(recipe)


def test_an_unknown_key_of_a_dataclass_config_lists_the_allowed_keys(counting: Path, tmp_path: Path):
    recipe = tmp_path / "k.yaml"
    recipe.write_text("name: k\nstages:\n  - {name: one, method: count, config: {stride: 2}}\n", encoding="utf-8")
    with pytest.raises(RecipeError, match=r"k\.yaml:3: stages\[0\]\.config\.stride: unknown key 'stride' "
                                          r"for CountConfig; did you mean 'step'\? \(allowed: start, step\)"):
        load_recipe(recipe)


class DescribedPlugin:
    """Lazy targets in a module that does not exist: listing them must not import anything."""

    @alpacafarm.hookimpl
    def register_methods(self, register):
        register("tally", "described_plugin_nowhere.methods:Tally", description="counts the instructions")
        register("bare", "described_plugin_nowhere.methods:Bare")

    @alpacafarm.hookimpl
    def register_annotators(self, register):
        register("coin", "described_plugin_nowhere.judges:Coin", description="a fair coin")


def test_plugins_json_lists_what_each_plugin_registered_with_its_description(register_test_plugin,
                                                                            capsys: pytest.CaptureFixture[str]):
    import json

    from alpacafarm import cli

    register_test_plugin(DescribedPlugin(), "described-plugin")
    assert cli.main(["plugins", "--json"]) == 0
    plugins = {p["name"]: p for p in json.loads(capsys.readouterr().out)["plugins"]}
    listed = plugins["described-plugin"]
    assert (listed["distribution"], listed["version"], listed["builtin"], listed["error"]) == (
        "(registered in-process)", "-", False, None)
    assert listed["registers"] == {"annotator": ["coin"], "method": ["bare", "tally"]}
    assert listed["descriptions"] == {"method": {"bare": "", "tally": "counts the instructions"},
                                      "annotator": {"coin": "a fair coin"}}
    assert "annotator" not in plugins["methods"]["registers"]  # each plugin lists its own names only
    assert "tally" not in plugins["methods"]["registers"]["method"]


def test_a_shared_annotator_option_the_annotator_has_no_field_for_is_named(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture[str]):
    from alpacafarm import cli
    from alpacafarm.testing import write_records

    pairs = write_records(tmp_path / "pairs.json", [{"instruction": "a", "output_1": "x", "output_2": "yy"}])
    code = cli.main(["annotate", str(pairs), "--annotator", "offline", "-o", str(tmp_path / "out.json"),
                     "--base-url", "http://127.0.0.1:9/v1"])
    assert code == 2 and not (tmp_path / "out.json").exists()
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: annotator 'offline' takes no --base-url (its config fields: batch_size, continuous, references)"]


class Judged(Count):
    annotator_role = "feedback"  # its outputs depend on the feedback annotator's labels


class JudgedPlugin:
    @alpacafarm.hookimpl
    def register_methods(self, register):
        register("judged_count", Judged)
        register("plain_count", Count)


@pytest.mark.parametrize("annotator", ["offline", "offline_ann"])
def test_new_offline_judge_weights_rerun_the_stages_that_annotate(annotator: str, register_test_plugin,
                                                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import json

    from alpacafarm_annotators.offline_judge import weights

    register_test_plugin(JudgedPlugin(), "judged-plugin")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: j\nannotator: {annotator}\nstages:\n  - {{name: one, method: judged_count}}\n"
                      "  - {name: two, method: plain_count}\n", encoding="utf-8")
    registry = get_registry()
    RUNS.clear()
    for _ in range(2):
        Pipeline(load_recipe(recipe, registry=registry), registry, tmp_path / "run").run()
    assert RUNS == ["one", "two"]  # unchanged: skipped
    document = json.loads(weights.WEIGHTS_FILE.read_text(encoding="utf-8"))
    document["weights"]["no_reference"][0] += 0.5  # a refit judge: the same name and config, other labels
    document["fingerprint"] = weights.fingerprint(document)
    refit = tmp_path / "refit.json"
    refit.write_text(json.dumps(document), encoding="utf-8")
    monkeypatch.setattr(weights, "WEIGHTS_FILE", refit)
    outcomes = Pipeline(load_recipe(recipe, registry=registry), registry, tmp_path / "run").run()
    assert RUNS == ["one", "two", "one"]  # the stage that annotates ran again; the other did not
    assert [o.status for o in outcomes] == ["ran", "skipped"]


# ------------------------------------------------------------------------------------------ where a stage runs


def test_where_a_method_runs_is_one_attribute_and_its_stage_context_carries_it(register_test_plugin, tmp_path: Path):
    import dataclasses

    from alpacafarm.method import Ranks

    seen: dict[str, Any] = {}

    class Everywhere(Method):
        provides = "report"
        ranks = Ranks.ALL

        def run(self, context: StageContext) -> Artifact:
            seen[context.stage] = context.ranks
            return Artifact("report", None, {})

    class Plugin:
        @alpacafarm.hookimpl
        def register_methods(self, register):
            register("everywhere", Everywhere)
            register("once", Count)

    register_test_plugin(Plugin(), "ranks-plugin")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nstages:\n  - {name: a, method: everywhere}\n  - {name: b, method: once}\n",
                      encoding="utf-8")
    registry = get_registry()
    Pipeline(load_recipe(recipe, registry=registry), registry, tmp_path / "run").run()
    assert seen == {"a": Ranks.ALL} and Count.ranks is Ranks.MAIN
    manifest = (tmp_path / "run" / "stages" / "a" / "manifest.json").read_text(encoding="utf-8")
    assert '"ranks_ran": 1' in manifest  # one process: every choice runs the stage once
    # the config lives on the method (self.config), built from the one validated config object: not twice
    assert "config" not in {f.name for f in dataclasses.fields(StageContext)}


def test_ranks_must_be_a_ranks_member():
    with pytest.raises(TypeError, match=r"OddRanks\.ranks is 'all'; it must be Ranks\.MAIN, Ranks\.ALL or "
                                        r"Ranks\.SINGLE_PROCESS"):
        type("OddRanks", (Method,), {"ranks": "all"})
