"""A joinless forward's prefetch rounds as one kernel: one node on the side branch a forward, not three a layer.

Inside vLLM's CUDA graphs each side-branch node a layer costs about 10 us of the main path whatever
its edges (runs 15-17 in docs/benchmarks.md: an idle prefetch path of three nodes a layer, 0.43 ms a
token at 40 layers; one node a forward, 0.03 ms). So here the rounds of layers first .. last of one
forward (BIGMOE_PREFETCH_ONE_NODE, replayed proposals, full RAM tiers) are one launch of P programs,
forked after the forward's first step and joined once at its end. For each layer l in turn:

1. program 0 waits for layer l-1's step (core.prefetch_chain's STEPPED word: its replay cursor has moved
   and its own copies are done; with a distance D, layer l-D's, or the step the launch follows), writes that step's
   rows' replayed proposal for layer l into the layer's
   scratch, and decides the round exactly as a joinless admit does (admit_kernel.decide_round with
   core.round_sync's claim: a step that came first has cancelled it, and then nothing is copied);
2. every program waits until the round is decided or cancelled (the claim word, acquire loads), reads
   the decided lists and copies its share of their blocks (copy_kernel.copy_listed_share), then counts
   that share per slot (round_sync.count_copied), which is what layer l's step waits on for the slots it hits.

Layer l's step settles the round and waits for its copies on the device, as in any joinless forward
(step_kernel's SYNC). Every wait is bounded (max_spins polls, about a second on a GPU): a program that
gives up on a decision copies nothing for that layer, and the step makes any copy it needs itself.

The layers' tensors are reached through a table of addresses (int64 [layers, FIELDS]) that the kernel
casts back to pointers; every layer must share the table shape, layout and policy (`shared_shape`).

Measured inside vLLM 0.33 (run 18 in docs/benchmarks.md): it decides and copies what the per-layer
rounds do, with the same tokens, but costs 0.59 ms a token at recall 0 where a fork a round costs 0.43:
sixteen programs held beside vLLM's kernels for the whole forward (one polling program alone cost 0.05 ms,
sixteen 0.20). So it is off (BIGMOE_PREFETCH_ONE_NODE), with its program count a setting to measure.

With mailboxes (BIGMOE_PREFETCH_HOST_COPIER) the kernel has one program and copies nothing: after each decision it
publishes the decided list to the layer's mailbox in pinned memory (`publish_round`), and core.host_copier's thread
copies it with the copy engines and moves `copied` as the kernel's programs would (core.host_rounds). Inside vLLM
0.33 (run 19) that was level with a fork a round at recall 0 and 0.07-0.21 ms a token faster at recall 0.8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from bigmoe_pager.core.acquire_kernel import IDS_BLOCK, NEEDED_KEY, PACKED_MAX, next_pow2
from bigmoe_pager.core.copy_kernel import BLOCK_BYTES, component_groups, copy_plan, record_blocks, record_words
from bigmoe_pager.core.host_copier import mailbox_words
from bigmoe_pager.core.prefetch_chain import GPU_MAX_SPINS
from bigmoe_pager.core.step_kernel import MAX_IDS
from bigmoe_pager.core.triton_launch import kernel_for

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

FIELDS = (
    "scratch",  # int64 [tokens * P]: the replayed proposal, written by program 0
    "expert_slot",
    "slot_expert",
    "last_use",
    "step",
    "freq",
    "prefetched",
    "would_fetch",  # int32
    "prefetch_step",
    "want",  # int32
    "used_score",
    "wasted_score",
    "gate_closed",
    "out_exp",
    "out_slot",
    "out_evicted",
    "stats",
    "claim",
    "copied",
    "target",
    "filled",
    "records",  # the copy's words
    "out0",
    "out1",
    "out2",
    "out3",
)
"""The columns of the address table, in the kernel's order; int64 tensors unless marked."""
_INT32 = {"would_fetch", "want"}
_WORDS = {"records", "out0", "out1", "out2", "out3"}


class ForwardRoundsError(ValueError):
    """The layers cannot share one kernel (the caller runs per-layer rounds instead); the message says why."""


@dataclass(frozen=True)
class Shape:
    """What every layer of a one-node forward shares: the kernel's compile-time shape and policy."""

    experts: int
    slots: int
    layout_key: tuple
    lfu: bool
    min_used_percent: int
    budget: int
    lift_percent: int | None


class ForwardRounds:
    """The address table of one forward's rounds into layers first .. last (their ExpertPagers, in order).

    pagers[i] is layer first + i's ExpertPager over a full RAM tier; predicted: the replayed trace's
    proposals, int32 [trace tokens, trace layers, P] on the device; cursor: the replay cursors, int64
    [MoE layers] (layer l's moves past the rows its step replays). Built outside any CUDA graph capture (the
    table is copied from the host once); `launch` takes any decode step's rows (at most MAX_IDS)."""

    def __init__(
        self,
        pagers: list,
        first: int,
        predicted: torch.Tensor,
        cursor: torch.Tensor,
        programs: int,
        mailboxes: torch.Tensor | None = None,
        after: int | None = None,
        distance: int = 1,
    ) -> None:
        """mailboxes: BIGMOE_PREFETCH_HOST_COPIER, int64 [layers, host_copier.mailbox_words(slots)] in pinned memory
        (one program; see `publish_round`): each decided list is published there for core.host_copier instead of
        copied by the kernel. after: the MoE index of the step the launch follows (default first - 1); distance:
        BIGMOE_PREFETCH_DISTANCE, layer l's round waits for the step of layer max(l - distance, after) and proposes
        from its rows."""
        if not pagers:
            raise ForwardRoundsError("a one-node forward needs at least one round")
        if programs < 1:
            raise ForwardRoundsError(f"a one-node forward needs >= 1 program, got {programs}")
        self.first, self.last = first, first + len(pagers) - 1
        self.after = first - 1 if after is None else after
        self.distance = max(1, distance)
        if not self.after < first:
            raise ForwardRoundsError(f"a launch after layer {self.after}'s step cannot decide layer {first}'s round")
        self.shape = shared_shape(pagers)
        self.predicted, self.cursor, self.programs = predicted, cursor, programs
        self.mailboxes = mailboxes
        if mailboxes is not None and (
            programs != 1 or tuple(mailboxes.shape) != (len(pagers), mailbox_words(self.shape.slots))
        ):
            raise ForwardRoundsError(
                f"published rounds take one program and int64 [{len(pagers)}, {mailbox_words(self.shape.slots)}] "
                f"mailboxes, got {programs} and {tuple(mailboxes.shape)}"
            )
        lead = pagers[0]
        self.layout = lead.layout
        self.plan = copy_plan(lead.layout)
        self.block = max(1, BLOCK_BYTES // self.plan.word_bytes)
        self.record_blocks = record_blocks(lead.layout)
        self.max_pred = MAX_IDS * predicted.shape[2]  # a fused step's rows (<= MAX_IDS) times the proposal's width
        self.miss_capacity = lead.vram.miss_capacity
        device = predicted.device
        self._keep: list[torch.Tensor] = []  # every tensor the table points into stays alive with it
        self.lists: list[dict[str, torch.Tensor]] = []
        """Per round: its decided lists (exp, slot, evicted: int64 [slots], -1 padded; the first m are the admit
        kernel's outputs)."""
        self.progress: list[tuple[torch.Tensor, torch.Tensor]] = []
        """Per round: its table's (copied, target) words (core.round_sync): a slot's copy is done once copied >=
        target."""
        rows = [self._row(p, device) for p in pagers]
        self.table = torch.tensor(rows, dtype=torch.int64, device=device)
        (self.group,) = component_groups(lead.layout, lead.buffers, self.block)

    def _row(self, pager, device) -> list[int]:
        state = pager.vram.admit_state()
        plan = self.plan
        (group,) = component_groups(pager.layout, pager.buffers, self.block)
        scratch = torch.full((self.max_pred,), -1, dtype=torch.int64, device=device)
        slots = self.shape.slots
        lists = {n: torch.full((slots,), -1, dtype=torch.int64, device=device) for n in ("exp", "slot", "evicted")}
        self.lists.append(lists)
        self.progress.append((state["copied"], state["target"]))
        tensors = {
            "scratch": scratch,
            **{k: state[k] for k in FIELDS if k in state},
            "out_exp": lists["exp"],
            "out_slot": lists["slot"],
            "out_evicted": lists["evicted"],
            "stats": pager.stats_row("vram"),
            "records": record_words(pager.ram.records, plan),
            **dict(zip(("out0", "out1", "out2", "out3"), group.outs)),
        }
        for name in FIELDS:
            t = tensors[name]
            want = plan.word if name in _WORDS else torch.int32 if name in _INT32 else torch.int64
            if t.dtype != want:
                raise ForwardRoundsError(f"{name} of layer {pager.layer} is {t.dtype}, the kernel reads {want}")
        self._keep += list(tensors.values())
        return [tensors[name].data_ptr() for name in FIELDS]

    def launch(self, flags: torch.Tensor, tokens: int, max_spins: int | None = None) -> None:
        """Enqueue the forward's rounds on the current stream (the side stream, forked after the first step), for
        steps of `tokens` rows each (capturable: no host copy)."""
        n_pred = tokens * self.predicted.shape[2]
        if not 1 <= n_pred <= self.max_pred:
            raise ForwardRoundsError(
                f"a step of {tokens} rows proposes {n_pred} ids, the kernel takes 1..{self.max_pred}"
            )
        on_gpu = flags.is_cuda
        if max_spins is None:
            max_spins = GPU_MAX_SPINS if on_gpu else 1
        s, g = self.shape, self.group
        length, layers, width = self.predicted.shape
        kernel_for(_forward_rounds_kernel, flags.device)[(self.programs,)](
            self.table,
            flags,
            self.predicted,
            self.cursor,
            self.first,
            self.last,
            self.after,
            self.distance,
            tokens,
            length,
            layers,
            self.predicted.stride(0),
            self.predicted.stride(1),
            n_pred,
            self.miss_capacity(n_pred),
            s.min_used_percent,
            -1 if s.lift_percent is None else s.lift_percent,
            self.layout.record_bytes,
            self.record_blocks,
            self.plan.pitch_words,
            max_spins,
            self.programs,
            self.table if self.mailboxes is None else self.mailboxes,  # (a pointer never read without HOST)
            FIELDS=len(FIELDS),
            WORD=_tl_word(self.plan.word),
            P=width,
            E=s.experts,
            S=s.slots,
            NEEDED=NEEDED_KEY,
            PACKED_MAX=PACKED_MAX,
            BLOCK_E=next_pow2(s.experts),
            BLOCK_S=next_pow2(s.slots),
            BLOCK_N=IDS_BLOCK,
            BLOCK_P=next_pow2(max(2, n_pred)),
            LFU=s.lfu,
            BUDGET=s.budget,
            ON_GPU=on_gpu,
            OFF0=g.offsets[0],
            OFF1=g.offsets[1],
            OFF2=g.offsets[2],
            OFF3=g.offsets[3],
            N0=g.sizes[0],
            N1=g.sizes[1],
            N2=g.sizes[2],
            N3=g.sizes[3],
            NB0=g.nblocks[0],
            NB1=g.nblocks[1],
            NB2=g.nblocks[2],
            NB3=g.nblocks[3],
            NBLK=sum(g.nblocks),
            BLOCK=self.block,
            HOST=self.mailboxes is not None,
            BOX=mailbox_words(s.slots),
            num_warps=4,
        )


def shared_shape(pagers: list) -> Shape:
    """The Shape every pager shares; ForwardRoundsError naming the first layer that differs, or that cannot take
    part (a partial RAM tier: its rounds read source rows, which the one-node kernel does not)."""
    shapes = []
    for pager in pagers:
        if not pager.ram.full:
            raise ForwardRoundsError(f"layer {pager.layer}'s RAM tier is partial: its rounds stay per layer")
        table = pager.vram
        shapes.append(
            Shape(
                pager.num_experts,
                pager.num_slots,
                _layout_key(pager.layout),
                table.lfu,
                table.min_used_percent,
                table.prefetch_budget,
                table.lift_percent,
            )
        )
    for pager, shape in zip(pagers, shapes):
        if shape != shapes[0]:
            raise ForwardRoundsError(
                f"layer {pager.layer} differs from layer {pagers[0].layer} ({shape} != {shapes[0]})"
            )
    return shapes[0]


def _layout_key(layout) -> tuple:
    return (layout.pitch, layout.record_bytes, tuple((c.name, c.offset, c.nbytes) for c in layout.components))


def _tl_word(word: torch.dtype):
    return {torch.int64: tl.int64, torch.int32: tl.int32, torch.int16: tl.int16, torch.uint8: tl.uint8}[word]


if triton is not None:
    from bigmoe_pager.core.admit_kernel import decide_round
    from bigmoe_pager.core.copy_kernel import copy_listed_share
    from bigmoe_pager.core.host_rounds import publish_round
    from bigmoe_pager.core.memory_order import GPU_SCOPE, load_acquire, load_uniform, pause
    from bigmoe_pager.core.prefetch_chain import FORWARD, TIMEOUTS, wait_for_step
    from bigmoe_pager.core.round_sync import DECIDED, count_copied

    _FORWARD, _TIMEOUTS, _DECIDED = (tl.constexpr(v) for v in (FORWARD, TIMEOUTS, DECIDED))

    # The address table's columns by name, as constexpr globals (all a kernel may read); FIELDS fixes their order.
    _SCRATCH = tl.constexpr(FIELDS.index("scratch"))
    _EXPERT_SLOT = tl.constexpr(FIELDS.index("expert_slot"))
    _SLOT_EXPERT = tl.constexpr(FIELDS.index("slot_expert"))
    _LAST_USE = tl.constexpr(FIELDS.index("last_use"))
    _STEP = tl.constexpr(FIELDS.index("step"))
    _FREQ = tl.constexpr(FIELDS.index("freq"))
    _PREFETCHED = tl.constexpr(FIELDS.index("prefetched"))
    _WOULD_FETCH = tl.constexpr(FIELDS.index("would_fetch"))
    _PREFETCH_STEP = tl.constexpr(FIELDS.index("prefetch_step"))
    _WANT = tl.constexpr(FIELDS.index("want"))
    _USED_SCORE = tl.constexpr(FIELDS.index("used_score"))
    _WASTED_SCORE = tl.constexpr(FIELDS.index("wasted_score"))
    _GATE_CLOSED = tl.constexpr(FIELDS.index("gate_closed"))
    _OUT_EXP = tl.constexpr(FIELDS.index("out_exp"))
    _OUT_SLOT = tl.constexpr(FIELDS.index("out_slot"))
    _OUT_EVICTED = tl.constexpr(FIELDS.index("out_evicted"))
    _STATS = tl.constexpr(FIELDS.index("stats"))
    _CLAIM = tl.constexpr(FIELDS.index("claim"))
    _COPIED = tl.constexpr(FIELDS.index("copied"))
    _TARGET = tl.constexpr(FIELDS.index("target"))
    _FILLED = tl.constexpr(FIELDS.index("filled"))
    _RECORDS = tl.constexpr(FIELDS.index("records"))
    _OUT0 = tl.constexpr(FIELDS.index("out0"))
    _OUT1 = tl.constexpr(FIELDS.index("out1"))
    _OUT2 = tl.constexpr(FIELDS.index("out2"))
    _OUT3 = tl.constexpr(FIELDS.index("out3"))

    @triton.jit
    def _field(row_ptr, index: tl.constexpr, DTYPE: tl.constexpr):
        return tl.load(row_ptr + index).to(tl.pointer_type(DTYPE))

    @triton.jit
    def round_of_layer(
        row,
        box_ptr,
        flags_ptr,
        forward,
        predicted_ptr,
        start,
        column,
        length,
        trace_layers,
        row_stride,
        layer_stride,
        n_pred,
        m,
        min_used_percent,
        lift_percent,
        record_bytes,
        record_blocks,
        P: tl.constexpr,
        E: tl.constexpr,
        S: tl.constexpr,
        NEEDED: tl.constexpr,
        PACKED_MAX: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_P: tl.constexpr,
        LFU: tl.constexpr,
        BUDGET: tl.constexpr,
        HOST: tl.constexpr,
        ON_GPU: tl.constexpr,
    ):
        """One joinless round, by one program: the replayed proposal of the trace rows start .. start + tokens - 1
        (column `column`: the proposals made at that MoE index for the next) into the row's scratch, the decision
        with round_sync's claim for `forward` (admit_kernel.decide_round), and with HOST the decided list published
        to the layer's mailbox `box_ptr` for the host copier. row: the layer's address-table row (FIELDS)."""
        scratch = _field(row, _SCRATCH, tl.int64)
        q = tl.arange(0, BLOCK_P)
        trace_row = (start + q // P) % length
        trace_row = tl.where(trace_row < 0, trace_row + length, trace_row)
        at = trace_row * row_stride + (column % trace_layers) * layer_stride + q % P
        ids = tl.load(predicted_ptr + at, mask=q < n_pred, other=-1)
        tl.store(scratch + q, ids.to(tl.int64), mask=q < n_pred)
        tl.debug_barrier()
        claim_ptr = _field(row, _CLAIM, tl.int64)
        decide_round(
            scratch,
            n_pred,
            _field(row, _EXPERT_SLOT, tl.int64),
            _field(row, _SLOT_EXPERT, tl.int64),
            _field(row, _LAST_USE, tl.int64),
            _field(row, _STEP, tl.int64),
            _field(row, _FREQ, tl.int64),
            _field(row, _PREFETCHED, tl.int64),
            _field(row, _WOULD_FETCH, tl.int32),
            _field(row, _PREFETCH_STEP, tl.int64),
            _field(row, _WANT, tl.int32),
            _field(row, _USED_SCORE, tl.int64),
            _field(row, _WASTED_SCORE, tl.int64),
            _field(row, _GATE_CLOSED, tl.int64),
            min_used_percent,
            lift_percent,
            scratch,  # no available mask, kept slots or source rows: a full RAM tier (never read)
            scratch,
            scratch,
            scratch,
            _field(row, _OUT_EXP, tl.int64),
            _field(row, _OUT_SLOT, tl.int64),
            _field(row, _OUT_EVICTED, tl.int64),
            _field(row, _OUT_EXP, tl.int64),
            m,
            _field(row, _STATS, tl.int64),
            record_bytes,
            flags_ptr,
            claim_ptr,
            _field(row, _COPIED, tl.int64),
            _field(row, _TARGET, tl.int64),
            _field(row, _FILLED, tl.int64),
            record_blocks,
            E,
            S,
            NEEDED,
            PACKED_MAX,
            BLOCK_E,
            BLOCK_S,
            BLOCK_N,
            False,
            False,
            False,
            True,
            LFU,
            BUDGET,
            True,
            ON_GPU,
        )
        if HOST:
            tl.debug_barrier()
            publish_round(
                box_ptr,
                flags_ptr,
                forward,
                _field(row, _OUT_EXP, tl.int64),
                _field(row, _OUT_SLOT, tl.int64),
                _field(row, _TARGET, tl.int64),
                m,
                S,
                BLOCK_S,
                ON_GPU,
            )

    @triton.jit
    def _forward_rounds_kernel(
        table_ptr,
        flags_ptr,
        predicted_ptr,
        cursor_ptr,
        first,
        last,
        after,
        distance,
        tokens,
        length,
        trace_layers,
        row_stride,
        layer_stride,
        n_pred,
        m,
        min_used_percent,
        lift_percent,
        record_bytes,
        record_blocks,
        pitch_words,
        max_spins,
        programs,
        mailbox_ptr,
        FIELDS: tl.constexpr,
        WORD: tl.constexpr,
        P: tl.constexpr,
        E: tl.constexpr,
        S: tl.constexpr,
        NEEDED: tl.constexpr,
        PACKED_MAX: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_P: tl.constexpr,
        LFU: tl.constexpr,
        BUDGET: tl.constexpr,
        ON_GPU: tl.constexpr,
        OFF0: tl.constexpr,
        OFF1: tl.constexpr,
        OFF2: tl.constexpr,
        OFF3: tl.constexpr,
        N0: tl.constexpr,
        N1: tl.constexpr,
        N2: tl.constexpr,
        N3: tl.constexpr,
        NB0: tl.constexpr,
        NB1: tl.constexpr,
        NB2: tl.constexpr,
        NB3: tl.constexpr,
        NBLK: tl.constexpr,
        BLOCK: tl.constexpr,
        HOST: tl.constexpr,
        BOX: tl.constexpr,
    ):
        pid = tl.program_id(0)
        forward = tl.load(flags_ptr + _FORWARD)  # counted by the first step, which this launch was forked after
        j = tl.arange(0, BLOCK_S)  # list positions (m <= S)
        for layer in range(first, last + 1):
            row = table_ptr + (layer - first) * FIELDS
            claim_ptr = _field(row, _CLAIM, tl.int64)
            if pid == 0:
                # 1. Once the step it proposes from is done (layer - 1's; with a distance, an earlier one's: its
                # cursor has moved past this forward's rows), the rows' proposal for this layer, and the decision;
                # 2'. with HOST, the host copies it.
                source = tl.maximum(layer - distance, after)
                wait_for_step(flags_ptr, forward, source, max_spins, ON_GPU)
                round_of_layer(
                    row,
                    mailbox_ptr + (layer - first) * BOX,
                    flags_ptr,
                    forward,
                    predicted_ptr,
                    tl.load(cursor_ptr + source, volatile=True) - tokens,
                    layer - 1,
                    length,
                    trace_layers,
                    row_stride,
                    layer_stride,
                    n_pred,
                    m,
                    min_used_percent,
                    lift_percent,
                    record_bytes,
                    record_blocks,
                    P,
                    E,
                    S,
                    NEEDED,
                    PACKED_MAX,
                    BLOCK_E,
                    BLOCK_S,
                    BLOCK_N,
                    BLOCK_P,
                    LFU,
                    BUDGET,
                    HOST,
                    ON_GPU,
                )
            if not HOST:  # (a kernel cannot `continue`)
                # 2. Every program: once decided (or cancelled by the step: then nothing), its share of the copy.
                mine = forward * 4
                seen = load_acquire(claim_ptr, GPU_SCOPE, ON_GPU)
                spins = 0
                while (seen < mine + _DECIDED) & (spins < max_spins):
                    pause(ON_GPU)
                    spins += 1
                    seen = load_acquire(claim_ptr, GPU_SCOPE, ON_GPU)
                seen = load_uniform(claim_ptr)  # the threads may part only at the give-up: one answer to branch on
                if seen == mine + _DECIDED:
                    mexp = tl.load(_field(row, _OUT_EXP, tl.int64) + j, mask=j < m, other=-1, volatile=True)
                    cand = tl.load(_field(row, _OUT_SLOT, tl.int64) + j, mask=j < m, other=-1, volatile=True)
                    count = tl.sum((mexp >= 0).to(tl.int32), 0)  # the decided list is a prefix
                    copy_listed_share(
                        pid,
                        programs,
                        count,
                        j,
                        mexp,  # record row = expert id (the RAM tier is full)
                        cand,
                        _field(row, _RECORDS, WORD),
                        pitch_words,
                        _field(row, _OUT0, WORD),
                        _field(row, _OUT1, WORD),
                        _field(row, _OUT2, WORD),
                        _field(row, _OUT3, WORD),
                        OFF0,
                        OFF1,
                        OFF2,
                        OFF3,
                        N0,
                        N1,
                        N2,
                        N3,
                        NB0,
                        NB1,
                        NB2,
                        NB3,
                        NBLK,
                        BLOCK,
                    )
                    tl.debug_barrier()  # this program's stores are made before its counts
                    copied_ptr = _field(row, _COPIED, tl.int64)
                    for i in range(0, count):
                        slot = tl.sum(tl.where(j == i, cand, 0), 0)
                        first_b = ((pid - i * NBLK) % programs + programs) % programs
                        blocks = tl.maximum((NBLK - first_b + programs - 1) // programs, 0)
                        if blocks > 0:
                            count_copied(copied_ptr, slot, blocks)
                elif seen < mine + _DECIDED:  # gave up on a decision that never came: counted (the step copies)
                    tl.atomic_add(flags_ptr + _TIMEOUTS, 1)
