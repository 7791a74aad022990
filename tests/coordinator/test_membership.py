"""Fast unit tests of the coordinator's worker places (`membership.Workers`):
joins, leaves and replacements by task index, and the no-worker clock.

Worker threads are replaced by a recording stand-in: what is checked is
which places exist, who is started and who is told to leave, not a worker's
own life (the elastic and fault tests run that on real servers).
"""

import pytest

from keras_ps.coordinator import membership
from keras_ps.coordinator.config import CoordinatorConfig
from keras_ps.coordinator.worker_states import WorkerState
from keras_ps.errors import NoWorkersAvailableError

pytestmark = pytest.mark.timeout(60)


class _Worker:
    """Records what `Workers` asks of a worker; states move as told."""

    def __init__(self, services, index, address, state=WorkerState.HEALTHY):
        self.index, self.address, self.state = index, address, state
        self.started = self.stopped = False
        self.left = None

    def start(self):
        self.started = True

    def leave(self, reason):
        self.left = reason
        self.state = WorkerState.LEFT

    def transition(self, state, reason):
        self.state = state

    def stop(self):
        self.stopped = True


def _start(monkeypatch, **config):
    monkeypatch.setattr(membership.worker_lib, "Worker", _Worker)
    w = membership.Workers(CoordinatorConfig(**config))
    w.start(services=object(), addresses=["a:1", "b:1"])
    return w


@pytest.fixture
def workers(monkeypatch):
    return _start(monkeypatch)


def _addresses(workers):
    return [(w.address, w.state) for w in workers.all()]


def test_the_cluster_spec_workers_start_healthy(workers):
    assert _addresses(workers) == [("a:1", WorkerState.HEALTHY),
                                   ("b:1", WorkerState.HEALTHY)]
    assert all(w.started for w in workers.all())
    assert workers.count() == 2 and workers.num_healthy() == 2
    assert workers.members_by_index() == {0: "a:1", 1: "b:1"}


def test_an_unchanged_membership_touches_nobody(workers):
    before = workers.all()
    workers.update(["a:1", "b:1"])
    assert workers.all() == before
    assert all(w.left is None for w in before)


def test_a_free_place_leaves_and_a_new_address_replaces(workers):
    first, second = workers.all()
    workers.update([None, "c:1"])
    assert first.left == "left the membership"
    assert second.left == "replaced by c:1"
    newcomer = workers[1]
    assert newcomer is not second and newcomer.started
    assert (newcomer.index, newcomer.address, newcomer.state) == (
        1, "c:1", WorkerState.JOINING)
    assert workers.num_healthy() == 0  # the newcomer is admitted once it answers


def test_a_join_past_the_end_fills_the_gap_with_left_places(workers):
    workers.update(["a:1", "b:1", None, "d:1"])
    assert _addresses(workers) == [
        ("a:1", WorkerState.HEALTHY), ("b:1", WorkerState.HEALTHY),
        (None, WorkerState.LEFT), ("d:1", WorkerState.JOINING)]
    assert [w.index for w in workers.all()] == [0, 1, 2, 3]
    assert not workers[2].started and workers[3].started
    assert workers.members() == [True, True, False, False]
    # Who counts when every worker is cut off from a ps (cut_off.py): not
    # a place left, nor a member not admitted yet; one out of training does.
    assert workers.in_job() == [0, 1]
    workers[1].state = WorkerState.FAILED
    assert workers.in_job() == [0, 1]


def test_a_shorter_membership_lets_the_places_past_it_leave(workers):
    workers.update(["a:1"])
    assert workers[1].left == "left the membership"
    assert workers.count() == 2  # places are kept; their index is not reused
    # The same address given again later joins anew: a left worker is final.
    workers.update(["a:1", "b:1"])
    assert workers[1].state is WorkerState.JOINING and workers[1].started


def test_a_refused_place_is_not_asked_again_until_its_address_changes(
        workers):
    # A member whose address is no worker task's is refused once, when it
    # first answers; the same membership again leaves it refused (no new
    # thread asks it), another address in its place joins anew.
    workers.update(["a:1", "b:1", "rdzv:1"])
    refused = workers[2]
    refused.state = WorkerState.REFUSED
    workers.update(["a:1", "b:1", "rdzv:1"])
    assert workers[2] is refused and refused.left is None
    assert workers.members() == [True, True, False]
    workers.update(["a:1", "b:1", "c:1"])
    assert refused.left == "replaced by c:1"
    assert (workers[2].address, workers[2].state) == ("c:1",
                                                      WorkerState.JOINING)


def _all_failed(workers, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(membership.time, "monotonic", lambda: clock[0])
    for w in workers.all():
        w.state = WorkerState.FAILED
    return clock


def test_no_healthy_worker_raises_after_the_timeout(monkeypatch):
    workers = _start(monkeypatch, no_worker_timeout=30.0)
    clock = _all_failed(workers, monkeypatch)
    workers.raise_if_none_healthy()  # the clock starts
    clock[0] += 29
    workers.raise_if_none_healthy()
    clock[0] += 2
    with pytest.raises(NoWorkersAvailableError,
                       match=r"30s \(workers: \['a:1', 'b:1'\]\).*"
                             "KERAS_PS_NO_WORKER_TIMEOUT"):
        workers.raise_if_none_healthy()


def _admitted(workers):
    workers.admitted()  # a worker came back, then was lost again


def _seen_healthy(workers):
    workers[0].state = WorkerState.HEALTHY  # join sees it healthy once
    workers.raise_if_none_healthy()
    workers[0].state = WorkerState.FAILED


@pytest.mark.parametrize("back", [_admitted, _seen_healthy])
def test_a_worker_back_restarts_the_no_worker_clock(monkeypatch, back):
    workers = _start(monkeypatch, no_worker_timeout=30.0)
    clock = _all_failed(workers, monkeypatch)
    workers.raise_if_none_healthy()
    clock[0] += 29
    back(workers)
    workers.raise_if_none_healthy()
    clock[0] += 29
    workers.raise_if_none_healthy()  # within the timeout of the new clock
    clock[0] += 2
    with pytest.raises(NoWorkersAvailableError):
        workers.raise_if_none_healthy()


def test_a_no_worker_timeout_of_zero_waits_forever(monkeypatch):
    workers = _start(monkeypatch)  # no_worker_timeout=0, the default
    clock = _all_failed(workers, monkeypatch)
    workers.raise_if_none_healthy()
    clock[0] += 1e6
    workers.raise_if_none_healthy()


def test_stop_stops_every_worker(workers):
    workers.update(["a:1", "b:1", "c:1"])
    workers.stop()
    assert all(w.stopped for w in workers.all())
