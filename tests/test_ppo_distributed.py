"""PPO on several processes through one accelerate Accelerator: the same global batch on 1 and 2 real ranks gives
the same weights within a stated tolerance (TRL's rule, not bit for bit), under DDP (torchrun, gloo) and under
DeepSpeed ZeRO-3 (``accelerate launch`` with the packaged config, DeepSpeed's CPU accelerator over gloo); a run
killed right after its first checkpoint resumes to the uninterrupted run's weights; PPO and Quark hold no file
named for a sharding strategy and touch no private attribute of deepspeed, accelerate or torch.distributed; nor
does the distributed layer (alpacafarm/training.py, alpacafarm/distributed.py, plugins/alpacafarm_methods) touch one
of those or of transformers and TRL.

Run as a script (``python tests/test_ppo_distributed.py MODE OUT``, under torchrun for ``ddp``, ``accelerate
launch`` for ``zero3``, alone for ``single``; a ``-killed`` suffix dies right after checkpoint-1, ``-resumed``
resumes from it) this file is the worker.

Tolerance: rtol 1e-4, atol 1e-5 on every weight and step statistic. The ranks sum their gradients in another
order than one process (and DeepSpeed flattens them into buckets), so float32 results differ in the last bits.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from alpacafarm.testing.launch import launch_environment, launch_ranks, rank_results

REPO_ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
PROMPTS = [{"instruction": f"Tell me something about topic number {i}.", "input": "" if i % 3 else "briefly"}
           for i in range(12)]

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed (pip install deepspeed --no-build-isolation)")


def _worker(mode: str, out: Path) -> None:
    """Two PPO steps on tiny random models, a checkpoint after each; the main rank saves the policy."""
    import copy

    import torch
    from transformers import TrainerCallback

    from alpacafarm import distributed as d
    from alpacafarm.model_loading import save_model
    from alpacafarm.testing import tiny_causal_lm, tiny_sequence_classifier, tiny_tokenizer
    from alpacafarm_methods.ppo.config import PPOMethodConfig
    from alpacafarm_methods.ppo.models import SeparateModels, ValueModel
    from alpacafarm_methods.ppo.trainer import PPOTrainer

    d.init()
    torch.set_num_threads(1)
    tokenizer = tiny_tokenizer()
    policy = tiny_causal_lm(tokenizer)
    models = SeparateModels(policy, copy.deepcopy(policy),
                            ValueModel.from_classifier(tiny_sequence_classifier(tokenizer)))
    scored: list[int] = []

    def reward(records: list[dict[str, Any]], completions: list[str]) -> list[float]:
        scored.append(len(completions))
        return [(len(c) % 7) / 7 + (0.5 if r["input"] else 0.0) for r, c in zip(records, completions, strict=True)]

    class DieAfterFirstCheckpoint(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 1:
                os._exit(9)  # as a kill -9 would: no clean-up, no second checkpoint

    base = mode.split("-")[0]
    # Two mini-batches of 4 per step, micro-batches of 1 on two ranks (2 accumulation steps each), generation
    # batches of 3 (3 batches: the ranks make different numbers of them, synced by repeats)
    args = PPOMethodConfig(output_dir=str(out / f"ckpt-{base}"), max_steps=2, warmup_steps=0, rollout_batch_size=8,
                           mini_batch_size=4, per_device_train_batch_size=1, generation_batch_size=3,
                           max_new_tokens=6, learning_rate=1e-2, save_strategy="steps", save_steps=1, seed=1,
                           report_to="none")
    callbacks = [DieAfterFirstCheckpoint()] if mode.endswith("-killed") else []
    trainer = PPOTrainer(args, models, tokenizer, PROMPTS, reward, callbacks=callbacks)
    resume = Path(args.output_dir) / "checkpoint-1" if mode.endswith("-resumed") else None
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    full = trainer.policy_state_dict()
    engine = trainer.model
    result: dict[str, Any] = {
        "rank": d.rank(), "world": d.world_size(), "distributed_type": trainer.accelerator.distributed_type.value,
        "engine": type(engine).__name__, "scored": scored,
        "policy_local_numel": sum(p.numel() for p in trainer.accelerator.unwrap_model(engine).policy.parameters()),
        "steps": [{k: v for k, v in e.items() if not k.endswith("_time")} for e in trainer.state.log_history
                  if "score" in e],
    }
    if trainer.accelerator.is_main_process:
        save_model(policy, tokenizer, out / f"model-{mode}", state_dict=full)  # as trained: float32
    (out / f"{mode}-rank{d.rank()}.json").write_text(json.dumps(result), encoding="utf-8")
    d.shutdown()


def _run(mode: str, out: Path, *, expect_exit: int = 0) -> list[dict[str, Any]]:
    """``single``: one process; ``ddp``: 2 ranks under torchrun; ``zero3``: 2 ranks under ``accelerate launch``."""
    from alpacafarm.launch_configs import config_path

    out.mkdir(parents=True, exist_ok=True)
    base = mode.split("-")[0]
    worker = [mode, str(out)]
    paths = [REPO_ROOT, REPO_ROOT / "plugins"]
    if base == "single":
        done = subprocess.run([sys.executable, str(Path(__file__)), *worker], capture_output=True, text=True,
                              env=launch_environment(*paths), cwd=out, timeout=400)
        ranks = 1
    elif base == "ddp":
        done, ranks = launch_ranks(Path(__file__), worker, cwd=out, pythonpath=paths), 2
    else:
        done, ranks = launch_ranks(Path(__file__), worker, cwd=out, pythonpath=paths, launcher="accelerate",
                                   config_file=config_path(base)), 2
    if expect_exit:
        assert done.returncode != 0, "the killed run exited cleanly"
        return []
    assert done.returncode == 0, done.stderr[-4000:]
    return rank_results(out, ranks, prefix=f"{mode}-")


def _weights(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _assert_same_run(ranks: list[dict[str, Any]], one: dict[str, Any], saved: dict[str, Any],
                     expected: dict[str, Any]) -> None:
    import torch

    assert ranks[0]["steps"] == ranks[1]["steps"] and len(ranks[0]["steps"]) == 2  # every rank logs the same
    for step_two, step_one in zip(ranks[0]["steps"], one["steps"], strict=True):
        assert set(step_two) == set(step_one)
        for key, value in step_one.items():
            assert step_two[key] == pytest.approx(value, rel=TOLERANCE["rtol"], abs=TOLERANCE["atol"]), key
    assert one["steps"][1]["kl"] != 0.0  # the first update moved the policy: the comparison covers it
    assert sorted(saved) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(saved[name], tensor, **TOLERANCE, msg=name)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("ppo-single")
    return out, _run("single", out)[0]


@pytest.mark.distributed
def test_two_ddp_ranks_train_the_one_process_weights(tmp_path: Path, single_run: tuple[Path, dict[str, Any]]):
    import torch

    from alpacafarm.testing import tiny_causal_lm, tiny_tokenizer

    single_dir, one = single_run
    ranks = _run("ddp", tmp_path)
    assert one["world"] == 1 and one["scored"] == [8, 8]
    assert [r["world"] for r in ranks] == [2, 2] and ranks[0]["distributed_type"] == "MULTI_CPU"
    assert ranks[0]["engine"] == "DistributedDataParallel"
    assert [r["scored"] for r in ranks] == [[4, 4], [4, 4]]  # each rank scored its half of every rollout batch
    saved, expected = _weights(tmp_path / "model-ddp"), _weights(single_dir / "model-single")
    _assert_same_run(ranks, one, saved, expected)
    initial = tiny_causal_lm(tiny_tokenizer()).state_dict()
    assert all(not torch.allclose(expected[n], initial[n]) for n in expected if expected[n].numel() > 1), \
        "some policy tensor did not train"


@pytest.mark.distributed
@needs_deepspeed
def test_two_zero3_ranks_train_the_one_process_weights(tmp_path: Path, single_run: tuple[Path, dict[str, Any]]):
    single_dir, one = single_run
    ranks = _run("zero3", tmp_path)
    assert [r["world"] for r in ranks] == [2, 2] and ranks[0]["distributed_type"] == "DEEPSPEED"
    assert ranks[0]["engine"] == "DeepSpeedEngine"
    full = _weights(single_dir / "model-single")
    # ZeRO-3 partitions the policy's weights themselves: each rank holds about half
    assert all(r["policy_local_numel"] < 0.6 * sum(t.numel() for t in full.values()) for r in ranks)
    _assert_same_run(ranks, one, _weights(tmp_path / "model-zero3"), full)


@pytest.mark.distributed
def test_ddp_run_killed_after_its_first_checkpoint_resumes_to_the_uninterrupted_weights(
        tmp_path: Path, single_run: tuple[Path, dict[str, Any]]):
    single_dir, one = single_run
    _run("ddp-killed", tmp_path, expect_exit=9)
    assert (tmp_path / "ckpt-ddp/checkpoint-1/trainer_state.json").is_file()
    assert not (tmp_path / "ckpt-ddp/checkpoint-2").exists()
    ranks = _run("ddp-resumed", tmp_path)
    assert [e["step"] for e in ranks[0]["steps"]] == [1, 2]  # step 1's log came back with the checkpoint
    for key, value in one["steps"][1].items():  # step 2 run again, as the uninterrupted run ran it
        assert ranks[0]["steps"][1][key] == pytest.approx(value, rel=TOLERANCE["rtol"], abs=TOLERANCE["atol"]), key
    import torch

    saved, expected = _weights(tmp_path / "model-ddp-resumed"), _weights(single_dir / "model-single")
    for name, tensor in expected.items():
        torch.testing.assert_close(saved[name], tensor, **TOLERANCE, msg=name)


def test_an_fsdp_launch_accelerate_cannot_honour_is_one_line(monkeypatch: pytest.MonkeyPatch):
    """On CPU processes accelerate builds plain data parallelism for an FSDP launch config without a word; the
    trainer refuses instead of training something else than asked."""
    from accelerate import DistributedType

    from alpacafarm.errors import UserError
    from alpacafarm.training import check_launch_honoured

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(UserError, match=r"asks for FSDP, which accelerate runs on GPUs only \(here: MULTI_CPU\)"):
        check_launch_honoured(DistributedType.MULTI_CPU)
    check_launch_honoured(DistributedType.FSDP)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    check_launch_honoured(DistributedType.MULTI_CPU)


def test_the_trainer_accelerator_starts_from_the_state_its_arguments_set_up(tmp_path: Path):
    """Building the arguments resets accelerate's state (transformers does it), so a previous trainer's state never
    reaches the PPO trainer's Accelerator; one built after the arguments is refused, not reused."""
    from accelerate import Accelerator

    from alpacafarm.training import trainer_accelerator
    from alpacafarm_methods.ppo.config import PPOMethodConfig

    Accelerator()  # an earlier trainer's
    args = PPOMethodConfig(output_dir=str(tmp_path), report_to="none")
    accelerator = trainer_accelerator(args, 1, project="ppo")
    assert accelerator.num_processes == 1
    Accelerator()
    with pytest.raises(RuntimeError, match="built after this trainer's arguments"):
        trainer_accelerator(args, 1, project="ppo")


GUARDED = ("deepspeed", "accelerate", "torch.distributed", "transformers", "trl")
PPO_AND_QUARK = sorted((REPO_ROOT / "plugins/alpacafarm_methods/ppo").glob("*.py")) + \
    sorted((REPO_ROOT / "plugins/alpacafarm_methods/quark").glob("*.py"))
#: Where trainers meet accelerate, DeepSpeed and transformers: every ``obj._y`` is refused there (``strict``).
#: alpacafarm/distributed.py is checked for the libraries' names only: it calls the standard library's
#: ``os._exit`` and ``atexit._run_exitfuncs`` on purpose and marks exceptions with an attribute of its own.
TRAINER_LAYER = [REPO_ROOT / "alpacafarm/training.py",
                 *sorted((REPO_ROOT / "plugins/alpacafarm_methods").rglob("*.py"))]


def private_uses(source: str, *, strict: bool) -> list[str]:
    """Private names of deepspeed, accelerate, torch.distributed, transformers or TRL that ``source`` reaches:
    ``from X import _y``, and ``a._y`` (at any depth) on a name bound to such a module or to a name imported from
    one. ``strict``: any ``obj._y`` whose root is not ``self``/``cls`` (what a file that must only use public APIs
    may not do)."""
    import ast

    tree = ast.parse(source)
    bound: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(GUARDED):
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"from {node.module} import {alias.name}")
                bound.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(GUARDED):
                    bound.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        root = node.value
        while isinstance(root, ast.Attribute | ast.Call | ast.Subscript):
            root = root.func if isinstance(root, ast.Call) else root.value
        name = root.id if isinstance(root, ast.Name) else ""
        if name in bound or (strict and name not in ("self", "cls")):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_ppo_and_quark_name_no_strategy_and_touch_no_private_attribute():
    assert len(PPO_AND_QUARK) >= 6
    for path in PPO_AND_QUARK:
        assert not re.search(r"shard|zero|fsdp|deepspeed|ddp", path.stem), f"{path.name} is named for a strategy"
    for path in TRAINER_LAYER:
        assert private_uses(path.read_text(encoding="utf-8"), strict=True) == [], path.relative_to(REPO_ROOT)
    everything = sorted((REPO_ROOT / "alpacafarm").rglob("*.py")) + sorted((REPO_ROOT / "plugins").rglob("*.py"))
    assert REPO_ROOT / "alpacafarm/distributed.py" in everything
    for path in everything:
        assert private_uses(path.read_text(encoding="utf-8"), strict=False) == [], path.relative_to(REPO_ROOT)
    # the check catches what the old code did
    assert private_uses("from accelerate.state import AcceleratorState\n"
                        "AcceleratorState._reset_state(reset_partial_state=False)\n", strict=False)
    assert private_uses("from accelerate.state import PartialState\nif PartialState._shared_state: pass\n",
                        strict=False)
    assert private_uses("from transformers.integrations import deepspeed as hf_deepspeed\n"
                        "config = hf_deepspeed._hf_deepspeed_config_weak_ref()\n", strict=False)
    assert private_uses("import deepspeed\nx = deepspeed.runtime.utils._x\n", strict=False)
    assert private_uses("from deepspeed.utils import _hp_mapping\n", strict=False)
    assert private_uses("def f(engine):\n    engine._remove_module_hooks()\n", strict=True)
    assert private_uses("def f(trainer):\n    return trainer.accelerator.state._shared_state\n", strict=True)


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]))
    from alpacafarm import distributed

    if distributed.joined_by_us():  # end the rank as the CLI does (distributed.end_process)
        distributed.end_process(0)
