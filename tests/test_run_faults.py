"""Lost or wrong results and tracebacks where one line is promised (issue 27): run directories the run did not
write, concurrent and interrupted runs, outputs a stage only claims, NaN, damaged run records, secrets in base
URLs, stale model conversions, full disks while saving, and one-line errors for what a user can cause."""

from __future__ import annotations

import fcntl
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from test_pipeline import PipelinePlugin, run
from test_user_errors import one_error_line

import alpacafarm
from alpacafarm.errors import UserError
from alpacafarm.method import Artifact, Method, StageContext
from alpacafarm.testing import offline_environment, write_records
from alpacafarm.testing.launch import launch_ranks, rank_results

KEY = "sk-proj-Rt5Yh8Kp2Lm4Nq7Ws1Xz3Cv6Bn9Mj0Qa"
SPLIT_RECIPE = ("# my notes: keep me\nname: r\ndata:\n  instructions: {builtin: alpaca_eval_sample, limit: 8}\n"
                "stages:\n  - {name: split, method: split_instructions, config: {eval_size: 2}}\n")


def cli(tmp_path: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **offline_environment(tmp_path / "hf_home"), "ALPACAFARM_CACHE_DIR": str(tmp_path / "cache"),
           "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "alpacafarm", *args], capture_output=True, text=True, env=env,
                          cwd=cwd or REPO_ROOT, timeout=300)


# ------------------------------------------------------------------------------------------- run directories
def test_a_folder_that_is_not_a_run_directory_is_refused_and_left_alone(tmp_path: Path):
    exp = tmp_path / "exp"
    exp.mkdir()
    recipe = exp / "recipe.yaml"
    recipe.write_text(SPLIT_RECIPE)
    one_error_line(cli(tmp_path, "run", str(recipe), "--output-dir", str(exp)), str(exp),
                   "not an alpacafarm run directory", "recipe.yaml")
    assert recipe.read_text() == SPLIT_RECIPE and sorted(p.name for p in exp.iterdir()) == ["recipe.yaml"]
    out = tmp_path / "run"  # a new folder, then the same folder again, is fine
    for _ in range(2):
        result = cli(tmp_path, "run", str(recipe), "--output-dir", str(out))
        assert result.returncode == 0, result.stderr


def test_a_refused_concurrent_run_writes_nothing_into_the_other_runs_directory(recipe_file: Path, tmp_path: Path):
    out = tmp_path / "run"
    run(recipe_file, out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with (out / ".lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(UserError, match="another alpacafarm run is using"):
            run(recipe_file, out)
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert after == before and "error.log" not in after


class Interrupted(Method):
    provides = "nothing"

    def run(self, context: StageContext) -> Artifact:
        raise KeyboardInterrupt


class ClaimsAModel(Method):
    """Returns a model folder it never wrote (a buggy plugin)."""

    provides = "sft_model"

    def run(self, context: StageContext) -> Artifact:
        return Artifact("model", str(context.stage_dir / "model"))


class BrokenDataset(Method):
    provides = "numbers"

    def run(self, context: StageContext) -> Artifact:
        (context.stage_dir / "rows.jsonl").write_text('{"a": 1}\n{"a": \n')
        return Artifact("dataset", str(context.stage_dir / "rows.jsonl"))


class MethodHelperFails(Method):
    """Calls shared method helpers the way a method does, with inputs they refuse."""

    provides = "nothing"

    def run(self, context: StageContext) -> Artifact:
        from alpacafarm.policy_training import build_sft_trainer_on_rows
        from alpacafarm.reward_selection import mark_finished

        if context.stage.startswith("rows"):
            build_sft_trainer_on_rows(None, None, "", [])
        mark_finished([[{"output": "a"}]], object(), "my_backend")
        raise AssertionError("unreachable")


class NamesItsStage(Method):
    provides = "nothing"

    def run(self, context: StageContext) -> Artifact:
        raise UserError(f"{context.stage}: round 3 has no winners")


class FaultyPlugin:
    @alpacafarm.hookimpl
    def register_methods(self, register):
        register("interrupted", Interrupted)
        register("claims_a_model", ClaimsAModel)
        register("broken_dataset", BrokenDataset)
        register("method_helper_fails", MethodHelperFails)
        register("names_its_stage", NamesItsStage)


@pytest.fixture
def recipe_file(tmp_path: Path, register_test_plugin) -> Path:
    register_test_plugin(PipelinePlugin(), "pipeline-test")
    register_test_plugin(FaultyPlugin(), "faulty-test")
    write_records(tmp_path / "instructions.jsonl", [{"instruction": "abc"}, {"instruction": "hello"}])
    path = tmp_path / "recipe.yaml"
    path.write_text(f"name: toy\ndata:\n  instructions:\n    path: {tmp_path / 'instructions.jsonl'}\n"
                    "stages:\n  - name: numbers\n    method: make_numbers\n")
    return path


def one_stage(tmp_path: Path, method: str) -> Path:
    path = tmp_path / f"{method}.yaml"
    path.write_text(f"name: {method}\nstages:\n  - name: s\n    method: {method}\n")
    return path


def test_ctrl_c_is_logged_as_an_interruption(recipe_file: Path, tmp_path: Path):
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run(one_stage(tmp_path, "interrupted"), out)
    log = (out / "run.log").read_text()
    assert "run interrupted (Ctrl-C)" in log and "run failed:" not in log


@pytest.mark.parametrize(("method", "problem"), [("claims_a_model", "does not exist"),
                                                 ("broken_dataset", "does not load")])
def test_a_stage_whose_outputs_do_not_exist_or_load_is_never_complete(recipe_file: Path, tmp_path: Path,
                                                                      method: str, problem: str):
    out = tmp_path / "run"
    with pytest.raises(UserError) as caught:
        run(one_stage(tmp_path, method), out)
    message = str(caught.value)
    assert f"stage 's': method {method!r} of plugin 'faulty-test'" in message and problem in message
    assert "\n" not in message
    assert json.loads((out / "stages" / "s" / "manifest.json").read_text())["status"] != "complete"


@pytest.mark.parametrize(("stage", "problem"), [
    ("rows_warmup", "there is nothing to train on: no training rows"),
    ("cut_check", "the generation backend 'my_backend' does not report which completions were cut"),
])
def test_a_shared_helpers_error_names_the_stage_that_called_it(recipe_file: Path, tmp_path: Path, stage: str,
                                                               problem: str):
    """Shared method helpers know nothing of their caller (they used to name 'expert_iteration' or 'preference pairs'
    whoever called them); the pipeline puts the stage in front of every error its method raises."""
    path = tmp_path / "helper.yaml"
    path.write_text(f"name: helper\nstages:\n  - name: {stage}\n    method: method_helper_fails\n")
    with pytest.raises(UserError) as caught:
        run(path, tmp_path / "run")
    assert str(caught.value) == f"stage {stage!r}: {problem}" + str(caught.value).split(problem, 1)[1]
    assert "expert_iteration" not in str(caught.value) and "preference pair" not in str(caught.value)


def test_an_error_that_names_its_stage_is_not_prefixed_twice(recipe_file: Path, tmp_path: Path):
    with pytest.raises(UserError, match=r"^s: round 3 has no winners$"):
        run(one_stage(tmp_path, "names_its_stage"), tmp_path / "run")


# --------------------------------------------------------------------------------------------------- NaN
def test_json_files_never_hold_nan_and_the_error_names_the_key(tmp_path: Path):
    from alpacafarm.data import write_json, write_jsonl

    with pytest.raises(UserError, match=r"metrics.json: reward\.per_n\[1\] is not a finite number"):
        write_json(tmp_path / "metrics.json", {"reward": {"per_n": [0.5, math.nan]}})
    with pytest.raises(UserError, match=r"rows.jsonl: line 2, score is not a finite number"):
        write_jsonl(tmp_path / "rows.jsonl", [{"score": 1.0}, {"score": math.inf}])
    assert not (tmp_path / "metrics.json").exists() and not (tmp_path / "rows.jsonl").exists()


def test_diverged_weights_are_never_saved_and_a_nan_reward_model_never_scores(tmp_path: Path):
    import torch

    from alpacafarm.model_loading import save_model
    from alpacafarm.rewards import RewardScorer
    from alpacafarm.testing import tiny_causal_lm, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = tiny_causal_lm(tokenizer)
    with torch.no_grad():
        next(model.parameters()).fill_(math.nan)  # what learning_rate=1e20 leaves
    with pytest.raises(UserError, match=r"not finite .*training diverged"):
        save_model(model, tokenizer, tmp_path / "model")
    assert not (tmp_path / "model").exists()
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    scorer_model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        scorer_model.score.weight.fill_(math.nan)
    scorer = RewardScorer(scorer_model, tokenizer)
    with pytest.raises(UserError, match="scored 2 of 2 texts NaN"):
        scorer.score_texts(["a good answer", "a bad one"])


def test_a_full_disk_while_saving_a_model_is_one_line(tmp_path: Path):
    """One line, and the folder a previous save wrote is left whole (save_model writes a temporary folder and
    renames it when whole), with no temporary folder left behind."""
    import torch
    from safetensors.torch import load_file

    from alpacafarm.model_loading import save_model
    from alpacafarm.testing import tiny_causal_lm, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    save_model(tiny_causal_lm(tokenizer, seed=1), tokenizer, tmp_path / "model")
    before = load_file(str(tmp_path / "model/model.safetensors"))
    code = ("import resource, signal, sys\n"
            "from alpacafarm.testing import tiny_causal_lm, tiny_tokenizer\n"
            "from alpacafarm.model_loading import save_model\n"
            "from alpacafarm.errors import UserError\n"
            "tokenizer = tiny_tokenizer(); model = tiny_causal_lm(tokenizer)\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # the disk fills at 200 KB a file\n"
            f"try:\n    save_model(model, tokenizer, {str(tmp_path / 'model')!r})\n"
            "except UserError as exc:\n    print('USER', exc)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, **offline_environment(tmp_path / "hf")})
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("USER ")] or [result.stdout]
    assert line.startswith(f"USER cannot save the model to {tmp_path / 'model'}: file too large"), result.stdout
    assert "EFBIG" in line
    after = load_file(str(tmp_path / "model/model.safetensors"))
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "hf") == ["model"]


# ---------------------------------------------------------------------------------------- damaged records
@pytest.mark.parametrize("content", ["", '{"recipe": "r", "hist', "[1, 2]"], ids=["empty", "truncated", "list"])
def test_a_damaged_run_json_is_one_line(tmp_path: Path, content: str):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(SPLIT_RECIPE)
    out = tmp_path / "run"
    assert cli(tmp_path, "run", str(recipe), "--output-dir", str(out)).returncode == 0
    (out / "run.json").write_text(content)
    one_error_line(cli(tmp_path, "run", str(recipe), "--output-dir", str(out)), str(out / "run.json"))


@pytest.mark.parametrize("content", ["", '{"status": "compl', "[]", '{"status": "complete"}'],
                         ids=["empty", "truncated", "list", "no-artifact"])
def test_a_damaged_manifest_reruns_its_stage_also_under_plan(tmp_path: Path, content: str):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(SPLIT_RECIPE)
    out = tmp_path / "run"
    assert cli(tmp_path, "run", str(recipe), "--output-dir", str(out)).returncode == 0
    (out / "stages" / "split" / "manifest.json").write_text(content)
    plan = cli(tmp_path, "run", str(recipe), "--output-dir", str(out), "--plan")
    assert plan.returncode == 0 and "Traceback" not in plan.stderr and "split  run" in plan.stdout, plan.stderr
    again = cli(tmp_path, "run", str(recipe), "--output-dir", str(out))
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr
    assert json.loads((out / "stages" / "split" / "manifest.json").read_text())["status"] == "complete"


@pytest.mark.parametrize("found", [2, 4, "3"])
def test_a_manifest_of_another_format_is_refused_in_one_line_and_never_run_over(tmp_path: Path, found):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(SPLIT_RECIPE)
    out = tmp_path / "run"
    assert cli(tmp_path, "run", str(recipe), "--output-dir", str(out)).returncode == 0
    manifest = out / "stages" / "split" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format": found}))
    for args in (("--plan",), ()):
        line = one_error_line(cli(tmp_path, "run", str(recipe), "--output-dir", str(out), *args), str(manifest))
        assert line == (f"error: {manifest} is of manifest format {json.dumps(found)}, not 3 (another alpacafarm "
                        f"version wrote it): delete {manifest.parent} to run the stage again")
    assert json.loads(manifest.read_text())["format"] == found and (out / "stages/split/train.jsonl").is_file()


# ------------------------------------------------------------------------------------------------- secrets
def test_a_key_in_the_base_url_never_reaches_the_run_directory(tmp_path: Path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(SPLIT_RECIPE + "annotator:\n  name: gpt4_b5\n  config:\n"
                      f"    base_url: 'https://user:{KEY}@judge.example/v1?api-key={KEY}'\n")
    out = tmp_path / "run"
    result = cli(tmp_path, "run", str(recipe), "--output-dir", str(out))
    assert result.returncode == 0, result.stderr
    written = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "manifest.json" for p in written)
    for path in written:
        assert KEY not in path.read_text(errors="replace"), path
    assert "https://user:<redacted>@judge.example/v1?api-key=<redacted>" in (out / "recipe.yaml").read_text()
    assert KEY not in result.stdout + result.stderr


def test_an_included_file_is_never_quoted(tmp_path: Path):
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$SECRETHASHVALUE:19000:0:99999:7:::\n")
    (tmp_path / "shadow.yaml").write_text(secret.read_text())
    for name in ("shadow", "shadow.yaml"):
        recipe = tmp_path / f"inc-{name}.yaml"
        recipe.write_text(f"include: {name}\n{SPLIT_RECIPE}")
        line = one_error_line(cli(tmp_path, "recipe", "check", str(recipe)), name)
        assert "SECRETHASH" not in line and "19000" not in line


# ------------------------------------------------------------------------------------------------ YAML bombs
def test_nested_yaml_aliases_and_a_recursive_alias_fail_in_one_line(tmp_path: Path):
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]  # 10^9 values
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(levels) + "\n" + SPLIT_RECIPE)
    one_error_line(cli(tmp_path, "recipe", "check", str(bomb)), "bomb.yaml", "YAML aliases are expanded")
    recursive = tmp_path / "self.yaml"
    recursive.write_text(SPLIT_RECIPE + "description: &d [*d]\n")
    one_error_line(cli(tmp_path, "recipe", "check", str(recursive)), "self.yaml", "recursive alias")


@pytest.mark.parametrize(("config", "culprit"), [
    ("{k: true}", "stages[1].config.k: expected a number, got true"),
    ("{max_instructions: true}", "stages[1].config.max_instructions: expected a number, got true"),  # was 1
    ("{backend: nonexistent}", "unknown generation backend 'nonexistent'")])
def test_a_bool_number_and_an_unknown_backend_fail_recipe_check(tmp_path: Path, config: str, culprit: str):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(SPLIT_RECIPE + f"  - {{name: prefs, method: preference_data, config: {config}}}\n")
    one_error_line(cli(tmp_path, "recipe", "check", str(recipe)), "r.yaml:7", culprit)


# ------------------------------------------------------------------------------- one line, not a traceback
def test_a_plugin_module_that_raises_on_import_is_one_line(tmp_path: Path):
    from test_cli import fake_distribution

    site = tmp_path / "site"
    register = ("from alpacafarm import hookimpl\n\n@hookimpl\ndef register_methods(register):\n"
                "    register('exploding', 'boom_method:Exploding')\n")
    fake_distribution(site, "boom-plugin", {"boom": "boom_plugin"},
                      {"boom_plugin": register, "boom_method": "raise RuntimeError('config server down')\n"})
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nstages:\n  - {name: s, method: exploding}\n")
    result = subprocess.run([sys.executable, "-m", "alpacafarm", "recipe", "check", str(recipe)],
                            capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONPATH": str(site), "ALPACAFARM_CACHE_DIR": str(tmp_path)})
    one_error_line(result, "boom_method", "RuntimeError", "config server down", "'boom'")


def test_a_lone_surrogate_and_an_unknown_template_are_one_line(tmp_path: Path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"instruction": "a", "output_1": "b\\ud800", "output_2": "c"}\n')
    one_error_line(cli(tmp_path, "annotate", str(pairs), "--annotator", "offline", "-o", str(tmp_path / "o.json")),
                   "pairs.jsonl", "record 1", "output_1", "lone surrogate")
    pairs.write_text('{"instruction": "a", "output_1": "b", "output_2": "c"}\n')
    one_error_line(cli(tmp_path, "annotate", str(pairs), "--annotator", "gpt4_b5", "--base-url",
                       "http://127.0.0.1:9/v1", "--set", "template=nonexist", "-o", str(tmp_path / "o.json")),
                   "'gpt4_b5'", "unknown template 'nonexist'")


def test_a_killed_conversion_leaves_no_temporary_folder_for_good(tmp_path: Path, monkeypatch):
    from alpacafarm.model_sources import resolve_model_path

    monkeypatch.setenv("ALPACAFARM_CACHE_DIR", str(tmp_path / "cache"))
    models = tmp_path / "cache" / "models"
    target = models / "smollm2-135m-instruct"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # converted before
    stale = models / "smollm2-135m-instruct.tmp4242"  # what a SIGKILLed conversion left behind
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 1024)
    assert resolve_model_path("smollm2-135m-instruct") == str(target)
    assert not stale.exists() and (target / "config.json").is_file()


def _generate_on_main_only(out: Path) -> None:
    """One rank of a two-process pipeline whose method samples with generate_on_ranks but runs on the main process
    only (``ranks`` is not ``Ranks.ALL``)."""
    from alpacafarm import distributed as d
    from alpacafarm.generation import SamplingConfig
    from alpacafarm.pipeline import Pipeline
    from alpacafarm.plugins import get_registry, register_plugin
    from alpacafarm.recipe import load_recipe

    class Sampler(Method):
        provides = "outputs"

        def run(self, context: StageContext) -> Artifact:
            context.generate_on_ranks("transformers", None, [{"instruction": "hi"}], SamplingConfig(), "sampling")
            return Artifact("report", None, {})

    class Plugin:
        @alpacafarm.hookimpl
        def register_methods(self, register):
            register("sampler", Sampler)

    d.init()
    register_plugin(Plugin(), "sampler-test")
    recipe = out / f"recipe{d.rank()}.yaml"
    recipe.write_text("name: s\nstages:\n  - {name: s, method: sampler}\n")
    try:
        Pipeline(load_recipe(recipe), get_registry(), out / "run").run()
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    (out / f"rank{d.rank()}.json").write_text(json.dumps({"error": error}))
    d.shutdown()


@pytest.mark.distributed
def test_generate_on_ranks_in_a_main_process_stage_on_two_processes_names_the_stage(tmp_path: Path):
    done = launch_ranks(Path(__file__), ["generate-on-main", str(tmp_path)], cwd=tmp_path, timeout=300,
                        pythonpath=[REPO_ROOT, REPO_ROOT / "plugins", REPO_ROOT / "tests"])
    assert done.returncode == 0, done.stderr[-3000:]
    errors = [rank["error"] for rank in rank_results(tmp_path)]
    assert errors[0].startswith("UserError: stage 's': context.generate_on_ranks needs every rank"), errors
    assert errors[1].startswith("RankFailed: rank 0 failed in stage 's': stage 's': context.generate_on_ranks"), errors


@pytest.mark.parametrize("ranks", ["MAIN", "SINGLE_PROCESS"])
def test_generate_on_ranks_outside_ranks_all_is_one_line(ranks: str, monkeypatch):
    from alpacafarm import distributed
    from alpacafarm.method import Ranks, StageContext

    context = StageContext(stage="sample", stage_dir=Path("stage"), run_dir=Path("run"), seed=0, inputs={},
                           recipe=None, registry=None, ranks=Ranks[ranks])
    monkeypatch.setattr(distributed, "world_size", lambda: 2)  # the context says where its method runs
    with pytest.raises(UserError, match=r"needs every rank.*ranks = Ranks\.ALL"):
        context.generate_on_ranks("transformers", None, [], None, "sampling")


def test_a_reward_model_trained_to_nan_fails_its_stage_in_one_line(tiny_model_dir: str, tmp_path: Path):
    from test_trl_methods import preference_records

    prefs = write_records(tmp_path / "prefs.jsonl", preference_records(32))
    recipe = tmp_path / "rm.yaml"
    recipe.write_text(f"name: rm-nan\nmodel: {{name: {tiny_model_dir}}}\ndata:\n  preferences: {{path: {prefs}}}\n"
                      "stages:\n  - name: rm\n    method: reward_model\n"
                      "    config: {max_steps: 3, per_device_train_batch_size: 8, learning_rate: 1.0e+20,"
                      " logging_steps: 1, save_strategy: 'no', eval_fraction: 0.25}\n")
    out = tmp_path / "run"
    result = cli(tmp_path, "run", str(recipe), "--output-dir", str(out))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and ("diverged" in errors[0] or "not finite" in errors[0]), result.stderr
    assert json.loads((out / "stages" / "rm" / "manifest.json").read_text())["status"] != "complete"
    assert not list(out.rglob("metrics.json"))  # no JSON file with NaN in it


if __name__ == "__main__":  # a rank of the two-process test above (started by torch.distributed.run)
    if sys.argv[1] == "generate-on-main":
        _generate_on_main_only(Path(sys.argv[2]))
