"""The pipeline runner: wiring, manifests, skipping unchanged stages, --force, resume after an interruption."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import alpacafarm
from alpacafarm.annotation import Annotator
from alpacafarm.data import write_jsonl
from alpacafarm.errors import RecipeError, UserError
from alpacafarm.method import Artifact, Method, StageContext
from alpacafarm.pipeline import Pipeline
from alpacafarm.plugins import get_registry
from alpacafarm.recipe import load_recipe
from alpacafarm.testing import write_records

CALLS: list[tuple[str, bool]] = []


@dataclass
class NumbersConfig:
    scale: int = 1


class MakeNumbers(Method):
    config_class = NumbersConfig
    requires = ("instructions",)
    provides = "numbers"

    def run(self, context: StageContext) -> Artifact:
        CALLS.append((context.stage, context.resuming))
        rows = [{"value": len(r["instruction"]) * self.config.scale} for r in context.records("instructions")]
        write_jsonl(context.stage_dir / "numbers.jsonl", rows)
        return Artifact("dataset", str(context.stage_dir / "numbers.jsonl"))


@dataclass
class SumConfig:
    fail_marker: str = ""


class SumNumbers(Method):
    config_class = SumConfig
    requires = ("numbers",)
    provides = "total"

    def run(self, context: StageContext) -> Artifact:
        CALLS.append((context.stage, context.resuming))
        (context.stage_dir / "partial.txt").write_text("work in progress")
        marker = Path(self.config.fail_marker) if self.config.fail_marker else None
        if marker is not None and not marker.exists():
            marker.write_text("failed once")
            raise RuntimeError("simulated crash in the middle of the stage")
        total = sum(r["value"] for r in context.records("numbers"))
        return Artifact("report", None, {"total": total, "resumed": context.resuming})


class CountingEvaluator(Method):
    requires = ("policy",)
    provides = "evaluation"
    annotator_role = "evaluation"  # as a judging evaluator would declare

    def run(self, context: StageContext) -> Artifact:
        CALLS.append((context.stage, context.resuming))
        return Artifact("evaluation", None, {"evaluated": context.input("policy").metadata.get("total")})


class ListingEvaluator(Method):
    """Records which inputs the pipeline wired: several policies, and ``total`` only when a stage provides it."""

    requires = ("policy",)
    optional = ("total",)
    provides = "evaluation"

    def run(self, context: StageContext) -> Artifact:
        return Artifact("evaluation", None, {"inputs": sorted(context.inputs)})


class PipelinePlugin:
    @alpacafarm.hookimpl
    def register_methods(self, register):
        register("make_numbers", MakeNumbers)
        register("sum_numbers", SumNumbers)

    @alpacafarm.hookimpl
    def register_evaluators(self, register):
        register("counting", CountingEvaluator)
        register("listing", ListingEvaluator)


@pytest.fixture
def recipe_file(tmp_path: Path, register_test_plugin) -> Path:
    register_test_plugin(PipelinePlugin(), "pipeline-test")
    CALLS.clear()
    write_records(tmp_path / "instructions.jsonl", [{"instruction": "abc"}, {"instruction": "hello"}])
    path = tmp_path / "recipe.yaml"
    path.write_text(
        "name: toy\n"
        f"data:\n  instructions:\n    path: {tmp_path / 'instructions.jsonl'}\n"
        "stages:\n"
        "  - name: numbers\n    method: make_numbers\n"
        "  - name: total\n    method: sum_numbers\n"
        "evaluation:\n  evaluator: counting\n"
    )
    return path


def run(recipe: Path, out: Path, *overrides: str, force: tuple[str, ...] = ()) -> dict[str, object]:
    loaded = load_recipe(recipe, list(overrides))
    outcomes = Pipeline(loaded, get_registry(), out).run(force=force)
    return {o.name: o for o in outcomes}


def statuses(outcomes: dict) -> dict[str, str]:
    return {name: o.status for name, o in outcomes.items()}


def test_first_run_writes_artifacts_and_manifests(recipe_file: Path, tmp_path: Path):
    out = tmp_path / "run"
    outcomes = run(recipe_file, out)
    assert statuses(outcomes) == {"numbers": "ran", "total": "ran", "evaluate": "ran"}
    assert outcomes["total"].artifact.metadata["total"] == 3 + 5
    assert outcomes["evaluate"].artifact.metadata["evaluated"] == 8
    manifest = json.loads((out / "stages" / "numbers" / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["method"] == "make_numbers"
    assert manifest["artifact"]["path"] == "stages/numbers/numbers.jsonl"  # relative: a run dir can move
    assert manifest["format"] == 3 and list(manifest["outputs"]) == ["stages/numbers/numbers.jsonl"]
    assert set(manifest["fingerprint_parts"]) == {"method", "plugin", "plugin_version", "config", "seed", "model",
                                                  "annotator", "code"}
    assert (manifest["inputs"]["instructions"]["from"] == "instructions"
            and len(manifest["inputs"]["instructions"]["id"]) == 64)
    assert manifest["versions"]["alpacafarm"] == alpacafarm.__version__ and "pluggy" in manifest["versions"]
    assert manifest["recipe"]["name"] == "toy" and isinstance(manifest["seed"], int)
    downstream = json.loads((out / "stages" / "total" / "manifest.json").read_text())
    assert downstream["inputs"]["numbers"]["id"] == manifest["artifact"]["output_id"]
    assert (out / "recipe.yaml").is_file() and (out / "run.log").is_file()
    assert json.loads((out / "run.json").read_text())["seed"] == 42


def test_rerun_skips_everything_unchanged(recipe_file: Path, tmp_path: Path):
    out = tmp_path / "run"
    run(recipe_file, out)
    CALLS.clear()
    outcomes = run(recipe_file, out)
    assert statuses(outcomes) == {"numbers": "skipped", "total": "skipped", "evaluate": "skipped"}
    assert CALLS == []
    assert outcomes["total"].artifact.metadata["total"] == 8  # artifacts come back from the manifests
    assert len(json.loads((out / "run.json").read_text())["history"]) == 2


def test_changed_config_reruns_only_that_stage_and_downstream(recipe_file: Path, tmp_path: Path):
    out = tmp_path / "run"
    run(recipe_file, out)
    outcomes = run(recipe_file, out, "stages.total.config.fail_marker=")  # same value as the default: unchanged?
    assert statuses(outcomes)["total"] == "ran"  # the raw config changed ({} -> {fail_marker: ''})
    outcomes = run(recipe_file, out, "stages.numbers.config.scale=2")
    assert statuses(outcomes) == {"numbers": "ran", "total": "ran", "evaluate": "ran"}
    assert outcomes["total"].artifact.metadata["total"] == 16


def test_changed_input_file_reruns(recipe_file: Path, tmp_path: Path):
    out = tmp_path / "run"
    run(recipe_file, out)
    write_records(tmp_path / "instructions.jsonl", [{"instruction": "abcdefghij"}])
    outcomes = run(recipe_file, out)
    assert statuses(outcomes) == {"numbers": "ran", "total": "ran", "evaluate": "ran"}
    assert outcomes["total"].artifact.metadata["total"] == 10


def test_force_reruns_the_stage_and_what_depends_on_it(recipe_file: Path, tmp_path: Path):
    out = tmp_path / "run"
    run(recipe_file, out)
    assert statuses(run(recipe_file, out, force=("total",))) == {"numbers": "skipped", "total": "ran",
                                                                 "evaluate": "ran"}
    assert statuses(run(recipe_file, out, force=("numbers",))) == {"numbers": "ran", "total": "ran", "evaluate": "ran"}
    with pytest.raises(UserError, match="--force totl: no such stage; did you mean 'total'"):
        run(recipe_file, out, force=("totl",))


def test_interrupted_stage_resumes_and_finished_stages_are_kept(recipe_file: Path, tmp_path: Path):
    out = tmp_path / "run"
    marker = tmp_path / "crash-marker"
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(recipe_file, out, f"stages.total.config.fail_marker={marker}")
    manifest = json.loads((out / "stages" / "total" / "manifest.json").read_text())
    assert manifest["status"] == "running"
    assert "simulated crash" in (out / "error.log").read_text()
    CALLS.clear()
    outcomes = run(recipe_file, out, f"stages.total.config.fail_marker={marker}")
    assert statuses(outcomes) == {"numbers": "skipped", "total": "ran", "evaluate": "ran"}
    assert ("total", True) in CALLS and outcomes["total"].artifact.metadata["resumed"] is True
    assert (out / "stages" / "total" / "partial.txt").is_file()  # the interrupted stage's files were kept for it


def test_changed_config_discards_stale_files_of_an_interrupted_stage(recipe_file: Path, tmp_path: Path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError):
        run(recipe_file, out, f"stages.total.config.fail_marker={tmp_path / 'm'}")
    CALLS.clear()
    run(recipe_file, out, "stages.numbers.config.scale=3")
    assert ("total", False) in CALLS  # different inputs: a fresh start, not a resume


def test_missing_requirement_names_the_stage(recipe_file: Path, tmp_path: Path):
    text = recipe_file.read_text().replace("  - name: numbers\n    method: make_numbers\n", "")
    recipe_file.write_text(text)
    with pytest.raises(RecipeError, match="stage 'total' \\(method 'sum_numbers'\\) needs 'numbers'"):
        Pipeline(load_recipe(recipe_file), get_registry(), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_explicit_input_must_name_an_earlier_stage(recipe_file: Path, tmp_path: Path):
    text = recipe_file.read_text().replace("method: sum_numbers\n",
                                           "method: sum_numbers\n    inputs: {numbers: numbrs}\n")
    recipe_file.write_text(text)
    with pytest.raises(RecipeError,
                       match=r"recipe.yaml:\d+: stages\[1\]\.inputs\.numbers: 'numbrs' .*did you mean 'numbers'"):
        Pipeline(load_recipe(recipe_file), get_registry(), tmp_path / "run")


def test_a_second_run_on_the_same_directory_is_refused(recipe_file: Path, tmp_path: Path):
    out = tmp_path / "run"
    out.mkdir()
    with (out / ".lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(UserError, match="another alpacafarm run is using"):
            run(recipe_file, out)


class Judge(Annotator):
    """A test annotator whose config is validated by its own pydantic class."""

    from pydantic import BaseModel

    class config_class(BaseModel):  # the attribute name is the plugin contract
        prefer: int = 1

    def __init__(self, config):
        self.config = config


class AnnotatingMethod(Method):
    requires = ()
    provides = "labels"
    annotator_role = "feedback"

    def run(self, context: StageContext) -> Artifact:
        judge = context.make_annotator()
        evaluation_judge = context.make_annotator("evaluation")
        return Artifact("labels", None, {"feedback": judge.config.prefer, "evaluation": evaluation_judge.config.prefer})


class AnnotatingPlugin:
    @alpacafarm.hookimpl
    def register_annotators(self, register):
        register("judge", Judge)

    @alpacafarm.hookimpl
    def register_methods(self, register):
        register("annotating", AnnotatingMethod)
        register("make_numbers", MakeNumbers)

    @alpacafarm.hookimpl
    def register_evaluators(self, register):
        register("counting", CountingEvaluator)


def test_stages_build_the_recipes_annotators_with_validated_configs(tmp_path: Path, register_test_plugin):
    register_test_plugin(AnnotatingPlugin(), "annotating-test")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: a\nannotator: {name: judge, config: {prefer: '2'}}\n"
                      "stages:\n  - {name: label, method: annotating}\n"
                      "evaluation: {evaluator: counting, annotator: {name: judge, config: {prefer: 3}}}\n")
    outcomes = run(recipe, tmp_path / "run")
    assert outcomes["label"].artifact.metadata["feedback"] == 2  # coerced by the annotator's own config class
    assert outcomes["label"].artifact.metadata["evaluation"] == 3
    assert outcomes["evaluate"].status == "ran"
    outcomes = run(recipe, tmp_path / "run", "annotator.config.prefer=5")  # another judge: label again
    assert outcomes["label"].status == "ran" and outcomes["label"].artifact.metadata["feedback"] == 5
    assert outcomes["evaluate"].status == "ran"  # its input changed
    outcomes = run(recipe, tmp_path / "run", "annotator.config.prefer=5", "evaluation.annotator.config.prefer=4")
    assert outcomes["label"].status == "skipped" and outcomes["evaluate"].status == "ran"


def test_a_stage_with_its_own_annotator_labels_with_it_and_reruns_when_only_it_changes(tmp_path: Path,
                                                                                      register_test_plugin):
    register_test_plugin(AnnotatingPlugin(), "stage-annotator-test")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: a\nannotator: {name: judge, config: {prefer: 2}}\n"
                      "stages:\n  - {name: noisy, method: annotating}\n"
                      "  - {name: clean, method: annotating, annotator: {name: judge, config: {prefer: '7'}}}\n")
    outcomes = run(recipe, tmp_path / "run")
    assert outcomes["noisy"].artifact.metadata["feedback"] == 2
    clean = outcomes["clean"].artifact.metadata
    assert (clean["feedback"], clean["evaluation"]) == (7, 7)  # coerced by its config class; every role it asks
    outcomes = run(recipe, tmp_path / "run", "stages.clean.annotator.config.prefer=8")
    assert outcomes["noisy"].status == "skipped" and outcomes["clean"].status == "ran"
    assert outcomes["clean"].artifact.metadata["feedback"] == 8
    with pytest.raises(RecipeError, match="prefer"):
        run(recipe, tmp_path / "run", "stages.clean.annotator.config.prefer=many")
    unused = tmp_path / "unused.yaml"
    unused.write_text("name: b\nstages:\n  - {name: n, method: make_numbers, annotator: judge}\n")
    with pytest.raises(RecipeError, match="asks no annotator"):
        run(unused, tmp_path / "run-b")


# ------------------------------------------------------------------------------ optional stages, several policies


def several_policies_recipe(tmp_path: Path, policy: str) -> Path:
    path = tmp_path / "several.yaml"
    path.write_text(
        "name: several\n"
        f"data:\n  instructions:\n    path: {tmp_path / 'instructions.jsonl'}\n"
        "stages:\n"
        "  - name: numbers\n    method: make_numbers\n"
        "  - name: more_numbers\n    method: make_numbers\n    config: {scale: 2}\n"
        "  - name: total\n    method: sum_numbers\n    enabled: false\n"
        f"evaluation:\n  evaluator: listing\n  policy: {policy}\n"
    )
    return path


def test_disabled_stages_are_validated_but_not_run_until_enabled(recipe_file: Path, tmp_path: Path):
    recipe = several_policies_recipe(tmp_path, "[numbers, more_numbers, total]")
    outcomes = run(recipe, tmp_path / "out")
    assert list(outcomes) == ["numbers", "more_numbers", "evaluate"]
    assert not (tmp_path / "out" / "stages" / "total").exists()
    # The evaluation evaluates both enabled stages; `total` (disabled) is neither a policy nor the optional input.
    assert outcomes["evaluate"].artifact.metadata["inputs"] == ["policy:more_numbers", "policy:numbers"]

    enabled = run(recipe, tmp_path / "out", "stages.total.enabled=true")
    assert statuses(enabled) == {"numbers": "skipped", "more_numbers": "skipped", "total": "ran", "evaluate": "ran"}
    assert enabled["evaluate"].artifact.metadata["inputs"] == ["policy:more_numbers", "policy:numbers",
                                                               "policy:total", "total"]
    with pytest.raises(RecipeError, match="did you mean 'fail_marker'"):  # a disabled stage's config is checked
        load_recipe(recipe, ["stages.total.config.fail_markr=x"])


def test_a_single_policy_keeps_the_plain_input_name(recipe_file: Path, tmp_path: Path):
    outcomes = run(several_policies_recipe(tmp_path, "more_numbers"), tmp_path / "out")
    assert outcomes["evaluate"].artifact.metadata["inputs"] == ["policy"]


def two_providers_recipe(tmp_path: Path, total_inputs: str = "", evaluation_inputs: str = "") -> Path:
    """Two stages provide ``numbers``, two provide ``total``: what a stage or the evaluation takes unnamed is the
    latest (a recipe with the annotators' and the reward model's pairs, or two reward models, is this shape)."""
    path = tmp_path / "two.yaml"
    path.write_text(
        "name: two\n"
        f"data:\n  instructions:\n    path: {tmp_path / 'instructions.jsonl'}\n"
        "stages:\n"
        "  - name: numbers\n    method: make_numbers\n"
        "  - name: more_numbers\n    method: make_numbers\n    config: {scale: 2}\n"
        f"  - name: total\n    method: sum_numbers\n{total_inputs}"
        "  - name: total_again\n    method: sum_numbers\n    inputs: {numbers: numbers}\n"
        f"evaluation:\n  evaluator: listing\n  policy: [numbers]\n{evaluation_inputs}"
    )
    return path


def test_an_input_that_several_stages_provide_takes_the_latest_and_says_so(recipe_file: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]):
    from alpacafarm.pipeline import input_warnings

    recipe = two_providers_recipe(tmp_path)
    pipeline = Pipeline(load_recipe(recipe), get_registry(), tmp_path / "out")
    assert input_warnings(pipeline.stages) == [
        "stage 'total' takes 'numbers' from 'more_numbers', the latest of 2 stages that provide it ('numbers', "
        "'more_numbers'); name one in stages.total.inputs.numbers to choose",
        "stage 'evaluate' takes 'total' from 'total_again', the latest of 2 stages that provide it ('total', "
        "'total_again'); name one in evaluation.inputs.total to choose",
    ]
    outcomes = {o.name: o for o in pipeline.run()}
    assert outcomes["total"].artifact.metadata["total"] == 2 * (3 + 5)  # more_numbers' (scale 2), the latest
    assert outcomes["total_again"].artifact.metadata["total"] == 3 + 5  # named: numbers'
    warned = "warning: stage 'total' takes 'numbers' from 'more_numbers', the latest of 2 stages"
    assert warned in capsys.readouterr().err
    assert "WARNING stage 'total' takes 'numbers' from 'more_numbers'" in (tmp_path / "out" / "run.log").read_text()


def test_naming_the_input_chooses_it_and_silences_the_warning(recipe_file: Path, tmp_path: Path):
    from alpacafarm.pipeline import input_warnings

    recipe = two_providers_recipe(tmp_path, "    inputs: {numbers: numbers}\n", "  inputs: {total: total}\n")
    pipeline = Pipeline(load_recipe(recipe), get_registry(), tmp_path / "out")
    assert input_warnings(pipeline.stages) == []
    outcomes = {o.name: o for o in pipeline.run()}
    assert outcomes["total"].artifact.metadata["total"] == 3 + 5
    manifest = json.loads((tmp_path / "out" / "stages" / "evaluate" / "manifest.json").read_text())
    assert manifest["inputs"]["total"]["from"] == "total"


def test_an_evaluation_input_it_does_not_take_is_named(recipe_file: Path, tmp_path: Path):
    recipe = two_providers_recipe(tmp_path, evaluation_inputs="  inputs: {totl: total}\n")
    with pytest.raises(RecipeError, match=r"evaluation\.inputs\.totl: evaluator 'listing' has no input 'totl' "
                                          r"\(inputs: total;"):
        load_recipe(recipe)
    recipe = two_providers_recipe(tmp_path, evaluation_inputs="  inputs: {total: totl}\n")
    with pytest.raises(RecipeError, match=r"evaluation\.inputs\.total: 'totl' is not an earlier stage.*did you mean"):
        Pipeline(load_recipe(recipe), get_registry(), tmp_path / "out")


def test_evaluated_stages_must_exist_and_not_all_be_disabled(recipe_file: Path, tmp_path: Path):
    with pytest.raises(RecipeError, match=r"evaluation\.policy\[1\].*no stage named 'nubmers'.*did you mean 'numbers'"):
        run(several_policies_recipe(tmp_path, "[numbers, nubmers]"), tmp_path / "out")
    with pytest.raises(RecipeError, match="every evaluated stage is disabled"):
        run(several_policies_recipe(tmp_path, "[total]"), tmp_path / "out")


def test_the_code_identity_follows_the_source_of_the_plugin_packages(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch):
    from alpacafarm.code_identity import code_identity, code_packages
    from alpacafarm.method import Method

    package = tmp_path / "codeid_plugin"
    package.mkdir()
    (package / "__init__.py").write_text("", encoding="utf-8")
    (package / "method.py").write_text("from alpacafarm.method import Method\n\nclass Mine(Method):\n"
                                       "    pass\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    from codeid_plugin.method import Mine

    from alpacafarm_methods.sampling.best_of_n import BestOfN

    assert code_packages(Mine) == ["codeid_plugin"] and code_identity(Method) == {}  # the core is versioned
    assert code_packages(BestOfN) == ["alpacafarm_methods"]
    before = code_identity(Mine)
    (package / "helpers.py").write_text("KEEP = 'lowest'\n", encoding="utf-8")  # any file of the package counts
    after = code_identity(Mine)
    assert before != after and code_identity(Mine) == after  # stable while nothing changes

    class Sub(BestOfN, Mine):  # a subclass of a built-in: both packages' code (and this test module's)
        pass

    assert set(code_identity(Sub)) == {"alpacafarm_methods", "codeid_plugin", __name__}


def test_a_method_defined_in_the_running_script_hashes_that_script(tmp_path: Path):
    """A method class in ``__main__`` (a script run with python or torchrun): find_spec('__main__') raises there,
    which failed every stage of such a script (CI, stop 33)."""
    script = tmp_path / "my_script.py"
    script.write_text("import json, sys\nfrom alpacafarm.code_identity import code_identity\n"
                      "from alpacafarm.method import Method\n\nclass Mine(Method):\n    pass\n\n"
                      "print(json.dumps(code_identity(Mine)))\n", encoding="utf-8")
    first = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    identity = json.loads(first.stdout)
    assert list(identity) == ["__main__"] and len(identity["__main__"]) == 64
    script.write_text(script.read_text(encoding="utf-8") + "# changed\n", encoding="utf-8")
    second = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert json.loads(second.stdout)["__main__"] != identity["__main__"]


def test_a_run_prints_and_logs_the_precision_it_samples_and_scores_in(recipe_file: Path, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]):
    """``alpacafarm run`` says at its start which precision the model block resolves to and why (issue 65: a
    quickstart four times slower than the README, on a CPU where bfloat16_if_native picked float32, said nothing)."""
    run(recipe_file, tmp_path / "out", "model.name=m", "model.inference_dtype=float32")
    line = "precision: sampling and scoring in float32 (the model block's inference_dtype)"
    assert line in capsys.readouterr().err
    assert line in (tmp_path / "out" / "run.log").read_text()


def test_a_stage_context_is_built_by_keyword_and_a_stage_start_is_typed():
    from alpacafarm.method import StageContext
    from alpacafarm.pipeline import StageStart

    with pytest.raises(TypeError):
        StageContext("evaluate", Path("stage"), Path("run"), 0, {}, None, None)  # ten positions were easy to swap
    context = StageContext(stage="evaluate", stage_dir=Path("stage"), run_dir=Path("run"), seed=3, inputs={},
                           recipe=None, registry=None, resuming=True)
    assert (context.stage, context.seed, context.resuming) == ("evaluate", 3, True)
    assert StageStart("resume", seed=5, manifest={}).resuming and not StageStart("run").resuming
