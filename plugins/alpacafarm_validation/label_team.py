"""The team page: who labelled how many, how much of the overlap is done and the human-human agreement so far.

Computed from the store alone (no simulated annotator runs), in well under a second for a session's labels, so
``GET /team`` can refresh itself every few seconds while a team labels. The page is rendered on the server with
every stored text escaped (``html.escape``); it carries no script.
"""

from __future__ import annotations

import datetime
import html
from typing import Any

from alpacafarm_validation.label_stats import MIN_SHARED_PAIRS, shared_pairs_warning
from alpacafarm_validation.label_store import LabelStore

REFRESH_S = 10


def team_summary(store: LabelStore, n_bootstrap: int = 500) -> dict[str, Any]:
    """Per labeller: labels, skips, "both bad" and the time of the last; the overlap's progress; human-human
    agreement and Light's kappa so far, with bootstrap intervals, and the minimum-shared-pairs warning."""
    from alpacafarm_validation.agreement import AgreementConfig, measure
    from alpacafarm_validation.label_report import human_by_pair, label_records, light_kappa
    from alpacafarm_validation.label_stats import human_intervals

    rows = store.labels()
    counts = store.run("count the pairs", lambda db: db.execute(
        "SELECT COUNT(*), COALESCE(SUM(overlap), 0) FROM pairs").fetchone(), write=False)
    people: dict[str, dict[str, Any]] = {}
    for row in rows:
        entry = people.setdefault(row["labeller"], {"labelled": 0, "skipped": 0, "both_bad": 0, "last": None})
        entry["skipped" if row["choice"] == "skip" else "labelled"] += 1
        entry["both_bad"] += row["choice"] == "both_bad"
        entry["last"] = datetime.datetime.fromtimestamp(row["created"], datetime.timezone.utc).isoformat(
            timespec="seconds")
    humans = human_by_pair(rows)
    shared = {k: v for k, v in humans.items() if len(v) >= 2}
    agreement: dict[str, Any] | None = None
    if shared:
        result = measure(label_records({k: [label for _, label in v] for k, v in shared.items()}), AgreementConfig())
        agreement = {"agreement": result.humans["agreement"], "pairs": len(shared),
                     **light_kappa(humans), **human_intervals(humans, 0, n_bootstrap)}
    overlap_done = sum(1 for r in {r["pair_id"]: r for r in rows if r["overlap"]}.values()
                       if len(humans.get((r["instruction"], r["output_1"], r["output_2"]), [])) >= 2)
    return {"labellers": dict(sorted(people.items())), "pairs": counts[0], "overlap_pairs": counts[1],
            "overlap_done": overlap_done, "shared_pairs": len(shared), "min_shared_pairs": MIN_SHARED_PAIRS,
            "human_human": agreement, "warning": shared_pairs_warning(len(shared))}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _interval(values: list[float] | None, scale: float = 100.0, digits: int = 1) -> str:
    return "" if not values else f" [95% {values[0] * scale:.{digits}f}, {values[1] * scale:.{digits}f}]"


def team_html(summary: dict[str, Any], refresh_url: str) -> str:
    """The team page for ``summary``; it reloads itself from ``refresh_url`` (already escaped)."""
    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{e['labelled']}</td><td>{e['skipped']}</td><td>{e['both_bad']}</td>"
        f"<td>{html.escape(e['last'] or '-')}</td></tr>" for name, e in summary["labellers"].items())
    hh = summary["human_human"]
    agreement = ("no pair has labels from 2 people yet" if hh is None else
                 f"human-human agreement {_pct(hh['agreement'])}{_interval(hh['agreement_interval'])} on "
                 f"{hh['pairs']} shared pairs; Light's κ "
                 f"{'-' if hh['kappa'] is None else format(hh['kappa'], '.2f')}"
                 f"{_interval(hh['kappa_interval'], 1, 2)}")
    warning = f"<p class=\"warning\">{html.escape(summary['warning'])}</p>" if summary["warning"] else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="refresh" content="{REFRESH_S};url={refresh_url}">
<title>alpacafarm · labelling team</title><link rel="stylesheet" href="/static/label.css"></head>
<body class="team"><h1>Labelling team</h1>
<p id="overlap">overlap: {summary['overlap_done']} of {summary['overlap_pairs']} shared pairs labelled by 2 or more
people · {summary['pairs']} pairs in the session</p>
<p id="agreement">{html.escape(agreement)}</p>{warning}
<table id="team"><thead><tr><th>labeller</th><th>labelled</th><th>skipped</th><th>both bad</th><th>last label
(UTC)</th></tr></thead><tbody>{rows}</tbody></table>
<p class="hint">Refreshes every {REFRESH_S} s. No simulated annotator runs here: <code>alpacafarm label report</code>
compares them.</p></body></html>
"""
