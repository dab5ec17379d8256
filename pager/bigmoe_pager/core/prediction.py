"""Next-layer expert predictions: the live predictor, and a trace's recorded predictions replayed.

Live: while layer l computes, layer l+1's router applied to a hidden state of layer l (the
vLLM adapter passes the one layer l's experts receive) proposes l+1's experts (the router's
own top-P; the literature's strongest cheap predictor).
Replayed (benchmarks): a trace's `predicted_ids` [tokens, layers, P] row [t, l] is what a
predictor proposed for layer l+1 of token t; `replayed_predictions` takes the rows of the
tokens a step is about to run, exactly where the live predictor's output would be used
(`replayed_rows`: on CUDA one Triton launch, replay_kernel, that reads the cursor on the device).
Both return int64 [tokens, P], -1 padded, fixed shapes, no host sync (capturable), and both
hand layer l+1's pager (DeviceLayerPager.prefetch) their proposal on a side stream on CUDA:
LivePredictions.feed / feed_ids (forked in layer l's call, joined by the time layer l+1 pages).
`hits` / `recall` score a proposal (host).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from bigmoe_pager.core import replay_kernel, triton_launch
from bigmoe_pager.core.prefetch_chain import PrefetchChain

Router = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]
"""Layer l+1's router: its gate Linear's weight [E, H] (a float dtype), or a function giving its logits [tokens, E]
for a hidden state (a gate whose weight the engine repacked, e.g. vLLM's CPU build on AVX-512 BF16 hosts)."""


def predict_next(hidden: torch.Tensor, next_router: Router, top_p: int) -> torch.Tensor:
    """int64 [tokens, top_p]: the experts layer l+1's router would rank highest for layer l's hidden state.

    hidden: [tokens, H], a hidden state of layer l (the vLLM adapter passes what layer l's experts
    receive, after l's post-attention norm; layer l+1's router sees l+1's normed state, which differs
    by what layers l and l+1 add and by the norm's weight). next_router: a weight's product runs in the
    weight's dtype. Softmax keeps order, so the top-P logits are the router's top-P probabilities.
    """
    if isinstance(next_router, torch.Tensor):
        logits = hidden.to(next_router.dtype) @ next_router.t()  # in the router's own dtype, as it routes
    else:
        logits = next_router(hidden)
    return torch.topk(logits, min(top_p, logits.shape[-1]), dim=-1).indices


def replayed_predictions(predicted: torch.Tensor, cursor: torch.Tensor, layer: int, tokens: int) -> torch.Tensor:
    """int64 [tokens, P]: rows cursor .. cursor + tokens - 1 (mod the trace's length) of predicted[:, layer].

    predicted: int32 [trace tokens, layers, P] on the step's device; cursor: int64 [] or [1], the
    replay position of the layer whose step comes next (the one the predictions are for, minus one:
    row [t, l] predicts layer l + 1). Reads no value on the host.
    """
    length, layers, _ = predicted.shape
    rows = (torch.arange(tokens, device=predicted.device) + cursor.reshape(())) % length
    return predicted[:, layer % layers][rows].long()


def replayed_rows(
    predicted: torch.Tensor, cursor: torch.Tensor, index: int, offset: int, layer: int, tokens: int
) -> torch.Tensor:
    """int64 [tokens * P]: replayed_predictions from row cursor[index] + offset, flattened.

    On CUDA (with Triton) one kernel launch (replay_kernel) that reads the cursor on the device, where the
    torch formulation launches six or seven tiny ones; elsewhere replayed_predictions, the reference.
    """
    if predicted.device.type == "cuda" and triton_launch.available():
        return replay_kernel.launch_replayed_rows(predicted, cursor, index, offset, layer, tokens)
    return replayed_predictions(predicted, cursor[index] + offset, layer, tokens).reshape(-1)


def hits(predicted, actual) -> tuple[int, int, int]:
    """(hits, true, proposed) summed over rows: per row, the distinct actual ids the distinct proposal contains,
    the distinct actual ids, the distinct proposed ids (-1 is padding in both). Host; for scoring."""
    hit = true = proposed = 0
    for p, a in zip(predicted.tolist(), actual.tolist()):  # tensors or numpy arrays [rows, n]
        guess = {e for e in p if e >= 0}
        truth = {e for e in a if e >= 0}
        hit += len(truth & guess)
        true += len(truth)
        proposed += len(guess)
    return hit, true, proposed


def recall(predicted, actual) -> float:
    """Share of the actual distinct ids (per token) that the prediction contains (host; for scoring)."""
    hit, true, _ = hits(predicted, actual)
    return hit / true if true else 0.0


class LivePredictions:
    """Proposals for layer l+1 (the live predictor's, or a replayed trace's), handed to its pager while layer l runs.

    On CUDA the router product and the next layer's prefetch (DeviceLayerPager.prefetch, run in
    order on this side stream) start once the current stream has reached the fork (the vLLM
    adapter forks once layer l's own paging is issued), so they overlap what the current stream
    does next; `join` makes the current stream wait for them. Both ends must lie in one CUDA graph
    capture: the adapter joins within layer l's call inside a capture of one piece (vLLM's
    PIECEWISE), at layer l+1's call otherwise. Fixed shapes, event waits only. Off CUDA everything
    runs in order. In a chained forward (`open_chain`, a FULL graph) the side stream is forked once
    and each later round waits for its layer's step on the device (core.prefetch_chain).
    """

    HIGH_PRIORITY = -1  # CUDA stream priority: lower is higher; torch maps it into the device's range

    def __init__(self, priority: int = 0) -> None:
        """priority: the side stream's CUDA priority (0: normal; HIGH_PRIORITY: its blocks are scheduled before
        those of normal streams whenever SMs free up)."""
        self.priority = priority
        self._stream = None
        self._forked = False  # the side stream has work the current stream has not joined yet
        self._chain: PrefetchChain | None = None  # open_chain's flags, while a chained forward is under way
        self._branch = False  # that forward's side-stream branch was forked (its first round)
        self._joinless = False  # that forward's rounds are settled by the steps on the device, not joined

    def open_chain(self, chain: PrefetchChain, joinless: bool = False) -> None:
        """A forward captured whole begins (its first layer's step publishes with `first`): until close_chain,
        the side stream is forked once, at the first round, and each later round given `after` = l waits on the
        device for layer l's step instead (core.prefetch_chain). Joins stay where the caller puts them, unless
        joinless: then every round given `after` claims its table for the forward and counts its copies, the next
        step settles it on the device (core.round_sync), and the caller joins only at close_chain."""
        self._chain, self._branch, self._joinless = chain, False, joinless

    def close_chain(self, device: torch.device) -> None:
        """The chained forward's last layer is done: join what is left, and fork again from the next round on."""
        self.join(device)
        self._chain, self._branch, self._joinless = None, False, False

    @property
    def chained(self) -> bool:
        """Whether a chained forward is under way."""
        return self._chain is not None

    @property
    def chain_flags(self) -> torch.Tensor:
        """The chained forward's flags (core.prefetch_chain); only while one is under way."""
        return self._chain.flags

    @property
    def joinless(self) -> bool:
        """Whether a joinless chained forward is under way (nothing to join before close_chain)."""
        return self._chain is not None and self._joinless

    def _round_flags(self, after: int | None) -> torch.Tensor | None:
        """The chain flags a round given `after` claims its table with (None: the round is joined as usual)."""
        return self._chain.flags if self.joinless and after is not None else None

    def feed(
        self, hidden: torch.Tensor, next_router: Router, top_p: int, next_pager=None, after: int | None = None
    ) -> torch.Tensor:
        """int64 [tokens, top_p]: predict_next for the rows of `hidden`, prefetched into `next_pager` (a
        DeviceLayerPager, or None: proposed only). On CUDA the ids are readable on the current stream after `join`.
        after: in a chained forward, the MoE index whose step the work must follow (the layer `hidden` is from)."""

        flags = self._round_flags(after)

        def propose() -> torch.Tensor:
            ids = predict_next(hidden, next_router, top_p)
            if next_pager is not None:  # no stream: it runs here, on the stream current now
                next_pager.prefetch(ids.reshape(-1), chain_flags=flags)
            return ids

        return self._forked_work(hidden, propose, after)

    def feed_ids(
        self, make_ids: Callable[[], torch.Tensor | None], next_pager, source: torch.Tensor, after: int | None = None
    ):
        """A proposal made elsewhere (a replayed trace's rows) prefetched into `next_pager` the same way; make_ids()
        runs on the side stream too, once the current stream has `source`, so its gathers (a handful of small
        kernels per layer) stay off the current stream's path as the live predictor's router product does.
        Returns the ids (None: make_ids had none, nothing prefetched). after: as in `feed`."""

        flags = self._round_flags(after)

        def prefetch() -> torch.Tensor | None:
            ids = make_ids()
            if ids is not None:
                next_pager.prefetch(ids.reshape(-1), chain_flags=flags)
            return ids

        return self._forked_work(source, prefetch, after)

    def feed_read_ahead(
        self, make_ids: Callable[[], torch.Tensor | None], pager, source: torch.Tensor, depth: int = 2
    ) -> None:
        """Like feed_ids for a layer `depth` layers further ahead: its predicted experts' SSD reads are posted
        (DeviceLayerPager.read_ahead, judged with that depth's), nothing is copied into its slots."""

        def post() -> None:
            ids = make_ids()
            if ids is not None:
                pager.read_ahead(ids.reshape(-1), depth=depth)

        self._forked_work(source, post)

    def fork_rounds(self, source: torch.Tensor, launch: Callable[[torch.Tensor], None], after: int) -> None:
        """In a joinless chained forward: launch(flags) on the side stream, ordered after layer `after`'s step as a
        round given `after` is (forked at the forward's first round; the launch waits for later steps itself).
        core.forward_rounds' one kernel for a forward's rounds."""
        self._forked_work(source, lambda: launch(self._chain.flags), after=after)

    def _forked_work(self, source: torch.Tensor, work, after: int | None = None):
        """work() on the side stream once the current stream has `source` (in order off CUDA); in a chained
        forward, after the branch's first round, once layer `after`'s step is done (a device wait, no fork)."""
        chained = self._chain is not None and after is not None and self._branch
        if not chained:  # a fork: in a chained forward, its first round's
            self._branch = self._chain is not None and after is not None
        stream = self._side_stream(source.device)
        if stream is None:
            if chained:
                self._chain.wait_stepped(after)  # in order already: returns at once (it runs in the interpreter)
            return work()
        if not chained:
            stream.wait_stream(torch.cuda.current_stream(source.device))
        with torch.cuda.stream(stream):
            if chained:
                self._chain.wait_stepped(after)
            out = work()
        if not torch.cuda.is_current_stream_capturing():  # a graph keeps its own tensors alive
            source.record_stream(stream)  # the allocator must not reuse it before the side stream is done
        self._forked = True
        return out

    def join(self, device: torch.device) -> None:
        """The current stream waits for what `feed` put on the side stream since the last join (if anything)."""
        if self._forked:
            torch.cuda.current_stream(device).wait_stream(self._stream)
            self._forked = False

    def _side_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device, priority=self.priority)
        return self._stream


class ReplayedPredictions:
    """A replayed trace's `predicted_ids` on the device, fed to the next layer's pager after each replayed step.

    Benchmark only, like route replay: with BIGMOE_ROUTE_REPLAY pointing at a trace that carries
    predictions, layer l's replayed step hands layer l + 1's pager the predictions for the same
    rows (`rows`), which the adapter feeds through LivePredictions.feed_ids: where and how a live
    predictor's proposal goes.
    A trace without predictions prefetches nothing. A trace may also carry `predicted_ids_ahead`, proposals made
    at layer l for layers l+2, l+3, ... (bigmoe_bench.traces.deeper_predictions), which `rows` hands callers
    looking that far ahead (SSD reads ahead, prefetch distance) in place of layer l+d-1's next-layer rows (the
    one-node kernel, core.forward_rounds, reads `predicted` on the device and still takes the next-layer rows).
    """

    _cache: dict[tuple[str, str], "ReplayedPredictions"] = {}

    def __init__(self, predicted: torch.Tensor | None, ahead: torch.Tensor | None = None) -> None:
        self.predicted = predicted
        """int32 [tokens, layers, P] on the step's device, or None."""
        self.ahead = ahead
        """int32 [depths, tokens, layers, P']: entry [d - 2, t, l] proposes layer l+d's experts; None: none."""

    @classmethod
    def for_trace(cls, path, device: torch.device) -> "ReplayedPredictions":
        """The predictions of the trace at `path` (read once per process and device)."""
        key = (str(path), str(device))
        if key not in cls._cache:
            with np.load(path, allow_pickle=False) as data:
                ids, ahead = (_int32(data, name) for name in ("predicted_ids", "predicted_ids_ahead"))
            on_device = [None if a is None else torch.from_numpy(a).to(device) for a in (ids, ahead)]
            cls._cache[key] = cls(on_device[0], on_device[1] if ids is not None else None)
        return cls._cache[key]

    def rows(self, moe_index: int, tokens: int, cursor: torch.Tensor, ahead: int = 1) -> torch.Tensor | None:
        """After layer `moe_index` replayed `tokens` rows (its cursor already advanced past them), layer
        moe_index + ahead's predicted experts for those rows, int64 [tokens * P] (None: the trace has none).
        Benchmark only: without `ahead` rows for that distance, layer l + ahead - 1's next-layer rows stand in,
        as right as the next layer's, where a real predictor looking further ahead is right less often. On CUDA
        one kernel launch (replayed_rows)."""
        if self.predicted is None:
            return None
        if ahead >= 2 and self.ahead is not None and ahead - 2 < self.ahead.shape[0]:
            return replayed_rows(self.ahead[ahead - 2], cursor, moe_index, -tokens, moe_index, tokens)
        return replayed_rows(self.predicted, cursor, moe_index, -tokens, moe_index + ahead - 1, tokens)

    def replace(self, predicted: np.ndarray | None, ahead: np.ndarray | None = None) -> None:
        """Benchmark only: copy another trace's predictions (and those further ahead) into the device tensors in
        place, so CUDA graphs that captured them read the new ones: each of the same shape, or None where these
        are None. ValueError otherwise, with nothing copied."""
        pairs = [(predicted, self.predicted, "predictions"), (ahead, self.ahead, "predictions further ahead")]
        for new, mine, what in pairs:
            if mine is None and new is not None:
                raise ValueError(f"the replayed trace carries no {what}, the new one does")
            if mine is not None and new is None:
                raise ValueError(f"the replayed trace carries {what}, the new one none")
            if new is not None and tuple(new.shape) != tuple(mine.shape):
                raise ValueError(f"the new {what} are {tuple(new.shape)}, the replayed ones {tuple(mine.shape)}")
        with torch.inference_mode():  # made in a forward under inference mode (vLLM's), so updated in it
            for new, mine, _ in pairs:
                if new is not None:
                    mine.copy_(torch.from_numpy(np.ascontiguousarray(new, dtype=np.int32)))


def _int32(data, name: str) -> np.ndarray | None:
    """The .npz member `name` as a contiguous int32 array (None where the file has no such member)."""
    return np.ascontiguousarray(data[name], dtype=np.int32) if name in data.files else None
