"""A prefetch round and the next layer's step, ordered on the device instead of by a graph join.

A round (layer l's proposal for layer l+1: the admit decision, then the copy, on the side stream)
and layer l+1's step both change layer l+1's slot table. With a graph join before each step the
step always comes second, and it waits for the whole round, wrong copies included; each join costs
about 9 us on vLLM's main path (runs 15-16 in docs/benchmarks.md: 0.37 ms a token at 40 layers).
In a joinless chained forward (BIGMOE_PREFETCH_JOINLESS) nothing joins the side stream until the
forward's end, and the two meet through words in device memory instead:

    claim          one word per table: forward * 4 + CLAIMED | DECIDED | CANCELLED
    copied[slot]   copy blocks finished into the slot, ever (the copy adds each program's share)
    target[slot]   what copied[slot] will be once the latest round's copy into it is done
    filled[slot]   the forward whose round last filled the slot, or HELD: a host copy into it outlived a drain

- The round's admit claims the table for this forward (atomic max) before it reads it. If the step
  came first and cancelled the round, the round changes and copies nothing. Otherwise it decides as
  always, sets target = max(copied, target) + blocks for each slot it fills (past an earlier copy into the slot
  that may still be under way: the host's), and releases DECIDED.
- The step, before it reads the table, settles the round: an unclaimed round is cancelled
  (compare-and-swap), a claimed one is waited for until DECIDED (a one-CTA decision that is already
  running: microseconds). So the two never interleave, and the step decides from either the table
  the round left or the one no round touched: both are states the joined path can reach.
- The step never evicts a slot this forward's round filled (every program of the step reads the
  same `filled` words, where a copy's progress can change between two programs' reads and split
  their decisions), unless too few other slots are left: then it waits until those copies are
  done. Before vLLM's MoE kernel may read a slot it needs, it waits until that slot's copy is
  done: a late copy is waited for, never skipped, and a wrong one is no longer waited for at all.
- No wait is unbounded. If a needed slot's copy has not finished after about a second (a side stream
  that cannot run beside the step, e.g. one hardware queue), the step copies that expert into the
  slot itself: the round writes the same bytes into the same slot, so the race is harmless. It is
  counted (the chain's TIMEOUTS word), as is a claimed round that never decided (then the step
  proceeds: that round's kernel would have to be stuck, which no test has seen).
- A host copy can outlive its forward (core.host_rounds: the drain gives up after about a second; run 38
  saw two copies that had not landed a minute later, in a process where torch.profiler had run). Its slot
  is then HELD (the drain writes it into `filled`, between forwards, so every program of a step reads
  one value): no round or step gives it to another expert, since the late bytes would land over that
  expert's; a step that hits it copies the expert itself at once instead of waiting again (the same
  bytes as the late copy); and the first drain that finds the copy landed releases it. Without this a
  late copy cost a second in every later forward that hit the slot, for the engine's life.

Measured inside vLLM 0.33 (run 17 in docs/benchmarks.md), a joinless forward decides, copies and produces tokens
as a joined one, and is 0.09 ms a token slower: with no graph edge a layer the idle path still costs 0.43 ms, so
the cost of a prefetch path in vLLM's graph follows the side branch's nodes, not its edges. What is built here (per
slot copy progress, no slot under copy taken, only needed copies waited for) is what a path with one side node a
forward needs: decisions made in the steps, one copier kernel a forward.

The forward's number is the chain's FORWARD word (core.prefetch_chain), which the forward's first
step counts before any round or later step reads it.

"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

CLAIMED, DECIDED, CANCELLED = 1, 2, 3
"""A claim word's state in its low two bits (forward * 4 + state)."""

HELD = -1
"""A `filled` word's value while a host copy into the slot is late (forwards count from 1; 0 is no forward)."""


if triton is not None:
    from bigmoe_pager.core.memory_order import GPU_SCOPE, load_acquire, load_uniform, pause, store_release

    _CLAIMED, _DECIDED, _CANCELLED, _HELD = (tl.constexpr(v) for v in (CLAIMED, DECIDED, CANCELLED, HELD))

    @triton.jit
    def claim_round(claim_ptr, forward):
        """The round's side: True when it holds the table for `forward` (False: the step cancelled it first)."""
        before = tl.atomic_max(claim_ptr, forward * 4 + _CLAIMED, sem="acq_rel")
        return before < forward * 4

    @triton.jit
    def release_round(claim_ptr, forward, ON_GPU: tl.constexpr):
        """The round's decision is written (the caller has fenced its stores with a barrier): the step may read."""
        store_release(claim_ptr, forward * 4 + _DECIDED, GPU_SCOPE, ON_GPU)

    @triton.jit
    def settle_round(claim_ptr, forward, max_spins, ON_GPU: tl.constexpr):
        """The step's side, before it reads the table: cancel an unclaimed round or wait for a claimed one's
        decision. Returns (cancelled by this program, gave up waiting), alike in every thread of the program: the
        cancelling is branched on atomics only, the wait polls without a barrier and is judged by one more atomic
        read (core.memory_order says why)."""
        mine = forward * 4
        seen = load_uniform(claim_ptr)
        cancelled = seen < 0  # False, as a tensor: the loop carries it
        while seen < mine:  # unclaimed for this forward: cancel it (a failed swap returns a later word: it ends)
            found = tl.atomic_cas(claim_ptr, seen, mine + _CANCELLED, sem="acq_rel")
            cancelled = found == seen
            seen = tl.where(cancelled, mine + _CANCELLED, found)
        if seen < mine + _DECIDED:  # claimed: its one program is deciding (microseconds)
            polled = seen
            spins = 0
            while (polled < mine + _DECIDED) & (spins < max_spins):
                pause(ON_GPU)
                spins += 1
                polled = load_acquire(claim_ptr, GPU_SCOPE, ON_GPU)
            seen = load_uniform(claim_ptr)
        return cancelled, seen < mine + _DECIDED

    @triton.jit
    def round_filled(filled_ptr, forward, slots, mask):
        """Which of `slots` (where mask) this forward's round filled (read afresh: the round's kernel wrote them)."""
        safe = tl.where(mask, slots, 0)
        return mask & (tl.load(filled_ptr + safe, volatile=True) == forward)

    @triton.jit
    def held_slots(filled_ptr, slots, mask):
        """Which of `slots` (where mask) the drain holds for a late host copy (stable for a whole forward: only a
        drain, between forwards, writes HELD or releases it)."""
        safe = tl.where(mask, slots, 0)
        return mask & (tl.load(filled_ptr + safe, mask=mask, other=0, volatile=True) == _HELD)

    @triton.jit
    def copies_under_way(copied_ptr, target_ptr, slots, mask, ON_GPU: tl.constexpr):
        """Which of `slots` (where mask) a round is still copying into (read afresh: another kernel writes them)."""
        safe = tl.where(mask, slots, 0)
        goal = tl.load(target_ptr + safe, volatile=True)
        done = load_acquire(copied_ptr + safe, GPU_SCOPE, ON_GPU)
        return mask & (done < goal)

    @triton.jit
    def wait_copies(copied_ptr, target_ptr, slots, mask, max_spins, ON_GPU: tl.constexpr):
        """Wait until no slot of `slots` (where mask) is being copied into; returns those still under way when
        it gave up (after max_spins polls)."""
        busy = copies_under_way(copied_ptr, target_ptr, slots, mask, ON_GPU)
        return wait_busy(copied_ptr, target_ptr, slots, busy, max_spins, ON_GPU)

    @triton.jit
    def wait_busy(copied_ptr, target_ptr, slots, busy, max_spins, ON_GPU: tl.constexpr):
        """wait_copies from a `busy` mask the caller has just read with copies_under_way (it counts them first)."""
        spins = 0
        while (tl.sum(busy.to(tl.int32), 0) > 0) & (spins < max_spins):
            pause(ON_GPU)
            spins += 1
            busy = copies_under_way(copied_ptr, target_ptr, slots, busy, ON_GPU)
        return busy

    @triton.jit
    def count_copied(copied_ptr, slot, blocks):
        """A copy program's share of a slot is written (the caller has fenced its stores with a barrier)."""
        tl.atomic_add(copied_ptr + slot, blocks, sem="release")
