"""Per-worker datasets and values as TF's coordinator has them, on the
shared real cluster (2 workers): `element_spec`, an iterator `type_spec`
that a tf.function's `input_signature` takes, a `tf.data.Dataset` as input;
and where keras_ps differs (how often `dataset_fn` is traced, per-worker
variables), what it does instead."""

import pytest
import tensorflow as tf

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("source", ["dataset_fn", "dataset"])
def test_iterator_type_spec_in_an_input_signature(coordinator, source):
    def dataset_fn():
        return tf.data.Dataset.range(100).map(lambda x: (x, 2 * x)).repeat()

    per_worker = coordinator.create_per_worker_dataset(
        dataset_fn if source == "dataset_fn" else dataset_fn())
    assert per_worker.element_spec == (tf.TensorSpec([], tf.int64),
                                       tf.TensorSpec([], tf.int64))
    iterators = iter(per_worker)

    @tf.function(input_signature=[iterators.type_spec])
    def step(iterator):
        x, doubled = next(iterator)
        return doubled - 2 * x

    results = [coordinator.schedule(step, args=(iterators,))
               for _ in range(6)]
    coordinator.join()
    assert [int(r.fetch()) for r in results] == [0] * 6
    assert len(step._list_all_concrete_functions()) == 1


@pytest.mark.parametrize("reads_the_worker", [False, True])
def test_dataset_fn_is_traced_once_unless_it_reads_the_worker(
        coordinator, reads_the_worker):
    """As in TF, a `dataset_fn` is traced once and its graph runs on every
    worker. A documented difference: one that reads
    `input_context.input_pipeline_id` in Python is traced once per worker,
    each with its own id (TF gives every worker the same context). Python
    side effects in it run once per trace."""
    traces = []

    def dataset_fn(input_context):
        def double(x):
            traces.append(1)  # runs when `map` traces `double`
            return 2 * x
        start = input_context.input_pipeline_id if reads_the_worker else 0
        return tf.data.Dataset.range(start, 8).map(double).repeat()

    coordinator.create_per_worker_dataset(dataset_fn)
    assert len(coordinator.workers) == 2
    assert len(traces) == (2 if reads_the_worker else 1)


def test_per_worker_variable_is_refused_with_the_alternative(strategy,
                                                             coordinator):
    """A documented difference: no `per_worker_variable=True`; a per-worker
    result is returned from the scheduled function and combined on the
    coordinator."""
    with strategy.scope():
        with pytest.raises(ValueError, match=(
                r"per_worker_variable=True.*Return per-worker results from "
                r"the scheduled function")):
            tf.Variable(0.0, per_worker_variable=True)
    counts = coordinator.create_per_worker_dataset(
        lambda: tf.data.Dataset.from_tensors(tf.constant(1.0)).repeat())
    results = [coordinator.schedule(tf.function(lambda it: next(it)),
                                    args=(iter(counts),)) for _ in range(4)]
    coordinator.join()
    assert sum(float(r.fetch()) for r in results) == 4.0
