"""A coordinator process whose calls get stuck on workers that answer.

The block is real: a read of a named pipe (FIFO) that no one writes blocks
the worker's op in open(2) while its process answers every probe, as a read
of a stalled network filesystem does. Prints JSON lines the test reads.

Usage: python tests/_stuck_job.py iterator|function PIPE
  iterator: worker 1's dataset reads its 40 lines, then the pipe; the other
      worker trains on, the stuck worker is re-admitted once the pipe is
      written to.
  function: the scheduled function itself reads the pipe, wherever it runs.
"""

import logging
import os
import sys
import tempfile
import threading
import time

import tensorflow as tf

import keras_ps
from _results import say

LINES_BEFORE_THE_PIPE = 40


class _Moves(logging.Handler):
    """Collects the workers' state moves the coordinator logs."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.moves = []
        log = logging.getLogger("keras_ps.coordinator.worker")
        log.setLevel(logging.INFO)
        log.addHandler(self)

    def emit(self, record):
        message = record.getMessage()
        if " -> " in message:
            self.moves.append(message)


def _lines_file(count, word):
    fd, path = tempfile.mkstemp(suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.writelines(f"{word} {i}\n" for i in range(count))
    return path


def _write_to(pipe):
    """Opens the pipe for writing (which lets the blocked open return) and
    closes it; in a thread, as the open waits for a reader."""
    def write():
        with open(pipe, "w") as f:
            f.write("released\n")
    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def iterator_stuck(pipe):
    moves = _Moves()
    plenty = _lines_file(100_000, "plenty")
    few = _lines_file(LINES_BEFORE_THE_PIPE, "few")
    with keras_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        coordinator = keras_ps.ClusterCoordinator(strategy)
        with strategy.scope():
            total = tf.Variable(0.0)
            few_read = tf.Variable(0.0)  # steps that ran on a line of `few`

        def dataset_fn(input_context):
            if input_context.input_pipeline_id == 1:
                return tf.data.TextLineDataset([few, pipe])
            return tf.data.TextLineDataset(plenty)

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

        @tf.function
        def step(it):
            line = next(it)
            # Both read the line: an update that does not would run while
            # the read blocks (TF orders ops on different resources freely).
            total.assign_add(tf.cast(tf.strings.length(line) > 0, tf.float32))
            few_read.assign_add(tf.cast(
                tf.strings.regex_full_match(line, "few.*"), tf.float32))

        steps = 400
        for _ in range(steps):
            coordinator.schedule(step, args=(iterator,))
        started = time.monotonic()
        coordinator.join()
        joined_after = time.monotonic() - started
        ran = [w.closures_run for w in coordinator.workers]
        state_while_stuck = coordinator.workers[1].state.value
        total_at_join = float(total.numpy())
        few_at_join = float(few_read.numpy())
        writer = _write_to(pipe)
        back = coordinator.workers[1].wait_until_runnable(timeout=120)
        writer.join(10)
        before = coordinator.workers[1].closures_run
        scheduled_after = 0
        # Rounds of 20 until worker 1 ran one: it reads 20 of its 40 lines
        # at most, so no read blocks again.
        while scheduled_after < 200 and \
                coordinator.workers[1].closures_run == before:
            for _ in range(20):
                coordinator.schedule(step, args=(iterator,))
            scheduled_after += 20
            coordinator.join()
        say(steps=steps, total_at_join=total_at_join, few_at_join=few_at_join,
            joined_after=joined_after, ran=ran,
            state_while_stuck=state_while_stuck, readmitted=back,
            ran_after=coordinator.workers[1].closures_run - before,
            scheduled_after=scheduled_after, total=float(total.numpy()),
            moves=moves.moves)


def function_stuck(pipe):
    moves = _Moves()
    with keras_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        coordinator = keras_ps.ClusterCoordinator(strategy)

        @tf.function
        def read_the_pipe():
            return tf.strings.length(tf.io.read_file(pipe))

        result = coordinator.schedule(read_the_pipe)
        started = time.monotonic()
        try:
            coordinator.join()
            error = None
        except Exception as e:  # what the user sees is the report
            error = e
        raised_after = time.monotonic() - started
        try:
            result.fetch()
            fetched = None
        except Exception as e:
            fetched = type(e).__name__
        states = [w.state.value for w in coordinator.workers]
        say(error_type=type(error).__name__ if error else None,
            is_deadline_exceeded=isinstance(
                error, tf.errors.DeadlineExceededError),
            message=str(error), fetched=fetched, raised_after=raised_after,
            states=states, moves=moves.moves)
        # Let both blocked reads return before the cluster stops.
        for _ in range(2):
            _write_to(pipe).join(10)


if __name__ == "__main__":
    mode, pipe = sys.argv[1], sys.argv[2]
    {"iterator": iterator_stuck, "function": function_stuck}[mode](pipe)
