"""The annotator interface: ``annotate(pairs) -> annotations``, sync and async.

Implementations (prompted API judges, pools, the offline judge, local transformers judges) live in plugins and
subclass :class:`Annotator`; they implement :meth:`Annotator.aannotate`. Identical outputs are a tie and are
never sent anywhere (:func:`identical_tie`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Any

from alpacafarm.types import Annotation, Pair

#: ``progress(n_done, cost_usd)`` is called as annotations complete (drives progress bars).
ProgressCallback = Callable[[int, float], None]


def identical_tie(pair: Pair, annotator: str) -> Annotation | None:
    """A tie for two identical outputs (whitespace-insensitive), else None."""
    if pair.output_1.strip() == pair.output_2.strip():
        return Annotation(0, annotator, metadata={"reason": "identical outputs"})
    return None


class Annotator:
    """Base class. ``name`` identifies the annotator in outputs, the cache and the ledger."""

    name: str = "annotator"

    async def aannotate(self, pairs: Sequence[Pair], progress: ProgressCallback | None = None) -> list[Annotation]:
        raise NotImplementedError

    def annotate(self, pairs: Sequence[Pair], progress: ProgressCallback | None = None) -> list[Annotation]:
        """Annotate ``pairs`` (one annotation each, in order). Works inside and outside a running event loop."""
        coroutine_factory = lambda: self.aannotate(list(pairs), progress)  # noqa: E731
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(coroutine_factory())
        result: dict[str, Any] = {}

        def runner() -> None:  # a notebook already runs a loop: use a private one on a thread
            try:
                result["value"] = asyncio.run(coroutine_factory())
            except BaseException as exc:
                result["error"] = exc

        thread = threading.Thread(target=runner)
        thread.start()
        thread.join()
        if "error" in result:
            raise result["error"]
        return result["value"]

    def close(self) -> None:
        """Release clients, files and models (called by the CLI and the pipeline when done)."""
