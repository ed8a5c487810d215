"""Several processes: the collectives of :mod:`alpacafarm.distributed` with 2 real ranks (torchrun, gloo on CPU),
``alpacafarm run --num-processes`` (accelerate launch), and a tiny recipe (SFT,
reward model, DPO, PPO, best-of-n, generation) run on 2 processes against the same recipe on one.

Run as a script under torchrun (``python -m torch.distributed.run --nproc_per_node 2 tests/test_distributed.py
WHAT OUT``) this file is the worker of the collective tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from alpacafarm.testing.launch import launch_ranks, rank_results

REPO_ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------------------------- the worker


def _worker(what: str, out: Path) -> None:
    """One rank: runs the collectives and writes what it saw to ``out/rank<R>.json``."""
    from alpacafarm import distributed as d

    d.init()
    result: dict[str, Any] = {"rank": d.rank(), "world": d.world_size(), "main": d.is_main()}
    if what == "collectives":
        result["gathered"] = d.all_gather_object({"r": d.rank()})
        result["broadcast"] = d.broadcast_object(f"decided by {d.rank()}")
        result["contiguous"] = d.shard(list(range(7)))
        result["strided"] = d.shard(list(range(7)), strided=True)
        result["back_contiguous"] = d.gather_shards([x * 10 for x in d.shard(list(range(7)))], 7)
        result["back_strided"] = d.gather_shards([x * 10 for x in d.shard(list(range(7)), strided=True)], 7,
                                                 strided=True)
        result["mapped"] = d.map_sharded(lambda xs: [x + 100 for x in xs], list(range(5)))
        result["on_main"] = d.run_on_main(lambda: f"ran on {d.rank()}")
        d.barrier()
    elif what == "failure":
        try:
            with d.agree("stage 'boom'"):
                if d.rank() == 1:
                    raise ValueError("rank one broke")
            result["error"] = None
        except Exception as exc:  # what each rank raised is the result
            result["error"] = f"{type(exc).__name__}: {exc}"
        d.barrier()  # every rank is still in step after a failure was reported
        result["after"] = "in step"
    elif what == "refuse":
        result.update(_refused_run(out))
    elif what == "score":
        from alpacafarm.reward_selection import score_rows

        calls: list[list[str]] = []
        result["scores"] = score_rows(_LengthReward(calls), SCORED_ROWS, 3, "scoring")
        result["scored"] = calls
    (out / f"rank{d.rank()}.json").write_text(json.dumps(result), encoding="utf-8")
    d.shutdown()


SCORED_ROWS = [{"instruction": f"Question {i}?", "input": "", "output": "word " * (i * 7 % 11)} for i in range(10)]


class _LengthReward:
    """A reward that records each batch it scores (outputs) and depends on the batch (its longest output), as a
    padded reward model may: scores equal one process's only if the batches do."""

    def __init__(self, calls: list[list[str]]) -> None:
        self.calls = calls

    def __call__(self, records: list[dict[str, Any]], completions: list[str]) -> list[float]:
        self.calls.append(list(completions))
        longest = max(len(c) for c in completions)
        return [len(c) + longest / 1000 for c in completions]


def _refused_run(out: Path) -> dict[str, Any]:
    """A recipe whose second stage's method has ``ranks = Ranks.SINGLE_PROCESS``, run as a pipeline on every rank."""
    import alpacafarm
    from alpacafarm.method import Artifact, Method, Ranks
    from alpacafarm.pipeline import Pipeline
    from alpacafarm.plugins import get_registry, register_plugin
    from alpacafarm.recipe import load_recipe

    ran: list[str] = []

    class Numbers(Method):
        provides = "numbers"

        def run(self, context: Any) -> Artifact:
            ran.append(context.stage)
            return Artifact("report", None, {})

    class SoloTrainer(Numbers):
        requires = ("numbers",)
        provides = "model"
        ranks = Ranks.SINGLE_PROCESS  # e.g. a trainer that would wait for a partner on the main process alone

    class Plugin:
        @alpacafarm.hookimpl
        def register_methods(self, register: Any) -> None:
            register("numbers", Numbers)
            register("solo_trainer", SoloTrainer)

    register_plugin(Plugin(), "refuse-test")
    recipe = out / f"recipe{os.environ['RANK']}.yaml"
    recipe.write_text("name: refuse\nstages:\n  - {name: first, method: numbers}\n"
                      "  - {name: solo, method: solo_trainer}\n", encoding="utf-8")
    run_dir = out / "run"
    try:
        Pipeline(load_recipe(recipe), get_registry(), run_dir).run()
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "ran": ran, "run_dir_exists": run_dir.exists()}


def _torchrun(what: str, out: Path, tmp_path: Path) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    done = launch_ranks(Path(__file__), [what, str(out)], cwd=tmp_path, pythonpath=[REPO_ROOT, REPO_ROOT / "plugins"],
                        timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return rank_results(out)


# ----------------------------------------------------------------------------------------------- collectives


def test_one_process_needs_no_process_group():
    from alpacafarm import distributed as d

    assert (d.world_size(), d.rank(), d.is_main()) == (1, 0, True)
    assert d.all_gather_object(3) == [3] and d.broadcast_object("x") == "x"
    assert d.shard([1, 2, 3]) == [1, 2, 3] and d.map_sharded(lambda xs: [x * 2 for x in xs], [1, 2]) == [2, 4]
    assert d.shard_indices(7, rank_=0, world=2) == [0, 1, 2, 3] and d.shard_indices(7, rank_=1, world=2) == [4, 5, 6]
    assert d.shard_indices(7, rank_=1, world=3, strided=True) == [1, 4]
    with pytest.raises(ValueError, match="boom"), d.agree("x"):
        raise ValueError("boom")


def test_each_rank_loads_its_models_on_its_own_gpu(monkeypatch: pytest.MonkeyPatch):
    import torch

    from alpacafarm.model_loading import device_map
    from alpacafarm.recipe import ModelSpec

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # no GPU here: the placement is what is checked
    spec = ModelSpec(name="m")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert device_map(spec) == "auto"  # one process: spread over every GPU
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert device_map(spec) == {"": 3}  # rank 3 of 4: its own GPU only
    assert device_map(ModelSpec(name="m", device="cpu")) == "cpu"  # an explicit device is kept


@pytest.mark.distributed
def test_collectives_on_two_real_ranks(tmp_path: Path):
    ranks = _torchrun("collectives", tmp_path / "out", tmp_path)
    assert [(r["rank"], r["world"], r["main"]) for r in ranks] == [(0, 2, True), (1, 2, False)]
    for r in ranks:
        assert r["gathered"] == [{"r": 0}, {"r": 1}]  # rank order
        assert r["broadcast"] == "decided by 0"  # main decides, everyone agrees
        assert r["back_contiguous"] == r["back_strided"] == [x * 10 for x in range(7)]  # original order
        assert r["mapped"] == [100, 101, 102, 103, 104]
        assert r["on_main"] == "ran on 0"
    assert [r["contiguous"] for r in ranks] == [[0, 1, 2, 3], [4, 5, 6]]
    assert [r["strided"] for r in ranks] == [[0, 2, 4, 6], [1, 3, 5]]


@pytest.mark.distributed
def test_a_failure_on_one_rank_stops_every_rank_with_one_message_naming_it(tmp_path: Path):
    ranks = _torchrun("failure", tmp_path / "out", tmp_path)
    assert ranks[1]["error"] == "ValueError: rank one broke"  # the failing rank keeps its own error
    assert ranks[0]["error"] == "RankFailed: rank 1 failed in stage 'boom': ValueError: rank one broke"
    assert [r["after"] for r in ranks] == ["in step", "in step"]


@pytest.mark.distributed
def test_best_of_n_scoring_is_split_across_ranks_in_the_batches_of_one_process(tmp_path: Path):
    from alpacafarm.reward_selection import score_rows

    one_calls: list[list[str]] = []
    one = score_rows(_LengthReward(one_calls), SCORED_ROWS, 3)
    ranks = _torchrun("score", tmp_path / "out", tmp_path)
    assert [r["scores"] for r in ranks] == [one, one]  # every rank has every score, equal to one process's
    assert len(one_calls) == 4 and [len(r["scored"]) for r in ranks] == [2, 2]  # each rank scored half the batches
    assert ranks[0]["scored"] + ranks[1]["scored"] != one_calls  # ... batch b on rank b mod 2:
    assert sorted(ranks[0]["scored"] + ranks[1]["scored"]) == sorted(one_calls)  # the same batches as one process


# ----------------------------------------------------------------------------------------------- launching


def test_accelerate_config_names_files_and_missing_deepspeed(tmp_path: Path):
    import importlib.util

    from alpacafarm.errors import MissingPackageError, UserError
    from alpacafarm.launch_configs import NAMES, config_path, launch_command, read_config, strip_launch_args

    assert NAMES == ("ddp", "fsdp2", "zero2", "zero3")
    for name in NAMES:
        assert read_config(config_path(name))["distributed_type"] in ("MULTI_GPU", "FSDP", "DEEPSPEED")
    assert read_config(config_path("fsdp2"))["fsdp_config"]["fsdp_version"] == 2
    with pytest.raises(UserError, match="did you mean 'fsdp2'"):
        config_path("fsdp")
    own = tmp_path / "mine.yaml"
    own.write_text("distributed_type: MULTI_GPU\nnum_machines: 1\n")
    command = launch_command(3, str(own), strip_launch_args(["run", "r.yaml", "--num-processes", "3",
                                                             "--accelerate-config=x", "--set", "seed=1"]))
    assert command[1:] == ["-m", "accelerate.commands.launch", "--config_file", str(own), "--num_processes", "3",
                           "--num_machines", "1", "-m", "alpacafarm", "run", "r.yaml", "--set", "seed=1"]
    if importlib.util.find_spec("deepspeed") is None:
        with pytest.raises(MissingPackageError, match="pip install deepspeed"):
            launch_command(2, "zero3", [])


@pytest.mark.distributed
def test_zero_config_without_deepspeed_is_one_line_exit_2(tmp_path: Path):
    import importlib.util

    from conftest import run_cli

    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("deepspeed is installed here")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: z\nstages:\n  - {name: split, method: split_instructions}\n"
                      "data:\n  instructions: {builtin: alpaca_eval_sample, limit: 4}\n")
    done = run_cli("run", str(recipe), "--num-processes", "2", "--accelerate-config", "zero3",
                   "--output-dir", str(tmp_path / "run"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: accelerate config zero3.yaml uses DeepSpeed, which is not installed: pip install deepspeed "
        "--no-build-isolation"]
    assert not (tmp_path / "run").exists()


@pytest.mark.distributed
def test_a_failing_two_process_run_prints_one_line_and_exits_2(tmp_path: Path, tiny_model_dir: str):
    from alpacafarm.testing import write_records

    data = write_records(tmp_path / "d.jsonl", [{"instruction": f"x{i}", "input": ""} for i in range(4)])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: f\nmodel: {{name: {tiny_model_dir}, dtype: float32, device: cpu}}\n"
                      f"data:\n  demonstrations: {{path: {data}}}\n"
                      "stages:\n  - {name: sft, method: sft, inputs: {sft_data: demonstrations},"
                      " config: {max_steps: 1, per_device_train_batch_size: 2}}\n")
    done = subprocess.run([sys.executable, "-m", "alpacafarm", "run", str(recipe), "--num-processes", "2",
                           "--output-dir", str(tmp_path / "run")], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert errors == ["error: stage 'sft': a demonstration record has no 'output' field (fields: input, "
                      "instruction); set stages.<name>.config.response_field"]  # the calling stage, named once
    traceback = (tmp_path / "run" / "error.log").read_text()
    assert "UserError: stage 'sft': a demonstration record" in traceback


@pytest.mark.distributed
def test_a_method_that_cannot_run_on_two_processes_is_refused_before_anything_runs(tmp_path: Path):
    ranks = _torchrun("refuse", tmp_path / "out", tmp_path)
    for r in ranks:  # every rank refuses alike, before any collective, with the same one line
        assert r["error"] == ("UserError: stage 'solo' (method solo_trainer) does not run on 2 processes yet; run "
                              "this recipe without --num-processes")
        assert r["ran"] == [] and r["run_dir_exists"] is False  # not even the first stage ran


# ----------------------------------------------------------------------------------------------- a whole recipe

#: Installed through ``sitecustomize`` in every launched process: records each file-system write (open for
#: writing, mkdir of a new folder, rename, remove, rmtree, SQLite connect) under AF_AUDIT_ROOT, per rank, with
#: Python's audit hooks — real writes, nothing mocked. (Writes done in native code, e.g. safetensors, are not seen.)
AUDIT_HOOK = '''
import os, sys
_root, _log = os.environ.get("AF_AUDIT_ROOT"), os.environ.get("AF_AUDIT_LOG")
if _root and _log:
    _rank = os.environ.get("RANK", "0")
    _fd = os.open(f"{_log}.rank{_rank}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    _busy = []
    _WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def _hook(event, args):
        if _busy:
            return
        path = None
        if event == "open":
            mode, flags = args[1], args[2]
            if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (mode is None and flags & _WRITE):
                path = args[0]
        elif event in ("os.mkdir", "os.remove", "os.rmdir", "shutil.rmtree", "os.rename", "os.replace",
                       "sqlite3.connect"):
            path = args[0]
        if isinstance(path, (str, os.PathLike)):
            full = os.path.abspath(os.fspath(path))
            if full.startswith(_root) and not (event == "os.mkdir" and os.path.isdir(full)):  # exist_ok no-op
                _busy.append(1)
                try:
                    os.write(_fd, f"{event} {full}\\n".encode())
                finally:
                    _busy.pop()

    sys.addaudithook(_hook)

    import atexit

    def _threads_at_exit():  # after the command returned (and left its process group): which threads still run
        names = []
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/comm") as fh:
                    names.append(fh.read().strip())
            except OSError:
                pass
        with open(f"{_log}.threads", "a") as fh:
            fh.write(f"{os.environ.get('RANK', '-')} {' '.join(sorted(names))}\\n")

    atexit.register(_threads_at_exit)

    if "LOCAL_RANK" in os.environ:  # a launcher's rank: a worker thread still running when the command returns
        import threading, time

        def _outlive():  # (a process group's, kept alive under FSDP2): the rank must not wait for it, nor die of it
            joined = False
            while True:  # until the command has left its process group
                time.sleep(0.2)
                dist = sys.modules.get("torch.distributed")
                up = dist is not None and dist.is_available() and dist.is_initialized()
                if joined and not up:
                    break
                joined = joined or up
            time.sleep(5)
            with open(f"{_log}.outlived", "a") as fh:
                fh.write(os.environ.get("RANK", "-") + "\\n")

        threading.Thread(target=_outlive, name="outliving", daemon=False).start()
'''

SFT_RECORDS = [{"instruction": f"Name the colour number {i}.", "input": "", "output": f"Colour {i} is blue."}
               for i in range(8)]


def tiny_recipe(tmp_path: Path, model: str, *, until: str | None = None) -> Path:
    """SFT, reward model, DPO, PPO, best-of-n, expert iteration, generation, binary FeedME, reward conditioning,
    GRPO and RLOO on a tiny random-init model, at the smallest sizes; ``until``: only the stages before that one
    (the same stages, seeds and fingerprints as in the whole recipe, so their outputs are the whole recipe's)."""
    from alpacafarm.testing import learnable_preferences, write_records

    sft = write_records(tmp_path / "sft.jsonl", SFT_RECORDS)
    prefs = write_records(tmp_path / "prefs.jsonl", learnable_preferences(8))
    prompts = write_records(tmp_path / "prompts.jsonl", [{"instruction": f"Tell me about topic {i}.", "input": ""}
                                                         for i in range(10)])
    train = ("per_device_train_batch_size: 2, max_steps: 2, learning_rate: 1.0e-3, save_strategy: 'no', "
             "logging_steps: 1")
    online = ("per_device_train_batch_size: 2, num_generations: 2, max_completion_length: 4, max_steps: 1, "
              "learning_rate: 1.0e-3, save_strategy: 'no', report_to: none, bf16: false, score_batch_size: 4")
    path = tmp_path / "recipe.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: two-ranks
        seed: 5
        model: {{name: {model}, dtype: float32, device: cpu}}
        data:
          demonstrations: {{path: {sft}}}
          preferences: {{path: {prefs}}}
          instructions: {{path: {prompts}}}
        stages:
          - {{name: split, method: split_instructions, config: {{eval_size: 5}}}}
          - {{name: sft, method: sft, inputs: {{sft_data: demonstrations}}, config: {{{train}}}}}
          - {{name: rm, method: reward_model, config: {{{train}, eval_fraction: 0.25}}}}
          - {{name: dpo, method: dpo, config: {{{train}}}}}
          - {{name: ppo, method: ppo, config: {{max_steps: 1, warmup_steps: 0, rollout_batch_size: 4,
              mini_batch_size: 4,
              per_device_train_batch_size: 4, generation_batch_size: 4, max_new_tokens: 4, score_batch_size: 4,
              save_steps: 1}}}}
          - {{name: bon, method: best_of_n, inputs: {{sft_model: base_model}},
              config: {{n: 3, sampling: {{max_new_tokens: 5, batch_size: 2}}}}}}
          - {{name: ei, method: expert_iteration, inputs: {{sft_model: base_model}},
              config: {{n: 2, rounds: 1, max_new_tokens: 4, generation_batch_size: 2, {train}}}}}
          - {{name: outputs, method: generate_outputs, inputs: {{sft_model: base_model}},
              config: {{sampling: {{temperature: 1.0, max_new_tokens: 6, batch_size: 2}}}}}}
          - {{name: dpo_outputs, method: generate_outputs, inputs: {{sft_model: dpo}},
              config: {{sampling: {{max_new_tokens: 4, batch_size: 2}}}}}}
          - {{name: feedme, method: binary_feedme, config: {{{train}}}}}
          - {{name: rc, method: binary_reward_conditioning, config: {{{train}}}}}
          - {{name: grpo, method: grpo, config: {{{online}}}}}
          - {{name: rloo, method: rloo, config: {{{online}}}}}
          - {{name: quark, method: quark, inputs: {{sft_model: base_model}},
              config: {{rounds: 2, max_new_tokens: 4, step_batch_size: 4, per_device_train_batch_size: 2,
              generation_batch_size: 2, score_batch_size: 4, prompts_per_round: 4, top_quantile: 0.5}}}}
        """), encoding="utf-8")
    if until is not None:
        text = path.read_text(encoding="utf-8")
        path.write_text(text[:text.index(f"  - {{name: {until},")], encoding="utf-8")
    return path


#: On 2 processes, TRL's trainers take a batch per process: a batch of 1 makes the one-process run's global batch (2)
#: for the stages whose models the compared outputs come from (SFT -> reward model -> best-of-n's rewards).
SAME_GLOBAL_BATCH = ("--set", "stages.sft.config.per_device_train_batch_size=1",
                     "--set", "stages.rm.config.per_device_train_batch_size=1")


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> dict[str, Any]:
    """The tiny recipe through ``alpacafarm run`` on one process and with ``--num-processes 2``."""
    tmp_path = tmp_path_factory.mktemp("ranks")
    recipe = tiny_recipe(tmp_path, tiny_model_dir)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(AUDIT_HOOK, encoding="utf-8")
    runs: dict[str, Any] = {}
    for name, extra in (("one", []), ("two", ["--num-processes", "2", *SAME_GLOBAL_BATCH])):
        run_dir = tmp_path / name
        env = {**os.environ, "OMP_NUM_THREADS": "1", "AF_AUDIT_ROOT": str(run_dir),
               "AF_AUDIT_LOG": str(tmp_path / f"writes-{name}"),
               "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, "-m", "alpacafarm", "run", str(recipe), "--output-dir", str(run_dir),
                               *extra], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        threads = tmp_path / f"writes-{name}.threads"
        outlived = tmp_path / f"writes-{name}.outlived"
        runs[name] = {"dir": run_dir, "stdout": done.stdout, "stderr": done.stderr,
                      "outlived": outlived.read_text().split() if outlived.is_file() else [],
                      "threads_at_exit": threads.read_text().splitlines() if threads.is_file() else [],
                      "writes": {p.name.rsplit(".", 1)[1]: p.read_text().splitlines()
                                 for p in tmp_path.glob(f"writes-{name}.rank*")}}
    return runs


def manifest(run: dict[str, Any], stage: str) -> dict[str, Any]:
    return json.loads((run["dir"] / "stages" / stage / "manifest.json").read_text())


@pytest.mark.distributed
def test_two_processes_really_ran_and_only_rank_0_wrote(two_runs: dict[str, Any]):
    two = two_runs["two"]
    assert "running on 2 processes" in (two["dir"] / "run.log").read_text()
    for stage in ("sft", "rm", "dpo", "ppo", "bon", "ei", "outputs", "feedme", "rc", "grpo", "rloo", "quark"):
        assert (manifest(two, stage)["world_size"], manifest(two, stage)["ranks_ran"]) == (2, 2), stage
    for stage in ("sft", "rm", "dpo", "feedme", "rc", "grpo", "rloo"):  # TRL's trainers span both ranks (DDP) ...
        metrics = json.loads((two["dir"] / "stages" / stage / "metrics.json").read_text())
        assert (metrics["trainer_processes"], metrics["distributed_type"]) == (2, "MULTI_CPU"), stage
        one = json.loads((two_runs["one"]["dir"] / "stages" / stage / "metrics.json").read_text())
        assert (one["trainer_processes"], one["distributed_type"]) == (1, "NO"), stage  # ... one process alone
    assert manifest(two, "split")["ranks_ran"] == 1 and manifest(two_runs["one"], "sft")["world_size"] == 1
    writes = two["writes"]
    assert set(writes) == {"rank0", "rank1"}  # both ranks ran (the hook loaded in each) ...
    assert any("manifest.json" in w for w in writes["rank0"])  # ... the hook sees rank 0's writes ...
    assert writes["rank1"] == []  # ... and rank 1 wrote nothing in the run directory


@pytest.mark.distributed
def test_every_rank_leaves_its_process_group_before_exit(two_runs: dict[str, Any]):
    # A group kept alive past destroy_process_group (a library function's default argument captured it) keeps its
    # gloo threads running into interpreter shutdown, where one may free a collective's tensors and abort the rank
    # ("terminate called without an active exception"): a finished run then exited 1, now and then.
    at_exit = {line.split(" ", 1)[0]: line for line in two_runs["two"]["threads_at_exit"]}
    assert {"0", "1"} <= set(at_exit)
    for rank_ in ("0", "1"):
        assert "gloo" not in at_exit[rank_], at_exit[rank_]
    assert "terminate called" not in two_runs["two"]["stderr"]
    # Threads that outlive the command (FSDP2's DTensor caches keep the group, and its threads, alive) do not get
    # to run into interpreter shutdown: a rank ends right after its command returned (distributed.end_process).
    assert two_runs["two"]["outlived"] == []


@pytest.mark.distributed
def test_two_process_outputs_equal_the_single_process_run(two_runs: dict[str, Any]):
    from alpacafarm.data import read_records

    one, two = two_runs["one"]["dir"], two_runs["two"]["dir"]
    for file in ("outputs/outputs.jsonl", "bon/samples.jsonl", "ei/round_1/samples.jsonl", "quark/round_1/pool.jsonl"):
        a, b = read_records(one / "stages" / file), read_records(two / "stages" / file)
        keys = ("instruction", "output", "sample_index")
        assert [{k: r[k] for k in keys} for r in a] == [{k: r[k] for k in keys} for r in b], file
        assert len({r["output"] for r in a}) > 1  # real sampling, not one repeated answer
    # best-of-n scored its samples on both ranks with the reward model trained on both (the same global batches,
    # gradients averaged across ranks: equal up to rounding): the same scores and the same choice for every n
    for file in ("samples", "best_of_1", "best_of_2", "best_of_3"):
        a, b = (read_records(run / "stages" / "bon" / f"{file}.jsonl") for run in (one, two))
        assert [{**r, "reward": None} for r in a] == [{**r, "reward": None} for r in b], file
        assert [r["reward"] for r in b] == pytest.approx([r["reward"] for r in a], rel=1e-4, abs=1e-5), file
    assert len({r["reward"] for r in read_records(one / "stages/bon/samples.jsonl")}) > 1
    # every trainer saved once and the next stage loaded it: DPO's outputs come from the saved DPO model
    for stage in ("sft", "rm", "dpo", "ppo", "ei/round_1", "feedme", "rc", "grpo", "rloo", "quark"):
        assert (two / "stages" / stage / "model" / "config.json").is_file(), stage
    ppo = json.loads((two / "stages/ppo/metrics.json").read_text())
    assert ppo["world_size"] == 2
    import torch
    from safetensors.torch import load_file

    # PPO on 2 processes trains the 1-process weights (the same global batch; TRL's rule: within a tolerance)
    a, b = (load_file(str(run / "stages/ppo/model/model.safetensors")) for run in (one, two))
    assert sorted(a) == sorted(b)
    for name, tensor in a.items():
        torch.testing.assert_close(b[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    assert len(read_records(two / "stages/dpo_outputs/outputs.jsonl")) == 5


def _complete(manifest_file: Path) -> bool:
    try:
        return json.loads(manifest_file.read_text())["status"] == "complete"
    except (OSError, ValueError, KeyError):  # not written yet
        return False


@pytest.mark.distributed
def test_a_killed_two_process_run_resumes_skipping_its_finished_stages_to_the_uninterrupted_outputs(
        two_runs: dict[str, Any], tmp_path: Path, tiny_model_dir: str):
    import signal
    import time

    import torch
    from safetensors.torch import load_file

    recipe = tiny_recipe(tmp_path, tiny_model_dir, until="ppo")  # split, sft, rm, dpo: two_runs' first stages
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "alpacafarm", "run", str(recipe), "--output-dir", str(run_dir),
               "--num-processes", "2", *SAME_GLOBAL_BATCH]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    stages = run_dir / "stages"
    # The launcher and both ranks die at once (their session is killed) as soon as the SFT stage is complete.
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tmp_path,
                          start_new_session=True) as launcher:
        deadline = time.monotonic() + 300
        while not _complete(stages / "sft" / "manifest.json"):
            assert launcher.poll() is None, "the run ended before its SFT stage was complete"
            assert time.monotonic() < deadline, "no complete SFT stage after 300 s"
            time.sleep(0.02)
        os.killpg(launcher.pid, signal.SIGKILL)
    assert not _complete(stages / "rm" / "manifest.json") and not (stages / "dpo").exists()
    sft_manifest = json.loads((stages / "sft" / "manifest.json").read_text())

    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    log = (run_dir / "run.log").read_text()
    assert "stage split skipped" in log and "stage sft skipped" in log  # decided once, for both ranks
    assert "stage rm started" in log and "stage dpo started" in log
    assert json.loads((stages / "sft" / "manifest.json").read_text()) == sft_manifest  # not run again
    for stage in ("rm", "dpo"):
        manifest_ = json.loads((stages / stage / "manifest.json").read_text())
        assert (manifest_["status"], manifest_["world_size"], manifest_["ranks_ran"]) == ("complete", 2, 2), stage
        assert json.loads((stages / stage / "metrics.json").read_text())["trainer_processes"] == 2, stage
    for stage in ("sft", "rm", "dpo"):  # the weights of the uninterrupted 2-process run
        resumed = load_file(str(stages / stage / "model" / "model.safetensors"))
        whole = load_file(str(two_runs["two"]["dir"] / "stages" / stage / "model" / "model.safetensors"))
        assert resumed.keys() == whole.keys(), stage
        for name, tensor in whole.items():
            torch.testing.assert_close(resumed[name], tensor, rtol=1e-6, atol=1e-7, msg=f"{stage}: {name}")


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]))
    from alpacafarm import distributed

    if distributed.joined_by_us():  # end the rank as the CLI does (distributed.end_process): gloo threads a process
        distributed.end_process(0)  # group left alive must not meet interpreter finalization ("terminate called")
