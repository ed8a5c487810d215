"""PPO under FSDP2 on 2 real ranks (torchrun, gloo on the CPU): the policy and value model sharded, the reference
and reward frozen and whole, the saved full weights those of the data-parallel 2-process run on the same seeds.

Run as a script under torchrun (``python -m torch.distributed.run --nproc_per_node 2 tests/test_ppo_fsdp.py
MODE OUT``) this file is the worker: MODE ``ddp`` (data parallel) or ``fsdp2`` (the environment ``accelerate
launch --config_file fsdp2.yaml`` gives every rank says so).
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

    import torch

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
    args = PPOMethodConfig(output_dir=str(out / f"ckpt-{mode}"), max_steps=2, rollout_batch_size=6,
                           mini_batch_size=3, per_device_train_batch_size=1, generation_batch_size=2,
                           max_new_tokens=6, learning_rate=1e-2, save_strategy="steps", save_steps=1, seed=1,
                           report_to="none")
    trainer = PPOTrainer(args, models, tokenizer, PPO_PROMPTS, reward)
    trainer.train()
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


def _torchrun(mode: str, out: Path) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO_ROOT), str(REPO_ROOT / "plugins"), os.environ.get("PYTHONPATH", "")])}
    for name in ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "ACCELERATE_USE_DEEPSPEED"):
        env.pop(name, None)
    if mode == "fsdp2":  # what `accelerate launch` with the packaged fsdp2 config sets for every rank
        env.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(_free_port()), str(Path(__file__)), mode, str(out)],
                          capture_output=True, text=True, env=env, cwd=out, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in range(2)]


def _weights(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_fsdp2_ppo_shards_policy_and_value_and_equals_the_data_parallel_run(tmp_path: Path):
    import torch

    from alpacafarm.testing import tiny_causal_lm, tiny_tokenizer

    ddp, fsdp = _torchrun("ddp", tmp_path), _torchrun("fsdp2", tmp_path)
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
    saved, expected = _weights(tmp_path / "model-fsdp2"), _weights(tmp_path / "model-ddp")
    initial = tiny_causal_lm(tiny_tokenizer()).state_dict()
    assert sorted(saved) == sorted(expected)
    for name, tensor in expected.items():
        assert saved[name].shape == initial[name].shape, name
        torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    assert any(not torch.allclose(saved[n], initial[n]) for n in saved)
    # checkpoints: gathered whole, the data-parallel format and values
    for step in (1, 2):
        ckpt_fsdp = torch.load(tmp_path / f"ckpt-fsdp2/checkpoint-{step}/trainable.pt", weights_only=True)
        ckpt_ddp = torch.load(tmp_path / f"ckpt-ddp/checkpoint-{step}/trainable.pt", weights_only=True)
        assert sorted(ckpt_fsdp) == sorted(ckpt_ddp)
        for name, tensor in ckpt_ddp.items():
            assert type(ckpt_fsdp[name]) is torch.Tensor and ckpt_fsdp[name].shape == tensor.shape, name
            torch.testing.assert_close(ckpt_fsdp[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
        opt_fsdp = torch.load(tmp_path / f"ckpt-fsdp2/checkpoint-{step}/optimizer.pt", weights_only=True)
        opt_ddp = torch.load(tmp_path / f"ckpt-ddp/checkpoint-{step}/optimizer.pt", weights_only=True)
        for index, state in opt_ddp["state"].items():
            torch.testing.assert_close(opt_fsdp["state"][index]["exp_avg"], state["exp_avg"], rtol=1e-4, atol=1e-6)



@pytest.mark.parametrize(("env", "message"), [
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
     "ppo: the DeepSpeed ZeRO-3 path of our PPO trainer is not available (it shards the policy and value with "
     "FSDP2 only); launch with --accelerate-config fsdp2 or ddp"),
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


def test_ppo_stage_refuses_zero3_before_loading_any_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    from alpacafarm.errors import UserError
    from alpacafarm_trl import ppo_trainer
    from alpacafarm_trl.ppo import PPO

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setattr(ppo_trainer, "build_models", lambda *a, **k: pytest.fail("models were loaded"))
    with pytest.raises(UserError, match="ZeRO-3 path of our PPO trainer is not available"):
        PPO.__new__(PPO).run(None)


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
