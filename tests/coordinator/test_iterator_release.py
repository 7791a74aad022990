"""fit and evaluate hand their dataset iterators to a holder on each worker
(keras_ps/coordinator/iterator_release.py), so TF's destructor of an iterator
runs on tf.data's thread there, not on the thread serving the coordinator.

What the tests can see for real: a TFRecord reader keeps its file open on the
worker process while its iterator lives (/proc/<pid>/fd). A released iterator
stays alive, held, until the next release on that worker, and is then
destroyed. The same holds for the iterators of a custom loop that it drops.
"""

import gc
import os
import sys

import pytest

from _cancels import cancel_on_its_worker, spin_from
from _open_files import open_on, reading_iterator, write_records
from _paths import TESTS
from _polling import wait_until
from _results import last_report
from _results import run_child

pytestmark = pytest.mark.timeout(180)


def _open_by_worker(cluster, path):
    """How many descriptors each worker process holds open on `path`."""
    return open_on([cluster.pid("worker", i) for i in range(2)], path)


def _open_on_workers(cluster, path):
    """How many descriptors the worker processes hold open on `path`."""
    return sum(_open_by_worker(cluster, path))


def _earlier_drops_released(cluster, coordinator, tmp_path):
    """Returns once every iterator dropped before the call has been released
    on the workers. Earlier tests of this process may have left iterators to
    the garbage collector: released after a test's own, one of them would
    push the test's out of the holder early. Markers are dropped after them,
    in order, until all but the last have closed their files: releases run
    in the order dropped, and a marker is destroyed once the next one's
    release reached its worker. A release passes over a worker that takes
    no calls at that moment (one set aside as hung, on a machine loaded
    enough that it did not answer a probe): that worker holds its marker
    until the next release, so up to three markers follow the first."""
    gc.collect()
    markers, error = [], None
    for index in range(4):
        markers.append(write_records(str(tmp_path / f"marker{index}.tfrecord")))
        iterator = reading_iterator(coordinator, markers[-1])
        del iterator
        gc.collect()
        if not index:
            continue
        try:
            wait_until(lambda: sum(_open_on_workers(cluster, m)
                                   for m in markers[:-1]) == 0, 30,
                       "the iterators dropped before the test to be released")
            return
        except AssertionError as timed_out:
            error = timed_out
    raise AssertionError(
        f"{error}: {_release_state(cluster, coordinator, markers)}")


def _release_state(cluster, coordinator, markers):
    """What a failed wait for a release reports: each marker's open
    descriptors by worker, the workers' states, and each release line's
    generation beside the coordinator's."""
    lines = {index: line.generation
             for index, line in coordinator._release._lines.items()}
    return (f"open by worker {[_open_by_worker(cluster, m) for m in markers]}, "
            f"workers {[(w.state.name, w.closures_run) for w in coordinator.workers]}, "
            f"lines {lines}, generation {coordinator._readmission.generation}")


def _reading_the_first_of_two_files(cluster, coordinator, tmp_path):
    """Once the iterators dropped before are released: two record files,
    and iterators reading the first on every worker that takes calls.
    Returns (first, second, iterators)."""
    _earlier_drops_released(cluster, coordinator, tmp_path)
    first = write_records(str(tmp_path / "first.tfrecord"))
    second = write_records(str(tmp_path / "second.tfrecord"))
    return first, second, reading_iterator(coordinator, first)


def test_a_released_iterator_is_held_until_the_next_release(
        cluster, coordinator, tmp_path):
    first, second, iterator = _reading_the_first_of_two_files(
        cluster, coordinator, tmp_path)
    readers = _open_on_workers(cluster, first)
    assert readers >= 1, "no worker holds the dataset's file open"
    coordinator.release_iterators(iterator)
    assert iterator.values == (None, None)
    del iterator

    # Dropped the plain way, the first iterators would be destroyed by now:
    # making and reading the second one takes many requests to each worker.
    iterator = reading_iterator(coordinator, second)
    assert _open_on_workers(cluster, first) == readers, (
        "the released iterators were destroyed before the next release")
    coordinator.release_iterators(iterator)
    del iterator
    wait_until(lambda: _open_on_workers(cluster, first) == 0, 60,
               "the first iterators' files to be closed on the workers")
    assert _open_on_workers(cluster, second) >= 1


def test_a_dropped_iterator_is_released_too(cluster, coordinator, tmp_path):
    # A custom loop that makes a new iterator each epoch and drops the last
    # one: the coordinator releases it on a thread of its own.
    first, second, iterator = _reading_the_first_of_two_files(
        cluster, coordinator, tmp_path)
    readers = _open_on_workers(cluster, first)
    assert readers >= 1, "no worker holds the dataset's file open"
    del iterator
    gc.collect()
    iterator = reading_iterator(coordinator, second)
    assert _open_on_workers(cluster, first) == readers, (
        "the dropped iterators were destroyed instead of released")
    del iterator
    gc.collect()
    wait_until(lambda: _open_on_workers(cluster, first) == 0, 60,
               "the first iterators' files to be closed on the workers")
    assert _open_on_workers(cluster, second) >= 1


def test_iterators_replaced_after_a_cancelled_call_are_released(
        cluster, coordinator, tmp_path):
    # A call cancelled on its worker has that worker's datasets made again:
    # the iterators replaced are alive there, and are released, not dropped
    # the plain way (which stalls the worker's next requests).
    import tensorflow as tf

    first, second, iterator = _reading_the_first_of_two_files(
        cluster, coordinator, tmp_path)
    readers = _open_by_worker(cluster, first)

    @tf.function
    def spin():
        return spin_from(tf.constant(0))

    spinner = cancel_on_its_worker(coordinator, spin)
    assert readers[spinner] >= 1
    # Dropped the plain way, the replaced iterator would be destroyed by
    # now: making and reading another one takes many requests to each worker.
    other = reading_iterator(coordinator, second)
    after = _open_by_worker(cluster, first)
    assert after == readers, (after, readers, spinner)
    coordinator.release_iterators(other)
    wait_until(lambda: _open_by_worker(cluster, first)[spinner] == 0, 60,
               "the replaced iterator's file to be closed")
    del iterator


def test_release_iterators_names_what_it_takes(coordinator):
    with pytest.raises(TypeError, match=r"iter\(per_worker_dataset\)"):
        coordinator.release_iterators([1, 2])


def _cluster_job(name, **env):
    """Runs tests/_cluster_job.py `name` on a cluster of its own; its last
    report and its output."""
    code, output = run_child(
        [sys.executable, os.path.join(TESTS, "_cluster_job.py"), name], 160,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **env))
    assert code == 0, output[-6000:]
    return last_report(output), output


def test_release_goes_on_through_a_worker_killed_and_restarted():
    """A worker killed after a release (its iterator then dropped the plain
    way), restarted and re-admitted: its line is made again and holds."""
    result, output = _cluster_job("release_after_restart")
    assert result["readmitted"] is True
    # Before the kill, both workers read and hold the first file.
    assert result["first"] == [1, 1]
    # After the re-admission: the iterators released last are held on both
    # workers while the next ones read; the release after frees them.
    assert result["held"] == [1, 1]
    assert result["reading"] == [1, 1]
    assert result["freed"] == [0, 0]
    # Nothing the lost worker's line failed on is printed at exit.
    assert "Exception ignored" not in output, output[-3000:]
    # Worker 0 kept its process through the re-admission's cluster push:
    # it kept its line too.
    assert 0 not in result["made_again"], result


def test_iterators_replaced_by_a_ps_recovery_are_released():
    """A ps killed and restarted, recovered in a custom loop: the workers
    kept their processes, so the iterators the recovery replaced on them
    are released (held until the next release), not dropped, and each
    keeps its release line: dropped, a line holding an iterator (here one
    released before the loss) would destroy it on the thread serving the
    worker, which held a 10M-row recovery 5-36 s."""
    result, _ = _cluster_job("release_after_ps_recovery")
    assert result["lost"] == [0]
    assert result["held_before"] == [1, 1]
    assert result["reading"] == [1, 1]
    assert result["held"] == [1, 1], result
    assert result["freed"] == [0, 0]
    assert result["made_again"] == [], result


def test_iterators_replaced_when_a_hung_worker_comes_back_are_released():
    """A worker SIGSTOPped until it is seen hung, then SIGCONTed and
    re-admitted: it kept its process, so the iterator its re-admission
    replaced is released (held until the next release), not dropped."""
    result, _ = _cluster_job("release_after_hang", KERAS_PS_HANG_TIMEOUT="3")
    assert result["readmitted"] is True
    assert result["reading"] == 1
    assert result["held"] == 1, result
    assert result["freed"] == 0
