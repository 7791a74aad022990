"""Exception types TF's coordinator raises where its users catch them:
`ValueError` for a coordinator API used wrongly (keras_ps' error is also the
`TypeError` it raised before), `CancelledError` for a closure that was in
flight when another one failed, even when its worker was lost meanwhile."""

import pytest
import tensorflow as tf

import keras_ps
from keras_ps.coordinator.closures import Closure, ClosureQueue
from keras_ps.errors import ScheduleUsageError

pytestmark = pytest.mark.timeout(120)

APP = tf.errors.InvalidArgumentError(None, None, "assertion failed")


# -- closures in flight on a lost worker after another closure's error -------------
def _started(queue, count):
    closures = [Closure(object(), (), {}, False) for _ in range(count)]
    for c in closures:
        queue.put(c)
    taken = [queue.take(max_pack=1, num_takers=count)[0] for _ in closures]
    assert taken == closures
    return closures


@pytest.mark.parametrize("error_raised_first", [True, False],
                         ids=["after_join_raised", "before_join"])
def test_closure_of_a_preempted_worker_is_cancelled_after_an_error(
        error_raised_first):
    """TF's one-worker-preemption-with-cancellation case, step by step: a
    long closure runs on worker 0, another fails on worker 1, worker 0 is
    lost; the long one's fetch() raises CancelledError, not a rerun."""
    queue = ClosureQueue()
    long_closure, failing = _started(queue, 2)
    queue.mark_failed(1, APP, failing.generation)
    if error_raised_first:
        with pytest.raises(tf.errors.InvalidArgumentError):
            queue.wait()
    queue.put_back([long_closure])  # worker 0 preempted
    if not error_raised_first:
        with pytest.raises(tf.errors.InvalidArgumentError):
            queue.wait()
    with pytest.raises(tf.errors.CancelledError, match="cancelled because "
                                                      "an earlier one failed"):
        long_closure.remote_value.fetch(timeout=1)
    assert queue.idle()
    # Closures scheduled after the error run, and are requeued when lost.
    (later,) = _started(queue, 1)
    queue.put_back([later])
    assert queue.take(max_pack=1, num_takers=1) == [later]
    queue.mark_finished(1)
    queue.wait()


# -- coordinator misuse: ValueError as in TF, TypeError as before -----------------------
def _refused(call):
    with pytest.raises(ValueError) as caught:
        call()
    assert isinstance(caught.value, TypeError)
    assert isinstance(caught.value, keras_ps.KerasPSError)
    assert type(caught.value) is ScheduleUsageError
    return str(caught.value)


def test_remote_value_argument_raises_value_error(coordinator):
    remote = coordinator.schedule(tf.function(lambda: tf.constant(1)))
    message = _refused(lambda: coordinator.schedule(
        tf.function(lambda x: x + 1), args=(remote,)))
    assert "Received: <RemoteValue" in message and ".fetch()" in message
    assert remote.fetch() == 1


def test_python_function_raises_value_error(coordinator):
    def plain_step():
        return 1

    message = _refused(lambda: coordinator.schedule(plain_step))
    assert "fn='plain_step'" in message and "tf.function(fn)" in message


def test_distributed_dataset_iterated_on_coordinator_raises_value_error(
        strategy):
    distributed = strategy.distribute_datasets_from_function(
        lambda context: tf.data.Dataset.range(4))
    message = _refused(lambda: iter(distributed))
    assert "create_per_worker_dataset" in message


def test_experimental_distribute_dataset_is_the_dataset(strategy, coordinator):
    """A documented difference: TF refuses to iterate it on the coordinator;
    keras_ps returns the dataset itself, which works there and as the input
    of `create_per_worker_dataset`."""
    dataset = tf.data.Dataset.range(3)
    distributed = strategy.experimental_distribute_dataset(dataset)
    assert distributed is dataset
    assert [int(x) for x in distributed] == [0, 1, 2]
    iterator = iter(coordinator.create_per_worker_dataset(distributed))
    first = coordinator.schedule(tf.function(lambda it: next(it)),
                                 args=(iterator,))
    assert int(first.fetch()) == 0
