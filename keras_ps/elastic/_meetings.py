"""Meetings of the rendezvous (barriers and synchronisations), free of gRPC.

Held by `MembershipState` and called under its lock: a meeting opens when the
first admitted node arrives at a tag, settles (complete or failed) by the pure
`meeting_outcome` decision, and is forgotten once every node collected it or
after a retention time.
"""

import dataclasses
import logging
from typing import Dict, Optional, Tuple

from keras_ps.elastic import api
from keras_ps.elastic._decisions import describe_addresses
from keras_ps.elastic._decisions import meeting_outcome
from keras_ps.elastic.api import MeetingKind
from keras_ps.elastic.api import MeetingState

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Meeting:
    kind: MeetingKind
    tag: str
    generation: int
    participants: set
    opened_at: float
    deadline: float
    arrived: Dict[str, bytes] = dataclasses.field(default_factory=dict)
    state: MeetingState = MeetingState.OPEN
    missing: Tuple[str, ...] = ()
    finished_at: float = 0.0
    collected: set = dataclasses.field(default_factory=set)


class Meetings:
    """The open and the finished meetings.

    Args:
        condition: the membership state's condition (its lock is held by
            every caller); notified when a meeting settles.
        node_order: () -> addresses in join order (orders missing nodes).
    """

    def __init__(self, condition, node_order):
        self._condition = condition
        self._node_order = node_order
        self._open: Dict[tuple, Meeting] = {}
        self._finished: Dict[tuple, Meeting] = {}
        self._generation = 0

    def arrive(self, kind: MeetingKind, address: str, tag: str, data: bytes,
               timeout: float, now: float, participants: set) -> int:
        """Records that `address` arrived at `tag`; returns the generation."""
        key = (kind, tag)
        meeting = self._open.get(key)
        if meeting is None:
            self._generation += 1
            meeting = Meeting(kind, tag, self._generation, participants,
                              opened_at=now, deadline=now + timeout)
            self._open[key] = meeting
            logger.debug("%s %r generation %s opened for %s nodes",
                         kind.value, tag, meeting.generation,
                         len(participants))
        else:
            meeting.deadline = min(meeting.deadline, now + timeout)
        meeting.participants.add(address)
        meeting.arrived[address] = data
        self._settle(meeting, now)
        self._condition.notify_all()
        return meeting.generation

    def result(self, kind: MeetingKind, tag: str, address: str,
               generation: int) -> Optional[Dict[str, bytes]]:
        """address -> data once the meeting completed, None while it is open.

        Raises:
            RendezvousTimeoutError: The meeting failed; lists the missing.
            RendezvousStateError: `generation` is unknown or forgotten.
        """
        key = (kind, tag)
        meeting = self._open.get(key)
        if meeting is not None and meeting.generation == generation:
            return None
        meeting = self._finished.get(key)
        if meeting is None or meeting.generation != generation:
            raise api.RendezvousStateError(
                f"{kind.value} {tag!r} generation {generation} is not "
                f"known to the server")
        meeting.collected.add(address)
        if meeting.collected.issuperset(meeting.arrived):
            del self._finished[key]
        if meeting.state is MeetingState.FAILED:
            waited = meeting.deadline - meeting.opened_at
            raise api.RendezvousTimeoutError(
                f"{kind.value} {tag!r} timed out after {waited:.3g}s; "
                f"{len(meeting.missing)} of {len(meeting.participants)} "
                f"nodes did not arrive: "
                f"{describe_addresses(meeting.missing)}",
                missing=meeting.missing)
        return dict(meeting.arrived)

    def settle_due(self, now: float):
        """Settles every open meeting whose deadline has passed."""
        for meeting in list(self._open.values()):
            if now >= meeting.deadline:
                self._settle(meeting, now)

    def remove_nodes(self, gone: set, now: float):
        """Nodes left: they no longer count in any open meeting."""
        for meeting in list(self._open.values()):
            meeting.participants -= gone
            for address in gone:
                meeting.arrived.pop(address, None)
            if not meeting.participants:
                del self._open[(meeting.kind, meeting.tag)]
            else:
                self._settle(meeting, now)

    def forget_finished(self, now: float, retention: float):
        for key, meeting in list(self._finished.items()):
            if now - meeting.finished_at > retention:
                del self._finished[key]

    def deadlines(self):
        return [m.deadline for m in self._open.values()]

    def counts(self) -> Tuple[int, int]:
        """(open meetings, finished meetings not yet forgotten)."""
        return len(self._open), len(self._finished)

    def _settle(self, meeting: Meeting, now: float):
        state = meeting_outcome(meeting.participants, meeting.arrived,
                                meeting.deadline, now)
        if state is MeetingState.OPEN:
            return
        meeting.state, meeting.finished_at = state, now
        key = (meeting.kind, meeting.tag)
        del self._open[key]
        self._finished[key] = meeting
        if state is MeetingState.FAILED:
            order = {a: i for i, a in enumerate(self._node_order())}
            meeting.missing = tuple(sorted(
                (p for p in meeting.participants if p not in meeting.arrived),
                key=lambda a: order.get(a, len(order))))
            logger.warning("%s %r generation %s timed out; missing: %s",
                           meeting.kind.value, meeting.tag, meeting.generation,
                           describe_addresses(meeting.missing))
        else:
            logger.debug("%s %r generation %s complete (%s nodes)",
                         meeting.kind.value, meeting.tag, meeting.generation,
                         len(meeting.arrived))
        self._condition.notify_all()
