"""What every attempt at a stage asked and paid, so that ``metrics.json`` counts them all after a resume.

A stage that stopped (killed, budget, a failing endpoint) and resumed paid for requests in each attempt; the
attempt that finishes only sees its own. :class:`AttemptTotals` keeps each attempt's figures in the stage folder
(``annotation_attempts.json``, rewritten after every annotation call, so a failed attempt's are kept too) and adds
them up.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ATTEMPTS_FILE = "annotation_attempts.json"


class AttemptTotals:
    """This attempt's annotation figures (``update``) plus those of the earlier attempts of a resumed stage."""

    def __init__(self, stage_dir: str | Path, resuming: bool, is_main: bool = True) -> None:
        self.path = Path(stage_dir) / ATTEMPTS_FILE
        self.is_main = is_main
        self.earlier = self._read() if resuming else []
        self.current: dict[str, float] = {}

    def _read(self) -> list[dict[str, float]]:
        """Earlier attempts' figures; a file that is not what this class writes counts as none (and says so)."""
        import logging

        if not self.path.is_file():
            return []
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            logging.getLogger("alpacafarm").warning("%s unreadable (%s): earlier attempts not counted", self.path, exc)
            return []
        if not isinstance(data, list) or not all(
                isinstance(a, dict) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in a.values())
                for a in data):
            logging.getLogger("alpacafarm").warning("%s malformed: earlier attempts not counted", self.path)
            return []
        return data

    def update(self, figures: dict[str, float]) -> None:
        """This attempt's figures so far (cumulative, replacing the last update); written at once."""
        from alpacafarm.data import write_json

        self.current = dict(figures)
        if self.is_main:
            write_json(self.path, [*self.earlier, self.current])

    def totals(self) -> dict[str, Any]:
        """Each figure summed over every attempt, and ``attempts``: how many there were."""
        attempts = [*self.earlier, self.current]
        keys = dict.fromkeys(k for a in attempts for k in a)
        out: dict[str, Any] = {k: sum(a.get(k, 0) for a in attempts) for k in keys}
        if "cost_usd" in out:
            out["cost_usd"] = round(out["cost_usd"], 6)
        out["attempts"] = len(attempts)
        return out
