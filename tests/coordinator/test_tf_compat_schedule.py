"""`schedule` traces a function outside the strategy's scope (TF's
coordinator traces inside it): a step that calls `optimizer.apply_gradients`
itself (no `strategy.run`) before the optimizer is built cannot make its
slots, and the error says how to fix it; built first, the step trains with
its slots on a ps. On the shared real cluster."""

import re

import keras
import pytest
import tensorflow as tf

pytestmark = pytest.mark.timeout(120)


def _model_and_step(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.01, momentum=0.9)

    @tf.function
    def train_step():
        x, y = tf.constant([[1.0, 2.0]]), tf.constant([[1.0]])
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return model, optimizer, train_step


def test_slots_made_by_the_first_trace_name_the_fix(strategy, coordinator):
    _, _, train_step = _model_and_step(strategy)
    with pytest.raises(RuntimeError) as raised:
        with strategy.scope():
            coordinator.schedule(train_step)
            coordinator.join()
    message = str(raised.value)
    # Keras numbers its names in a process (sgd_9, sequential_6/dense_22).
    assert re.search(r"Optimizer 'sgd(_\d+)?' makes its slot for "
                     r"'sequential(_\d+)?/dense(_\d+)?/kernel'", message), (
        message)
    for needle in ("outside the scope of the keras_ps strategy",
                   "A step given to coordinator.schedule is traced outside",
                   "optimizer.build(model.trainable_variables)",
                   "strategy.run"):
        assert needle in message, message


def test_an_optimizer_built_first_trains_with_its_slots_on_a_ps(
        strategy, coordinator):
    model, optimizer, train_step = _model_and_step(strategy)
    with strategy.scope():
        optimizer.build(model.trainable_variables)
    losses = [coordinator.schedule(train_step) for _ in range(5)]
    coordinator.join()
    assert all(float(loss.fetch()) >= 0 for loss in losses)
    assert int(optimizer.iterations.numpy()) == 5
    slots = [v for v in optimizer.variables if "momentum" in v.path]
    assert len(slots) == 2, [v.path for v in optimizer.variables]
    for slot in slots:
        assert "/job:ps/" in slot.value.device, (slot.path, slot.value.device)
        assert float(tf.reduce_sum(tf.abs(slot.value))) > 0, slot.path


def test_tf_own_coordinator_class_gives_keras_ps_coordinator(strategy,
                                                             coordinator):
    # TF code moving to keras_ps may still make TF's coordinator.
    made = tf.distribute.coordinator.ClusterCoordinator(strategy)
    assert made is coordinator
    assert made.schedule(tf.function(lambda: tf.constant(3))).fetch() == 3
