"""BIGMOE_PREDICT=router in a vLLM process: while MoE layer l runs, layer l+1's router proposes l+1's experts.

Where: `PagedRoutedExperts.paged_forward` runs the layer's paging and kernel inside
`Predictor.ahead(layer, x)`, after routing; x is the hidden state layer l's experts receive.
The next layer and its router are found at the layer's first forward (vLLM's profile run,
after loading): the paged layer with MoE index l + 1 (neither layer in the MTP drafter, whose
layer is no decoder layer's successor), and the gate of the MoERunner vLLM registered under
that layer's name in `compilation_config.static_forward_context` (vLLM 0.32 CPU and 0.33:
`MoERunner.gate`, a GateLinear whose weight is [E, H]). Where none is usable: one warning
line, no predictions there.

The proposal goes to the next layer's DeviceLayerPager, prefetched on a side stream
(prediction.LivePredictions) forked once layer l's own paging is issued, so the copies do not
compete with the copies layer l waits for and overlap layer l's kernel. Where it is joined:
- inside a capture that is not the whole forward (vLLM's PIECEWISE pieces; any capture outside a
  vLLM forward): at the end of layer l's call, since no later piece may wait on this one's work;
- otherwise (vLLM's FULL graphs, eager steps): at the start of layer l+1's call, before its own
  paging, so the copies also overlap everything vLLM runs between the two MoE calls (attention).
  vLLM 0.33's default model runner (V2) captures its FULL graphs with the forward context's mode
  at NONE, so "not the whole forward" is read as "mode PIECEWISE", never as "mode not FULL"
  (see `whole_forward_capture`).
With BIGMOE_PREFETCH_CHAIN=1 (off: measured slower, run 16) a forward captured whole forks the side stream once:
its model's first layer opens a chain (core.prefetch_chain) when every layer of the model steps fused, each step
publishes itself (the Turn's `chain`), and each later round waits on the device for the step before it. While the
chain is on, forwards not captured whole (prefill's eager and piecewise ones) propose nothing unless
BIGMOE_PREFETCH_CHAINED_ONLY=0: their side streams slowed every launch of the decode graph (run 27).
With BIGMOE_SSD_READ_AHEAD=1 and BIGMOE_SSD_READ_AHEAD_LAYERS=D > 1, the same fork also posts the SSD
reads of layers l+2 .. l+D's proposed experts (their routers on layer l's hidden state, or a replayed
trace's rows for them). A replayed trace that carries predictions keeps priority. With BIGMOE_TRACE_PATH (eager only)
the proposals are recorded as the trace's predicted_ids, and with BIGMOE_SSD_READ_AHEAD_LAYERS=D > 1 (reads ahead on or
off) those for layers l+2 .. l+D as its predicted_ids_ahead (scripts/score_predictor.py scores each depth).
With BIGMOE_PREFETCH_HOST_COPIER=1 a joinless forward's rounds over full RAM tiers publish their lists to a host
thread that copies them with the copy engines (the process's one, adapters.vllm.host_copies): each layer's round, or
the one-node kernel's one program with BIGMOE_PREFETCH_ONE_NODE=1. With BIGMOE_PREFETCH_DISTANCE=D > 1 a joinless
forward's layer l prefetches into layer l+D (the router of l+D on l's hidden state), so the copies have D layers of
compute to land in; its first layer also fills layers 1 .. D-1. The host-driven pager prefetches
nothing: there the predictor runs only to record. The router keeps the final say: a proposal
moves weights, never a step's ids.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable

import torch
from bigmoe_pager.adapters.vllm.host_copies import HostCopies
from bigmoe_pager.core.device_layer import DeviceLayerPager
from bigmoe_pager.core.expert_names import is_mtp_layer
from bigmoe_pager.core.forward_rounds import ForwardRounds, ForwardRoundsError
from bigmoe_pager.core.host_copier import HostCopier, HostCopierError
from bigmoe_pager.core.pager import PREFETCH_PROGRAMS_PER_RECORD
from bigmoe_pager.core.prediction import LivePredictions, Router, predict_next
from bigmoe_pager.core.prefetch_chain import ChainSignal, PrefetchChain
from bigmoe_pager.settings import PagerSettings

log = logging.getLogger("vllm.bigmoe_pager")  # under vLLM's logger so its handler shows our lines


class Turn:
    """What `Predictor.ahead` hands a layer's call: the chain signal its step publishes (None: none), and the fork,
    called once the layer's own paging is issued (`turn()`)."""

    def __init__(self, fork: Callable[[], None], chain: ChainSignal | None = None):
        self._fork = fork
        self.chain = chain

    def __call__(self) -> None:
        self._fork()


JOINED = "the next layer's prefetch is joined at"
FORKED = "prefetch rounds are forked"


@dataclass(frozen=True)
class NextRouter:
    """What layer l's proposals need: the next paged layer and its router."""

    layer: object
    """The paged layer l + 1 (its `pager` takes the proposals)."""
    router: Router
    """Its router: the gate's weight [E, H] (a float dtype), or the gate's own product where vLLM repacked it."""
    top: int
    """Experts proposed per token."""


def next_router(layer, nxt, hidden: torch.Tensor, top: int) -> NextRouter | str | None:
    """Layer `layer`'s next layer `nxt` (or None) with its router; None where no layer follows in the same model
    (the last decoder layer, the MTP drafter); a one-line reason where one follows but its router is not usable."""
    if nxt is None or is_mtp_layer(layer.layer_name) or is_mtp_layer(nxt.layer_name):
        return None
    runner = nxt._runners.get(nxt.layer_name)
    gate = getattr(runner, "gate", None)
    weight = getattr(gate, "weight", None)
    where = f"MoE layer {nxt._moe_index} ({nxt.layer_name})"
    if not isinstance(weight, torch.Tensor):
        return f"vLLM keeps no router weight for {where} (no MoERunner.gate)"
    top = top or nxt.moe_config.experts_per_token
    if weight.numel() == 0 and callable(getattr(gate, "cpu_linear", None)):
        return _repacked(gate, nxt, hidden, top, where)
    if weight.dim() != 2 or not weight.is_floating_point() or weight.element_size() < 2:
        return f"the router of {where} is {weight.dtype} {tuple(weight.shape)}, not a float [E, H] matrix"
    expected = (nxt._num_experts, hidden.shape[-1])
    if tuple(weight.shape) != expected or weight.device != hidden.device:
        got = f"{tuple(weight.shape)} on {weight.device}"
        return f"the router of {where} is {got}, expected {expected} on {hidden.device}"
    return NextRouter(nxt, weight, top)


def _repacked(gate, nxt, hidden: torch.Tensor, top: int, where: str) -> NextRouter | str:
    """vLLM's CPU build prepacks small GEMMs, routers included, and leaves the gate's `weight` empty (hosts with
    AVX-512 BF16): the gate's own packed product (`cpu_linear`) then gives the router's logits."""
    shape = (getattr(gate, "output_size", None), getattr(gate, "input_size", None))
    expected = (nxt._num_experts, hidden.shape[-1])
    if shape != expected:
        return f"the router of {where} is repacked as {shape}, expected {expected}"
    return NextRouter(nxt, lambda h: gate.cpu_linear(h, gate.weight, getattr(gate, "bias", None)), top)


class Predictor:
    """The process's live next-layer predictor (held by the PagerProcess; off unless BIGMOE_PREDICT=router)."""

    def __init__(
        self,
        settings: PagerSettings,
        routing,
        layer_after: Callable[[int], object],
        on_device: bool,
        whole_forward_captured: Callable[[], bool] | None = None,
        host_copies: HostCopies | None = None,
    ):
        """routing: the process's Routing (trace recording, replayed predictions); layer_after(i): paged layer i+1;
        whole_forward_captured(): whether a capture under way holds the whole forward (default: vLLM's forward
        context, `vllm_whole_forward_capture`); host_copies: the process's host copier (default: one of its own)."""
        self.whole_forward_captured = whole_forward_captured or vllm_whole_forward_capture
        self.on = settings.enabled and settings.predict == "router"  # no pager, no layer to prefetch into
        self.top = settings.predict_top
        self.read_ahead_layers = max(1, settings.ssd_read_ahead_layers) if settings.ssd_read_ahead else 1
        """Layers ahead whose predicted SSD reads each layer posts (BIGMOE_SSD_READ_AHEAD_LAYERS; 1: the next)."""
        self.recorded_layers = max(1, settings.ssd_read_ahead_layers)
        """Layers ahead whose live proposals a recorded trace holds (BIGMOE_TRACE_PATH; BIGMOE_SSD_READ_AHEAD_LAYERS
        whether or not reads ahead are posted, so a trace of a run without an SSD tier scores each depth too)."""
        self.routing = routing
        self.layer_after = layer_after
        priority = LivePredictions.HIGH_PRIORITY if settings.prefetch_high_priority else 0
        self.live = LivePredictions(priority)
        self.one_node = settings.prefetch_one_node
        """BIGMOE_PREFETCH_ONE_NODE: a joinless forward's replayed rounds as one kernel (core.forward_rounds)."""
        self.chained_only = settings.prefetch_chained_only
        """BIGMOE_PREFETCH_CHAINED_ONLY: which forwards that are not chained propose and prefetch (`_rounds_here`)."""
        self.one_node_programs = settings.prefetch_one_node_programs
        """BIGMOE_PREFETCH_ONE_NODE_PROGRAMS: that kernel's programs (0: the pagers' prefetch programs)."""
        self.host = settings.prefetch_host_copier
        """BIGMOE_PREFETCH_HOST_COPIER: a joinless forward's rounds over full RAM tiers are copied by `copier` (each
        layer's round publishes its list, or the one-node kernel's one program does with BIGMOE_PREFETCH_ONE_NODE); a
        failed copier is the export thread's to report (adapters.vllm.device.failed_part)."""
        self.host_copies = host_copies or HostCopies(settings)
        """The process's host copier thread, which the rounds publish to when `host`."""
        self.distance = max(1, settings.prefetch_distance)
        """BIGMOE_PREFETCH_DISTANCE: in a joinless forward, layer l's round prefetches into layer l + distance."""
        joinless = settings.prefetch_joinless or self.one_node or self.host or self.distance > 1
        self.chain_on = settings.prefetch_chain or joinless
        """BIGMOE_PREFETCH_CHAIN: a forward captured whole forks its rounds' side stream once (core.prefetch_chain)."""
        self.joinless = joinless
        """BIGMOE_PREFETCH_JOINLESS: and joins it once, at its end; the steps settle the rounds (core.round_sync)."""
        self._chain: PrefetchChain | None = None  # the flags, made by the first uncaptured forward
        self._told: set[tuple[str, str]] = set()  # (JOINED or FORKED, placement) already logged
        self._next: dict[int, NextRouter | None] = {}  # per MoE index, resolved at the layer's first forward
        self._further: dict[tuple[int, int], NextRouter | None] = {}  # (MoE index, layers ahead) -> that router
        self._rounds: dict[tuple[int, bool, str], ForwardRounds | None] = {}
        """BIGMOE_PREFETCH_ONE_NODE: (MoE index it launches at, one a forward, device) -> its kernel (None: cannot)."""
        self._warned = False
        if self.on and on_device:
            top = self.top or "the model's top-k"
            log.warning("bigmoe: next-layer prefetch on: layer l+1's router proposes %s experts per token", top)
        elif self.on:
            log.warning(
                "bigmoe: BIGMOE_PREDICT=router feeds the device-driven pager (CUDA) only; the host-driven pager "
                "prefetches nothing, so proposals are only computed to be recorded (BIGMOE_TRACE_PATH)"
            )

    @contextlib.contextmanager
    def ahead(self, layer, hidden: torch.Tensor, num_ids: int | None = None):
        """Around layer `layer`'s paging and kernel on `hidden` [tokens, H] (num_ids: the step's ids, when known);
        yields a Turn, which the caller calls once the layer's own paging is issued: the next layer's experts are
        then proposed and prefetched (on a side stream on CUDA). Uncalled, the fork happens after the whole call
        (host-driven pager, big steps). The Turn's `chain` is what the layer's step publishes (a chained forward)."""
        if not self.live.joinless:
            self.live.join(hidden.device)  # the layer before's proposal for this layer lands before this layer pages
        made: list = []

        def fork() -> None:
            if not made:
                made.append(self.propose(layer, hidden))

        try:
            yield Turn(fork, self._chain_signal(layer, hidden, num_ids))
            fork()
        except BaseException:  # nothing forked stays behind a failed call, and no chained forward stays open
            if self.live.chained:
                self.live.close_chain(hidden.device)
            else:
                self.live.join(hidden.device)
            raise
        if self.live.chained and self._last_of_its_model(layer):
            flags, joinless = self.live.chain_flags, self.live.joinless
            self.live.close_chain(hidden.device)
            self.host_copies.drain(hidden.device, flags)  # after the join: every publication is in, PUBLISHED final
            if joinless:  # whether the next forward is quiet (core.prefetch_chain)
                self._chain.end_forward()
        if not self._join_later(hidden):
            self.live.join(hidden.device)  # a no-op when nothing was forked
        ids = made[0]
        if ids is not None and self.routing.trace_path is not None:
            self.routing.record_predictions(layer._moe_index, ids)

    def _chain_signal(self, layer, hidden: torch.Tensor, num_ids: int | None) -> ChainSignal | None:
        """What layer `layer`'s step publishes: a chained forward opens at its model's first layer when the forward
        is captured whole and every layer of the model steps fused (core.prefetch_chain); None otherwise. The flags
        are made at the first forward outside a capture (vLLM's profile run and warm-up come before its captures)."""
        if self.live.chained:
            index = layer._moe_index
            return self._chain.signal(index, first=False, joinless=self.live.joinless)
        if not (self.chain_on and num_ids is not None and self._first_of_its_model(layer)):
            return None
        if not capturing():
            if self._chain is None:  # made outside captures: one made inside would be zeroed by every replay
                self._chain = PrefetchChain(self._layer_count(), hidden.device)
            return None
        if not self.whole_forward_captured():
            return None
        if self._chain is None or self._chain.flags.device != hidden.device:
            self._tell("once a layer (the chain's flags were not made by an uncaptured forward first)", what=FORKED)
            return None
        if not all(self._publishes(each, num_ids) for each in self._layers_of_its_model(layer)):
            self._tell("once a layer (not every layer's step is fused, so the rounds cannot be chained)", what=FORKED)
            return None
        self._tell("once a forward (chained rounds" + (", joined once)" if self.joinless else ")"), what=FORKED)
        self.live.open_chain(self._chain, joinless=self.joinless)
        return self._chain.signal(layer._moe_index, first=True)

    @staticmethod
    def _publishes(layer, num_ids: int) -> bool:
        pager = getattr(layer, "pager", None)
        return isinstance(pager, DeviceLayerPager) and pager.publishes(num_ids)

    def _layers_of_its_model(self, layer) -> list:
        """`layer` and the paged layers of the same model after it."""
        found = [layer]
        while not self._last_of_its_model(found[-1]):
            found.append(self.layer_after(found[-1]._moe_index))
        return found

    def _all_layers(self) -> list:
        """The process's paged layers, MoE index 0 first."""
        return [self.layer_after(i - 1) for i in range(self._layer_count())]

    def _layer_count(self) -> int:
        """Paged layers of the process (MoE indices 0 .. count - 1)."""
        count = 1
        while self.layer_after(count - 1) is not None:
            count += 1
        return count

    def _first_of_its_model(self, layer) -> bool:
        """Whether no paged layer of the same model comes before `layer`."""
        index = layer._moe_index
        before = self.layer_after(index - 2) if index > 0 else None
        return before is None or is_mtp_layer(before.layer_name) != is_mtp_layer(layer.layer_name)

    def _last_of_its_model(self, layer) -> bool:
        """Whether no paged layer of the same model (the decoder, or the MTP drafter) follows `layer`."""
        nxt = self.layer_after(layer._moe_index)
        return nxt is None or is_mtp_layer(nxt.layer_name) != is_mtp_layer(layer.layer_name)

    def _join_later(self, hidden: torch.Tensor) -> bool:
        """Whether the side stream may stay unjoined until the next layer's call (see the module's docstring)."""
        if hidden.device.type != "cuda" or not capturing():
            return True
        later = self.whole_forward_captured()
        self._tell(
            "the next layer's MoE call (a whole-forward capture)"
            if later
            else "the end of this layer's MoE call (a capture of one graph piece)"
        )
        return later

    @property
    def join_placements(self) -> list[str]:
        """Where CUDA graph captures of this process joined the prefetch so far (as logged), sorted."""
        return sorted(where for what, where in self._told if what == JOINED)

    @property
    def fork_placements(self) -> list[str]:
        """How often captures of this process that could chain their rounds forked them (as logged), sorted."""
        return sorted(where for what, where in self._told if what == FORKED)

    @property
    def chain_cancels(self) -> int | None:
        """Rounds a joinless forward's steps cancelled because they came first (None: no forward was chained)."""
        return None if self._chain is None else self._chain.cancels

    @property
    def chain_forwards(self) -> int | None:
        """Chained forwards counted so far (None: none was chained; one sync)."""
        return None if self._chain is None else self._chain.forwards

    @property
    def copier(self) -> HostCopier | None:
        """The process's host copier thread, once started."""
        return self.host_copies.copier

    @property
    def chain_timeouts(self) -> int | None:
        """Chained rounds whose wait for their layer's step gave up (None: no forward was chained; one sync)."""
        return None if self._chain is None else self._chain.timeouts

    @property
    def chain_late(self) -> int | None:
        """Drains that held a slot for a late host copy (None: no forward was chained; one sync); each
        prefetch_chain.LATE_LIMIT-th held the rounds back a while."""
        return None if self._chain is None else self._chain.late

    @property
    def chain_seen(self) -> dict[str, int] | None:
        """Timeouts, cancels and late drains as the last joinless forward's end left them, read from host memory (no
        CUDA call: the export thread's view; None: no forward was chained)."""
        return None if self._chain is None else self._chain.seen_counts()

    def _tell(self, where: str, what: str = JOINED) -> None:
        """One log line per placement a capture used: where the prefetch is forked and waited for decides how much
        it overlaps and what it costs."""
        if (what, where) not in self._told:
            self._told.add((what, where))
            log.warning("bigmoe: in CUDA graph captures, %s %s", what, where)

    def propose(self, layer, hidden: torch.Tensor) -> torch.Tensor | None:
        """The proposal for the next layer [tokens, P], handed to its device-driven pager; None: nothing proposed."""
        if self.routing.replays_predictions(hidden.device):
            return self._replayed(layer, hidden)
        if not self.on or self._target(layer, hidden) is None:
            return None
        self._host_serves_targets(layer, hidden)
        if not self._rounds_here():
            return None
        proposed = None
        for ahead in self._round_distances(layer):
            target = self._router_ahead(layer, hidden, ahead)
            if target is None:
                continue
            pager = target.layer.pager
            prefetch = isinstance(pager, DeviceLayerPager) and pager.started  # started at vLLM's first forward
            if not (prefetch or self.routing.trace_path is not None):
                continue
            ids = self.live.feed(hidden, target.router, target.top, pager if prefetch else None, self._after(layer))
            proposed = ids if ahead == 1 else proposed
        self._read_further(layer, hidden, lambda ahead: self._router_ids(layer, hidden, ahead))
        if self.routing.trace_path is not None:
            self._record_further(layer, hidden)
        return proposed

    def _rounds_here(self) -> bool:
        """Whether this forward proposes and prefetches: a chained one always; one that is not, unless
        BIGMOE_PREFETCH_CHAINED_ONLY says no, or is unset while the chain is on and the forward is not captured whole
        (eager and piecewise ones: their side streams slowed the decode graph's launches, run 27)."""
        if self.live.chained:
            return True
        if self.chained_only is not None:
            return not self.chained_only
        if not self.chain_on:
            return True
        return capturing() and self.whole_forward_captured()

    def _replayed(self, layer, hidden: torch.Tensor) -> None:
        """Benchmark: a replayed trace's predictions for the rows this layer just replayed, prefetched into the
        next layer's started device-driven pager the way a live proposal is (None: they are not recorded)."""
        pager = getattr(self.layer_after(layer._moe_index), "pager", None)
        if not (isinstance(pager, DeviceLayerPager) and pager.started):
            return None
        index, tokens = layer._moe_index, hidden.shape[0]
        if self.one_node and not capturing():
            self._prepare_rounds(layer, hidden)
        if self.one_node and self.live.joinless and self._one_node_rounds(layer, hidden):
            return None
        self._host_serves_targets(layer, hidden)
        if not self._rounds_here():
            return None

        def replayed(ahead: int) -> torch.Tensor | None:
            return self.routing.replayed_proposal(index, tokens, hidden.device, ahead)

        for ahead in self._round_distances(layer):
            target = getattr(self.layer_after(index + ahead - 1), "pager", None)
            if isinstance(target, DeviceLayerPager) and target.started:
                self.live.feed_ids(lambda ahead=ahead: replayed(ahead), target, hidden, self._after(layer))
        self._read_further(layer, hidden, replayed)
        return None

    def _one_node_rounds(self, layer, hidden: torch.Tensor) -> bool:
        """BIGMOE_PREFETCH_ONE_NODE: the rounds of this forward after `layer` as one kernel (core.forward_rounds),
        launched at the model's first layer on CUDA (one side node a forward) and at each layer in Triton's
        interpreter (where a launch runs to its end before the next step could publish). False: these layers' rounds
        stay per layer (they cannot share the kernel, or its tables were not made by an uncaptured forward; logged)."""
        whole = self._one_kernel_a_forward(hidden)
        starts = self._model_first(layer) if whole else layer
        key = (starts._moe_index, whole, str(hidden.device))
        rounds = self._rounds.get(key)
        if rounds is None:
            if starts is layer and key not in self._rounds:  # (a kernel the layers cannot share was logged when made)
                self._tell(
                    "once a layer (the one-node kernel's tables were not made by an uncaptured forward first)",
                    what=FORKED,
                )
            return False
        if starts is layer:
            self.live.fork_rounds(hidden, lambda flags: rounds.launch(flags, hidden.shape[0]), after=layer._moe_index)
        return True

    def _prepare_rounds(self, layer, hidden: torch.Tensor) -> None:
        """In an uncaptured forward (its table is copied from the host, which a capture forbids): make the one-node
        kernel that a captured forward launches at `layer`, once every layer it prefetches into is started."""
        whole = self._one_kernel_a_forward(hidden)
        key = (layer._moe_index, whole, str(hidden.device))
        if key in self._rounds or (whole and not self._first_of_its_model(layer)):
            return
        targets = self._layers_of_its_model(layer)[1:]
        if not whole:  # the rounds this layer's call makes (see _round_distances)
            d = self.distance
            targets = targets[:d] if self._first_of_its_model(layer) else targets[d - 1 : d]
            if not targets:
                self._rounds[key] = None  # none: this layer is within `distance` of its model's last
                return
        replay = self.routing.replayed_tensors(hidden.device)
        pagers = [getattr(t, "pager", None) for t in targets]
        if not targets or replay is None or not all(isinstance(p, DeviceLayerPager) and p.started for p in pagers):
            return  # tried again at the next uncaptured forward
        started = [p.pager_started() for p in pagers]
        programs = self.one_node_programs or started[0].prefetch_programs or PREFETCH_PROGRAMS_PER_RECORD
        mailboxes = None
        if self.host:
            programs = 1
            mailboxes = HostCopier.mailbox(started[0].num_slots, hidden.device, len(started))
        try:
            self._rounds[key] = rounds = ForwardRounds(
                started,
                targets[0]._moe_index,
                *replay,
                programs,
                mailboxes,
                layer._moe_index,
                self.distance,
            )
        except ForwardRoundsError as exc:
            self._rounds[key] = None
            self._tell(f"once a layer, not as one kernel a forward ({exc})", what=FORKED)
            return
        if self.host:
            try:
                self.host_copies.publish_rounds(started, rounds.mailboxes, hidden.device)
            except (HostCopierError, ValueError) as exc:
                self._without_host_copier(exc)

    def _without_host_copier(self, exc: Exception) -> None:
        """The host copier cannot serve these layers (no C compiler, memory it cannot copy from): one line, and every
        round goes back to the GPU's own copies (a joinless forward's, or the one-node kernel's). Happens in an
        uncaptured forward, before any capture could have published a round."""
        log.warning("bigmoe: BIGMOE_PREFETCH_HOST_COPIER: %s; prefetch rounds are copied on the GPU instead", exc)
        self.host = False
        self._rounds = {key: r for key, r in self._rounds.items() if r is None or r.mailboxes is None}
        for layer in self._all_layers():
            pager = getattr(layer, "pager", None)
            if isinstance(pager, DeviceLayerPager) and pager.started:
                pager.pager_started().mailbox = None
        self.host_copies.give_up_prefetch()

    def _host_serves_targets(self, layer, hidden: torch.Tensor) -> None:
        """`_served_by_host` for each started device-driven pager that `layer`'s rounds prefetch into; in every
        uncaptured forward, whether or not it prefetches (BIGMOE_PREFETCH_CHAINED_ONLY), since a capture cannot."""
        for ahead in self._round_distances(layer):
            target = getattr(self.layer_after(layer._moe_index + ahead - 1), "pager", None)
            if isinstance(target, DeviceLayerPager) and target.started:
                self._served_by_host(target, hidden)

    def _served_by_host(self, layer_pager: DeviceLayerPager, hidden: torch.Tensor) -> None:
        """BIGMOE_PREFETCH_HOST_COPIER without the one-node kernel, in an uncaptured forward: from now on the joinless
        rounds into `layer_pager` publish their lists to a mailbox the host copier serves (ExpertPager.mailbox). Over a
        partial RAM tier they keep copying with a kernel: an SSD read may rewrite a RAM row while a DMA reads it."""
        if not self.host or self.one_node or capturing():
            return
        pager = layer_pager.pager_started()
        if pager.mailbox is not None or not pager.ram.full:
            return
        mailbox = HostCopier.mailbox(pager.num_slots, hidden.device)
        try:
            self.host_copies.publish_rounds([pager], [mailbox], hidden.device)
        except (HostCopierError, ValueError) as exc:
            self._without_host_copier(exc)
            return
        pager.mailbox = mailbox

    @staticmethod
    def _one_kernel_a_forward(hidden: torch.Tensor) -> bool:
        """Whether a forward's rounds are launched once (CUDA: the launch waits for each step on the device) rather
        than once a layer (Triton's interpreter: a launch runs to its end before the next step)."""
        return hidden.device.type == "cuda"

    def _model_first(self, layer):
        """The first paged layer of `layer`'s model."""
        while not self._first_of_its_model(layer):
            layer = self.layer_after(layer._moe_index - 2)
        return layer

    def _round_distances(self, layer) -> list[int]:
        """How many layers ahead the rounds forked in `layer`'s call prefetch into: the next one; in a joinless
        forward with BIGMOE_PREFETCH_DISTANCE=D the D-th (from the model's first layer, each of 1 .. D), never past
        the last layer of `layer`'s model."""
        if self.distance == 1 or not self.live.joinless:
            return [1]
        wanted = range(1, self.distance + 1) if self._first_of_its_model(layer) else [self.distance]
        return [ahead for ahead in wanted if self._in_its_model(layer, ahead)]

    def _in_its_model(self, layer, ahead: int) -> bool:
        """Whether the paged layer `ahead` layers after `layer` exists in the same model (decoder or MTP drafter)."""
        target = self.layer_after(layer._moe_index + ahead - 1)
        return target is not None and is_mtp_layer(target.layer_name) == is_mtp_layer(layer.layer_name)

    def _after(self, layer) -> int | None:
        """In a chained forward, the MoE index whose step a round proposed in `layer`'s call must follow."""
        return layer._moe_index if self.live.chained else None

    def _read_further(self, layer, hidden: torch.Tensor, proposal: Callable[[int], torch.Tensor | None]) -> None:
        """BIGMOE_SSD_READ_AHEAD_LAYERS > 1: layers l+2 .. l+depth of the same model post the SSD reads of their
        proposed experts (proposal(ahead), made on the side stream), so the disk starts that many layers early."""
        for ahead in range(2, self.read_ahead_layers + 1):
            if not self._in_its_model(layer, ahead):
                return
            pager = getattr(self.layer_after(layer._moe_index + ahead - 1), "pager", None)
            if isinstance(pager, DeviceLayerPager) and pager.started and pager.read_ahead_ssd and not pager.ram.full:
                self.live.feed_read_ahead(lambda ahead=ahead: proposal(ahead), pager, hidden, depth=ahead)

    def _record_further(self, layer, hidden: torch.Tensor) -> None:
        """BIGMOE_TRACE_PATH: the live proposals for layers l+2 .. l+recorded_layers of the same model, recorded as
        the trace's predicted_ids_ahead (made again here, on the host's trace path only: eager runs)."""
        for ahead in range(2, self.recorded_layers + 1):
            if not self._in_its_model(layer, ahead):
                return
            ids = self._router_ids(layer, hidden, ahead)
            if ids is not None:
                self.routing.record_predictions(layer._moe_index, ids, ahead)

    def _router_ids(self, layer, hidden: torch.Tensor, ahead: int) -> torch.Tensor | None:
        """The live proposal for layer l + ahead: that layer's router applied to this layer's hidden state."""
        target = self._router_ahead(layer, hidden, ahead)
        return None if target is None else predict_next(hidden, target.router, target.top)

    def _router_ahead(self, layer, hidden: torch.Tensor, ahead: int) -> NextRouter | None:
        """Layer l + ahead and its router, for proposals made on layer l's hidden state (None: none usable)."""
        if ahead == 1:
            return self._target(layer, hidden)
        key = (layer._moe_index, ahead)
        if key not in self._further:
            found = next_router(layer, self.layer_after(layer._moe_index + ahead - 1), hidden, self.top)
            self._further[key] = found if isinstance(found, NextRouter) else None
        return self._further[key]

    def _target(self, layer, hidden: torch.Tensor) -> NextRouter | None:
        index = layer._moe_index
        if index not in self._next:
            found = next_router(layer, self.layer_after(index), hidden, self.top)
            if isinstance(found, str):
                if not self._warned:
                    log.warning("bigmoe: BIGMOE_PREDICT=router: %s; MoE layer %d predicts nothing", found, index)
                    self._warned = True
                found = None
            self._next[index] = found
        return self._next[index]


def capturing() -> bool:
    """Whether a CUDA graph capture is under way on the current stream; False where torch has no CUDA (its
    query raises there)."""
    try:
        return torch.cuda.is_current_stream_capturing()
    except (RuntimeError, AssertionError):
        return False


def whole_forward_capture(mode: str | None) -> bool:
    """Whether a CUDA graph capture under way holds the whole forward, from the mode name in vLLM's forward
    context (None: no forward context, a capture outside any vLLM forward, taken as a piece).

    vLLM captures a piece only under mode PIECEWISE (its piecewise backend and breakable graphs set it);
    a FULL graph is captured under mode FULL by the V1 model runner (0.25) and under mode NONE by the V2
    model runner (0.33's default), which records the plain eager forward inside torch.cuda.graph.
    """
    return mode is not None and mode != "PIECEWISE"


def vllm_whole_forward_capture() -> bool:
    """whole_forward_capture for the forward vLLM is running (or capturing) now."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return whole_forward_capture(None)
    mode = get_forward_context().cudagraph_runtime_mode
    return whole_forward_capture(getattr(mode, "name", str(mode)))
