"""run_signals: what SIGINT, SIGTERM and SIGHUP do while `bigmoe run` has a server.

A signal that comes while the server is being started waits until its record exists. The first
of them raises Stop in the main thread (the run then says it is stopping and stops the
server cleanly, or on SIGHUP leaves it running). Once the server is being stopped, SIGINT or SIGTERM
sends SIGKILL to its whole group at once and raises Killed; the run then only reaps and cleans up.
"""

from __future__ import annotations

import signal

from bigmoe.serve import launch

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stop(Exception):
    """The first signal: stop the server (or, for SIGHUP, leave it running)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Killed(KeyboardInterrupt):
    """A signal while the server was being stopped: its group has been sent SIGKILL."""


class RunSignals:
    """Context manager that installs the handlers for as long as the run has a server (main thread only)."""

    def __init__(self):
        self.server: launch.Server | None = None
        """The server the signals are about (set once it is started)."""
        self.stopping = False
        """The server is being stopped: a further SIGINT or SIGTERM kills it."""
        self.killed = False
        self.pending: int | None = None
        """A signal that came while the server was being started."""
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "RunSignals":
        for signum in HANDLED:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def started(self, server: launch.Server) -> None:
        """The server runs and has its record: from now on signals are about it (one that came meanwhile acts now)."""
        self.server = server
        if self.pending is not None:
            self.stopping = True
            raise Stop(self.pending)

    def _handle(self, signum: int, frame) -> None:
        if self.server is None:
            self.pending = self.pending or signum  # no process to stop yet, or no record to find it by
            return
        if not self.stopping:
            self.stopping = True
            raise Stop(signum)
        if signum == signal.SIGHUP:
            return  # the terminal closed while the server is being stopped: the stop goes on
        if self.server is not None:
            launch.signal_group(self.server.info, signal.SIGKILL)
        if not self.killed:
            self.killed = True
            raise Killed()
