"""Exactly-once evaluation: every example counted once, even after faults.

The dataset is split into shards. Each shard is one scheduled function that
runs `model.test_step` over the whole shard inside a `keras.StatelessScope`,
so metric updates go into local tensors instead of the metric variables on
the ps, and returns the final metric state. The coordinator adds each
shard's change once. A shard whose worker dies is run again elsewhere; its
lost partial updates were never applied, so nothing is counted twice.

Metric states must be additive (sums and counts), as every built-in Keras
metric's are.
"""

import logging

import keras
import numpy as np
import tensorflow as tf

from keras_ps import _constants
from keras_ps._keras import fit_routing
from keras_ps.coordinator.datasets import serialized
from keras_ps.training.logs import python_logs

logger = logging.getLogger(__name__)


def _shard_function(model, variables, make_dataset, num_shards):
    # Inside a StatelessScope Keras reads every variable it computes a
    # regularization loss of through the scope, so those weights are mapped
    # too (to their values at the start of the shard; evaluation does not
    # change them).
    regularized = [w for w in model.trainable_weights
                   if getattr(w, "regularizer", None) is not None]

    def evaluate_shard(shard_index, initial_state):
        iterator = iter(make_dataset().shard(num_shards, shard_index))
        weights = [(w, tf.identity(w.value)) for w in regularized]

        def body(_, batches, *state):
            optional = iterator.get_next_as_optional()

            def run_step():
                mapping = list(zip(variables, state)) + weights
                with keras.StatelessScope(state_mapping=mapping) as scope:
                    model.test_step(optional.get_value())
                updated = []
                for v, old in zip(variables, state):
                    new = scope.get_current_value(v)
                    updated.append(old if new is None else
                                   tf.cast(new, old.dtype))
                return updated

            state = tf.cond(optional.has_value(), run_step, lambda: list(state))
            batches += tf.cast(optional.has_value(), tf.int64)
            return (tf.logical_not(optional.has_value()), batches, *state)

        _, batches, *final = tf.while_loop(
            lambda done, *_: tf.logical_not(done), body,
            (tf.constant(False), tf.constant(0, tf.int64), *initial_state))
        return batches, final

    return tf.function(evaluate_shard, autograph=False)


def evaluate_exactly_once(model, coordinator, dataset):
    """Evaluates `model` on every element of the finite `dataset` once.

    Returns:
        The metrics as a dict of Python numbers (also left in the model's
        metric variables, as Keras' evaluate leaves them); an empty dict,
        as Keras returns, when `dataset` holds no batch.
    """
    cardinality = int(dataset.cardinality())
    if cardinality == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            "Exact evaluation needs a finite dataset, and this one repeats "
            "forever. Received: a dataset of infinite cardinality. Remove "
            ".repeat() from the evaluation data, or pass steps=N (and "
            "exact=False) to evaluate N batches.")
    strategy = model.distribute_strategy
    fit_routing.symbolic_build(model, strategy, dataset.element_spec)
    model.reset_metrics()
    variables = list(model.metrics_variables)
    initial = [np.asarray(v.numpy()) for v in variables]
    num_shards = coordinator.num_workers * _constants.env_int(
        _constants.EVAL_SHARDS_PER_WORKER_ENV_VAR,
        _constants.DEFAULT_EVAL_SHARDS_PER_WORKER, minimum=1)
    fn = _shard_function(model, variables, serialized(dataset), num_shards)
    initial_state = [tf.constant(value) for value in initial]
    remotes = [coordinator.schedule(fn, args=(tf.constant(i, tf.int64),
                                              initial_state))
               for i in range(num_shards)]
    coordinator.join()
    totals = [value.copy() for value in initial]
    batches = 0
    for remote in remotes:
        shard_batches, shard_state = remote.fetch()
        batches += int(shard_batches)
        for total, start, final in zip(totals, initial, shard_state):
            total += np.asarray(final) - start
    for v, total in zip(variables, totals):
        v.assign(total)
    logger.info("[chief] exact evaluation: %d batches in %d shards over %d "
                "workers", batches, num_shards, coordinator.num_workers)
    if batches == 0:
        # The metrics' initial values would read as a perfect score.
        logger.warning(
            "[chief] evaluate evaluated no batch: the data is empty (a "
            "filter that drops every example?). It returns no metrics, as "
            "Keras does: {} (or [] without return_dict), and fit's epoch logs "
            "get no val_ metrics. Fix: check the evaluation data or fit's "
            "validation_data.")
        return {}
    return python_logs(model.get_metrics_result())
