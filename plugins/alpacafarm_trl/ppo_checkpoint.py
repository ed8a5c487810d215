"""The PPO trainer's ``checkpoint-N/`` folders: trained weights (policy, value), optimizer, scheduler, RNG and trainer
state, written by the main process and read back by every rank on resume.

Under FSDP2 (:mod:`alpacafarm_trl.ppo_sharding`) and DeepSpeed ZeRO (:mod:`alpacafarm_trl.ppo_zero`) every rank
first gathers the sharded weights and optimizer state whole (collectives), so a checkpoint has the data-parallel
format whatever the launch config, and resuming shards it again: a run can resume under another config.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import torch

from alpacafarm.errors import UserError


def save_checkpoint(trainer: Any) -> Path | None:
    """Write ``checkpoint-N/`` (call on every rank: sharded tensors are gathered first); its path on the main
    process, None on the others."""
    import numpy as np

    from alpacafarm import distributed

    sharding = trainer.sharding
    trainable = sharding.full_parameters(trainer.params)
    optimizer_state = sharding.full_optimizer_state(trainer.optimizer)
    if not distributed.is_main():
        return None
    output_dir = Path(trainer.args.output_dir)
    final = output_dir / f"checkpoint-{trainer.state.global_step}"
    partial = output_dir / f"{final.name}.partial"  # renamed when complete: a crash leaves no half one
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    torch.save({k: p.cpu() for k, p in trainable.items()}, partial / "trainable.pt")
    torch.save(optimizer_state, partial / "optimizer.pt")
    torch.save(trainer.lr_scheduler.state_dict(), partial / "scheduler.pt")
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    torch.save(rng, partial / "rng_state.pth")
    trainer.state.save_to_json(str(partial / "trainer_state.json"))
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    rotate_checkpoints(output_dir, trainer.args.save_total_limit)
    return final


def rotate_checkpoints(output_dir: Path, limit: int | None) -> None:
    if not limit or limit < 1:
        return
    checkpoints = sorted((p for p in output_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                         key=lambda p: int(p.name.split("-")[-1]))
    for old in checkpoints[:-limit]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(trainer: Any, path: Path) -> None:
    """Restore ``trainer`` from ``path`` (sharded tensors are sharded again like the trainer's)."""
    import numpy as np
    from transformers.trainer_callback import TrainerState

    saved = torch.load(path / "trainable.pt", map_location="cpu", weights_only=True)
    missing = sorted(set(trainer.params) - set(saved))
    if missing:
        raise UserError(f"checkpoint {path} does not match this model ({len(missing)} tensors missing, "
                        f"e.g. {missing[0]})")
    trainer.sharding.load_parameters(trainer.params, saved)
    optimizer_state = torch.load(path / "optimizer.pt", map_location=trainer.models.device, weights_only=True)
    trainer.sharding.load_optimizer(trainer.optimizer, list(trainer.params.values()), optimizer_state)
    trainer.lr_scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    rng = torch.load(path / "rng_state.pth", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["cpu"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    trainer.state = TrainerState.load_from_json(str(path / "trainer_state.json"))
    trainer.state.max_steps = trainer.max_steps
