"""TRL's trainers (SFT, reward model, DPO) under DeepSpeed ZeRO-3 through ``alpacafarm run --num-processes 2
--accelerate-config zero3`` on CPUs (DeepSpeed's CPU accelerator joins the ranks over gloo): every rank trains in
one engine spanning both, and the main process saves full weights that load with ``from_pretrained`` and equal the
same recipe's weights under ``--accelerate-config ddp`` (the same global batch: the same optimisation).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_distributed import tiny_recipe

pytestmark = [pytest.mark.distributed,  # every test here reads one two-process run
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                 reason="deepspeed is not installed (pip install deepspeed --no-build-isolation)")]

TRAINED = ("sft", "rm", "dpo")


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> dict[str, Path]:
    """split -> sft -> reward model -> DPO (the first stages of test_distributed's tiny recipe, ``device: cpu``) on 2
    processes, once with the ``ddp`` config and once with ``zero3``."""
    tmp_path = tmp_path_factory.mktemp("zero3-stages")
    recipe = tiny_recipe(tmp_path, tiny_model_dir, until="ppo")
    runs = {}
    for config in ("ddp", "zero3"):
        run_dir = tmp_path / config
        done = subprocess.run([sys.executable, "-m", "alpacafarm", "run", str(recipe), "--output-dir", str(run_dir),
                               "--num-processes", "2", "--accelerate-config", config], capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        runs[config] = run_dir
    return runs


def _stage_file(run_dir: Path, stage: str, name: str) -> dict[str, Any]:
    return json.loads((run_dir / "stages" / stage / name).read_text())


def test_zero3_stages_train_on_both_ranks_through_one_deepspeed_engine(launched: dict[str, Path]):
    for stage in TRAINED:
        manifest = _stage_file(launched["zero3"], stage, "manifest.json")
        assert (manifest["world_size"], manifest["ranks_ran"]) == (2, 2), stage
        metrics = _stage_file(launched["zero3"], stage, "metrics.json")
        # the trainer's accelerator saw both processes (a CPU-only rank used to count itself alone) under ZeRO-3
        assert (metrics["trainer_processes"], metrics["distributed_type"], metrics["zero_stage"]) == \
            (2, "DEEPSPEED", 3), stage
        ddp = _stage_file(launched["ddp"], stage, "metrics.json")
        assert (ddp["trainer_processes"], ddp["distributed_type"], ddp["zero_stage"]) == (2, "MULTI_CPU", None)
        assert metrics["steps"] == ddp["steps"] == 2 and metrics["epochs"] == ddp["epochs"], stage  # one global batch


def test_zero3_saves_full_weights_equal_to_the_ddp_run(launched: dict[str, Path], tiny_model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    for stage in TRAINED:
        auto = AutoModelForSequenceClassification if stage == "rm" else AutoModelForCausalLM
        zero3, ddp = (auto.from_pretrained(launched[c] / "stages" / stage / "model").state_dict()
                      for c in ("zero3", "ddp"))
        assert zero3.keys() == ddp.keys(), stage
        for name, tensor in zero3.items():
            assert tensor.shape == ddp[name].shape and tensor.numel() > 0, (stage, name)  # whole, not a ZeRO shard
            torch.testing.assert_close(tensor, ddp[name], rtol=1e-4, atol=1e-4, msg=f"{stage}: {name}")
        if stage == "sft":  # the weights compared did train
            moved = max((zero3[n] - base[n]).abs().max().item() for n in base)
            assert moved > 1e-4
