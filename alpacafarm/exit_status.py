"""The exit status of every ``alpacafarm`` command: the one rule, as constants. ``docs/exit-status.md`` says what
each means; ``tests/test_exit_status.py`` checks that the page and these constants agree and that the commands
follow them. Every exit status in the code comes from here.
"""

from __future__ import annotations

OK = 0  # done (a gate verdict of PASS, a baseline written)
FAILED = 1  # the work failed (a stage, an annotation), or the gate's verdict FAIL
USER_ERROR = 2  # a user error or a refused input: one line naming the culprit, nothing run
INCONCLUSIVE = 3  # the gate cannot tell
STALE = 4  # the gate's baseline no longer describes the benchmark
CRASHED = 5  # bench only: the benchmark run crashed (a bug), no verdict
INTERRUPTED = 130  # Ctrl-C

#: ``{code: name}``, in the order of docs/exit-status.md.
EXIT_STATUSES: dict[int, str] = {OK: "OK", FAILED: "FAILED", USER_ERROR: "USER_ERROR", INCONCLUSIVE: "INCONCLUSIVE",
                                 STALE: "STALE", CRASHED: "CRASHED", INTERRUPTED: "INTERRUPTED"}
