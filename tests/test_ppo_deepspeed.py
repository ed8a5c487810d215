"""PPO under DeepSpeed ZeRO-2 and ZeRO-3 on 2 real ranks (``accelerate launch`` with the packaged configs; DeepSpeed's
CPU accelerator joins them over gloo): the policy and value model trained through one DeepSpeed engine, the
reference and reward frozen and whole, each step the one-process step, the saved full weights the one-process run's.

Run as a script (``python tests/test_ppo_deepspeed.py MODE OUT``, under ``accelerate launch`` for ``zero2`` and
``zero3``, alone for ``single``; ``zero2-resumed`` and ``zero3-resumed`` resume from the checkpoint-1 the test put
in their folder) this file is the worker.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_distributed import PPO_PROMPTS, _free_port  # noqa: E402

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed (pip install deepspeed --no-build-isolation)")


def _worker(mode: str, out: Path) -> None:
    """Two PPO steps on tiny random models, a checkpoint after each; the main rank saves the policy."""
    import copy

    import torch

    from alpacafarm import distributed as d
    from alpacafarm.modeling import save_model
    from alpacafarm.testing import tiny_causal_lm, tiny_sequence_classifier, tiny_tokenizer
    from alpacafarm_trl.ppo_config import PPOMethodConfig
    from alpacafarm_trl.ppo_models import SeparateModels, ValueModel
    from alpacafarm_trl.ppo_trainer import PPOTrainer

    d.init()
    torch.set_num_threads(1)
    tokenizer = tiny_tokenizer()
    policy = tiny_causal_lm(tokenizer)
    models = SeparateModels(policy, copy.deepcopy(policy),
                            ValueModel.from_classifier(tiny_sequence_classifier(tokenizer)))

    def reward(records: list[dict[str, Any]], completions: list[str]) -> list[float]:
        return [(len(c) % 7) / 7 + (0.5 if r["input"] else 0.0) for r, c in zip(records, completions, strict=True)]

    # As in test_ppo_fsdp: the ranks hold different numbers of rows per mini-batch (padding passes run) and sample
    # different numbers of generation batches (generation from the gathered policy is unsynced).
    args = PPOMethodConfig(output_dir=str(out / f"ckpt-{mode}"), max_steps=2, rollout_batch_size=6,
                           mini_batch_size=3, per_device_train_batch_size=1, generation_batch_size=2,
                           max_new_tokens=6, learning_rate=1e-2, save_strategy="steps", save_steps=1, seed=1,
                           report_to="none")
    trainer = PPOTrainer(args, models, tokenizer, PPO_PROMPTS, reward)
    resume = Path(args.output_dir) / "checkpoint-1"  # put there by the test for the "-resumed" modes
    trainer.train(resume_from_checkpoint=str(resume) if mode.endswith("-resumed") else None)
    full = trainer.sharding.full_state_dict(policy)
    holdings = getattr(trainer.sharding, "holdings", None)
    result: dict[str, Any] = {
        "rank": d.rank(), "world": d.world_size(), "sharding": trainer.sharding.mode,
        "engine": type(getattr(trainer.sharding, "engine", None)).__name__,
        "holdings": {name: holdings(m) for name, m in (("policy", policy), ("value", models.value))}
        if holdings else None,
        "reference_whole": all(not hasattr(p, "ds_id") and p.numel() > 0 for p in models.reference.parameters()),
        "policy_partitioned": all(hasattr(p, "ds_id") and p.numel() == 0 for p in policy.parameters()),
        "steps": [{k: v for k, v in e.items() if not k.endswith("_time")} for e in trainer.state.log_history
                  if "score" in e],
    }
    if d.is_main():
        save_model(policy, tokenizer, out / f"model-{mode}", dtype=torch.float32, state_dict=full)
    (out / f"{mode}-rank{d.rank()}.json").write_text(json.dumps(result), encoding="utf-8")
    d.shutdown()


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO_ROOT), str(REPO_ROOT / "plugins"), os.environ.get("PYTHONPATH", "")])}
    for name in list(env):
        if name.startswith(("ACCELERATE_", "FSDP_")) or name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            env.pop(name)
    return env


def _run(mode: str, out: Path) -> list[dict[str, Any]]:
    """``single``: one process; ``zero2``/``zero3``: 2 ranks under ``accelerate launch`` with the packaged config."""
    from alpacafarm.launch_configs import config_path

    out.mkdir(parents=True, exist_ok=True)
    stage = mode.split("-")[0]
    worker = [str(Path(__file__)), mode, str(out)]
    if mode == "single":
        command, ranks = [sys.executable, *worker], 1
    else:
        command, ranks = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                          str(config_path(stage)), "--num_processes", "2", "--main_process_port",
                          str(_free_port()), *worker], 2
    done = subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=out, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in range(ranks)]


def _weights(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def single_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("ppo-single")
    return out, _run("single", out)[0]


@needs_deepspeed
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_zero_ppo_trains_through_a_deepspeed_engine_and_equals_the_one_process_run(
        stage: str, tmp_path: Path, single_run: tuple[Path, dict[str, Any]]):
    import torch
    from transformers import AutoModelForCausalLM

    from alpacafarm.testing import tiny_causal_lm, tiny_tokenizer

    single_dir, single = single_run
    ranks = _run(stage, tmp_path)
    for r in ranks:  # 2 real ranks, one DeepSpeed engine each, AdamW's fp32 state split in halves
        assert (r["world"], r["sharding"], r["engine"]) == (2, stage, "DeepSpeedEngine")
        local, full = (sum(r["holdings"][m][i] for m in ("policy", "value")) for i in (0, 1))
        assert abs(local - full / 2) <= 0.01 * full, (local, full)  # ZeRO-2 splits the two models' flat group
        if stage == "zero3":  # ZeRO-3 each parameter
            for name in ("policy", "value"):
                local, full = r["holdings"][name]
                assert abs(local - full / 2) <= 0.01 * full, (name, local, full)
        assert r["reference_whole"] is True  # the frozen reference is a whole copy on every rank
        assert r["policy_partitioned"] is (stage == "zero3")  # ZeRO-3 partitions the weights themselves
    assert single["world"] == 1 and single["sharding"] is None
    # every rank logs the same statistics, and each 2-rank step is the one-process step
    assert ranks[0]["steps"] == ranks[1]["steps"] and len(ranks[0]["steps"]) == 2
    for step_zero, step_one in zip(ranks[0]["steps"], single["steps"], strict=True):
        assert set(step_zero) == set(step_one)
        for key, value in step_one.items():
            assert step_zero[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    assert single["steps"][1]["kl"] != 0.0  # the first update moved the policy
    # the saved full weights load with from_pretrained and equal the one-process run's; training moved them
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / f"model-{stage}")).state_dict()
    expected = _weights(single_dir / "model-single")
    initial = tiny_causal_lm(tiny_tokenizer()).state_dict()
    for name, tensor in expected.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    assert any(not torch.allclose(expected[n], initial[n]) for n in expected)
    # checkpoints: gathered whole, in the data-parallel format, with the one-process values
    for step in (1, 2):
        ckpt = torch.load(tmp_path / f"ckpt-{stage}/checkpoint-{step}/trainable.pt", weights_only=True)
        ckpt_one = torch.load(single_dir / f"ckpt-single/checkpoint-{step}/trainable.pt", weights_only=True)
        assert sorted(ckpt) == sorted(ckpt_one)
        for name, tensor in ckpt_one.items():
            assert ckpt[name].shape == tensor.shape, name
            torch.testing.assert_close(ckpt[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
        opt = torch.load(tmp_path / f"ckpt-{stage}/checkpoint-{step}/optimizer.pt", weights_only=True)
        opt_one = torch.load(single_dir / f"ckpt-single/checkpoint-{step}/optimizer.pt", weights_only=True)
        assert sorted(opt["state"]) == sorted(opt_one["state"])
        assert [g["params"] for g in opt["param_groups"]] == [g["params"] for g in opt_one["param_groups"]]
        assert opt["param_groups"][0]["lr"] == pytest.approx(opt_one["param_groups"][0]["lr"])
        for index, state in opt_one["state"].items():
            assert float(opt["state"][index]["step"]) == float(state["step"])
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(opt["state"][index][key], state[key], rtol=1e-4, atol=1e-7)


@needs_deepspeed
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_zero_ppo_resumes_from_a_data_parallel_checkpoint_to_the_one_process_weights(
        stage: str, tmp_path: Path, single_run: tuple[Path, dict[str, Any]]):
    """A checkpoint has one format under every launch config: ZeRO cuts the one-process run's checkpoint-1
    (weights, AdamW moments and step count) into its shards and ends where the one-process run ended."""
    import shutil

    import torch

    single_dir, single = single_run
    shutil.copytree(single_dir / "ckpt-single/checkpoint-1", tmp_path / f"ckpt-{stage}-resumed/checkpoint-1")
    ranks = _run(f"{stage}-resumed", tmp_path)
    assert [r["world"] for r in ranks] == [2, 2] and ranks[0]["sharding"] == stage
    for key, value in single["steps"][1].items():  # step 2 run again, as one process ran it
        assert ranks[0]["steps"][1][key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    saved, expected = _weights(tmp_path / f"model-{stage}-resumed"), _weights(single_dir / "model-single")
    for name, tensor in expected.items():
        torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    ckpt = torch.load(tmp_path / f"ckpt-{stage}-resumed/checkpoint-2/trainable.pt", weights_only=True)
    ckpt_one = torch.load(single_dir / "ckpt-single/checkpoint-2/trainable.pt", weights_only=True)
    for name, tensor in ckpt_one.items():  # the value model too
        torch.testing.assert_close(ckpt[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


@needs_deepspeed
def test_a_ppo_stage_under_alpacafarm_run_zero3_loads_its_folders_and_saves_the_one_process_model(
        tmp_path: Path, tiny_model_dir: str):
    """The command a user types: ``alpacafarm run --num-processes 2 --accelerate-config zero3`` (its zero3_init_flag
    on) re-runs a finished run's PPO stage, loading the SFT and reward model folders (on ``device: cpu``) whole and
    saving ``model/``, which equals the one-process stage's."""
    import shutil
    import textwrap

    import torch

    from alpacafarm.testing import learnable_preferences, write_records

    sft = write_records(tmp_path / "sft.jsonl", [{"instruction": f"Name the colour number {i}.", "input": "",
                                                  "output": f"Colour {i} is blue."} for i in range(8)])
    prefs = write_records(tmp_path / "prefs.jsonl", learnable_preferences(8))
    prompts = write_records(tmp_path / "prompts.jsonl", [{"instruction": f"Tell me about topic {i}.", "input": ""}
                                                         for i in range(10)])
    train = "per_device_train_batch_size: 2, max_steps: 2, learning_rate: 1.0e-3, save_strategy: 'no'"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(textwrap.dedent(f"""\
        name: zero3-ppo
        seed: 5
        model: {{name: {tiny_model_dir}, dtype: float32, device: cpu}}
        data:
          demonstrations: {{path: {sft}}}
          preferences: {{path: {prefs}}}
          instructions: {{path: {prompts}}}
        stages:
          - {{name: split, method: split_instructions, config: {{eval_size: 5}}}}
          - {{name: sft, method: sft, inputs: {{sft_data: demonstrations}}, config: {{{train}}}}}
          - {{name: rm, method: reward_model, config: {{{train}, eval_fraction: 0.25}}}}
          - {{name: ppo, method: ppo, config: {{max_steps: 2, rollout_batch_size: 4, mini_batch_size: 2,
              per_device_train_batch_size: 1, generation_batch_size: 2, max_new_tokens: 4, score_batch_size: 4}}}}
        """), encoding="utf-8")

    def run(run_dir: Path, *launch: str) -> None:
        done = subprocess.run([sys.executable, "-m", "alpacafarm", "run", str(recipe), "--output-dir", str(run_dir),
                               *launch], capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=400)
        assert done.returncode == 0, done.stderr[-4000:]

    run(tmp_path / "one")
    shutil.copytree(tmp_path / "one", tmp_path / "two")
    shutil.rmtree(tmp_path / "two/stages/ppo")  # lost: the PPO stage runs again, the others are skipped
    run(tmp_path / "two", "--num-processes", "2", "--accelerate-config", "zero3")
    metrics = json.loads((tmp_path / "two/stages/ppo/metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == 2
    saved, expected = (_weights(tmp_path / f"{name}/stages/ppo/model") for name in ("two", "one"))
    assert sorted(saved) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]))
    from alpacafarm import distributed

    if distributed.joined_by_us():  # end the rank as the CLI does (distributed.end_process): gloo threads a process
        distributed.end_process(0)  # group left alive must not meet interpreter finalization ("terminate called")
