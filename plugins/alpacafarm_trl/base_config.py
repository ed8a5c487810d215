"""Defaults every trainer config of this plugin shares: bf16 and activation checkpointing chosen for the machine.

TRL's configs default to ``bf16=True`` and gradient checkpointing on. Both are wrong on a CPU (bf16 makes
``TrainingArguments`` refuse to build there; checkpointing only slows a small model down), so the method configs
inherit :class:`TrainingDefaults` first (``@dataclass class XConfig(TrainingDefaults, trl.XConfig)``): the two
fields default to ``None`` (automatic) and are resolved for the machine at hand before TRL's own checks run.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainingDefaults:
    """Mixin for ``TrainingArguments`` subclasses: ``bf16`` / ``gradient_checkpointing`` ``None`` = automatic."""

    bf16: bool | None = None
    gradient_checkpointing: bool | None = None

    def __post_init__(self) -> None:
        apply_device_defaults(self)
        super().__post_init__()  # type: ignore[misc]  # TrainingArguments.__post_init__


def apply_device_defaults(config: object) -> None:
    """Resolve ``bf16`` and gradient checkpointing for this machine; runs before ``TrainingArguments.__post_init__``.

    ``bf16: None`` (the default) means bfloat16 only on a GPU that supports it. An explicit ``bf16: true``
    where no such GPU exists is turned off with a note (so a GPU recipe still loads and checks on a laptop).
    Gradient checkpointing left unset is on with CUDA (memory is what matters there) and off elsewhere.
    """
    import torch

    cuda = torch.cuda.is_available()
    bf16_ok = cuda and torch.cuda.is_bf16_supported()
    notes: list[str] = []
    if config.bf16 is None:
        config.bf16 = bf16_ok and not config.fp16
    elif config.bf16 and not bf16_ok:
        notes.append("bf16: true needs a GPU with bfloat16 support; this machine has none, so training runs in float32")
        config.bf16 = False
    if config.gradient_checkpointing is None and config.activation_checkpointing is None:
        # Set the new name directly: setting the deprecated alias makes transformers warn on every config.
        config.activation_checkpointing = cuda
    object.__setattr__(config, "device_notes", notes)
