"""``alpacafarm plugin new`` and the gate workflows, run as written.

The scaffolded repository is pip-installed (no network, no build isolation) into a folder on ``PYTHONPATH`` and its
own test and ``recipe check`` run in fresh processes. The workflows (the plugin template and this repository's
``.github/workflows/benchmark.yml``) are parsed as YAML and their ``run:`` steps executed with bash, in a scratch
copy of the repository they are meant for, with the GitHub variables set and ``${{ }}`` expressions substituted
(:class:`WorkflowRun`); ``uses:`` steps (checkout, setup-python, upload-artifact) are GitHub's and are skipped.

What the workflow tests do not run for real: downloads. The ``python`` on their ``PATH`` makes ``python -m venv``
add a ``.pth`` line to the new environment pointing at this test environment's site-packages, so pip finds every
dependency installed (no index is reached); pip still builds and installs alpacafarm itself from the checkout
given as ``ALPACAFARM_SPEC`` (``alpacafarm[fast-cpu] @ file://...``, as a git URL would be), and the plugin.
The benchmark each workflow runs is a tiny recipe (tiny random-init model, 12 instructions, the tiny model as
``local_judge``) written where the author's ``RECIPE`` points, with a baseline made beforehand as an author does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO_ROOT, run_cli

PLUGIN_WORKFLOW = REPO_ROOT / "alpacafarm" / "plugin_template" / "benchmark-workflow.yml"
REPO_WORKFLOW = REPO_ROOT / ".github" / "workflows" / "benchmark.yml"


def pip_install_target(source: Path, target: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                             "--no-index", "--target", str(target), str(source)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def run_python(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **env}, timeout=600)


# ------------------------------------------------------------------------------------------ plugin new


@pytest.mark.slow
def test_plugin_new_writes_a_repository_whose_test_and_recipe_check_pass(tmp_path: Path):
    result = run_cli("plugin", "new", "my-rerank", "--dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    root = tmp_path / "my-rerank"
    assert result.stdout.startswith(f"plugin written: {root}")
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert files == [".github/workflows/benchmark.yml", ".gitignore", "README.md", "benchmarks/bench.yaml",
                     "my_rerank/__init__.py", "my_rerank/method.py", "pyproject.toml", "tests/test_method.py"]
    assert (root / ".github/workflows/benchmark.yml").read_text(encoding="utf-8") == \
        PLUGIN_WORKFLOW.read_text(encoding="utf-8")
    assert "__PACKAGE__" not in "".join(p.read_text(encoding="utf-8") for p in root.rglob("*") if p.is_file())
    site = tmp_path / "site"
    pip_install_target(root, site)
    env = {"PYTHONPATH": str(site)}
    listed = run_cli("plugins", "--json", env=env)
    plugin = next(p for p in json.loads(listed.stdout)["plugins"] if p["name"] == "my_rerank")
    assert plugin["registers"] == {"method": ["my_rerank"]} and plugin["error"] is None
    tests = run_python("-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=root, env=env)
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert "1 passed" in tests.stdout
    check = run_cli("recipe", "check", "benchmarks/bench.yaml", cwd=root, env=env)
    assert check.returncode == 0, check.stderr
    assert "my_rerank: my_rerank (my_rerank); sft_model <- base_model, reward_model <- reward_model" in check.stdout
    # nothing is overwritten; a bad name is one line
    again = run_cli("plugin", "new", "my-rerank", "--dir", str(tmp_path))
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"error: plugin new: {root} already exists and is not an empty folder; nothing was written"]
    bad = run_cli("plugin", "new", "My Plugin", "--dir", str(tmp_path))
    assert bad.returncode == 2 and bad.stderr.startswith("error: plugin name 'My Plugin': use lower-case")


def test_an_unknown_kind_is_one_line_and_each_kind_writes_its_own_method(tmp_path: Path):
    bad = run_cli("plugin", "new", "my-thing", "--kind", "ppo", "--dir", str(tmp_path))
    assert bad.returncode == 2 and "invalid choice: 'ppo'" in bad.stderr and not (tmp_path / "my-thing").exists()
    from alpacafarm.scaffold import new_plugin

    with pytest.raises(Exception, match="unknown kind 'ppo'; choose one of rerank, direct-alignment"):
        new_plugin("my-thing", tmp_path, kind="ppo")
    rerank = new_plugin("my-rerank", tmp_path)
    direct = new_plugin("my-variant", tmp_path, kind="direct-alignment")
    assert "class Rerank(Method)" in (rerank / "my_rerank" / "method.py").read_text(encoding="utf-8")
    method = (direct / "my_variant" / "method.py").read_text(encoding="utf-8")
    assert "class RobustDPO(DirectAlignment)" in method and len(method.splitlines()) <= 60
    assert "my_variant.method:RobustDPO" in (direct / "my_variant" / "__init__.py").read_text(encoding="utf-8")
    readme = (direct / "README.md").read_text(encoding="utf-8")
    assert "a DPO variant (robust DPO" in readme and "__WHAT__" not in readme and "__START__" not in readme


@pytest.mark.slow
def test_a_scaffolded_dpo_variant_installs_passes_its_test_and_runs_through_a_recipe_and_the_gate(
        tmp_path: Path, tiny_model_dir: str):
    from alpacafarm.testing import learnable_preferences, write_records

    result = run_cli("plugin", "new", "my-robust-dpo", "--kind", "direct-alignment", "--dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    root = tmp_path / "my-robust-dpo"
    site = tmp_path / "site"
    pip_install_target(root, site)
    env = {"PYTHONPATH": str(site)}
    tests = run_python("-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=root, env=env)
    assert tests.returncode == 0 and "1 passed" in tests.stdout, tests.stdout + tests.stderr
    check = run_cli("recipe", "check", "benchmarks/bench.yaml", cwd=root, env=env)
    assert check.returncode == 0, check.stderr
    assert "my_robust_dpo: my_robust_dpo (my_robust_dpo); sft_model <- base_model, preferences <- preferences" \
        in check.stdout
    # the gate over a tiny world: the variant trains on recorded pairs, its policy answers, a tiny judge judges
    prefs = write_records(root / "prefs.jsonl", learnable_preferences(16))
    (root / "benchmarks" / "tiny.yaml").write_text(f"""name: tiny-gate
seed: 5
model: {{name: {tiny_model_dir}, dtype: float32, device: cpu, prompt_format: chat_template}}
data:
  instructions: {{builtin: alpaca_eval_sample, limit: 24}}
  preferences: {{path: {prefs}}}
stages:
  - {{name: split, method: split_instructions, config: {{eval_size: 12}}}}
  - name: variant
    method: my_robust_dpo
    config: {{flip_rate: 0.2, max_steps: 2, per_device_train_batch_size: 8, learning_rate: 1.0e-4, warmup_steps: 0,
             logging_steps: 1, save_strategy: "no"}}
  - name: variant_outputs
    method: generate_outputs
    inputs: {{sft_model: variant}}
    config: {{split: eval, sampling: {{temperature: 1.0, max_new_tokens: 8, batch_size: 12}}}}
evaluation:
  evaluator: win_rate
  annotator: {{name: local_judge, config: {{model: {tiny_model_dir}}}}}
  policy: [variant_outputs]
""", encoding="utf-8")
    made = run_cli("bench", "benchmarks/tiny.yaml", "--baseline", "benchmarks/baseline.json", "--update-baseline",
                   "--allow-underpowered", cwd=root, env=env)
    assert made.returncode == 0, made.stderr
    metrics = json.loads(next((root / "runs").rglob("variant/metrics.json")).read_text(encoding="utf-8"))
    assert metrics["flip_rate"] == 0.2 and metrics["steps"] == 2 and metrics["n_pairs"] == 16
    gated = run_cli("bench", "benchmarks/tiny.yaml", "--baseline", "benchmarks/baseline.json", "--report",
                    "gate.md", cwd=root, env=env)
    assert gated.returncode == 0, gated.stderr
    assert (root / "gate.md").read_text(encoding="utf-8").startswith("## ✅ alpacafarm bench: PASS")


# ------------------------------------------------------------------------------------------ workflows


class WorkflowRun:
    """Runs a GitHub Actions workflow's ``run:`` steps with bash in ``workdir``, as a runner would.

    ``variables`` are the repository's ``vars``; ``env`` replaces workflow-level ``env:`` values (what the author
    edits in the file). Supported expressions: ``vars.X``, ``vars.X || 'default'``, ``steps.ID.outputs.KEY``,
    ``github.token``, ``github.event.pull_request.number``, and the step conditions ``always()`` and
    ``hashFiles('f') != ''``; anything else fails the test (a typo in the workflow would too on GitHub).
    """

    def __init__(self, workflow: Path, workdir: Path, variables: dict[str, str], env: dict[str, str],
                 shim_dir: Path) -> None:
        self.doc = yaml.safe_load(workflow.read_text(encoding="utf-8"))
        self.workdir, self.variables, self.shim_dir = workdir, variables, shim_dir
        self.outputs: dict[str, dict[str, str]] = {}
        self.env = {k: self.expand(str(v)) for k, v in (self.doc.get("env") or {}).items()}
        self.env.update(env)

    def expression(self, text: str) -> str:
        text = text.strip()
        if "||" in text:
            left, right = (part.strip() for part in text.split("||", 1))
            return self.expression(left) or self.expression(right)
        if re.fullmatch(r"'[^']*'", text):
            return text[1:-1]
        if text.startswith("vars."):
            return self.variables.get(text[5:], "")
        match = re.fullmatch(r"steps\.(\w+)\.outputs\.(\w+)", text)
        if match:
            return self.outputs.get(match[1], {}).get(match[2], "")
        if text == "github.token":
            return "not-a-token"
        if text == "github.event.pull_request.number":
            return "1"
        raise AssertionError(f"unsupported expression in the workflow: {text!r}")

    def expand(self, text: str) -> str:
        return re.sub(r"\$\{\{(.*?)\}\}", lambda m: self.expression(m[1]), text)

    def condition(self, text: str | None, failed: bool) -> bool:
        if text is None:
            return not failed
        parts = [p.strip() for p in str(text).split("&&")]
        ok = True
        for part in parts:
            if part == "always()":
                continue
            match = re.fullmatch(r"hashFiles\('([^']+)'\) != ''", part)
            assert match, f"unsupported condition {part!r}"
            ok = ok and (self.workdir / match[1]).exists()
        return ok and (not failed or "always()" in parts)

    def run(self, only: list[str] | None = None) -> list[dict[str, Any]]:
        """Run the steps (named ``only``, else all) in order; a failed step skips later ones without always()."""
        (job,) = self.doc["jobs"].values()
        temp = self.workdir.parent / f"{self.workdir.name}-runner-temp"
        temp.mkdir(exist_ok=True)
        results, failed = [], False
        for step in job["steps"]:
            if "run" not in step or (only is not None and step.get("name") not in only):
                continue
            if not self.condition(step.get("if"), failed):
                results.append({"name": step.get("name"), "skipped": True})
                continue
            output_file = temp / f"output-{len(results)}"
            output_file.write_text("", encoding="utf-8")
            env = {**os.environ, **self.env, **{k: self.expand(str(v)) for k, v in (step.get("env") or {}).items()},
                   "GITHUB_OUTPUT": str(output_file), "GITHUB_STEP_SUMMARY": str(temp / "summary.md"),
                   "RUNNER_TEMP": str(temp), "CI": "true", "GITHUB_ACTIONS": "true",
                   "PATH": f"{self.shim_dir}{os.pathsep}{os.environ['PATH']}"}
            env.pop("VIRTUAL_ENV", None)
            done = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", self.expand(step["run"])],
                                  cwd=self.workdir, env=env, capture_output=True, text=True, timeout=900)
            if "id" in step:
                lines = output_file.read_text(encoding="utf-8").splitlines()
                self.outputs[step["id"]] = dict(line.split("=", 1) for line in lines if "=" in line)
            results.append({"name": step.get("name"), "rc": done.returncode, "stdout": done.stdout,
                            "stderr": done.stderr})
            failed = failed or done.returncode != 0
        return results


@pytest.fixture(scope="module")
def python_shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``python`` whose ``-m venv DIR`` layers DIR on this environment's site-packages (no downloads)."""
    folder = tmp_path_factory.mktemp("shim")
    parent_site = sysconfig.get_paths()["purelib"]
    shim = folder / "python"
    shim.write_text(f"""#!/bin/bash
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  "{sys.executable}" "$@" || exit $?
  target="${{@: -1}}"
  site=$("$target/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "{parent_site}" > "$site/_test_parent_site.pth"
  exit 0
fi
exec "{sys.executable}" "$@"
""", encoding="utf-8")
    shim.chmod(0o755)
    return folder


def repository_copy(destination: Path) -> Path:
    """The working tree as git sees it (tracked and untracked-not-ignored files), copied."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


def tiny_recipe(path: Path, model: str, method: str, stage: str, config: str) -> Path:
    """A benchmark small enough for a test: 12 held-out instructions, the tiny model as sampler, reward and judge."""
    path.write_text(f"""name: tiny-gate
seed: 5
model: {{name: {model}, dtype: float32, device: cpu, prompt_format: chat_template}}
data:
  instructions: {{builtin: alpaca_eval_sample, limit: 24}}
stages:
  - {{name: split, method: split_instructions, config: {{eval_size: 12}}}}
  - name: {stage}
    method: {method}
    inputs: {{reward_model: base_model}}
    config: {config}
evaluation:
  evaluator: win_rate
  annotator: {{name: local_judge, config: {{model: {model}}}}}
  policy: [{stage}]
""", encoding="utf-8")
    return path


def verdict_step(run: WorkflowRun, code: str) -> dict[str, Any]:
    run.outputs["gate"] = {"code": code}
    (result,) = run.run(only=["Verdict"])
    return result


@pytest.mark.slow
def test_the_plugin_workflow_template_installs_and_gates_a_scaffolded_plugin(tmp_path: Path, tiny_model_dir: str,
                                                                             python_shim: Path):
    alpacafarm = repository_copy(tmp_path / "alpacafarm-checkout")
    assert run_cli("plugin", "new", "my-rerank", "--dir", str(tmp_path)).returncode == 0
    repo = tmp_path / "my-rerank"
    recipe = tiny_recipe(repo / "benchmarks" / "tiny.yaml", tiny_model_dir, "my_rerank", "rerank",
                         "{n: 2, sampling: {temperature: 1.0, max_new_tokens: 8, batch_size: 12}}")
    # The author's one-off step on the default branch: the baseline (a tiny benchmark is underpowered: allowed)
    site = tmp_path / "site"
    pip_install_target(repo, site)
    made = run_cli("bench", "benchmarks/tiny.yaml", "--baseline", "benchmarks/baseline.json", "--update-baseline",
                   "--allow-underpowered", cwd=repo, env={"PYTHONPATH": str(site)})
    assert made.returncode == 0, made.stderr
    shutil.rmtree(repo / "runs")  # the gate starts from nothing, as on a fresh runner
    variables = {"ALPACAFARM_SPEC": f"alpacafarm[fast-cpu] @ file://{alpacafarm}",
                 "ALPACAFARM_TORCH_INDEX": "file:///nonexistent-index"}  # unused: torch is already there
    run = WorkflowRun(PLUGIN_WORKFLOW, repo, variables, {"RECIPE": str(recipe.relative_to(repo))}, python_shim)
    assert run.env["ON_INCONCLUSIVE"] == "fail" and run.env["BASELINE"] == "benchmarks/baseline.json"
    install, gate, comment, verdict = run.run()
    assert install["rc"] == 0, install["stderr"][-3000:]
    listing = install["stdout"] + install["stderr"]  # the table goes where the console writes
    assert re.search(r"my_rerank\s+│\s+my-rerank\s+│\s+0\.1\.0", listing), listing[-3000:]
    # alpacafarm came from the checkout, not from this environment
    where = subprocess.run([str(repo / ".venv/bin/python"), "-c", "import alpacafarm; print(alpacafarm.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert where.stdout.strip().startswith(str(repo / ".venv")), where
    assert gate["rc"] == 0 and run.outputs["gate"]["code"] == "0", gate["stderr"][-3000:]
    assert (repo / "gate.md").read_text(encoding="utf-8").startswith("## ✅ alpacafarm bench: PASS")
    assert comment["rc"] == 0  # no gh here: the comment is best effort
    assert verdict["rc"] == 0 and verdict["stdout"].strip() == "PASS"
    # INCONCLUSIVE fails by default; the variable switches it to a warning. FAIL, STALE and crashes fail.
    inconclusive = verdict_step(run, "3")
    assert inconclusive["rc"] == 3 and "::error title=benchmark gate::INCONCLUSIVE" in inconclusive["stdout"]
    warned = WorkflowRun(PLUGIN_WORKFLOW, repo, {**variables, "ALPACAFARM_ON_INCONCLUSIVE": "warn"}, {}, python_shim)
    result = verdict_step(warned, "3")
    assert result["rc"] == 0 and "::warning title=benchmark gate::INCONCLUSIVE" in result["stdout"]
    assert [verdict_step(run, code)["rc"] for code in ("1", "4", "2", "5")] == [1, 4, 1, 1]
    # Without ALPACAFARM_SPEC the install says what to set, instead of installing something else
    unset = WorkflowRun(PLUGIN_WORKFLOW, repo, {}, {}, python_shim).run(only=[install["name"]])[0]
    assert unset["rc"] == 2 and "set the repository variable ALPACAFARM_SPEC" in unset["stdout"]


@pytest.mark.slow
def test_this_repositorys_gate_workflow_installs_the_extras_it_needs_and_gates(tmp_path: Path, tiny_model_dir: str,
                                                                              python_shim: Path):
    repo = repository_copy(tmp_path / "checkout")
    recipe = tiny_recipe(repo / "runs-tiny.yaml", tiny_model_dir, "best_of_n", "best_of_n",
                         "{n: 2, n_values: [1, 2], sampling: {temperature: 1.0, max_new_tokens: 8, batch_size: 12}}")
    made = run_cli("bench", str(recipe), "--baseline", str(repo / "tiny-baseline.json"), "--update-baseline",
                   "--allow-underpowered", cwd=repo)
    assert made.returncode == 0, made.stderr
    shutil.rmtree(repo / "runs")
    run = WorkflowRun(REPO_WORKFLOW, repo, {"ALPACAFARM_TORCH_INDEX": "file:///nonexistent-index"},
                      {"RECIPE": "runs-tiny.yaml", "BASELINE": "tiny-baseline.json"}, python_shim)
    install, gate, verdict = run.run()
    assert install["rc"] == 0, install["stderr"][-3000:]
    # the recipe's openvino backend needs the fast-cpu extra: the workflow installs it, pinned
    assert "fast-cpu" in REPO_WORKFLOW.read_text(encoding="utf-8")
    importable = subprocess.run([str(repo / ".venv/bin/python"), "-c", "import openvino_genai, alpacafarm; "
                                 "print(alpacafarm.__file__)"], capture_output=True, text=True, cwd=tmp_path)
    assert importable.returncode == 0 and importable.stdout.strip().startswith(str(repo)), importable
    assert gate["rc"] == 0 and run.outputs["gate"]["code"] == "0", gate["stderr"][-3000:]
    assert verdict["rc"] == 0
    assert verdict_step(run, "3")["rc"] == 3 and verdict_step(run, "1")["rc"] == 1


def test_this_repositorys_gate_workflow_gates_every_benchmark_with_a_committed_baseline():
    """One matrix job per benchmark (the steps above run each with its RECIPE and BASELINE): every recipe checks and
    every baseline is a baseline of that recipe."""
    (job,) = yaml.safe_load(REPO_WORKFLOW.read_text(encoding="utf-8"))["jobs"].values()
    assert job["env"] == {"RECIPE": "${{ matrix.recipe }}", "BASELINE": "${{ matrix.baseline }}"}
    benchmarks = job["strategy"]["matrix"]["include"]
    assert {b["recipe"] for b in benchmarks} >= {"recipes/bench/best_of_n.yaml", "recipes/compare.yaml"}
    for benchmark in benchmarks:
        baseline = json.loads((REPO_ROOT / benchmark["baseline"]).read_text(encoding="utf-8"))
        assert baseline["recipe"] == benchmark["recipe"], benchmark
        assert (REPO_ROOT / benchmark["recipe"]).is_file()
