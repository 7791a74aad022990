"""Membership state of the rendezvous, free of gRPC.

The logic is split in two layers, as in torchelastic's rendezvous:

* small pure functions in `_decisions.py` (`decide_phase`, `lease_expired`,
  `meeting_outcome`, ...) that take plain values and return a decision;
* `MembershipState` here, which holds the state and applies those decisions
  under one lock. Every public method reads the time from an injected
  clock, so the whole thing is unit-testable with a fake clock.

Time-based transitions (gather window closing, leases lapsing, meetings
timing out) are applied lazily at the start of every call and by the server's
reaper thread calling `tick()`.
"""

import collections
import contextlib
import dataclasses
import logging
import math
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from keras_ps.elastic import api
from keras_ps.elastic._meetings import Meetings
from keras_ps.elastic._decisions import decide_phase
from keras_ps.elastic._decisions import describe_addresses
from keras_ps.elastic._decisions import lease_expired
from keras_ps.elastic._decisions import lowest_free_slot
from keras_ps.elastic.api import MeetingKind
from keras_ps.elastic.api import NodeState
from keras_ps.elastic.api import RemovalReason
from keras_ps.elastic.api import RendezvousPhase

logger = logging.getLogger(__name__)

_INF = math.inf


# --------------------------------------------------------------------------
# State records.
# --------------------------------------------------------------------------


@dataclasses.dataclass
class _Node:
    address: str
    state: NodeState
    last_seen: float
    inflight: int = 0
    index: int = -1
    seen_version: int = 0


@dataclasses.dataclass(frozen=True)
class MembershipSnapshot:
    """A consistent view of the state, for logs, tests and debugging."""

    phase: RendezvousPhase
    version: int
    workers: Tuple[Optional[str], ...]
    waiting: Tuple[str, ...]
    job: Optional[Tuple[int, int]]
    open_meetings: int
    finished_meetings: int


class MembershipState:
    """Registered nodes, the cluster spec and the meetings, under one lock.

    Args:
        config: The server's `RendezvousConfig`.
        clock: Monotonic time source in seconds.
    """

    def __init__(self, config: api.RendezvousConfig,
                 clock: Callable[[], float] = time.monotonic):
        self._config = config
        self._clock = clock
        self.condition = threading.Condition(threading.RLock())
        self._nodes: Dict[str, _Node] = {}  # join order
        self._slots: List[Optional[str]] = []
        self._admitted = 0
        self._phase = RendezvousPhase.AWAITING_MIN
        self._gather_deadline: Optional[float] = None
        self._job: Optional[Tuple[int, int]] = None
        self._version = 0
        self._totals: Dict[int, Tuple[int, int]] = {0: (0, 0)}
        self._changes = collections.deque(maxlen=64)
        self._meetings = Meetings(self.condition, lambda: list(self._nodes))
        self._next_lease_check = _INF

    # ---------------------------------------------------------- membership

    def join(self, address: str, min_nodes: int, max_nodes: int) -> NodeState:
        """Registers `address` (or refreshes its lease if known).

        Raises:
            RendezvousClosedError: The server is shutting down.
            RendezvousStateError: min/max differ from the job's.
            RendezvousResourceExhaustedError: max_pending_nodes reached.
        """
        with self.condition:
            now = self._tick()
            if self._job is not None and self._job != (min_nodes, max_nodes):
                raise api.RendezvousStateError(
                    f"node {address} asked for min_nodes:max_nodes="
                    f"{min_nodes}:{max_nodes} but the job runs with "
                    f"{self._job[0]}:{self._job[1]}. Start every agent of "
                    f"the job with --nnodes={self._job[0]}:{self._job[1]}, "
                    "or restart the rendezvous server for a new job")
            node = self._nodes.get(address)
            if node is not None:
                node.last_seen = now
                return node.state
            limit = max_nodes + self._config.max_pending_nodes
            if len(self._nodes) >= limit:
                raise api.RendezvousResourceExhaustedError(
                    f"refusing node {address}: {len(self._nodes)} nodes are "
                    f"registered, max_nodes={max_nodes} plus "
                    f"max_pending_nodes={self._config.max_pending_nodes}. "
                    "Raise max_pending_nodes (--max_pending_nodes, "
                    "KERAS_PS_RDZV_MAX_PENDING_NODES) or the MAX of --nnodes")
            if self._job is None:
                self._job = (min_nodes, max_nodes)
                logger.info("new job: min_nodes=%s max_nodes=%s",
                            min_nodes, max_nodes)
            node = _Node(address, NodeState.WAITING, last_seen=now)
            self._nodes[address] = node
            self._next_lease_check = min(
                self._next_lease_check, now + self._config.keepalive_timeout)
            logger.info("node %s registered (%s waiting, %s admitted)",
                        address, len(self._nodes) - self._admitted,
                        self._admitted)
            self._reconcile(now)
            return node.state

    def spec_for(self, address: str) -> Optional[api.MembershipView]:
        """The cluster spec as `address` sees it, None while it waits.

        Raises:
            RendezvousUnknownNodeError: `address` is not registered.
            RendezvousClosedError: The server is shutting down.
        """
        with self.condition:
            node = self._known(address)
            if node.state is not NodeState.ADMITTED:
                return None
            return api.MembershipView(tuple(self._slots), node.index,
                                   self._version)

    def keep_alive(self, address: str) -> api.WaitingNodes:
        """Refreshes the lease and reports changes since the last call.

        Raises:
            RendezvousUnknownNodeError: `address` is not registered.
        """
        with self.condition:
            node = self._known(address)
            if node.state is not NodeState.ADMITTED:
                return api.WaitingNodes(0, 0, 0, self._version, node.state)
            joined_then, lost_then = self._totals[node.seen_version]
            joined_now, lost_now = self._totals[self._version]
            node.seen_version = self._version
            self._prune_history()
            joined, lost = joined_now - joined_then, lost_now - lost_then
            return api.WaitingNodes(joined - lost, joined, lost,
                                    self._version, node.state)

    def leave(self, address: str) -> bool:
        """Removes `address`; False if it was not registered."""
        with self.condition:
            now = self._tick()
            if address not in self._nodes:
                return False
            self._remove([address], RemovalReason.LEFT, now)
            return True

    @property
    def registered(self) -> int:
        """Number of registered nodes."""
        with self.condition:
            return len(self._nodes)

    @property
    def phase(self) -> RendezvousPhase:
        with self.condition:
            return self._phase

    def describe_wait(self, address: str) -> str:
        """Why `address` is still waiting, for timeout messages."""
        with self.condition:
            job = self._job or (0, 0)
            return (f"node {address} not admitted: {len(self._nodes)} "
                    f"registered, {self._admitted} admitted, "
                    f"min_nodes={job[0]} max_nodes={job[1]}, "
                    f"phase {self._phase.value}")

    # ------------------------------------------------------------- meetings

    def arrive(self, kind: MeetingKind, address: str, tag: str, data: bytes,
               timeout: float) -> int:
        """Records that `address` arrived at `tag`; returns the generation.

        Raises:
            RendezvousUnknownNodeError: `address` is not registered.
            RendezvousStateError: `address` is not admitted.
        """
        with self.condition:
            node = self._known(address)
            if node.state is not NodeState.ADMITTED:
                raise api.RendezvousStateError(
                    f"node {address} is waiting for a place; only admitted "
                    f"nodes can enter {kind.value} {tag!r}")
            participants = {a for a in self._slots if a is not None}
            return self._meetings.arrive(kind, address, tag, data, timeout,
                                         node.last_seen, participants)

    def meeting_result(self, kind: MeetingKind, address: str, tag: str,
                       generation: int) -> Optional[Dict[str, bytes]]:
        """address -> data once the meeting completed, None while it is open.

        Raises:
            RendezvousTimeoutError: The meeting failed; lists the missing.
            RendezvousUnknownNodeError: `address` is not registered.
            RendezvousStateError: `generation` is unknown or forgotten.
        """
        with self.condition:
            self._known(address)
            return self._meetings.result(kind, tag, address, generation)

    # ---------------------------------------------------- time and waiting

    def tick(self) -> float:
        """Applies due time-based transitions and forgets old finished
        meetings; returns the next time something is due (may be inf)."""
        with self.condition:
            now = self._tick()
            retention = (self._config.keepalive_timeout
                         + self._config.long_poll_timeout)
            self._meetings.forget_finished(now, retention)
            return self.next_deadline()

    def next_deadline(self) -> float:
        """Earliest time at which a time-based transition is due."""
        with self.condition:
            times = [self._next_lease_check]
            if self._gather_deadline is not None:
                times.append(self._gather_deadline)
            times.extend(self._meetings.deadlines())
            return min(times)

    def wait_for(self, attempt: Callable[[], object], deadline: float):
        """Calls `attempt` under the lock until it returns non-None or the
        (clock) deadline passes; returns that value or None."""
        with self.condition:
            while True:
                result = attempt()
                if result is not None:
                    return result
                now = self._clock()
                if now >= deadline:
                    return None
                wake = min(deadline, self.next_deadline())
                self.condition.wait(max(0.0, wake - now) + 1e-3)

    @contextlib.contextmanager
    def in_flight(self, address: str):
        """Marks a blocking call of `address`: its lease cannot lapse while
        the call waits on the server."""
        with self.condition:
            node = self._nodes.get(address)
            if node is not None:
                node.inflight += 1
        try:
            yield
        finally:
            with self.condition:
                if node is not None and self._nodes.get(address) is node:
                    now = self._clock()
                    node.inflight -= 1
                    node.last_seen = now
                    self._next_lease_check = min(
                        self._next_lease_check,
                        now + self._config.keepalive_timeout)

    def close(self):
        """Wakes every waiter; later calls raise RendezvousClosedError."""
        with self.condition:
            if self._phase is not RendezvousPhase.CLOSED:
                logger.info("rendezvous %s -> %s", self._phase.value,
                            RendezvousPhase.CLOSED.value)
                self._phase = RendezvousPhase.CLOSED
            self.condition.notify_all()

    def snapshot(self) -> MembershipSnapshot:
        with self.condition:
            waiting = tuple(a for a, n in self._nodes.items()
                            if n.state is NodeState.WAITING)
            return MembershipSnapshot(
                self._phase, self._version, tuple(self._slots), waiting,
                self._job, *self._meetings.counts())

    @property
    def changes(self) -> Tuple[api.MembershipChange, ...]:
        """The most recent membership changes, oldest first."""
        with self.condition:
            return tuple(self._changes)

    # ------------------------------------------------------------ internals

    def _known(self, address: str) -> _Node:
        now = self._tick()
        node = self._nodes.get(address)
        if node is None:
            raise api.RendezvousUnknownNodeError(
                f"node {address} is not registered (it left, its lease "
                f"lapsed or the server restarted); join again")
        node.last_seen = now
        return node

    def _tick(self) -> float:
        now = self._clock()
        if self._phase is RendezvousPhase.CLOSED:
            raise api.RendezvousClosedError(
                "the rendezvous server is shutting down")
        if now >= self._next_lease_check:
            self._expire(now)
        if (self._gather_deadline is not None
                and now >= self._gather_deadline):
            self._reconcile(now)
        self._meetings.settle_due(now)
        return now

    def _expire(self, now: float):
        lease = self._config.keepalive_timeout
        expired, next_check = [], _INF
        for node in self._nodes.values():
            if lease_expired(node.last_seen, node.inflight, now, lease):
                expired.append(node.address)
            elif node.inflight == 0:
                next_check = min(next_check, node.last_seen + lease)
        self._next_lease_check = next_check
        if expired:
            logger.info("lease of %s node(s) lapsed: %s", len(expired),
                        describe_addresses(expired))
            self._remove(expired, RemovalReason.EXPIRED, now)

    def _remove(self, addresses, reason: RemovalReason, now: float):
        removed = []
        for address in addresses:
            node = self._nodes.pop(address)
            if node.state is NodeState.ADMITTED:
                self._slots[node.index] = None
                self._admitted -= 1
                removed.append(address)
            else:
                logger.info("waiting node %s removed (%s)", address,
                            reason.value)
        while self._slots and self._slots[-1] is None:
            self._slots.pop()
        self._meetings.remove_nodes(set(addresses), now)
        if not self._nodes:
            if self._job is not None:
                logger.info("all nodes gone; rendezvous %s -> %s",
                            self._phase.value,
                            RendezvousPhase.AWAITING_MIN.value)
            self._phase = RendezvousPhase.AWAITING_MIN
            self._gather_deadline = None
            self._job = None
        self._reconcile(now, removed, reason)
        self.condition.notify_all()

    def _reconcile(self, now: float, removed=(), reason=None):
        """Moves the phase on and fills free places; records one change."""
        admitted = []
        if self._phase is not RendezvousPhase.ESTABLISHED and self._job:
            min_nodes, max_nodes = self._job
            phase, deadline, establish = decide_phase(
                self._phase, len(self._nodes), min_nodes, max_nodes,
                self._gather_deadline, self._config.gather_timeout, now)
            self._gather_deadline = deadline
            if establish:
                phase, self._gather_deadline = RendezvousPhase.ESTABLISHED, None
            if phase is not self._phase:
                logger.info("rendezvous %s -> %s (%s registered)",
                            self._phase.value, phase.value, len(self._nodes))
                self._phase = phase
        if self._phase is RendezvousPhase.ESTABLISHED:
            max_nodes = self._job[1]
            for node in self._nodes.values():
                if self._admitted >= max_nodes:
                    break
                if node.state is NodeState.WAITING:
                    self._admit(node)
                    admitted.append(node.address)
        if admitted or removed:
            self._version += 1
            joined_total, lost_total = self._totals[self._version - 1]
            self._totals[self._version] = (joined_total + len(admitted),
                                           lost_total + len(removed))
            for address in admitted:
                self._nodes[address].seen_version = self._version
            change = api.MembershipChange(self._version, tuple(admitted),
                                          tuple(removed), reason)
            self._changes.append(change)
            logger.info(
                "membership version %s: admitted [%s], removed [%s]%s; "
                "%s admitted, %s waiting", self._version,
                describe_addresses(admitted), describe_addresses(removed),
                f" ({reason.value})" if removed and reason else "",
                self._admitted, len(self._nodes) - self._admitted)
            self.condition.notify_all()

    def _admit(self, node: _Node):
        index = lowest_free_slot(self._slots)
        if index == len(self._slots):
            self._slots.append(node.address)
        else:
            self._slots[index] = node.address
        node.state, node.index = NodeState.ADMITTED, index
        self._admitted += 1
        logger.debug("node %s %s -> %s at index %s", node.address,
                     NodeState.WAITING.value, NodeState.ADMITTED.value, index)

    def _prune_history(self):
        if len(self._totals) <= 64 + self._admitted:
            return
        oldest = min((n.seen_version for n in self._nodes.values()
                      if n.state is NodeState.ADMITTED),
                     default=self._version)
        for version in [v for v in self._totals if v < oldest]:
            del self._totals[version]
