import gc
import threading
import weakref

import pytest
import tensorflow as tf

from _cancels import cancel_on_its_worker, spin_from
from _polling import wait_until
import keras_ps
from keras_ps.coordinator import packing
from keras_ps.coordinator import worker_index, num_workers

pytestmark = pytest.mark.timeout(120)


def test_fetch_of_a_scheduled_sum(strategy, coordinator):
    @tf.function
    def worker_fn(iterator):
        def replica_fn(inputs):
            return tf.math.reduce_sum(inputs)
        return strategy.run(replica_fn, args=(next(iterator),))

    def dataset_fn():
        return tf.data.Dataset.from_tensor_slices([3] * 3)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    result = coordinator.schedule(worker_fn, args=(iterator,))
    assert coordinator.fetch(result) == 3
    assert result.fetch() == 3
    assert result.get().numpy() == 3


def test_scheduled_assign_add(strategy, coordinator):
    with strategy.scope():
        v = tf.Variable(initial_value=0, dtype=tf.int32)

    @tf.function
    def worker_fn():
        v.assign_add(1)
        return v.read_value()

    result = coordinator.schedule(worker_fn)
    coordinator.join()
    assert result.fetch() == 1
    assert v.numpy() == 1


def test_many_packed_steps_each_run_once(strategy, coordinator):
    with strategy.scope():
        total = tf.Variable(0.0)

    def dataset_fn():
        return tf.data.Dataset.from_tensors(1.0).repeat()

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def step(it):
        x = next(it)
        total.assign_add(x)
        return x * 2

    results = [coordinator.schedule(step, args=(iterator,)) for _ in range(300)]
    coordinator.join()
    assert total.numpy() == 300.0  # no failures: exactly once
    assert all(r.fetch() == 2.0 for r in results)
    assert all(w.closures_run > 0 for w in coordinator.workers)


def test_loop_packed_steps_each_run_once_with_their_own_outputs(
        strategy, coordinator):
    # fit's step functions are packed in a loop: one traced function runs
    # packs of any size, each closure gets its own step's outputs back.
    with strategy.scope():
        total = tf.Variable(0, dtype=tf.int64)
    iterator = iter(coordinator.create_per_worker_dataset(
        lambda: tf.data.Dataset.range(10**6)))

    @tf.function
    def step(it):
        x = next(it)
        total.assign_add(x)
        return {"x": x, "pair": tf.stack([x, 2 * x]),
                "worker": tf.cast(worker_index(), tf.int64)}

    packing.loop_packable(step)
    results = [coordinator.schedule(step, args=(iterator,)) for _ in range(300)]
    coordinator.join()
    outputs = [r.fetch() for r in results]
    assert all(o["pair"].tolist() == [o["x"], 2 * o["x"]] for o in outputs)
    # Each worker's elements were each taken once, by one closure.
    for w in (0, 1):
        xs = sorted(int(o["x"]) for o in outputs if o["worker"] == w)
        assert xs == list(range(len(xs)))
    assert total.numpy() == sum(int(o["x"]) for o in outputs)
    assert coordinator._packing.sizes(step) == ["loop"]  # one trace, any size


def test_worker_index_inside_scheduled_function(coordinator):
    @tf.function
    def who():
        return worker_index(), num_workers()

    results = [coordinator.schedule(who) for _ in range(40)]
    coordinator.join()
    seen = {tuple(int(x) for x in r.fetch()) for r in results}
    assert seen <= {(0, 2), (1, 2)}
    assert {i for i, _ in seen} == {0, 1} or len(seen) == 1


def test_dataset_fn_sees_input_context(coordinator):
    def dataset_fn(context):
        return tf.data.Dataset.from_tensors(
            [context.input_pipeline_id, context.num_input_pipelines]).repeat()

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def read(it):
        return next(it), worker_index()

    results = [coordinator.schedule(read, args=(iterator,)) for _ in range(40)]
    coordinator.join()
    for r in results:
        (pipeline, count), index = r.fetch()
        assert pipeline == index and count == 2


def _worker_of_each_element(coordinator, per_worker_dataset):
    iterator = iter(per_worker_dataset)

    @tf.function
    def read(it):
        return next(it), worker_index()

    results = [coordinator.schedule(read, args=(iterator,)) for _ in range(40)]
    coordinator.join()
    return [(int(element), int(index)) for element, index in
            (r.fetch() for r in results)]


def test_a_dataset_fn_that_ignores_the_worker_is_traced_once(coordinator):
    traces = []

    def dataset_fn(context):
        traces.append(context.num_input_pipelines)
        # The worker's index as a tensor given at call time: one trace serves
        # every worker, each still gets its own elements.
        return tf.data.Dataset.from_tensors(worker_index()).repeat()

    pairs = _worker_of_each_element(
        coordinator, coordinator.create_per_worker_dataset(dataset_fn))
    assert traces == [2]
    assert all(element == index for element, index in pairs), pairs


@pytest.mark.parametrize("read_by", ["context", "strategy"])
def test_a_dataset_fn_that_reads_the_worker_is_traced_per_worker(
        strategy, coordinator, read_by):
    traces = []

    def from_context(context):
        traces.append(context.input_pipeline_id)
        return tf.data.Dataset.from_tensors(
            tf.constant(context.input_pipeline_id, tf.int64)).repeat()

    def from_strategy():
        return from_context(strategy.input_context())

    dataset_fn = from_context if read_by == "context" else from_strategy
    pairs = _worker_of_each_element(
        coordinator, coordinator.create_per_worker_dataset(dataset_fn))
    assert sorted(traces) == [0, 1]
    assert all(element == index for element, index in pairs), pairs


def test_datasets_made_call_after_call_do_not_warn_of_retracing(
        coordinator, caplog):
    """A per-worker dataset is made for every fit call, its dataset_fn
    traced per worker when it reads the worker: by the 5th trace TF would
    warn the user to stop creating tf.functions in a loop."""
    import logging
    traces = []

    def dataset_fn(context):
        traces.append(context.input_pipeline_id)
        return tf.data.Dataset.from_tensors(
            tf.constant(context.input_pipeline_id, tf.int64)).repeat()

    caplog.set_level(logging.WARNING, logger="tensorflow")
    for _ in range(4):
        pairs = _worker_of_each_element(
            coordinator, coordinator.create_per_worker_dataset(dataset_fn))
        assert all(element == index for element, index in pairs), pairs
    assert sorted(traces) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [r.getMessage() for r in caplog.records
            if "retracing" in r.getMessage()] == []


@pytest.mark.parametrize("generator", ["random", "numpy"])
def test_a_dataset_fn_that_draws_a_python_seed_is_traced_per_worker(
        coordinator, generator):
    import random

    import numpy as np
    seeds = []

    def dataset_fn():
        seed = (random.randrange(2**31) if generator == "random"
                else int(np.random.randint(2**31)))
        seeds.append(seed)
        return tf.data.Dataset.from_tensors(
            tf.constant(seed, tf.int64)).repeat()

    pairs = _worker_of_each_element(
        coordinator, coordinator.create_per_worker_dataset(dataset_fn))
    # Each worker traced its own dataset_fn, with a seed of its own.
    assert len(seeds) == 2
    assert {element for element, _ in pairs} <= set(seeds)
    by_worker = {index: element for element, index in pairs}
    assert len(set(by_worker.values())) == len(by_worker)


def test_per_worker_dataset_from_dataset(coordinator):
    dataset = tf.data.Dataset.range(5).repeat()
    iterator = iter(coordinator.create_per_worker_dataset(dataset))

    @tf.function
    def read(it):
        return next(it)

    result = coordinator.schedule(read, args=(iterator,))
    assert result.fetch() == 0


def test_application_error_raised_once_then_usable(strategy, coordinator):
    from tensorflow.python.data.experimental.ops import testing

    with strategy.scope():
        x = tf.Variable(1.0)
    # The failing step first waits 0.5 s on its worker and each other step
    # 20 ms, so most of the 200 are still queued when the error comes back.
    delayed = iter(coordinator.create_per_worker_dataset(
        lambda: tf.data.Dataset.from_tensors(0.0).repeat().apply(
            testing.sleep(500000))))

    @tf.function
    def bad(it):
        return tf.debugging.check_numerics(next(it) / 0.0, "loss is NaN")

    slow = iter(coordinator.create_per_worker_dataset(
        lambda: tf.data.Dataset.from_tensors(1.0).repeat().apply(
            testing.sleep(20000))))

    @tf.function
    def ok(it):
        return x + next(it)

    first = coordinator.schedule(bad, args=(delayed,))
    pending = []
    with pytest.raises(tf.errors.InvalidArgumentError, match="loss is NaN"):
        for _ in range(200):
            pending.append(coordinator.schedule(ok, args=(slow,)))
        coordinator.join()
    coordinator.join()  # raised once only
    with pytest.raises(tf.errors.InvalidArgumentError):
        first.fetch()
    outcomes = {"ready": 0, "cancelled": 0, "same_error": 0}
    for r in pending:
        try:
            r.fetch()
            outcomes["ready"] += 1
        except tf.errors.CancelledError:
            outcomes["cancelled"] += 1
        except tf.errors.InvalidArgumentError as e:
            # A call already in flight on the failing worker can come back
            # with the same error (TF's worker reports it again).
            assert "loss is NaN" in str(e)
            outcomes["same_error"] += 1
    assert sum(outcomes.values()) == len(pending)
    assert outcomes["cancelled"] > 0, outcomes
    again = coordinator.schedule(ok, args=(slow,))
    assert again.fetch() == 2.0


def test_outputs_that_cannot_be_copied_back_are_raised_after_one_retry(
        strategy, coordinator):
    # A dataset returned from a scheduled function runs on its worker, but
    # its variant cannot be copied to the coordinator (TF fails the copy
    # with InternalError). After a function ran to its end, a failed copy
    # is retried once (a worker lost at that moment fails it with errors of
    # any type), on whichever worker takes it; the same failure again is
    # raised with what to do, the function having run exactly twice.
    with strategy.scope():
        runs = tf.Variable(0)

    @tf.function
    def returns_a_dataset():
        runs.assign_add(1)
        return tf.data.experimental.to_variant(tf.data.Dataset.range(3))

    result = coordinator.schedule(returns_a_dataset)
    with pytest.raises(tf.errors.InternalError) as raised:
        coordinator.join()
    notes = "\n".join(getattr(raised.value, "__notes__", ()))
    assert "could not be copied from the worker to the coordinator" in \
        notes, notes
    assert "ran to its end 2 times" in notes, notes
    assert runs.numpy() == 2
    with pytest.raises(tf.errors.InternalError):
        result.fetch()
    # The coordinator goes on.
    assert coordinator.schedule(tf.function(lambda: runs + 1)).fetch() == 3


def test_a_dropped_per_worker_dataset_is_freed_at_once(coordinator):
    # Without the garbage collector: a per-worker dataset and its iterator
    # go as soon as the user drops them, so a later re-admission does not
    # make them again on the returning worker. An iterator alone keeps its
    # dataset (it is rebuilt from it).
    gc.disable()
    try:
        dataset = coordinator.create_per_worker_dataset(
            lambda: tf.data.Dataset.range(3).repeat())
        iterator = iter(dataset)
        freed = weakref.ref(dataset)
        del dataset
        assert freed() is not None  # held by its iterator

        @tf.function
        def read(it):
            return next(it)

        assert coordinator.schedule(read, args=(iterator,)).fetch() == 0
        del iterator
        assert freed() is None
    finally:
        gc.enable()


def test_schedule_requires_tf_function(coordinator):
    def plain():
        return 1

    with pytest.raises(TypeError, match="plain.*tf.function"):
        coordinator.schedule(plain)


def test_remote_value_argument_rejected(coordinator):
    @tf.function
    def one():
        return tf.constant(1)

    value = coordinator.schedule(one)
    with pytest.raises(TypeError, match="RemoteValue.*fetch"):
        coordinator.schedule(one, args=(value,))
    coordinator.join()


def test_next_on_per_worker_values(coordinator):
    iterator = iter(coordinator.create_per_worker_dataset(
        lambda: tf.data.Dataset.range(3)))
    with pytest.raises(TypeError, match="inside the tf.function"):
        next(iterator)


def test_dataset_fn_that_creates_variables(coordinator):
    def dataset_fn():
        tf.Variable(1.0, name="oops")
        return tf.data.Dataset.range(3)

    with pytest.raises(ValueError, match="oops.*may not create variables"):
        coordinator.create_per_worker_dataset(dataset_fn)


def test_out_of_range_inside_scheduled_function(coordinator):
    iterator = iter(coordinator.create_per_worker_dataset(
        lambda: tf.data.Dataset.range(1)))

    @tf.function
    def read(it):
        return next(it)

    results = [coordinator.schedule(read, args=(iterator,)) for _ in range(6)]
    with pytest.raises(tf.errors.OutOfRangeError):
        coordinator.join()
    coordinator.join()
    # Nothing is left pending; the closure whose packed call ran out carries
    # the OutOfRangeError, the rest of its pack and the queue are cancelled.
    assert all(r.status.value != "pending" for r in results)
    errors = []
    for r in results:
        try:
            r.fetch()
        except tf.errors.OpError as e:
            errors.append(type(e))
    assert tf.errors.OutOfRangeError in errors


def test_worker_index_outside_function():
    with pytest.raises(RuntimeError, match="inside a tf.function"):
        worker_index()


def test_one_coordinator_per_strategy(strategy, coordinator):
    threads = threading.active_count()
    again = keras_ps.ClusterCoordinator(strategy)
    assert again is coordinator
    assert keras_ps.ClusterCoordinator(strategy, max_pack=coordinator.max_pack) \
        is coordinator
    assert threading.active_count() == threads  # no second set of workers
    with pytest.raises(ValueError, match="already has a coordinator"):
        keras_ps.ClusterCoordinator(strategy, max_pack=coordinator.max_pack + 1)


def test_error_cancels_a_long_function_in_flight(coordinator):
    @tf.function
    def long_running():
        return spin_from(tf.constant(0))

    # Its call is cancelled on its worker by another closure's error: join
    # raises that error, its fetch() CancelledError.
    cancel_on_its_worker(coordinator, long_running)
    # The coordinator goes on: later functions run.
    ok = coordinator.schedule(tf.function(lambda: tf.constant(5)))
    assert ok.fetch() == 5


def test_an_iterator_reads_again_after_an_error_cancelled_its_call(
        coordinator):
    # A call cancelled on its worker may have been inside its iterator's
    # next() (which ends that iterator for good): that worker's datasets are
    # made again, and the same iterator reads on, from their start.
    iterator = iter(coordinator.create_per_worker_dataset(
        lambda: tf.data.Dataset.range(10**6)))

    @tf.function
    def read_then_spin(it):
        return spin_from(next(it))

    @tf.function
    def read(it):
        return worker_index(), next(it)

    spinner = cancel_on_its_worker(coordinator, read_then_spin, (iterator,))
    read_by = {}
    for _ in range(200):
        index, value = coordinator.schedule(read, args=(iterator,)).fetch()
        read_by.setdefault(int(index), []).append(int(value))
        if len(read_by.get(spinner, ())) >= 2:
            break
    assert read_by[spinner][:2] == [0, 1], read_by
    assert all(v == list(range(len(v))) for v in read_by.values()), read_by


def test_cancel_scheduled_drops_pending_and_running_functions(coordinator):
    # A custom loop that ends for its own reason: long functions run on
    # every worker and more wait; all end cancelled, nothing is raised later.
    @tf.function
    def long_running():
        return tf.while_loop(lambda i: i < 10**9, lambda i: i + 1,
                             [tf.constant(0)])[0]

    remotes = [coordinator.schedule(long_running)
               for _ in range(coordinator.num_workers + 3)]

    def running_on_every_worker():
        lines = coordinator.calls_in_flight()
        return len(lines) == coordinator.num_workers and all(
            "closures of 'long_running' has run on the worker for" in line
            for line in lines)

    wait_until(running_on_every_worker, 60, "the long functions to run")
    assert coordinator.cancel_scheduled() is True
    assert coordinator.is_idle()
    for remote in remotes:
        with pytest.raises(tf.errors.CancelledError):
            remote.fetch()
    coordinator.join()  # no error left behind
    assert coordinator.schedule(tf.function(lambda: tf.constant(5))).fetch() == 5


def test_a_call_cancelled_while_traced_is_not_sent(coordinator, caplog):
    # Its trace waits until the call was cancelled: when the trace ends the
    # call is dropped unsent, and its worker's datasets are not made again
    # (as they are after a call cancelled on the worker).
    import logging
    caplog.set_level(logging.INFO, logger="keras_ps.coordinator")
    tracing, may_end = threading.Event(), threading.Event()

    @tf.function
    def slow_to_trace():
        tracing.set()
        may_end.wait(60)
        return tf.constant(1)

    remote = coordinator.schedule(slow_to_trace)
    assert tracing.wait(60), "the function was never traced"
    assert [line.split(": ", 1)[1] for line in coordinator.calls_in_flight()
            ] == ["1 closures of 'slow_to_trace' is being traced"]
    returned = []
    canceller = threading.Thread(
        target=lambda: returned.append(coordinator.cancel_scheduled()))
    canceller.start()
    wait_until(lambda: any("cancelling 1 calls in flight" in r.getMessage()
                           for r in caplog.records),
               30, "the call in flight to be cancelled")
    may_end.set()
    canceller.join(60)
    assert returned == [True]
    with pytest.raises(tf.errors.CancelledError):
        remote.fetch()
    messages = [r.getMessage() for r in caplog.records]
    assert any("1 closures cancelled before they were sent" in m
               for m in messages), messages
    assert not any("cancelled in flight after" in m for m in messages), messages
    assert coordinator.schedule(tf.function(lambda: tf.constant(5))).fetch() == 5


def test_per_worker_dataset_build_element_spec_and_iterator_type_spec(
        coordinator):
    dataset = coordinator.create_per_worker_dataset(
        lambda: tf.data.Dataset.from_tensors(tf.constant([1, 2])).repeat())
    dataset.build()  # made already; building again changes nothing
    assert dataset.element_spec == tf.TensorSpec([2], tf.int32)
    iterators = iter(dataset)
    spec = iterators.type_spec
    assert isinstance(spec, tf.data.IteratorSpec)
    assert spec == tf.data.IteratorSpec(dataset.element_spec)


def test_per_worker_variable_is_refused_with_what_to_do(strategy):
    with strategy.scope():
        with pytest.raises(ValueError, match="per_worker_variable=True"):
            tf.Variable(0.0, per_worker_variable=True)
