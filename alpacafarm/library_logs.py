"""What the libraries say during a run goes to the run log, not to the console (``run -v`` shows it there too).

transformers, datasets, peft, accelerate, TRL, torch and the Hugging Face hub print load reports (with ANSI
colour codes even when redirected), warnings and progress bars of their own; Python warnings (``pin_memory``
...) go to stderr. :func:`route_library_output`, called by ``alpacafarm run`` before anything is loaded:

* hands every record of those libraries' loggers, and every Python warning (``logging.captureWarnings``), to the
  handlers of the ``alpacafarm`` logger, where the pipeline attaches the run's ``run.log`` (records that come
  before it is attached wait for it), colour codes stripped and the library named;
* turns the libraries' progress bars off (transformers' "Loading weights", datasets' "Map", the hub's
  downloads, any ``tqdm``); training shows one line of ours instead (:mod:`alpacafarm.training_progress`);
* with ``verbose``, also writes the records to the console (stderr) and leaves the progress bars on.

Our own console output (rich: stage headers, progress lines, tables) is not affected.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import logging
import os
import re
from collections import deque

#: Loggers whose records go to the run log instead of the console.
LIBRARY_LOGGERS = ("transformers", "datasets", "huggingface_hub", "peft", "accelerate", "trl", "torch",
                   "bitsandbytes", "tokenizers", "safetensors", "filelock", "fsspec", "urllib3", "httpx", "openai",
                   "vllm", "py.warnings")
#: Environment switches that turn library progress bars off (read when each library is imported).
PROGRESS_BAR_SWITCHES = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
                         "TQDM_DISABLE": "1"}
RUN_LOGGER = "alpacafarm"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text)


def plain_record(record: logging.LogRecord) -> logging.LogRecord:
    """A copy of ``record`` whose message is formatted, free of colour codes, and names the library."""
    plain = copy.copy(record)
    plain.msg, plain.args = f"[{record.name}] {strip_ansi(record.getMessage())}", None
    return plain


class RunLogHandler(logging.Handler):
    """Hands library records to the ``alpacafarm`` logger's handlers (the run log); keeps up to ``backlog``
    records while that logger has none and writes them, in order, once it has (see :class:`_FlushBacklog`)."""

    def __init__(self, backlog: int = 1000) -> None:
        super().__init__()
        self.pending: deque[logging.LogRecord] = deque(maxlen=backlog)

    def emit(self, record: logging.LogRecord) -> None:
        self.pending.append(plain_record(record))
        self.flush_pending()

    def flush_pending(self) -> None:
        targets = [h for h in logging.getLogger(RUN_LOGGER).handlers if not isinstance(h, ConsoleLogHandler)]
        if not targets:
            return
        with self.lock:
            while self.pending:
                record = self.pending.popleft()
                for handler in targets:
                    if record.levelno >= handler.level:
                        handler.handle(record)


class ConsoleLogHandler(logging.Handler):
    """``-v``: library records on the console (stderr) as ``[library] LEVEL: message``, through rich so that
    they print above a running progress line; colour codes only on a terminal."""

    def emit(self, record: logging.LogRecord) -> None:
        from alpacafarm.console import console

        try:
            text = f"[{record.name}] {record.levelname}: {record.getMessage()}"
            out = console()
            out.out(text if out.is_terminal else strip_ansi(text), highlight=False)
        except Exception:  # a logging handler must never raise
            self.handleError(record)


class _FlushBacklog(logging.Filter):
    """On the ``alpacafarm`` logger: its first record once the run log is attached writes the backlog first."""

    def __init__(self, handler: RunLogHandler) -> None:
        super().__init__()
        self.handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        if self.handler.pending:
            self.handler.flush_pending()
        return True


def _disown_library_handlers(name: str, keep: list[logging.Handler]) -> None:
    """Remove the stderr handlers a library put on its own logger (transformers, datasets, the hub do)."""
    logger = logging.getLogger(name)
    for handler in list(logger.handlers):
        if handler not in keep and type(handler) is logging.StreamHandler:
            logger.removeHandler(handler)


#: library → (its logging module, which adds a stderr handler when imported; how to turn its progress bars off)
SELF_CONFIGURING = {
    "huggingface_hub": ("huggingface_hub.utils.logging", ("huggingface_hub.utils", "disable_progress_bars")),
    "transformers": ("transformers.utils.logging", ("transformers.utils.logging", "disable_progress_bar")),
    "datasets": ("datasets.utils.logging", ("datasets.utils.tqdm", "disable_progress_bars")),
}


def _configure_installed_libraries(verbose: bool) -> None:
    """Import the logging module of each installed library that configures its own (so its stderr handler exists
    now and can be taken off), and switch its progress bars off where it was imported before the switches."""
    for library, (logging_module, (bars_module, disable)) in SELF_CONFIGURING.items():
        if importlib.util.find_spec(library) is None:
            continue
        importlib.import_module(logging_module)
        if not verbose:
            getattr(importlib.import_module(bars_module), disable)()


def name_deepspeed_accelerator() -> None:
    """DeepSpeed, where installed, picks its accelerator when first imported (transformers and accelerate import it)
    and, finding no GPU, warns on stdout through a handler it adds in that same import, before anything can route
    it. Where torch sees no CUDA device, name the CPU accelerator it falls back to (``DS_ACCELERATOR=cpu``): the
    same choice, without the stray line. An accelerator already named in the environment is kept."""
    if "DS_ACCELERATOR" in os.environ or importlib.util.find_spec("deepspeed") is None:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def route_library_output(verbose: bool = False) -> None:
    """Send library logs and Python warnings to the run log (and the console when ``verbose``); turn library
    progress bars off unless ``verbose``. Idempotent; call it before loading models or importing trainers."""
    if not verbose:
        for key, value in PROGRESS_BAR_SWITCHES.items():
            os.environ.setdefault(key, value)
    ours = [h for name in LIBRARY_LOGGERS for h in logging.getLogger(name).handlers
            if isinstance(h, RunLogHandler | ConsoleLogHandler)]
    run_log = next((h for h in ours if isinstance(h, RunLogHandler)), None) or RunLogHandler()
    handlers: list[logging.Handler] = [run_log]
    if verbose:
        handlers.append(next((h for h in ours if isinstance(h, ConsoleLogHandler)), None) or ConsoleLogHandler())
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        for handler in ours:
            logger.removeHandler(handler)
        for handler in handlers:
            logger.addHandler(handler)
        logger.propagate = False
    run_logger = logging.getLogger(RUN_LOGGER)
    for old in [f for f in run_logger.filters if isinstance(f, _FlushBacklog)]:
        run_logger.removeFilter(old)
    run_logger.addFilter(_FlushBacklog(run_log))
    for old in [h for h in run_logger.handlers if isinstance(h, ConsoleLogHandler)]:
        run_logger.removeHandler(old)
    if verbose:  # our own messages (what each stage does) on the console too
        run_logger.addHandler(handlers[-1])
    logging.captureWarnings(True)
    _configure_installed_libraries(verbose)
    name_deepspeed_accelerator()
    for name in LIBRARY_LOGGERS:
        _disown_library_handlers(name, handlers)
