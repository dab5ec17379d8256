"""The process's one host copier thread (core.host_copier) and the mailboxes it serves.

The predictor's prefetch rounds (BIGMOE_PREFETCH_HOST_COPIER) hand their copies to it: each layer's round, or the
one-node kernel's program, publishes its decided list to a mailbox; a chained forward's end drains those copies on the
device.

The thread starts with its first user, in an uncaptured forward (vLLM's profile run or an eager step). A prefetch path
that cannot use it (a layer it cannot serve) gives it up, and then the thread stops. A failed thread is the export
loop's to report (adapters.vllm.device.failed_part), which stops the server.
"""

from __future__ import annotations

import logging

import torch
from bigmoe_pager.core.host_copier import HostCopier
from bigmoe_pager.core.host_rounds import drain_published, progress_words, serve_pager
from bigmoe_pager.settings import PagerSettings

log = logging.getLogger("vllm.bigmoe_pager")


class HostCopies:
    """The host copier of one process, made at its first use, and the prefetch rounds it copies."""

    def __init__(self, settings: PagerSettings):
        self.hot_ms = settings.host_copier_hot_ms
        """BIGMOE_HOST_COPIER_HOT_MS: how long the thread busy-polls after its last round (None: its default)."""
        self.copier: HostCopier | None = None
        """The thread, once a user asked for it (`copier_for`)."""
        self._published: dict[tuple[str, int], torch.Tensor] = {}
        """Per (device, slots): the progress words (host_rounds.progress_words) of the layers whose prefetch rounds
        the thread copies, which a chained forward's end drains."""

    def copier_for(self, device: torch.device) -> HostCopier:
        """The thread, started at the first call (outside any capture); HostCopierError if it cannot be built or
        started."""
        if self.copier is None:
            self.copier = HostCopier(device, hot_ms=self.hot_ms)
        return self.copier

    def publish_rounds(self, pagers: list, mailboxes, device: torch.device) -> None:
        """The thread serves `mailboxes` (prefetch rounds' lists) into their `pagers`' slots, and a chained forward's
        end drains their copies. HostCopierError or ValueError where it cannot."""
        copier = self.copier_for(device)
        if not self._published:  # the first layers whose rounds the host copies
            log.warning("bigmoe: prefetch rounds are copied by a host thread through the GPU's copy engines")
        for pager, mailbox in zip(pagers, mailboxes):
            serve_pager(copier, pager, mailbox)
        key = (str(device), pagers[0].num_slots)
        words = progress_words(pagers, device)
        before = self._published.get(key)
        self._published[key] = words if before is None else torch.cat([before, words])

    def drain(self, device: torch.device, flags: torch.Tensor) -> None:
        """At a chained forward's end, once its side stream is joined: wait on the device until the thread's copies
        of its prefetch rounds are done (flags: the forward's chain words)."""
        for (where, slots), words in self._published.items():
            if where == str(device):
                drain_published(words, slots, flags)

    def give_up_prefetch(self) -> None:
        """Prefetch rounds no longer go to the thread: nothing to drain, and the thread stops."""
        self._published.clear()
        if self.copier is not None:
            self.copier.close()
            self.copier = None

    @property
    def stats(self) -> dict[str, int] | None:
        """The thread's counters (rounds, experts, bytes it served, its error code); None: no thread runs."""
        return None if self.copier is None else self.copier.stats()
