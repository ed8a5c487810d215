"""Recipe loading: includes, --set overrides, one-line errors that name the culprit, plugin config validation, CLI."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import run_cli
from pydantic import BaseModel, ConfigDict

import alpacafarm
from alpacafarm.cli import main
from alpacafarm.errors import RecipeError, UserError
from alpacafarm.method import Artifact, Method
from alpacafarm.plugins import get_registry, register_plugin, unregister_plugin
from alpacafarm.recipe import load_recipe

REPO_ROOT = Path(__file__).resolve().parents[1]
SPLIT_STAGE = "stages:\n  - {name: split, method: split_instructions}\n"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def error_of(path: Path, overrides: list[str] | tuple[str, ...] = ()) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# ------------------------------------------------------------------------------------------------- includes


def test_include_merges_mappings_and_replaces_lists(tmp_path):
    write(tmp_path / "base.yaml", """\
        seed: 7
        model: {name: base-model, dtype: float16, device: cpu}
        stages:
          - {name: a, method: split_instructions}
          - {name: b, method: split_instructions}
        """)
    recipe = load_recipe(write(tmp_path / "top.yaml", "include: base.yaml\nname: t\nmodel: {dtype: bfloat16}\n"
                               + SPLIT_STAGE)).recipe
    assert recipe.seed == 7
    assert (recipe.model.name, recipe.model.dtype, recipe.model.device) == ("base-model", "bfloat16", "cpu")
    assert [s.name for s in recipe.stages] == ["split"]


def test_include_is_relative_to_the_including_file_and_later_includes_win(tmp_path):
    write(tmp_path / "conf" / "parts" / "seed.yaml", "seed: 5\ndescription: from seed.yaml\n")
    write(tmp_path / "conf" / "a.yaml", "include: parts/seed.yaml\nmodel: {name: from-a, device: cpu}\n")
    write(tmp_path / "conf" / "b.yaml", "seed: 6\nmodel: {name: from-b}\n")
    top = write(tmp_path / "conf" / "top.yaml", "include: [a.yaml, b.yaml]\nname: t\n" + SPLIT_STAGE)
    recipe = load_recipe(top).recipe
    assert (recipe.seed, recipe.description) == (6, "from seed.yaml")
    assert (recipe.model.name, recipe.model.device) == ("from-b", "cpu")
    write(tmp_path / "conf" / "top2.yaml", "include: [b.yaml, a.yaml]\nname: t\n" + SPLIT_STAGE)
    assert load_recipe(tmp_path / "conf" / "top2.yaml").recipe.model.name == "from-a"


def test_errors_inside_an_included_file_point_at_that_file(tmp_path):
    write(tmp_path / "base.yaml", "seed: 1\nmodel:\n  name: x\n  dtype: float8\n")
    message = error_of(write(tmp_path / "top.yaml", "include: base.yaml\nname: t\n" + SPLIT_STAGE))
    assert "base.yaml:4: model.dtype:" in message


def test_include_cycle_is_an_error(tmp_path):
    write(tmp_path / "one.yaml", "include: two.yaml\nname: t\n")
    write(tmp_path / "two.yaml", "include: one.yaml\nseed: 1\n")
    message = error_of(tmp_path / "one.yaml")
    assert "include cycle" in message
    assert message.count("one.yaml") >= 2 and "two.yaml" in message


def test_missing_include_names_the_file(tmp_path):
    message = error_of(write(tmp_path / "r.yaml", "name: t\ninclude: [parts/nothere.yaml]\n" + SPLIT_STAGE))
    assert "r.yaml:2" in message and "nothere.yaml" in message and "not found" in message


def test_shared_pieces_are_included_from_the_installed_package_wherever_the_recipe_is(tmp_path):
    # A benchmark recipe copied into a plugin's repository (no recipes/ folder there) still loads and checks.
    plugin_repo = tmp_path / "my-plugin"
    copied = write(plugin_repo / "benchmarks" / "bench.yaml",
                   (REPO_ROOT / "recipes" / "bench" / "best_of_n.yaml").read_text(encoding="utf-8"))
    assert "include: alpacafarm:offline" in copied.read_text(encoding="utf-8")
    loaded = load_recipe(copied)
    assert loaded.recipe.model.name == "smollm2-135m-instruct" and loaded.recipe.seed == 42
    result = run_cli("recipe", "check", str(copied), cwd=plugin_repo)
    assert result.returncode == 0, result.stderr


def test_an_unknown_package_piece_is_a_one_line_error_listing_the_pieces(tmp_path):
    message = error_of(write(tmp_path / "r.yaml", "name: t\ninclude: alpacafarm:ofline\n" + SPLIT_STAGE))
    assert message.startswith(f"{tmp_path / 'r.yaml'}:2: include: 'alpacafarm:ofline': alpacafarm ships no recipe "
                              "piece 'ofline'; did you mean 'offline'?"), message
    assert "(pieces: " in message and "offline" in message


# ------------------------------------------------------------------------------------------------- --set


@pytest.fixture
def quickstart_copy(tmp_path):
    return write(tmp_path / "q.yaml", (REPO_ROOT / "recipes" / "quickstart.yaml").read_text())


def test_set_overrides_are_coerced(quickstart_copy):
    loaded = load_recipe(quickstart_copy, [
        "seed=3", "stages.split.config.eval_fraction=0.5", "stages.3.config.sampling.max_new_tokens=8",
        "model.trust_remote_code=true", "model.lora.target_modules=[q_proj, v_proj]", "model.lora.dropout=1e-5",
    ])
    recipe = loaded.recipe
    assert recipe.seed == 3 and isinstance(recipe.seed, int)
    assert loaded.stage_configs["split"].eval_fraction == 0.5
    assert loaded.stage_configs["outputs"].sampling.max_new_tokens == 8  # nested, addressed by index
    assert recipe.model.trust_remote_code is True
    assert recipe.model.lora.target_modules == ["q_proj", "v_proj"]
    assert recipe.model.lora.dropout == pytest.approx(1e-5)
    assert loaded.resolved()["stages"][0]["config"] == {"eval_size": 128, "eval_fraction": 0.5}


def test_exponent_floats_are_floats_in_files_and_overrides(tmp_path):
    path = write(tmp_path / "r.yaml", "name: t\nmodel: {name: m, lora: {dropout: 2e-5}}\n" + SPLIT_STAGE)
    assert load_recipe(path).recipe.model.lora.dropout == pytest.approx(2e-5)
    assert load_recipe(path, ["stages.split.config.eval_fraction=1e-1"]).stage_configs["split"].eval_fraction == 0.1


def test_bad_set_overrides(quickstart_copy):
    assert error_of(quickstart_copy, ["seed=abc"]).startswith("--set: seed: ")
    assert "no item 'nosuch'" in error_of(quickstart_copy, ["stages.nosuch.config.x=1"])
    assert "no item 99" in error_of(quickstart_copy, ["stages.99.config.x=1"])
    assert "KEY=VALUE" in error_of(quickstart_copy, ["seed"])
    message = error_of(quickstart_copy, ["stages.split.config.eval_fractoin=0.5"])
    assert "stages[0].config.eval_fractoin" in message and "did you mean 'eval_fraction'" in message


# ------------------------------------------------------------------------------------------------- schema errors


@pytest.mark.parametrize(("text", "expected"), [
    ("name: t\nstagse: []\n" + SPLIT_STAGE,
     ["r.yaml:2: stagse: unknown key 'stagse'", "did you mean 'stages'?"]),
    ("name: t\nmodel:\n  name: x\n  lora_r: 8\n" + SPLIT_STAGE,
     ["r.yaml:4: model.lora_r: unknown key 'lora_r'", "did you mean 'lora'"]),
    ("name: t\nseed: abc\n" + SPLIT_STAGE, ["r.yaml:2: seed:", "valid integer"]),
    ("name: t\nmodel:\n  name: x\n  dtype: float8\n" + SPLIT_STAGE, ["r.yaml:4: model.dtype:", "'bfloat16'"]),
    ("name: t\nstages:\n  - name: split\n   method: x\n", ["r.yaml:4: malformed YAML"]),
    ("name: t\nstages:\n  - name: s\n    method: split_instruction\n",
     ["r.yaml:4: stages[0].method: unknown method 'split_instruction'", "did you mean 'split_instructions'?",
      "known: ", "inspect_model"]),
    ("name: t\nstages:\n  - name: s\n    method: split_instructions\n    config:\n      eval_fractoin: 0.3\n",
     ["r.yaml:6: stages[0].config.eval_fractoin: unknown key", "did you mean 'eval_fraction'?"]),
    ("name: t\nstages:\n  - name: s\n    method: split_instructions\n    config:\n      eval_fraction: lots\n",
     ["r.yaml:6: stages[0].config.eval_fraction:", "valid number"]),
    ("name: t\nstages:\n  - name: s\n    method: split_instructions\n    config:\n      eval_fraction: 1.5\n",
     ["r.yaml:6: stages[0].config.eval_fraction:", "less than 1"]),
    ("name: t\n" + SPLIT_STAGE + "  - {name: split, method: split_instructions}\n",
     ["r.yaml:4: stages[1].name: stage name 'split' is already used"]),
    ("name: t\nstages:\n  - name: s\n    method: split_instructions\n    inputs:\n      prompts: x\n",
     ["r.yaml:6: stages[0].inputs.prompts: method 'split_instructions' has no input 'prompts'", "instructions"]),
    ("name: t\ndata:\n  instructions: {path: no/such/file.jsonl}\n" + SPLIT_STAGE,
     ["r.yaml:3: data.instructions.path: file not found: no/such/file.jsonl"]),
    ("- just\n- a list\n", ["r.yaml:1: a recipe must be a YAML mapping"]),
    ("name: t\nstages:\n  - name: s\n    method: split_instructions\n    config:\n",  # nothing after 'config:'
     ["r.yaml:5: stages[0].config: has no value (nothing after 'config:'); give a mapping"]),
    ("name:\n" + SPLIT_STAGE, ["r.yaml:1: name: has no value (nothing after 'name:'); give a string"]),
])
def test_recipe_errors_name_the_culprit(tmp_path, text, expected):
    message = error_of(write(tmp_path / "r.yaml", text))
    for part in expected:
        assert part in message


def test_misspelled_required_key_is_named(tmp_path):
    message = error_of(write(tmp_path / "r.yaml", "name: t\nstagse:\n  - {name: s, method: split_instructions}\n"))
    assert "stagse" in message and "did you mean 'stages'" in message


def test_quoted_exponent_string_stays_a_string(tmp_path):
    path = write(tmp_path / "r.yaml", 'name: t\nmodel: {name: m, revision: "12e4567"}\n' + SPLIT_STAGE)
    assert load_recipe(path).recipe.model.revision == "12e4567"


def test_error_in_a_set_mapping_points_at_set(quickstart_copy):
    assert error_of(quickstart_copy, ["model={name: x, dtype: float8}"]).startswith("--set")


def test_missing_recipe_file(tmp_path):
    with pytest.raises(UserError, match=r"recipe file not found: .*nope\.yaml"):
        load_recipe(tmp_path / "nope.yaml")


# ------------------------------------------------------------------------------------------------- plugin configs


@dataclass
class ToyConfig:
    steps: int = 1
    learning_rate: float = 1e-3
    tags: list[str] = field(default_factory=list)
    api_token: int = 0  # a secret-named field: its value never appears in an error
    token_env: str = "TOY_TOKEN"  # the NAME of the variable holding a secret

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")


class ToyMethod(Method):
    config_class = ToyConfig
    provides = "toy"

    def run(self, context):
        return Artifact("toy")


class JudgeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    threshold: int = 0


class LongerJudge:
    config_class = JudgeConfig

    def __init__(self, config: dict) -> None:
        self.config = config


class _TestPlugin:
    @alpacafarm.hookimpl
    def register_methods(self, register):
        register("toy_method", ToyMethod)

    @alpacafarm.hookimpl
    def register_annotators(self, register):
        register("longer_judge", LongerJudge)


@pytest.fixture
def test_plugin():
    register_plugin(_TestPlugin(), "testplugin")
    try:
        yield get_registry()
    finally:
        unregister_plugin("testplugin")
        assert ("method", "toy_method") not in get_registry()


def toy_recipe(tmp_path: Path, config: str, extra: str = "") -> Path:
    return write(tmp_path / "toy.yaml", f"name: t\n{extra}stages:\n  - name: toy\n    method: toy_method\n"
                 f"    config:\n{textwrap.indent(textwrap.dedent(config), '      ')}")


def test_dataclass_config_is_coerced(tmp_path, test_plugin):
    loaded = load_recipe(toy_recipe(tmp_path, 'steps: "3"\nlearning_rate: 2e-5\ntags: [a, b]\n'))
    assert loaded.stage_configs["toy"] == ToyConfig(steps=3, learning_rate=2e-5, tags=["a", "b"])
    assert isinstance(loaded.stage_configs["toy"].steps, int)


@pytest.mark.parametrize(("config", "expected"), [
    ("steps: 2\nstpes: 3\n", ["toy.yaml:7: stages[0].config.stpes: unknown key 'stpes'", "did you mean 'steps'?"]),
    ("steps: many\n", ["toy.yaml:6: stages[0].config.steps:", "valid integer", "'many'"]),
    ("tags: notalist\n", ["toy.yaml:6: stages[0].config.tags:", "valid list"]),
    ("steps: 0\n", ["toy.yaml:5: stages[0].config: ToyConfig: steps must be at least 1, got 0"]),
])
def test_dataclass_config_errors(tmp_path, test_plugin, config, expected):
    message = error_of(toy_recipe(tmp_path, config))
    for part in expected:
        assert part in message


SECRET = "sk-proj-Xq7vT2mLp9RwZ4kN8sHd3JfY6cBg1AeU5oIi0"


@pytest.mark.parametrize(("config", "expected"), [
    (f"api_token: {SECRET}\n", "stages[0].config.api_token: Input should be a valid integer"),
    (f"token_env: {SECRET}\n", "stages[0].config.token_env: looks like a key itself; put the key in an environment "
                                "variable and give its name"),
    ("token_env: 4d1b9e7c2a8f3d6b1e9c4a7f2d8b3e6c\n", "stages[0].config.token_env: looks like a key itself"),
])
def test_secrets_are_never_in_config_errors(tmp_path, test_plugin, config, expected):
    message = error_of(toy_recipe(tmp_path, config))
    assert expected in message and SECRET not in message and "4d1b9e7c" not in message


def test_an_environment_variable_name_is_accepted(tmp_path, test_plugin):
    loaded = load_recipe(toy_recipe(tmp_path, "token_env: MY_TEAM_OPENAI_API_KEY_2024\n"))
    assert loaded.stage_configs["toy"].token_env == "MY_TEAM_OPENAI_API_KEY_2024"


def test_annotator_name_and_config_are_validated(tmp_path, test_plugin):
    config = "steps: 1\n"
    assert (load_recipe(toy_recipe(tmp_path, config, "annotator: longer_judge\n")).recipe.annotator.name
            == "longer_judge")
    message = error_of(toy_recipe(tmp_path, config, "annotator: longer_judg\n"))
    assert "toy.yaml:2: annotator.name: unknown annotator 'longer_judg'" in message
    assert "did you mean 'longer_judge'" in message
    message = error_of(toy_recipe(tmp_path, config, "annotator:\n  name: longer_judge\n  config: {threshhold: 2}\n"))
    assert "annotator.config.threshhold: unknown key" in message and "did you mean 'threshold'?" in message


# ------------------------------------------------------------------------------------------------- CLI


BAD_RECIPES = {
    "unknown_key": ("name: t\nstagse: []\n" + SPLIT_STAGE, "stagse"),
    "unknown_method": ("name: t\nstages:\n  - {name: s, method: nosuch_method}\n", "nosuch_method"),
    "malformed": ("name: t\nstages: [\n", "malformed YAML"),
    "needs_model": ("name: t\nstages:\n  - {name: s, method: inspect_model}\n", "needs a model"),
}


@pytest.fixture
def cli(capsys):
    get_registry()  # load plugins first so that no loader warning lands in the captured output
    capsys.readouterr()

    def call(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return call


@pytest.mark.parametrize("case", sorted(BAD_RECIPES))
def test_cli_reports_bad_recipes_in_one_line(tmp_path, cli, case):
    text, culprit = BAD_RECIPES[case]
    bad = write(tmp_path / "bad.yaml", text)
    run_dir = tmp_path / "run"
    for args in (["recipe", "check", str(bad)], ["run", str(bad), "--output-dir", str(run_dir)]):
        code, _, err = cli(*args)
        assert code == 2, err
        lines = err.splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith("error: ") and "bad.yaml" in lines[0] and culprit in lines[0]
        assert "Traceback" not in err
    assert not run_dir.exists()


def test_cli_debug_adds_the_traceback(tmp_path, cli):
    bad = write(tmp_path / "bad.yaml", BAD_RECIPES["unknown_method"][0])
    code, _, err = cli("--debug", "recipe", "check", str(bad))
    assert code == 2
    assert "Traceback (most recent call last)" in err and "RecipeError" in err
    assert err.splitlines()[-1].startswith("error: ") and "nosuch_method" in err.splitlines()[-1]


def test_cli_set_error_and_quickstart_check(cli):
    quickstart = str(REPO_ROOT / "recipes" / "quickstart.yaml")
    code, out, err = cli("recipe", "check", quickstart)
    assert (code, err) == (0, "")
    assert "ok:" in out and "'quickstart', 5 stage(s)" in out and "split: split_instructions" in out
    code, _, err = cli("recipe", "check", quickstart, "--set", "stages.split.config.eval_fraction=2")
    assert code == 2 and err.startswith("error: --set: stages[0].config.eval_fraction:") and err.count("\n") == 1


# ------------------------------------------------------------------------------------------- generation sizes
GENERATE = ("name: t\nmodel: {name: smollm2-135m-instruct}\ndata:\n  instructions: {builtin: alpaca_eval_sample}\n"
            + SPLIT_STAGE + "  - name: gen\n    method: generate_outputs\n    config:\n      sampling:\n")


@pytest.mark.parametrize(("setting", "shown"), [("max_new_tokens: 100000000000000000000000", "max_new_tokens"),
                                                ("max_new_tokens: 32769", "max_new_tokens"),
                                                ("n: 4097", "n")])
def test_generation_sizes_are_bounded_where_the_recipe_is_checked(tmp_path, cli, setting, shown):
    """``max_new_tokens: 1e23`` passed ``recipe check`` and ``--plan``; the stage then sampled until killed."""
    recipe = write(tmp_path / "r.yaml", GENERATE + f"        {setting}\n")
    bound = "32,768" if shown == "max_new_tokens" else "4,096"
    message = error_of(recipe)
    assert message.startswith(f"{recipe}:11: stages[1].config.sampling.{shown}: ") and f"[1, {bound}]" in message
    assert "samples until the stage is killed" in message, message
    code, out, err = cli("run", str(recipe), "--plan", "--output-dir", str(tmp_path / "run"))
    assert code == 2 and out == "" and err.count("\n") == 1 and f"sampling.{shown}" in err, err
    write(tmp_path / "ok.yaml", GENERATE + "        max_new_tokens: 32768\n        n: 4096\n")
    load_recipe(tmp_path / "ok.yaml")  # the bound itself is allowed


def test_generation_sizes_are_bounded_where_sampling_runs():
    """A config copied with ``model_copy(update=...)`` (best-of-n's own ``n``) and a trainer's own
    ``max_new_tokens`` (PPO, Quark) never pass through SamplingConfig's check: the sampler refuses them itself."""
    from alpacafarm.generation import Generator, SamplingConfig, generate_records
    from alpacafarm.sampling import sample

    copied = SamplingConfig().model_copy(update={"n": 10**9})
    with pytest.raises(UserError, match=r"^sampling: n must be a whole number in \[1, 4,096\], got 1000000000"):
        generate_records(Generator(), [{"instruction": "hi"}], copied)
    with pytest.raises(UserError, match=r"^sampling: max_new_tokens must be a whole number in \[1, 32,768\]"):
        sample(None, None, [[1, 2]], max_new_tokens=10**23)


def test_evaluate_max_new_tokens_is_bounded_in_one_line():
    """Before the bound this loaded the model and sampled until killed: a short time limit says so quickly."""
    import os
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "alpacafarm", "evaluate", "--model", "smollm2-135m-instruct",
                             "--annotator", "offline", "--max-new-tokens", "100000000"], capture_output=True,
                            text=True, env=os.environ, cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        "error: --max-new-tokens must be a whole number in [1, 32,768], got 100000000 (alpacafarm.sampling: the "
        "bound is past every real answer; a larger value samples until the stage is killed)"], result.stderr
