"""Pure rendezvous logic (no gRPC), driven by a fake clock."""

import pickle

import pytest

from _clock import FakeClock  # tests/_clock.py
from keras_ps.elastic import _decisions
from keras_ps.elastic import api
from keras_ps.elastic._membership import MembershipState
from keras_ps.elastic.api import MeetingKind
from keras_ps.elastic.api import MeetingState
from keras_ps.elastic.api import NodeState
from keras_ps.elastic.api import RemovalReason
from keras_ps.elastic.api import RendezvousPhase as Phase

pytestmark = pytest.mark.timeout(30)

A, B, C, D = (f"10.0.0.{i}:2222" for i in range(1, 5))


def make_state(**knobs):
    knobs.setdefault("gather_timeout", 5.0)
    knobs.setdefault("keepalive_timeout", 10.0)
    clock = FakeClock()
    return MembershipState(api.RendezvousConfig(**knobs), clock), clock


def established(state, nodes, min_nodes=None, max_nodes=None):
    min_nodes = min_nodes or len(nodes)
    max_nodes = max_nodes or len(nodes)
    for node in nodes:
        state.join(node, min_nodes, max_nodes)
    assert state.phase is Phase.ESTABLISHED
    return state


# ----------------------------------------------------------- pure decisions


@pytest.mark.parametrize(
    "phase, registered, deadline, now, expected",
    [
        (Phase.AWAITING_MIN, 1, None, 0.0, (Phase.AWAITING_MIN, None, False)),
        (Phase.AWAITING_MIN, 2, None, 0.0, (Phase.GATHERING, 5.0, False)),
        (Phase.GATHERING, 3, 5.0, 4.9, (Phase.GATHERING, 5.0, False)),
        (Phase.GATHERING, 3, 5.0, 5.0, (Phase.GATHERING, 5.0, True)),
        (Phase.GATHERING, 4, 5.0, 1.0, (Phase.GATHERING, 5.0, True)),
        (Phase.GATHERING, 1, 5.0, 1.0, (Phase.AWAITING_MIN, None, False)),
        (Phase.ESTABLISHED, 1, None, 9.0, (Phase.ESTABLISHED, None, False)),
    ])
def test_decide_phase(phase, registered, deadline, now, expected):
    assert _decisions.decide_phase(phase, registered, 2, 4, deadline, 5.0,
                                   now) == expected


def test_decide_phase_without_gather_window_establishes_at_min():
    assert _decisions.decide_phase(Phase.AWAITING_MIN, 2, 2, 4, None, 0.0,
                                   0.0) == (Phase.GATHERING, None, True)


def test_small_decisions():
    assert _decisions.lease_expired(0.0, 0, 10.5, 10.0)
    assert not _decisions.lease_expired(0.0, 0, 10.0, 10.0)
    assert not _decisions.lease_expired(0.0, 1, 99.0, 10.0)
    assert _decisions.lowest_free_slot([A, None, C, None]) == 1
    assert _decisions.lowest_free_slot([A, B]) == 2
    assert _decisions.meeting_outcome({A, B}, {A: b""}, 5.0,
                                      4.0) is MeetingState.OPEN
    assert _decisions.meeting_outcome({A, B}, {A: b""}, 5.0,
                                      5.0) is MeetingState.FAILED
    assert _decisions.meeting_outcome({A}, {A: b""}, 5.0,
                                      9.0) is MeetingState.COMPLETE
    assert _decisions.describe_addresses("abc", limit=2) == "a, b and 1 more"


# ------------------------------------------------------------- membership


def test_gather_window_admits_late_joiners_in_join_order():
    state, clock = make_state()
    state.join(B, 2, 4)
    state.join(A, 2, 4)
    assert state.phase is Phase.GATHERING
    assert state.spec_for(A) is None
    clock.advance(4.9)
    state.join(C, 2, 4)
    assert state.spec_for(C) is None
    clock.advance(0.1)
    spec = state.spec_for(C)
    assert spec == api.MembershipView((B, A, C), 2, 1)
    assert state.spec_for(B).index == 0
    assert state.changes[-1].admitted == (B, A, C)


def test_reaching_max_nodes_closes_the_window_at_once():
    state, _ = make_state()
    for node in (A, B, C):
        state.join(node, 2, 3)
    assert state.spec_for(A) == api.MembershipView((A, B, C), 0, 1)


def test_overflow_node_waits_and_takes_the_freed_place():
    state, _ = make_state()
    established(state, [A, B, C], 2, 2)
    assert state.spec_for(C) is None
    assert state.keep_alive(C).state is NodeState.WAITING
    assert state.leave(A)
    assert state.spec_for(C) == api.MembershipView((C, B), 0, 2)
    assert state.spec_for(B).index == 1  # B keeps its index
    change = state.changes[-1]
    assert (change.admitted, change.removed) == ((C,), (A,))
    assert change.reason is RemovalReason.LEFT


def test_freed_place_stays_free_until_someone_joins():
    state, _ = make_state()
    established(state, [A, B, C], 1, 3)
    state.leave(B)
    assert state.spec_for(A).workers == (A, None, C)
    assert state.spec_for(C).addresses == (A, C)
    state.join(D, 1, 3)
    assert state.spec_for(D) == api.MembershipView((A, D, C), 1, 3)
    state.leave(C)
    assert state.spec_for(A).workers == (A, D)  # trailing place dropped


def test_keep_alive_reports_net_changes_since_previous_call():
    state, _ = make_state(gather_timeout=0.0)
    established(state, [A, B], 2, 4)
    assert state.keep_alive(A).count == 0
    state.join(C, 2, 4)
    state.join(D, 2, 4)
    assert state.keep_alive(A).count == 2
    assert state.keep_alive(A).count == 0
    assert state.keep_alive(C).count == 1  # D joined after C
    state.leave(D)
    state.leave(C)
    waiting = state.keep_alive(A)
    assert (waiting.count, waiting.joined, waiting.lost) == (-2, 0, 2)
    assert state.keep_alive(B).count == 0  # +2 then -2 since its admission


def test_lease_lapse_removes_node_and_others_see_minus_one():
    state, clock = make_state(keepalive_timeout=10.0)
    established(state, [A, B])
    clock.advance(6.0)
    state.keep_alive(A)
    clock.advance(6.0)
    assert state.keep_alive(A).count == -1
    assert state.changes[-1].reason is RemovalReason.EXPIRED
    with pytest.raises(api.RendezvousUnknownNodeError, match=B):
        state.keep_alive(B)


def test_node_waiting_in_a_call_does_not_expire():
    state, clock = make_state(keepalive_timeout=10.0)
    established(state, [A, B])
    with state.in_flight(B):
        for _ in range(5):
            clock.advance(6.0)
            assert state.keep_alive(A).count == 0
    clock.advance(9.0)
    assert state.keep_alive(A).count == 0
    assert state.spec_for(B).index == 1


def test_tick_expires_without_any_call():
    state, clock = make_state(keepalive_timeout=1.0)
    established(state, [A])
    clock.advance(2.0)
    state.tick()
    assert state.snapshot().workers == ()


def test_everyone_gone_resets_the_job():
    state, _ = make_state()
    established(state, [A, B])
    state.leave(A)
    state.leave(B)
    snap = state.snapshot()
    assert (snap.phase, snap.job, snap.workers) == (
        Phase.AWAITING_MIN, None, ())
    state.join(C, 3, 3)  # a new job may use other sizes
    assert state.snapshot().job == (3, 3)


def test_min_max_mismatch_is_refused():
    state, _ = make_state()
    state.join(A, 2, 4)
    with pytest.raises(api.RendezvousStateError, match="2:4") as info:
        state.join(B, 1, 4)
    assert "Start every agent of the job with --nnodes=2:4" in str(info.value)


def test_pending_cap_refuses_joins():
    state, _ = make_state(max_pending_nodes=2)
    established(state, [A], 1, 1)
    state.join(B, 1, 1)
    state.join(C, 1, 1)
    with pytest.raises(api.RendezvousResourceExhaustedError,
                       match="max_pending_nodes=2") as info:
        state.join(D, 1, 1)
    assert "Raise max_pending_nodes (--max_pending_nodes" in str(info.value)
    state.join(B, 1, 1)  # known nodes still refresh their lease
    state.leave(C)
    state.join(D, 1, 1)


def test_leave_unknown_and_closed():
    state, _ = make_state()
    assert not state.leave(A)
    state.close()
    with pytest.raises(api.RendezvousClosedError):
        state.join(A, 1, 1)


# --------------------------------------------------------------- meetings


def test_barrier_completes_when_all_arrive():
    state, _ = make_state()
    established(state, [A, B])
    kind = MeetingKind.BARRIER
    gen = state.arrive(kind, A, "t", b"", 5.0)
    assert state.meeting_result(kind, A, "t", gen) is None
    assert state.arrive(kind, B, "t", b"", 5.0) == gen
    assert state.meeting_result(kind, A, "t", gen) == {A: b"", B: b""}
    assert state.meeting_result(kind, B, "t", gen) == {A: b"", B: b""}
    assert state.snapshot().finished_meetings == 0  # all collected
    gen2 = state.arrive(kind, A, "t", b"", 5.0)  # tag reused
    assert gen2 > gen


def test_meeting_timeout_names_missing_for_everyone():
    state, clock = make_state()
    established(state, [A, B, C])
    kind = MeetingKind.SYNCHRONIZE
    gen = state.arrive(kind, A, "t", b"a", 5.0)
    clock.advance(1.0)
    state.arrive(kind, B, "t", b"b", 60.0)
    clock.advance(4.0)
    for node in (A, B):
        with pytest.raises(api.RendezvousTimeoutError, match=C) as info:
            state.meeting_result(kind, node, "t", gen)
        assert info.value.missing == (C,)
    with pytest.raises(api.RendezvousStateError):
        state.meeting_result(kind, A, "t", gen)  # forgotten once collected


def test_tags_and_kinds_are_independent():
    state, _ = make_state()
    established(state, [A, B])
    x = state.arrive(MeetingKind.BARRIER, A, "x", b"", 5.0)
    y = state.arrive(MeetingKind.BARRIER, B, "y", b"", 5.0)
    s = state.arrive(MeetingKind.SYNCHRONIZE, A, "x", b"1", 5.0)
    state.arrive(MeetingKind.BARRIER, B, "x", b"", 5.0)
    assert state.meeting_result(MeetingKind.BARRIER, A, "x", x) is not None
    assert state.meeting_result(MeetingKind.BARRIER, B, "y", y) is None
    assert state.meeting_result(MeetingKind.SYNCHRONIZE, A, "x", s) is None


def test_departure_completes_a_meeting():
    state, _ = make_state()
    established(state, [A, B, C])
    gen = state.arrive(MeetingKind.BARRIER, A, "t", b"", 5.0)
    state.arrive(MeetingKind.BARRIER, B, "t", b"", 5.0)
    state.leave(C)
    assert state.meeting_result(MeetingKind.BARRIER, A, "t", gen) == {
        A: b"", B: b""}


def test_waiting_or_unknown_nodes_cannot_meet():
    state, _ = make_state()
    established(state, [A, B], 1, 1)
    with pytest.raises(api.RendezvousStateError, match="waiting"):
        state.arrive(MeetingKind.BARRIER, B, "t", b"", 1.0)
    with pytest.raises(api.RendezvousUnknownNodeError):
        state.arrive(MeetingKind.BARRIER, C, "t", b"", 1.0)


def test_unclaimed_results_are_forgotten_after_retention():
    state, clock = make_state(keepalive_timeout=2.0, long_poll_timeout=1.0)
    established(state, [A, B])
    gen = state.arrive(MeetingKind.BARRIER, A, "t", b"", 5.0)
    state.arrive(MeetingKind.BARRIER, B, "t", b"", 5.0)
    state.meeting_result(MeetingKind.BARRIER, A, "t", gen)
    assert state.snapshot().finished_meetings == 1
    clock.advance(1.5)
    state.keep_alive(B)
    state.tick()
    assert state.snapshot().finished_meetings == 1
    clock.advance(2.0)
    state.keep_alive(B)
    state.tick()
    assert state.snapshot().finished_meetings == 0


# ------------------------------------------------------ config and errors


def test_config_defaults_and_env():
    config = api.RendezvousConfig()
    assert (config.gather_timeout, config.keepalive_timeout,
            config.barrier_timeout, config.max_pending_nodes,
            config.token) == (5.0, 10.0, 60.0, 1024, None)
    env = {"KERAS_PS_RDZV_GATHER_TIMEOUT": "1.5",
           "KERAS_PS_RDZV_MAX_PENDING_NODES": "7",
           "KERAS_PS_RDZV_TOKEN": "abc"}
    config = api.RendezvousConfig.from_env(env, max_pending_nodes=9)
    assert (config.gather_timeout, config.max_pending_nodes,
            config.token) == (1.5, 9, "abc")
    assert "abc" not in repr(config)


@pytest.mark.parametrize("field, value", [
    ("gather_timeout", -1.0), ("keepalive_timeout", 0.0),
    ("barrier_timeout", float("nan")), ("max_pending_nodes", -1),
    ("max_workers", 2), ("long_poll_timeout", float("inf")),
    ("token", ""), ("token", "has space"),
])
def test_config_validation_names_field_and_value(field, value):
    with pytest.raises(ValueError, match=field) as info:
        api.RendezvousConfig(**{field: value})
    if field != "token":
        assert repr(value) in str(info.value)


def test_config_env_errors_name_the_variable():
    with pytest.raises(ValueError, match="KERAS_PS_RDZV_KEEPALIVE_TIMEOUT"):
        api.RendezvousConfig.from_env(
            {"KERAS_PS_RDZV_KEEPALIVE_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match="KERAS_PS_RDZV_GATHER_TIMEOUT"):
        api.RendezvousConfig.from_env({"KERAS_PS_RDZV_GATHER_TIMEOUT": "-3"})


def test_config_env_errors_name_only_the_variable_at_fault():
    # As the launcher calls it: every flag passed, None where not given.
    env = {"KERAS_PS_RDZV_GATHER_TIMEOUT": "1.5",
           "KERAS_PS_RDZV_KEEPALIVE_TIMEOUT": "-1"}
    with pytest.raises(ValueError) as info:
        api.RendezvousConfig.from_env(env, keepalive_timeout=None,
                                      max_workers=None)
    message = str(info.value)
    assert "keepalive_timeout" in message and "-1.0" in message, message
    assert message.endswith("(set from KERAS_PS_RDZV_KEEPALIVE_TIMEOUT)"), \
        message
    with pytest.raises(ValueError, match=r"an integer\). Unset it"):
        api.RendezvousConfig.from_env({"KERAS_PS_RDZV_MAX_WORKERS": "8.5"})


def test_more_workers_than_calls_names_both_and_the_fix():
    with pytest.raises(ValueError) as info:
        api.RendezvousConfig.from_env(
            {"KERAS_PS_RDZV_MAX_CONCURRENT_RPCS": "4096"}, max_workers=8192)
    message = str(info.value)
    assert "max_concurrent_rpcs=4096 with max_workers=8192" in message
    assert "Lower max_workers (--max_workers" in message
    assert message.endswith("(set from KERAS_PS_RDZV_MAX_CONCURRENT_RPCS)")


@pytest.mark.parametrize("address", ["", "host", ":80", "host:", "host:0",
                                     "host:65536", "host:x1", "a b:1",
                                     "::1:80", "[::1:80", "h,i:1"])
def test_parse_address_rejects(address):
    with pytest.raises(ValueError, match="address"):
        api.parse_address(address)


def test_parse_address_accepts():
    assert api.parse_address("host:1") == ("host", 1)
    assert api.parse_address("[::1]:65535") == ("[::1]", 65535)
    assert api.parse_address("h:0", allow_port_zero=True) == ("h", 0)


@pytest.mark.parametrize("error", [
    api.RendezvousError("x"),
    api.RendezvousTimeoutError("late", missing=(A, B)),
    api.RendezvousAuthError("no"),
    api.RendezvousClosedError("gone"),
    api.RendezvousInvalidArgumentError("bad"),
    api.RendezvousResourceExhaustedError("full"),
    api.RendezvousUnknownNodeError("who"),
    api.RendezvousStateError("state"),
])
def test_errors_are_picklable(error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert isinstance(copy, api.RendezvousError)
    if isinstance(error, api.RendezvousTimeoutError):
        assert copy.missing == (A, B) and copy.missing_count == 2
        assert isinstance(copy, TimeoutError)
