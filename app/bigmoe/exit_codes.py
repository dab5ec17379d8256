"""The one table of `bigmoe`'s exit codes (README, "Exit codes", shows the same table).

Every command exits with one of these; each failure also prints one line on stderr.
Codes from 128 up follow the shell's rule: 128 + the number of the signal that ended the run.
"""

from __future__ import annotations

OK = 0
"""Done (for `run`: the server answered and was stopped, or was stopped by `bigmoe stop`)."""
ERROR = 1
"""An error the message explains (bad preset, port in use, no such server, the server died while serving)."""
USAGE = 2
"""The command line is wrong (unknown option, bad value)."""
PLAN_REFUSED = 3
"""The plan was refused; `--force` runs it anyway."""
START_FAILED = 4
"""vLLM did not come up (it exited during start-up, or did not answer /health in time)."""
NOT_READY = 5
"""A downloaded file differs from the Hub's listing (it was removed; run again)."""
NOT_FOUND = 6
"""The Hub has no such model or revision, or it is gated without a valid token."""
NETWORK = 7
"""The Hub could not be reached, or a download broke off (whole files are kept)."""
NO_SPACE = 8
"""The files still to download, or the paging file, do not fit in the free disk space."""
HANGUP = 129
"""The terminal closed (SIGHUP): `run` left its server running; `bigmoe ps` and `bigmoe stop` find it."""
INTERRUPTED = 130
"""Ctrl-C (SIGINT): the server was stopped (a second Ctrl-C kills it at once); a download resumes on the next run."""
TERMINATED = 143
"""SIGTERM: the server was stopped cleanly."""

TABLE: tuple[tuple[int, str], ...] = (
    (OK, "done"),
    (ERROR, "an error the message explains"),
    (USAGE, "bad command line"),
    (PLAN_REFUSED, "plan refused (--force runs it anyway)"),
    (START_FAILED, "vLLM did not come up"),
    (NOT_READY, "a downloaded file failed its check"),
    (NOT_FOUND, "no such model or revision on the Hub"),
    (NETWORK, "the Hub unreachable or the download broke off"),
    (NO_SPACE, "not enough disk space"),
    (HANGUP, "terminal closed: the server keeps running"),
    (INTERRUPTED, "Ctrl-C: the server was stopped"),
    (TERMINATED, "SIGTERM: the server was stopped"),
)
"""(code, meaning) in order; a unit test checks that the README's table says the same."""
