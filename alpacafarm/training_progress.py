"""One progress line per training run, with the current loss on it, for any ``transformers`` / TRL trainer.

A ``Trainer`` shows a tqdm bar (``ProgressCallback``) or, with ``disable_tqdm``, prints every log entry as a
dict on stdout (``PrinterCallback``), ``{'loss': ..., 'grad_norm': ...}`` each ``logging_steps``.
:func:`training_progress` replaces both with :class:`StageProgress`: a rich progress line (steps done of
``max_steps``, time, ``loss 0.41``) and the log entries in the run log::

    trainer = build_my_trainer(...)
    with training_progress(trainer, context, "training (DPO)"):
        result = trainer.train(resume_from_checkpoint=resume_checkpoint(context))

It works with anything that has a ``callback_handler`` of trainer callbacks (our PPO trainer too). A loop that
trains several times under one line of its own (Quark's rounds) passes that line: the loss goes on it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

#: Log keys shown after the bar, in this order, when an entry has them (``loss`` is the Trainer's).
SHOWN_KEYS = (("loss", "loss"), ("reward", "reward"), ("score", "score"))


def status_text(logs: dict[str, Any]) -> str | None:
    """``loss 0.4123 reward 1.2`` from a log entry; ``None`` when it has none of :data:`SHOWN_KEYS`."""
    parts = [f"{label} {logs[key]:.4g}" for key, label in SHOWN_KEYS if isinstance(logs.get(key), int | float)]
    return " ".join(parts) or None


class StageProgress(TrainerCallback):
    """A progress line for a training run of a stage; log entries go to the stage's logger (the run log).

    ``line``: an existing progress line to show the loss on instead of opening one (it is not advanced).
    """

    def __init__(self, context: Any, description: str | None = None, line: Any = None) -> None:
        self.context = context
        self.description = description or "training"
        self.line = line
        self._own: ExitStack | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.line is not None or self._own is not None:
            return
        from alpacafarm.console import progress_bar

        self._own = ExitStack()
        self.line = self._own.enter_context(progress_bar(self.description, state.max_steps or None))
        self.line.update(completed=state.global_step)  # a resumed run starts where its checkpoint was

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._own is not None:
            self.line.update(completed=state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        logs = {k: v for k, v in (logs or {}).items() if k != "total_flos"}
        self.context.logger.info("stage %s: step %d: %s", self.context.stage, state.global_step,
                                 json.dumps(logs, default=str))
        status = status_text(logs)
        if status is not None and self.line is not None:
            self.line.update(status=status)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """End this callback's own line (a no-op when it has none, or it ended)."""
        if self._own is not None:
            own, self._own = self._own, None
            own.close()
            self.line = None


@contextmanager
def training_progress(trainer: Any, context: Any, description: str | None = None, *,
                      line: Any = None) -> Iterator[StageProgress]:
    """While inside, ``trainer`` shows one progress line with the loss (see the module docstring) instead of its
    tqdm bar and printed log dicts; its log entries go to ``context.logger``. The line ends with the block, also
    when training fails."""
    handler = trainer.callback_handler
    for callback in list(handler.callbacks):
        if isinstance(callback, PrinterCallback | ProgressCallback):
            handler.remove_callback(callback)
    progress = StageProgress(context, description, line)
    handler.add_callback(progress)
    try:
        yield progress
    finally:
        progress.close()
        handler.remove_callback(progress)
