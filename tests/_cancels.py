"""For the cancellation tests: a call cancelled on its worker for real,
by another closure's error, on the coordinator's real cluster."""

import pytest
import tensorflow as tf

from _polling import wait_until


def spin_from(start):
    """Inside a tf.function: 10**9 cheap loop steps from `start` (minutes
    unless the call is cancelled)."""
    return tf.while_loop(lambda i: i < 10**9, lambda i: i + 1, [start])[0]


@tf.function
def _fails():
    return tf.debugging.check_numerics(tf.constant(float("nan")), "bad")


def cancel_on_its_worker(coordinator, spinning_fn, args=()):
    """Schedules `spinning_fn` (a tf.function that runs until cancelled),
    waits until it runs on a worker, then schedules a closure that fails:
    `join` raises that error and `spinning_fn`'s call is cancelled on its
    worker. Returns that worker's index."""
    spinning = coordinator.schedule(spinning_fn, args=args)
    running = f"'{spinning_fn.__name__}' has run on the worker"
    (line,) = wait_until(
        lambda: [l for l in coordinator.calls_in_flight() if running in l],
        60, f"{spinning_fn.__name__} to run on a worker")
    coordinator.schedule(_fails)
    with pytest.raises(tf.errors.InvalidArgumentError):
        coordinator.join()
    with pytest.raises(tf.errors.CancelledError):
        spinning.fetch()
    return int(line.split()[1])  # "worker <index> (<address>): ..."
