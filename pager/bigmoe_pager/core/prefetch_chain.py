"""One forward's prefetch rounds on one side-stream branch, ordered after their layers' steps by device flags.

A round that prefetches layer l+1's experts reads what layer l's step left behind on the current
stream (the hidden state its router product takes, the replay cursor) and should not compete with
l's own misses for the link, so it starts once layer l's step is done. With one CUDA graph fork
per round that costs about 9 us a layer on vLLM's main path (run 15 in docs/benchmarks.md: 0.36
ms a token at 40 layers), where one fork a forward cost 0.03 ms. So a forward captured whole can
fork the side stream once, after its first layer's step, and order each later round by flags in
device memory instead of graph edges (BIGMOE_PREFETCH_CHAIN; off: it measured slower, below):

    flags[FORWARD]      forwards counted so far (the first layer's step adds one)
    flags[TIMEOUTS]     waits that gave up (see below; core.round_sync's too)
    flags[CANCELS]      rounds a joinless forward's step cancelled because it came first (core.round_sync)
    flags[PUBLISHED]    1 once a round published a list with entries for the host copier, 0 again once a forward's
                        drain saw every copy done (core.host_rounds)
    flags[QUIET]        the next joinless forward's number when it is quiet (written at each joinless forward's end)
    flags[OPEN]         gates a joinless forward's rounds found open after judging (reset at the forward's end)
    flags[LATE]         drains that held a slot for a host copy still under way (core.host_rounds); every
                        LATE_LIMIT-th holds the rounds back: the copy engines' work may not be landing beside kernels
    flags[RESUME]       the first forward whose rounds fetch again after a hold-back (0: none so far); a drain that
                        still finds a late copy under way keeps a hold-back in force
    flags[HOLD]         forwards the first hold-back lasts (HOLD_FORWARDS); each later one twice the one before
    flags[STEPPED + l]  the forward whose step of layer l is done (its copies included)

A joinless forward is quiet when, at the end of the one before, no round's gate was open and no copy was under way
(`end_forward`): its rounds then judge their marks and scores as always but claim, take and copy nothing, so none
of its steps needs to settle a round, keep the slots a round filled, or wait for a copy. Those three cost 2.3 of
the joinless step's 2.5 us (run 35 in docs/benchmarks.md: 0.09 ms a token at recall 0, where every gate is closed).
A round that finds its gate open in a quiet forward marks what it would fetch and counts itself in OPEN, so the
following forward is not quiet and fetches: a gate reopens one forward later than it would otherwise. Both words
are read with plain loads: only `end_forward`, on the main stream after every step and round of a forward, writes
QUIET, and a forward's steps and rounds all read it after that forward's first step.

The fused step kernel (step_kernel, a `ChainSignal`) publishes `STEPPED + l` with a release store
when its last program is done; `wait_stepped` enqueues, on the side stream before round l+1, one
program that spins (acquire loads) until that word holds this forward's number. The rounds' joins
stay as they are (the main stream waits for round l+1 before step l+1) unless the forward is joinless
(core.round_sync: then the step and the round meet through words in device memory); the STEPPED flags
order nothing that tokens depend on: a round that started early would read a stale
hidden state or cursor and propose the wrong experts, which costs bandwidth, never a token. That is
why a wait may give up: after `max_spins` polls (about a second on a GPU) it counts a timeout and
lets the round run, where a hang would lose the engine.

Measured inside vLLM 0.33 (run 16), an idle chain costs what 39 forks cost: the joins a layer
cost as much as the forks did (0.40 ms a token with no wait at all), and the waiting programs
add 0.10-0.50 ms more. Only a forward with no cross-stream edge a layer (the joins replaced by
flags too) could be cheaper; docs/benchmarks.md says what that needs.

In Triton's CPU interpreter the same kernels run with plain volatile loads and stores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from bigmoe_pager.core.triton_launch import kernel_for

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

FORWARD, TIMEOUTS, CANCELS, PUBLISHED, QUIET, OPEN, LATE, RESUME, HOLD, STEPPED = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9
LATE_LIMIT = 3
"""Every LATE_LIMIT-th drain with a late host copy holds the prefetch rounds back (HOLD_FORWARDS). Run 38: in a
process where the copies stopped landing beside the kernels (after a torch.profiler session) every forward's drain
waited its second, 1.75 s a token; one late copy alone (the copier thread descheduled for a second) does not hold
prefetch back. The count is over the engine's life, not a rate: three such hiccups far apart hold it back too (none
was counted in any vLLM bench row, runs 16-40)."""
HOLD_FORWARDS = 4096
"""Forwards the first hold-back lasts; each later one lasts twice the one before (MAX_DOUBLINGS at most), and none
ends while a late copy is still under way (so run 38's copies that never land hold prefetch back for good). 4096
forwards are 20-30 s of one sequence's decode at 5-7 ms a token (runs 38-39): they outlast a passing stall (seconds),
and where the stall persists each retry costs its LATE_LIMIT late drains, about a second each (run 39), against a
hold that doubles: about 10% of the first half minute, 5% of the next minute, and so on."""
MAX_DOUBLINGS = 20
"""A hold-back's length stops doubling here (HOLD_FORWARDS << 20 forwards: months of decode, far inside int64)."""
SEEN = ("timeouts", "cancels", "late", "forward", "resume")
"""The words each joinless forward's end also copies to host memory (PrefetchChain.seen), in this order: TIMEOUTS,
CANCELS, LATE, FORWARD and RESUME, for a thread that must read them without a CUDA call (one beside vLLM's captures
could break them)."""
GPU_MAX_SPINS = 1 << 22  # polls ~0.25 us apart: about a second before a wait gives up
NO_CHAIN, PUBLISH, COUNT_AND_PUBLISH = 0, 1, 2
"""What a fused step does with its ChainSignal (step_kernel's CHAIN): nothing, publish, or count a forward first."""


@dataclass(frozen=True)
class ChainSignal:
    """What one layer's fused step publishes: its MoE index's STEPPED word in `flags`, once done."""

    flags: torch.Tensor
    """int64 [STEPPED + layers] on the step's device (PrefetchChain.flags)."""
    layer: int
    """The MoE index l: the step publishes flags[STEPPED + l]."""
    first: bool
    """The forward's first chained layer: its step also counts the forward (flags[FORWARD] + 1)."""
    joinless: bool = False
    """Nothing joins the round into this layer before its step: the step settles it on the device
    (core.round_sync). Never for the first layer, which no round of the forward precedes."""

    @property
    def mode(self) -> int:
        return COUNT_AND_PUBLISH if self.first else PUBLISH


class PrefetchChain:
    """The device flags of one process's chained prefetch rounds (one per device; any number of layers)."""

    def __init__(self, layers: int, device: torch.device | str, hold_forwards: int = HOLD_FORWARDS) -> None:
        if hold_forwards < 1:
            raise ValueError(f"a hold-back lasts at least one forward, not {hold_forwards}")
        self.flags = torch.zeros(STEPPED + layers, dtype=torch.int64, device=device)
        self.flags[HOLD] = hold_forwards
        self.seen = torch.zeros(len(SEEN), dtype=torch.int64, pin_memory=torch.device(device).type == "cuda")
        """SEEN's words as the last joinless forward's end left them, in host memory (pinned on a GPU, where the end
        kernel writes it as the rounds write their mailboxes)."""

    @property
    def layers(self) -> int:
        return self.flags.numel() - STEPPED

    def signal(self, layer: int, first: bool, joinless: bool = False) -> ChainSignal:
        return ChainSignal(self.flags, self._checked(layer), first, joinless and not first)

    def wait_stepped(self, layer: int, max_spins: int | None = None) -> None:
        """Enqueue, on the current stream, one program that waits until layer `layer`'s step of the forward
        under way is done (capturable; gives up after max_spins polls, default GPU_MAX_SPINS, counting a timeout)."""
        self._checked(layer)
        on_gpu = self.flags.is_cuda
        spins = (GPU_MAX_SPINS if on_gpu else 1) if max_spins is None else max_spins
        # Triton's default four warps: with one warp the chained engine ran 0.50 ms a token slower than forks, with
        # four 0.10 (run 16 in docs/benchmarks.md, calls b and a; two machines)
        kernel_for(_wait_kernel, self.flags.device)[(1,)](self.flags, layer, spins, ON_GPU=on_gpu)

    def end_forward(self) -> None:
        """Enqueue, on the current stream at a joinless forward's end (its side streams joined, its drain enqueued),
        the next forward's QUIET word: quiet when no gate was open and no published copy is still under way; and SEEN's
        words into `seen`."""
        kernel_for(_end_kernel, self.flags.device)[(1,)](self.flags, self.seen)

    def seen_counts(self) -> dict[str, int]:
        """SEEN's words as the last joinless forward's end left them (host memory: no CUDA call, no sync; 0 each before
        the first)."""
        return dict(zip(SEEN, self.seen.tolist()))

    def _checked(self, layer: int) -> int:
        if not 0 <= layer < self.layers:
            raise IndexError(f"MoE layer {layer} is outside the chain's {self.layers} layers")
        return layer

    @property
    def forwards(self) -> int:
        """Forwards counted so far (reads the device: one sync)."""
        return int(self.flags[FORWARD])

    @property
    def timeouts(self) -> int:
        """Waits that gave up so far (reads the device: one sync)."""
        return int(self.flags[TIMEOUTS])

    @property
    def quiet(self) -> int:
        """The forward the last end_forward declared quiet, 0 for none (reads the device: one sync)."""
        return int(self.flags[QUIET])

    @property
    def late(self) -> int:
        """Drains that held a slot for a late host copy (reads the device: one sync); each LATE_LIMIT-th held the
        rounds back."""
        return int(self.flags[LATE])

    @property
    def resume(self) -> int:
        """The first forward whose rounds fetch again after the last hold-back, 0 for none (reads the device: one
        sync)."""
        return int(self.flags[RESUME])

    @property
    def cancels(self) -> int:
        """Rounds a joinless forward's steps cancelled so far (reads the device: one sync)."""
        return int(self.flags[CANCELS])

    def stepped(self, layer: int) -> int:
        """The forward whose step of `layer` was last published (reads the device: one sync)."""
        return int(self.flags[STEPPED + layer])


def hold_backs(seen: dict[str, int]) -> int:
    """The hold-backs so far, from `seen` (PrefetchChain.seen_counts): one each LATE_LIMIT late drains."""
    return seen["late"] // LATE_LIMIT


def forwards_held(seen: dict[str, int]) -> int:
    """Forwards after the last seen one whose rounds hold back, 0 when the next one fetches (more if a late copy is
    still under way when they end)."""
    return max(0, seen["resume"] - seen["forward"] - 1)


if triton is not None:
    from bigmoe_pager.core.memory_order import GPU_SCOPE, load_acquire, load_uniform, pause, store_release

    _FORWARD, _TIMEOUTS, _CANCELS, _PUBLISHED, _QUIET, _OPEN, _LATE, _RESUME, _HOLD, _STEPPED = (
        tl.constexpr(v) for v in (FORWARD, TIMEOUTS, CANCELS, PUBLISHED, QUIET, OPEN, LATE, RESUME, HOLD, STEPPED)
    )
    _LATE_LIMIT, _MAX_DOUBLINGS = tl.constexpr(LATE_LIMIT), tl.constexpr(MAX_DOUBLINGS)
    _COUNT_AND_PUBLISH = tl.constexpr(COUNT_AND_PUBLISH)

    @triton.jit
    def publish_step(flags_ptr, layer, MODE: tl.constexpr, ON_GPU: tl.constexpr):
        """Called by the program of a fused step that finishes it (every copy done): count the forward if the
        step is the forward's first chained one, then publish its number as layer `layer`'s STEPPED word."""
        forward = tl.load(flags_ptr + _FORWARD)
        if MODE == _COUNT_AND_PUBLISH:
            forward += 1
            tl.store(flags_ptr + _FORWARD, forward)
        store_release(flags_ptr + _STEPPED + layer, forward, GPU_SCOPE, ON_GPU)

    @triton.jit
    def quiet_forward(flags_ptr, forward):
        """Whether `forward` is quiet (a plain load: QUIET does not change during a forward)."""
        return tl.load(flags_ptr + _QUIET) == forward

    @triton.jit
    def holding_back(flags_ptr, forward):
        """Whether `forward`'s rounds hold back after late host copies (a plain load: only drains, between forwards,
        write RESUME)."""
        return forward < tl.load(flags_ptr + _RESUME)

    @triton.jit
    def count_late_drain(flags_ptr):
        """A drain (one program) found a host copy late: count it in LATE; every LATE_LIMIT-th holds back the rounds
        of the forwards after this one, HOLD's forwards doubled once for each hold-back before."""
        late = tl.load(flags_ptr + _LATE) + 1
        tl.store(flags_ptr + _LATE, late)
        if late % _LATE_LIMIT == 0:
            doublings = tl.minimum(late // _LATE_LIMIT - 1, _MAX_DOUBLINGS)
            forwards = tl.load(flags_ptr + _HOLD) << doublings
            tl.store(flags_ptr + _RESUME, tl.load(flags_ptr + _FORWARD) + 1 + forwards)

    @triton.jit
    def hold_while_late(flags_ptr):
        """A drain (one program) left a late copy under way: a hold-back in force now stays in force for the next
        forward too (copies that never land hold prefetch back for good)."""
        forward = tl.load(flags_ptr + _FORWARD)
        resume = tl.load(flags_ptr + _RESUME)
        if forward < resume:
            tl.store(flags_ptr + _RESUME, tl.maximum(resume, forward + 2))

    @triton.jit
    def count_open_gate(flags_ptr, gate_open):
        """A round's gate is open after judging: the forward is not followed by a quiet one."""
        if gate_open:
            tl.atomic_add(flags_ptr + _OPEN, 1)

    @triton.jit
    def _end_kernel(flags_ptr, seen_ptr):
        forward = tl.load(flags_ptr + _FORWARD)
        calm = (tl.load(flags_ptr + _OPEN, volatile=True) == 0) & (tl.load(flags_ptr + _PUBLISHED, volatile=True) == 0)
        tl.store(flags_ptr + _QUIET, tl.where(calm, forward + 1, 0))
        tl.store(flags_ptr + _OPEN, 0)
        tl.store(seen_ptr, tl.load(flags_ptr + _TIMEOUTS, volatile=True))  # SEEN's order
        tl.store(seen_ptr + 1, tl.load(flags_ptr + _CANCELS, volatile=True))
        tl.store(seen_ptr + 2, tl.load(flags_ptr + _LATE, volatile=True))
        tl.store(seen_ptr + 3, forward)
        tl.store(seen_ptr + 4, tl.load(flags_ptr + _RESUME, volatile=True))

    @triton.jit
    def _wait_kernel(flags_ptr, layer, max_spins, ON_GPU: tl.constexpr):
        forward = tl.load(flags_ptr + _FORWARD)  # counted by the first step, which the side stream was forked after
        wait_for_step(flags_ptr, forward, layer, max_spins, ON_GPU)

    @triton.jit
    def wait_for_step(flags_ptr, forward, layer, max_spins, ON_GPU: tl.constexpr):
        """Poll until layer `layer`'s step of `forward` is published; after max_spins polls count a timeout."""
        seen = load_acquire(flags_ptr + _STEPPED + layer, GPU_SCOPE, ON_GPU)
        spins = 0
        while (seen != forward) & (spins < max_spins):
            pause(ON_GPU)
            seen = load_acquire(flags_ptr + _STEPPED + layer, GPU_SCOPE, ON_GPU)
            spins += 1
        if load_uniform(flags_ptr + _STEPPED + layer) != forward:  # (one answer for every thread: core.memory_order)
            tl.atomic_add(flags_ptr + _TIMEOUTS, 1)
