"""One progress line per training run, with the current loss or reward on it, for every trainer of a stage.

A ``transformers`` / TRL ``Trainer`` shows a tqdm bar (``ProgressCallback``) or, with ``disable_tqdm``, prints
every log entry as a dict on stdout (``PrinterCallback``). :func:`training_progress` replaces both with
:class:`StageProgress`: the stage's progress line (``training (GRPO) ━━━━ 3/6 0:07:30 0:07:30 loss 0.02 reward
1.3``: steps done of ``max_steps``, elapsed, remaining, the last logged :data:`SHOWN_KEYS`), shown by the main
process only (:meth:`~alpacafarm.method.StageContext.progress`), and each log entry in the run log::

    trainer = build_my_trainer(...)
    with training_progress(trainer, context, "training (DPO)"):
        result = trainer.train(resume_from_checkpoint=resume_checkpoint(context))

It works with anything that has a ``callback_handler`` of trainer callbacks and fires ``on_train_begin``,
``on_step_end``, ``on_log`` and ``on_train_end`` as the ``Trainer`` does (our PPO trainer does). Redirected
output gets the line as it goes too (:mod:`alpacafarm.console`), not only when training ends.

Several runs under one line (online DPO's rounds): open the line with ``context.progress(description, total)``
and pass it with ``count_steps=True``: each run's steps count on after what the line shows already. Passed
without ``count_steps``, a line only gets the loss (it counts something else).

A training loop of its own, without trainer callbacks, shows the same line with :func:`loop_progress` and calls
:meth:`StageProgress.advance` after each optimizer step, with the step's log entry when it has one::

    with loop_progress(context, "training (Quark)", total_steps, start=resumed_step) as progress:
        for step in range(resumed_step + 1, total_steps + 1):
            logs = train_one_step(...)  # {"loss": ..., "reward": ...}, or None on a step that logs nothing
            progress.advance(step, logs)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

#: Log keys shown after the bar, the first two an entry has, in this order (``loss`` is the Trainer's, ``reward``
#: GRPO's, RLOO's and PPO's); two keep the line within 80 columns (a redirected console).
SHOWN_KEYS = (("loss", "loss"), ("reward", "reward"), ("score", "score"))


def status_text(logs: dict[str, Any]) -> str | None:
    """``loss 0.4123 reward 1.2`` from a log entry; ``None`` when it has none of :data:`SHOWN_KEYS`."""
    parts = [f"{label} {logs[key]:.4g}" for key, label in SHOWN_KEYS if isinstance(logs.get(key), int | float)]
    return " ".join(parts[:2]) or None


class StageProgress(TrainerCallback):
    """The progress line of a stage's training run; log entries go to the stage's logger (the run log).

    ``line``: an existing progress line to use instead of opening one; ``count_steps``: the run's steps count
    on it after what it shows (otherwise it only gets the loss). :meth:`advance` is what the callback hooks call.
    """

    def __init__(self, context: Any, description: str | None = None, line: Any = None, *,
                 count_steps: bool = False) -> None:
        self.context = context
        self.description = description or "training"
        self.line = line
        self.count_steps = line is None or count_steps
        self.base = 0.0  # what a shared line showed before this run
        self._own: ExitStack | None = None

    def open(self, total: int | None, step: int = 0) -> None:
        """Show the line from ``step`` (a resumed run starts where its checkpoint was); opens it unless passed."""
        if self.line is None:
            self._own = ExitStack()
            self.line = self._own.enter_context(self.context.progress(self.description, total or None))
        elif self.count_steps:
            self.base = self.line.completed
        self._show(step)

    def advance(self, step: int, logs: dict[str, Any] | None = None) -> None:
        """``step`` optimizer steps done; ``logs`` (if given) go to the run log, their loss or reward onto the line."""
        status = None
        if logs is not None:
            logs = {k: v for k, v in logs.items() if k != "total_flos"}
            self.context.logger.info("stage %s: step %d: %s", self.context.stage, step, json.dumps(logs, default=str))
            status = status_text(logs)
        self._show(step, status)

    def _show(self, step: int, status: str | None = None) -> None:
        if self.line is None:
            return
        if self.count_steps:
            self.line.update(completed=self.base + step, status=status)
        elif status is not None:
            self.line.update(status=status)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._own is None:
            self.open(state.max_steps, state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not control.should_log:  # otherwise on_log shows the step, with its loss
            self._show(state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.advance(state.global_step, logs or {})

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._show(state.global_step)
        self.close()

    def close(self) -> None:
        """End this callback's own line (a no-op when it has none, or it ended)."""
        if self._own is not None:
            own, self._own = self._own, None
            own.close()
            self.line = None


@contextmanager
def training_progress(trainer: Any, context: Any, description: str | None = None, *,
                      line: Any = None, count_steps: bool = False) -> Iterator[StageProgress]:
    """While inside, ``trainer`` shows one progress line with the loss (see the module docstring) instead of its
    tqdm bar and printed log dicts; its log entries go to ``context.logger``. The line ends with the block, also
    when training fails."""
    handler = trainer.callback_handler
    for callback in list(handler.callbacks):
        if isinstance(callback, PrinterCallback | ProgressCallback):
            handler.remove_callback(callback)
    progress = StageProgress(context, description, line, count_steps=count_steps)
    handler.add_callback(progress)
    try:
        yield progress
    finally:
        progress.close()
        handler.remove_callback(progress)


@contextmanager
def loop_progress(context: Any, description: str, total: int | None, *, start: int = 0) -> Iterator[StageProgress]:
    """The progress line of a training loop of its own (no trainer callbacks): ``total`` optimizer steps, ``start``
    of them done (a resumed run); call :meth:`StageProgress.advance` after each step (see the module docstring)."""
    progress = StageProgress(context, description)
    progress.open(total, start)
    try:
        yield progress
    finally:
        progress.close()
