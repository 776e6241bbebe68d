"""Pipeline sends released once the schedule proves they can complete, not when the step ends.

torch's runtime schedules (``_PipelineScheduleRuntime._step_microbatches``: interleaved 1F1B and
zero bubble) keep the works of every ``SEND_F`` / ``SEND_B`` in a local list and wait for them only
after the step's last action. A work keeps its tensor, so a rank holds every chunk output it sent
(after that micro-batch's backward has freed everything else of it) and every input gradient it
sent, until the step ends: about ``2 x vpp x micro-batches`` boundary tensors. torch defers the wait
because a blocking wait on a send whose receive the peer has not posted yet can deadlock the
interleaved order.

Here a send is waited (and its work dropped, so its tensor goes when nothing else holds it) once
the schedule *proves* its receive is posted: the peer's action list (``pipeline_order_with_comms``,
the same on every rank) posts that receive at a known position, and the step's own receives carry
knowledge of how far each rank has got (a vector clock: the receive from a peer completes only
after that peer ran every action before its send, and knew what its own receives told it). A
send whose receive is posted completes without any further action of ours, so its wait cannot
deadlock. Completion is also polled (``Work.is_completed``, which NCCL answers without blocking;
gloo answers only after a wait), so on a device a send may go sooner: the proof is the bound.

The bound does not depend on timing: :func:`pending_gradient_sends` computes it from the
action lists alone, for the cost model. A chunk output sent forward is always proven received by
the time its backward runs (the gradient it receives was made from it), so the forward sends add
nothing to what the stage holds anyway; what stays alive is input gradients sent backward whose
receive the rank cannot yet know posted.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import heapq
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

# The action kinds of torch's lowered schedules this knows; anything else (a V-schedule's
# same-rank hand-off, overlapped F/B pairs) turns the release off for the step
_KNOWN = frozenset({"F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD",
                    "REDUCE_GRAD"})


def _kind(action: Any) -> str:
    return action.computation_type.value


def _receipt(action: Any, stage_to_rank: Mapping[int, int], n_stages: int, rank: int) -> tuple[int, int, str] | None:
    """The send that a compute action's receive matched: (peer rank, stage, kind), or None when the
    action receives nothing from another rank."""
    kind, stage = _kind(action), action.stage_index
    if kind == "F" and stage > 0 and stage_to_rank[stage - 1] != rank:
        return stage_to_rank[stage - 1], stage - 1, "SEND_F"
    if kind in ("B", "I") and stage < n_stages - 1 and stage_to_rank[stage + 1] != rank:
        return stage_to_rank[stage + 1], stage + 1, "SEND_B"
    return None


def _matching_receive(send: tuple[int, str, int], stage_to_rank: Mapping[int, int]) -> tuple[int, tuple[int, str, int]]:
    """For a send (stage, kind, micro-batch): the peer rank and the key of the receive it matches in
    the peer's list."""
    stage, kind, mb = send
    if kind == "SEND_F":
        return stage_to_rank[stage + 1], (stage + 1, "RECV_F", mb)
    return stage_to_rank[stage - 1], (stage - 1, "RECV_B", mb)


def _known_kinds(orders: Mapping[int, Sequence[Any]]) -> dict[int, list[str]]:
    """Each rank's action kinds, in order; a ValueError where one is not of :data:`_KNOWN`."""
    kinds = {rank: [_kind(a) for a in actions] for rank, actions in orders.items()}
    for rank, of_rank in kinds.items():
        unknown = set(of_rank) - _KNOWN
        if unknown:
            raise ValueError(f"rank {rank}'s schedule has actions {sorted(unknown)} the send release does not know")
    return kinds


class SendProof:
    """What every rank knows after each of its actions (its vector clock: the index in each rank's
    action list that rank has provably passed), from the lowered action lists of every rank."""

    def __init__(self, orders: Mapping[int, Sequence[Any]], stage_to_rank: Mapping[int, int]):
        _known_kinds(orders)
        self.orders, self.stage_to_rank = orders, stage_to_rank
        ranks = sorted(orders)
        self.ranks = ranks
        n_stages = len(stage_to_rank)
        self.index = {r: {(a.stage_index, _kind(a), a.microbatch_index): i for i, a in enumerate(orders[r])}
                      for r in ranks}
        self.clock: dict[int, list[tuple[int, ...] | None]] = {r: [None] * len(orders[r]) for r in ranks}
        position = dict.fromkeys(ranks, 0)
        known = {r: [-1] * len(ranks) for r in ranks}
        slot = {r: i for i, r in enumerate(ranks)}
        self.slot = slot
        moved = True
        while moved:  # every rank as far as its receives allow, until all are done
            moved = False
            for r in ranks:
                actions = orders[r]
                while position[r] < len(actions):
                    i = position[r]
                    got = _receipt(actions[i], stage_to_rank, n_stages, r)
                    if got is not None:
                        peer, stage, kind = got
                        sent = self.clock[peer][self.index[peer][(stage, kind, actions[i].microbatch_index)]]
                        if sent is None:
                            break
                        known[r] = [max(a, b) for a, b in zip(known[r], sent, strict=True)]
                    known[r][slot[r]] = i
                    self.clock[r][i] = tuple(known[r])
                    position[r] += 1
                    moved = True
        stuck = [r for r in ranks if position[r] < len(orders[r])]
        if stuck:
            raise ValueError(f"the schedule's receives cannot all be matched (ranks {stuck} wait forever)")

    def posted(self, rank: int, at: int, send: tuple[int, str, int]) -> bool:
        """Whether ``rank``, after its action ``at``, provably knows the receive of its ``send``
        (stage, kind, micro-batch) posted."""
        peer, key = _matching_receive(send, self.stage_to_rank)
        return self.clock[rank][at][self.slot[peer]] >= self.index[peer][key]

    def pending_gradient_sends(self, rank: int) -> int:
        """The most input-gradient sends of ``rank`` not yet proven received at any of its actions."""
        pending: list[Any] = []
        most = 0
        for i, action in enumerate(self.orders[rank]):
            if _kind(action) == "SEND_B":
                pending.append((action.stage_index, "SEND_B", action.microbatch_index))
            pending = [s for s in pending if not self.posted(rank, i, s)]
            most = max(most, len(pending))
        return most


# Rounds of pp micro-batches after which the bound stops changing: the steady state repeats round
# by round, and two rounds already give a longer step's bound on every rank (checked against the
# proof walked over the whole step, both schedules: pp 2-8, vpp 1-4, up to four rounds in
# tests/unit/test_send_bound.py, more rounds and pp 9-16 in its slow test; the shapes of the 1T plan on 3,072
# ranks and of 175B on 1,024, pp up to 64, at three and four rounds when this was set)
STEADY_ROUNDS = 2


def pending_gradient_sends(pp: int, vpp: int, n_microbatches: int, rank: int, schedule: str = "1f1b") -> int:
    """The bound, for torch's interleaved schedule (``schedule`` "1f1b" or "zb") of ``pp`` ranks
    with ``vpp`` stages each: the most input gradients ``rank`` has sent whose receive it cannot
    yet know posted (so that the release keeps them). Whole rounds of ``pp`` micro-batches beyond
    :data:`STEADY_ROUNDS` repeat the steady state, so they are not walked again (the cost model
    asks this for every point it ranks)."""
    return schedule_bounds(pp, vpp, n_microbatches, schedule)[0][rank]


class ReceiveBuffers(NamedTuple):
    """An interleaved rank's receive buffers alive while its compute actions run (the runtime's
    ``_lazy_receive_stage`` makes one when its receive is posted, and it goes with the last backward
    action of its stage and micro-batch: a received activation is that micro-batch's stage input,
    a received gradient is read by its backward, under zero bubble by the weight pass too)."""

    most: int  # at any compute action of the step
    last_backward: int  # at the rank's last compute action (its first chunk's last backward)
    last_loss: int  # at the last backward of the model's last stage (0 on a rank without it)


def receive_buffers(pp: int, vpp: int, n_microbatches: int, rank: int, schedule: str = "1f1b") -> ReceiveBuffers:
    """:class:`ReceiveBuffers` of ``rank`` under torch's interleaved schedule (``schedule`` "1f1b"
    or "zb"), read off its action lists as :func:`pending_gradient_sends` is (rounds beyond
    :data:`STEADY_ROUNDS` repeat the steady state; the cool-down is the same)."""
    return schedule_bounds(pp, vpp, n_microbatches, schedule)[1][rank]


def schedule_bounds(pp: int, vpp: int, n_microbatches: int, schedule: str = "1f1b"
                    ) -> tuple[tuple[int, ...], tuple[ReceiveBuffers, ...]]:
    """:func:`pending_gradient_sends` and :func:`receive_buffers` of every rank, in rank order."""
    return _bounds(pp, vpp, steady_microbatches(pp, n_microbatches), schedule)


def steady_microbatches(pp: int, n_microbatches: int) -> int:
    """The micro-batches whose schedule gives the bounds of ``n_microbatches``' (whole rounds
    beyond :data:`STEADY_ROUNDS` repeat the steady state)."""
    return min(n_microbatches, STEADY_ROUNDS * pp) if n_microbatches % pp == 0 else n_microbatches


@functools.cache
def _bounds(pp: int, vpp: int, n_microbatches: int, schedule: str
            ) -> tuple[tuple[int, ...], tuple[ReceiveBuffers, ...]]:
    """:func:`pending_gradient_sends` and :func:`receive_buffers` of every rank, from one lowering of
    torch's action lists."""
    from torch.distributed.pipelining import schedules

    cls = schedules.ScheduleInterleavedZeroBubble if schedule == "zb" else schedules.ScheduleInterleaved1F1B
    with _collector_paused():
        orders, stage_to_rank = _lowered_orders(cls, pp, vpp, n_microbatches)
        last_stage = len(stage_to_rank) - 1
        kinds = _known_kinds(orders)
        return _pending_bounds(orders, stage_to_rank, kinds), \
            tuple(_receives_alive(orders[r], kinds[r], last_stage) for r in sorted(orders))


def _receives_alive(actions: Sequence[Any], kinds: Sequence[str], last_stage: int) -> ReceiveBuffers:
    """:class:`ReceiveBuffers` of one rank's lowered action list (``kinds``: its actions' kinds)."""
    ends: dict[tuple[int, int], int] = {}  # (stage, micro-batch) -> its last backward action
    for i, (action, kind) in enumerate(zip(actions, kinds, strict=True)):
        if kind in ("B", "I", "W"):
            ends[(action.stage_index, action.microbatch_index)] = i
    freed: dict[int, int] = {}  # action -> the buffers alive that go when it ends
    alive = most = at_loss = alive_now = 0
    for i, (action, kind) in enumerate(zip(actions, kinds, strict=True)):
        if kind in ("RECV_F", "RECV_B"):
            end = ends[(action.stage_index, action.microbatch_index)]
            freed[end] = freed.get(end, 0) + 1
            alive += 1
        elif kind in ("F", "B", "I", "W"):
            alive_now = alive
            most = max(most, alive_now)
            if kind in ("B", "I") and action.stage_index == last_stage:
                at_loss = alive_now
            alive -= freed.pop(i, 0)
    return ReceiveBuffers(most, alive_now, at_loss)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for a while. torch's lowering makes some 10^5 action tuples
    a shape, none in a cycle (reference counting frees them), and each batch of them set off a
    collection that walks the caller's objects too: about a quarter of the lowering's time."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _pending_bounds(orders: Mapping[int, Sequence[Any]], stage_to_rank: Mapping[int, int],
                    kinds: Mapping[int, Sequence[str]]) -> tuple[int, ...]:
    """:meth:`SendProof.pending_gradient_sends` of every rank in order, by the same walk keeping less:
    a rank's clock only at its sends (all a receive reads), and its unproven gradient sends as a
    heap per peer of where their receives sit in that peer's list. A rank's knowledge only grows,
    so a send proven once stays proven: each leaves the heap once, where the proof re-tests every
    held send at every action. ``kinds``: each rank's action kinds (:func:`_known_kinds`)."""
    ranks = sorted(orders)
    slot = {r: i for i, r in enumerate(ranks)}
    n_stages = len(stage_to_rank)
    sends: dict[int, dict[tuple[int, str, int], int]] = {r: {} for r in ranks}
    receives: dict[int, dict[tuple[int, str, int], int]] = {r: {} for r in ranks}
    for r in ranks:
        for i, (action, kind) in enumerate(zip(orders[r], kinds[r], strict=True)):
            if kind in ("SEND_F", "SEND_B"):
                sends[r][(action.stage_index, kind, action.microbatch_index)] = i
            elif kind == "RECV_B":
                receives[r][(action.stage_index, kind, action.microbatch_index)] = i
    sent_with: dict[int, dict[int, np.ndarray]] = {r: {} for r in ranks}  # a send's index -> the clock then
    position = dict.fromkeys(ranks, 0)
    known = {r: np.full(len(ranks), -1, dtype=np.int64) for r in ranks}
    held: dict[int, dict[int, list[int]]] = {r: {} for r in ranks}  # peer -> its receives' indices
    count, most = dict.fromkeys(ranks, 0), dict.fromkeys(ranks, 0)
    moved = True
    while moved:  # every rank as far as its receives allow, until all are done
        moved = False
        for r in ranks:
            actions, kinds_r, at, clock, heaps = orders[r], kinds[r], position[r], known[r], held[r]
            while at < len(actions):
                action, kind = actions[at], kinds_r[at]
                got = _receipt(action, stage_to_rank, n_stages, r) if kind in ("F", "B", "I") else None
                if got is not None:
                    peer, stage, sent = got
                    j = sends[peer][(stage, sent, action.microbatch_index)]
                    if position[peer] <= j:
                        break
                    np.maximum(clock, sent_with[peer][j], out=clock)
                clock[slot[r]] = at
                if kind in ("SEND_F", "SEND_B"):
                    sent_with[r][at] = clock.copy()
                if kind == "SEND_B":
                    peer, key = _matching_receive((action.stage_index, kind, action.microbatch_index), stage_to_rank)
                    heapq.heappush(heaps.setdefault(peer, []), receives[peer][key])
                    count[r] += 1
                if count[r]:
                    for peer, heap in heaps.items():
                        while heap and heap[0] <= clock[slot[peer]]:
                            heapq.heappop(heap)
                            count[r] -= 1
                    most[r] = max(most[r], count[r])
                at += 1
                moved = True
            position[r] = at
    stuck = [r for r in ranks if position[r] < len(orders[r])]
    if stuck:
        raise ValueError(f"the schedule's receives cannot all be matched (ranks {stuck} wait forever)")
    return tuple(most[r] for r in ranks)


def _lowered_orders(cls: type, pp: int, vpp: int, m: int) -> tuple[dict[int, list[Any]], dict[int, int]]:
    """torch's own action lists (communication included) for a schedule, without stages or a
    process group: its per-rank order, then its lowering."""
    from torch.distributed.pipelining import schedules

    shell = object.__new__(cls)  # only the attributes the order needs; no stage is touched
    shell.pp_group_size, shell.n_local_stages, shell._n_microbatches = pp, vpp, m
    shell._num_stages, shell.rank = pp * vpp, 0
    shell.number_of_rounds = max(1, m // pp)
    shell.microbatches_per_round = m // shell.number_of_rounds
    stage_to_rank = {s: s % pp for s in range(pp * vpp)}
    shell.stage_index_to_group_rank = stage_to_rank
    compute = {r: shell._calculate_single_rank_operations(r) for r in range(pp)}
    if cls is schedules.ScheduleInterleavedZeroBubble:
        shell.pipeline_order = compute
        compute = shell._add_bubbles_to_actions(vpp * pp)
    lowered = {r: schedules._add_reduce_grad(schedules._add_unshard_reshard(compute[r]), m) for r in compute}
    return schedules._add_send_recv(lowered, stage_to_rank=lambda s: stage_to_rank[s], num_stages=pp * vpp), \
        stage_to_rank


class SendRelease:
    """For one step of one rank's runtime schedule: the send works still held, each waited and
    dropped once proven posted (or seen completed)."""

    def __init__(self, proof: SendProof, rank: int):
        self.proof, self.rank = proof, rank
        # (the send's key: stage, kind, micro-batch; the list of its works torch holds too)
        self.pending: list[tuple[tuple[int, str, int], list[Any]]] = []
        self._labelled: tuple[tuple[int, str, int], list[Any]] | None = None
        self.most = 0  # the most sends held at once this step (what a test can compare)

    def label(self, send: tuple[int, str, int], ops: list[Any]) -> list[Any]:
        """The ops a stage is about to hand to ``_batch_p2p`` for its ``send`` (stage, "SEND_F" or
        "SEND_B", micro-batch)."""
        self._labelled = (send, ops)
        return ops

    def sent(self, ops: list[Any], works: list[Any]) -> None:
        if self._labelled is not None and self._labelled[1] is ops and works:
            self.pending.append((self._labelled[0], works))
            self.most = max(self.most, len(self.pending))
        self._labelled = None

    def reached(self, key: tuple[int, str, int]) -> None:
        """The rank is at its action ``key`` (a compute action, its receive done): release what is
        proven posted or already complete."""
        at = self.proof.index[self.rank].get(key)
        kept = []
        for action, works in self.pending:
            if (at is not None and self.proof.posted(self.rank, at, action)) or all(w.is_completed() for w in works):
                for work in works:
                    work.wait()  # its receive is posted: completes without us (or has)
                works.clear()  # torch's list of this send's works: nothing left for it to wait on
            else:
                kept.append((action, works))
        self.pending = kept


_ACTIVE: list[SendRelease] = []


def active() -> SendRelease | None:
    """The release of the step running in this process, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def releasing_sends(schedule: Any) -> Iterator[SendRelease | None]:
    """Around one ``step`` of a torch runtime schedule: release its sends as proven (see the module
    docstring). torch's internals this relies on (``pipeline_order_with_comms``,
    ``stage_index_to_group_rank``, the module-level ``_batch_p2p``) missing or unknown: a warning,
    and torch's own retention for the step."""
    from torch.distributed.pipelining import schedules

    try:
        proof = schedule.__dict__.get("_send_proof")
        if proof is None:
            proof = SendProof(schedule.pipeline_order_with_comms, schedule.stage_index_to_group_rank)
            schedule.__dict__["_send_proof"] = proof
        original = schedules._batch_p2p
        release = SendRelease(proof, schedule.rank)
    except (AttributeError, KeyError, ValueError) as e:
        warnings.warn(f"pipeline sends are kept until the step ends (torch's retention): {e}", stacklevel=3)
        yield None
        return

    def batch_p2p(p2p_ops, desc=None):
        works = original(p2p_ops, desc)
        release.sent(p2p_ops, works)
        return works

    schedules._batch_p2p = batch_p2p
    _ACTIVE.append(release)
    try:
        yield release
    finally:
        _ACTIVE.pop()
        schedules._batch_p2p = original
