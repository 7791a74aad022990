"""Pure membership decisions of the rendezvous.

Small functions of plain values, no state, no clock, no locks: the
`MembershipState` in `_membership.py` applies them under its lock. Kept apart
so each rule can be unit-tested on its own.
"""

from typing import List, Optional, Tuple

from keras_ps.elastic.api import MeetingState
from keras_ps.elastic.api import RendezvousPhase

_MAX_LISTED = 20  # addresses named in an error message


def decide_phase(phase: RendezvousPhase, registered: int, min_nodes: int,
                 max_nodes: int, gather_deadline: Optional[float],
                 gather_timeout: float, now: float
                 ) -> Tuple[RendezvousPhase, Optional[float], bool]:
    """Decides the next phase before the cluster spec is established.

    Returns:
        (phase, gather_deadline, establish): `establish` is True when the
        first cluster spec should be published now.
    """
    if phase in (RendezvousPhase.ESTABLISHED, RendezvousPhase.CLOSED):
        return phase, gather_deadline, False
    if registered < min_nodes:
        return RendezvousPhase.AWAITING_MIN, None, False
    if registered >= max_nodes or gather_timeout == 0:
        return RendezvousPhase.GATHERING, gather_deadline, True
    if phase is RendezvousPhase.AWAITING_MIN or gather_deadline is None:
        return RendezvousPhase.GATHERING, now + gather_timeout, False
    return RendezvousPhase.GATHERING, gather_deadline, now >= gather_deadline


def lease_expired(last_seen: float, inflight: int, now: float,
                  keepalive_timeout: float) -> bool:
    """A node's lease lapsed: no call in flight and none for too long."""
    return inflight == 0 and now - last_seen > keepalive_timeout


def lowest_free_slot(slots: List[Optional[str]]) -> int:
    """Index a newly admitted node takes: the first freed place, else the
    end (so nodes that stay keep their index)."""
    for index, address in enumerate(slots):
        if address is None:
            return index
    return len(slots)


def meeting_outcome(participants, arrived, deadline: float,
                    now: float) -> MeetingState:
    """A meeting completes when every participant arrived, and fails when
    its deadline passes first."""
    if all(p in arrived for p in participants):
        return MeetingState.COMPLETE
    if now >= deadline:
        return MeetingState.FAILED
    return MeetingState.OPEN


def describe_addresses(addresses, limit: int = _MAX_LISTED) -> str:
    """'a, b and 3 more' for error messages."""
    addresses = list(addresses)
    shown = ", ".join(addresses[:limit])
    if len(addresses) > limit:
        shown += f" and {len(addresses) - limit} more"
    return shown
