"""PPO under FSDP2 on 2 real ranks (torchrun, gloo on the CPU): the policy and value model sharded, the reference
and reward frozen and whole, the saved full weights those of the data-parallel 2-process run on the same seeds.

Run as a script under torchrun (``python -m torch.distributed.run --nproc_per_node 2 tests/test_ppo_fsdp.py
MODE OUT``) this file is the worker: MODE ``ddp`` (data parallel) or ``fsdp2`` (the environment ``accelerate
launch --config_file fsdp2.yaml`` gives every rank says so), or ``fsdp2-killed`` (every rank SIGKILLs itself once
checkpoint-1 is written) and ``fsdp2-resumed`` (the same run resumed from that checkpoint).
"""

from __future__ import annotations

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


def _worker(mode: str, out: Path) -> None:
    """Two PPO steps on tiny random models, a checkpoint after each; the main rank saves the policy."""
    import copy
    import signal

    import torch
    from transformers import TrainerCallback

    from alpacafarm import distributed as d
    from alpacafarm.modeling import save_model
    from alpacafarm.testing import tiny_causal_lm, tiny_sequence_classifier, tiny_tokenizer
    from alpacafarm_trl.ppo_config import PPOMethodConfig
    from alpacafarm_trl.ppo_models import SeparateModels, ValueModel
    from alpacafarm_trl.ppo_sharding import is_sharded, local_and_full_numel
    from alpacafarm_trl.ppo_trainer import PPOTrainer

    d.init()
    torch.set_num_threads(1)
    tokenizer = tiny_tokenizer()
    policy = tiny_causal_lm(tokenizer)
    models = SeparateModels(policy, copy.deepcopy(policy),
                            ValueModel.from_classifier(tiny_sequence_classifier(tokenizer)))

    def reward(records: list[dict[str, Any]], completions: list[str]) -> list[float]:
        return [(len(c) % 7) / 7 + (0.5 if r["input"] else 0.0) for r, c in zip(records, completions, strict=True)]

    # rollout_batch_size 6 on 2 ranks, mini-batches of 3, micro-batches of 1: the ranks hold different numbers
    # of rows per mini-batch (so different numbers of micro-batches: the padding passes are exercised); 3
    # generation batches of 2: rank 0 samples two, rank 1 one (generation from the sharded policy is unsynced).
    interrupted = mode in ("fsdp2-killed", "fsdp2-resumed")  # one run, killed after checkpoint-1, then resumed
    args = PPOMethodConfig(output_dir=str(out / ("ckpt-fsdp2-interrupted" if interrupted else f"ckpt-{mode}")),
                           max_steps=2, rollout_batch_size=6,
                           mini_batch_size=3, per_device_train_batch_size=1, generation_batch_size=2,
                           max_new_tokens=6, learning_rate=1e-2, save_strategy="steps", save_steps=1, seed=1,
                           report_to="none")

    class KillAfterFirstCheckpoint(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    trainer = PPOTrainer(args, models, tokenizer, PPO_PROMPTS, reward,
                         callbacks=[KillAfterFirstCheckpoint()] if mode == "fsdp2-killed" else None)
    trainer.train(resume_from_checkpoint=str(Path(args.output_dir) / "checkpoint-1")
                  if mode == "fsdp2-resumed" else None)
    full = trainer.sharding.full_state_dict(policy)
    result: dict[str, Any] = {
        "rank": d.rank(), "world": d.world_size(), "sharded": trainer.sharding.active,
        "numel": {name: local_and_full_numel(m) for name, m in (("policy", policy), ("value", models.value),
                                                                ("reference", models.reference))},
        "dtensor_grads": any(is_sharded(p.grad) for p in trainer.params.values() if p.grad is not None),
        "steps": [{k: v for k, v in e.items() if not k.endswith("_time")} for e in trainer.state.log_history
                  if "score" in e],
    }
    if d.is_main():
        save_model(policy, tokenizer, out / f"model-{mode}", dtype=torch.float32, state_dict=full)
    (out / f"{mode}-rank{d.rank()}.json").write_text(json.dumps(result), encoding="utf-8")
    d.shutdown()


def _torchrun(mode: str, out: Path, *, killed: bool = False) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO_ROOT), str(REPO_ROOT / "plugins"), os.environ.get("PYTHONPATH", "")])}
    for name in ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "ACCELERATE_USE_DEEPSPEED"):
        env.pop(name, None)
    if mode.startswith("fsdp2"):  # what `accelerate launch` with the packaged fsdp2 config sets for every rank
        env.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(_free_port()), str(Path(__file__)), mode, str(out)],
                          capture_output=True, text=True, env=env, cwd=out, timeout=300)
    if killed:
        assert done.returncode != 0 and "SIGKILL" in done.stderr, done.stderr[-4000:]
        return []
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in range(2)]


def _weights(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """The uninterrupted 2-rank FSDP2 run (its folder, each rank's report)."""
    out = tmp_path_factory.mktemp("ppo-fsdp2")
    return out, _torchrun("fsdp2", out)


def test_fsdp2_ppo_shards_policy_and_value_and_equals_the_data_parallel_run(
        tmp_path: Path, fsdp2_run: tuple[Path, list[dict[str, Any]]]):
    import torch

    from alpacafarm.testing import tiny_causal_lm, tiny_tokenizer

    fsdp_dir, fsdp = fsdp2_run
    ddp = _torchrun("ddp", tmp_path)
    for r in fsdp:  # sharded: each rank holds about half of the policy and of the value model ...
        assert (r["world"], r["sharded"], r["dtensor_grads"]) == (2, True, True)
        for name in ("policy", "value"):
            local, full = r["numel"][name]
            assert abs(local - full / 2) <= 0.01 * full, (name, local, full)
        assert r["numel"]["reference"][0] == r["numel"]["reference"][1]  # ... the frozen reference is whole
    for r in ddp:
        assert r["sharded"] is False and r["numel"]["policy"][0] == r["numel"]["policy"][1]
    # the step statistics: every rank logs the same, and FSDP2's step is the data-parallel step
    assert fsdp[0]["steps"] == fsdp[1]["steps"] and len(fsdp[0]["steps"]) == 2
    for step_fsdp, step_ddp in zip(fsdp[0]["steps"], ddp[0]["steps"], strict=True):
        assert set(step_fsdp) == set(step_ddp)
        for key, value in step_ddp.items():
            assert step_fsdp[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    assert ddp[0]["steps"][1]["kl"] != 0.0  # the first update moved the policy
    # the saved full weights (gathered from the shards) equal the data-parallel run's, and training moved them
    saved, expected = _weights(fsdp_dir / "model-fsdp2"), _weights(tmp_path / "model-ddp")
    initial = tiny_causal_lm(tiny_tokenizer()).state_dict()
    assert sorted(saved) == sorted(expected)
    for name, tensor in expected.items():
        assert saved[name].shape == initial[name].shape, name
        torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    assert any(not torch.allclose(saved[n], initial[n]) for n in saved)
    # checkpoints: gathered whole, the data-parallel format and values
    for step in (1, 2):
        ckpt_fsdp = torch.load(fsdp_dir / f"ckpt-fsdp2/checkpoint-{step}/trainable.pt", weights_only=True)
        ckpt_ddp = torch.load(tmp_path / f"ckpt-ddp/checkpoint-{step}/trainable.pt", weights_only=True)
        assert sorted(ckpt_fsdp) == sorted(ckpt_ddp)
        for name, tensor in ckpt_ddp.items():
            assert type(ckpt_fsdp[name]) is torch.Tensor and ckpt_fsdp[name].shape == tensor.shape, name
            torch.testing.assert_close(ckpt_fsdp[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
        opt_fsdp = torch.load(fsdp_dir / f"ckpt-fsdp2/checkpoint-{step}/optimizer.pt", weights_only=True)
        opt_ddp = torch.load(tmp_path / f"ckpt-ddp/checkpoint-{step}/optimizer.pt", weights_only=True)
        for index, state in opt_ddp["state"].items():
            torch.testing.assert_close(opt_fsdp["state"][index]["exp_avg"], state["exp_avg"], rtol=1e-4, atol=1e-6)


def test_fsdp2_ppo_killed_after_its_first_checkpoint_resumes_to_the_uninterrupted_weights(
        tmp_path: Path, fsdp2_run: tuple[Path, list[dict[str, Any]]]):
    import torch

    fsdp_dir, uninterrupted = fsdp2_run
    _torchrun("fsdp2-killed", tmp_path, killed=True)  # every rank SIGKILLed once checkpoint-1 is on disk
    folder = tmp_path / "ckpt-fsdp2-interrupted"
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint-1"]
    assert not (tmp_path / "model-fsdp2-killed").exists()
    resumed = _torchrun("fsdp2-resumed", tmp_path)
    for r in resumed:
        assert (r["world"], r["sharded"]) == (2, True)
    # the log: step 1 as checkpoint-1 kept it, step 2 run again as the uninterrupted run logged it
    assert [e["step"] for e in resumed[0]["steps"]] == [1, 2] and resumed[0]["steps"] == resumed[1]["steps"]
    for step_resumed, step in zip(resumed[0]["steps"], uninterrupted[0]["steps"], strict=True):
        for key, value in step.items():
            assert step_resumed[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    saved, expected = _weights(tmp_path / "model-fsdp2-resumed"), _weights(fsdp_dir / "model-fsdp2")
    assert sorted(saved) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(saved[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    ckpt = torch.load(folder / "checkpoint-2/trainable.pt", weights_only=True)
    ckpt_expected = torch.load(fsdp_dir / "ckpt-fsdp2/checkpoint-2/trainable.pt", weights_only=True)
    for name, tensor in ckpt_expected.items():  # the value model too
        torch.testing.assert_close(ckpt[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(("env", "message"), [
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1"},
     "ppo: DeepSpeed ZeRO stage 1 is not supported by our PPO trainer; set zero_stage: 2 or 3 in the accelerate "
     "config (the packaged ones: --accelerate-config zero2 or zero3)"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"},
     "ppo: FSDP version 1 is not supported by our PPO trainer; set fsdp_version: 2 in the accelerate config (the "
     "packaged one: --accelerate-config fsdp2)"),
])
def test_launch_configs_ppo_cannot_honour_are_one_line_errors(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                                               message: str):
    from alpacafarm.errors import UserError
    from alpacafarm_trl.ppo_sharding import requested_sharding

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError) as raised:
        requested_sharding()
    assert str(raised.value) == message


def test_ppo_stage_refuses_zero1_before_loading_any_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    from alpacafarm.errors import UserError
    from alpacafarm_trl import ppo_trainer
    from alpacafarm_trl.ppo import PPO

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "1")
    monkeypatch.setattr(ppo_trainer, "build_models", lambda *a, **k: pytest.fail("models were loaded"))
    with pytest.raises(UserError, match="DeepSpeed ZeRO stage 1 is not supported by our PPO trainer"):
        PPO.__new__(PPO).run(None)


@pytest.mark.parametrize("stage", ["2", "3"])
def test_zero2_and_zero3_launches_train_ppo_through_deepspeed_or_name_the_missing_package(
        monkeypatch: pytest.MonkeyPatch, stage: str):
    import importlib.util

    from alpacafarm.errors import MissingPackageError
    from alpacafarm_trl.ppo_sharding import requested_sharding

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", stage)
    if importlib.util.find_spec("deepspeed") is not None:
        assert requested_sharding() == f"zero{stage}"  # tests/test_ppo_deepspeed.py runs them
        return
    with pytest.raises(MissingPackageError) as raised:
        requested_sharding()
    assert str(raised.value) == (f"ppo: the accelerate config asks for DeepSpeed ZeRO-{stage}, which is not "
                                 "installed: pip install deepspeed --no-build-isolation")


def test_without_an_fsdp_launch_nothing_is_sharded(monkeypatch: pytest.MonkeyPatch):
    from alpacafarm_trl.ppo_sharding import requested_sharding

    for name in ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(name, raising=False)
    assert requested_sharding() is None
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert requested_sharding() == "fsdp2"


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]))
    from alpacafarm import distributed

    if distributed.joined_by_us():  # end the rank as the CLI does (distributed.end_process): gloo threads a process
        distributed.end_process(0)  # group left alive must not meet interpreter finalization ("terminate called")
