"""A coordinator process whose calls get stuck on workers that answer.

The block is real: a read of a named pipe (FIFO) that no one writes blocks
the worker's op in open(2) while its process answers every probe, as a read
of a stalled network filesystem does. Prints JSON lines the test reads.

Usage: python tests/_stuck_job.py iterator|function|shard|everywhere PIPE
  iterator: worker 1's dataset reads its 40 lines, then the pipe; the other
      worker trains on, the stuck worker is re-admitted once the pipe is
      written to.
  function: the scheduled function itself reads the pipe, wherever it runs.
  shard: Model.fit on a ShardedInput of files, one of which is the pipe.
  everywhere: every worker's dataset reads its 40 lines, then the pipe.
"""

import contextlib
import logging
import os
import sys
import tempfile
import threading
import time

import keras
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


@contextlib.contextmanager
def _two_workers():
    """A LocalCluster of two workers and a ps: its strategy and coordinator."""
    with keras_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = keras_ps.ParameterServerStrategy(cluster.resolver)
        yield strategy, keras_ps.ClusterCoordinator(strategy)


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
    with _two_workers() as (strategy, coordinator):
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


def _raised_by(run):
    """The exception `run()` raises (what the user sees), or None."""
    try:
        run()
    except Exception as e:
        return e
    return None


def _report_failure(error, moves, coordinator, **extra):
    say(error_type=type(error).__name__ if error else None,
        is_deadline_exceeded=isinstance(error, tf.errors.DeadlineExceededError),
        message=str(error), states=[w.state.value for w in coordinator.workers],
        moves=moves.moves, **extra)


def function_stuck(pipe):
    moves = _Moves()
    with _two_workers() as (strategy, coordinator):

        @tf.function
        def read_the_pipe():
            return tf.strings.length(tf.io.read_file(pipe))

        result = coordinator.schedule(read_the_pipe)
        error = _raised_by(coordinator.join)
        fetched = _raised_by(result.fetch)
        _report_failure(error, moves, coordinator,
                        fetched=type(fetched).__name__ if fetched else None)
        # Let both blocked reads return before the cluster stops.
        for _ in range(2):
            _write_to(pipe).join(10)


def every_worker_stuck(pipe):
    moves = _Moves()
    few = _lines_file(LINES_BEFORE_THE_PIPE, "few")
    with _two_workers() as (strategy, coordinator):
        with strategy.scope():
            total = tf.Variable(0.0)
        iterator = iter(coordinator.create_per_worker_dataset(
            lambda _: tf.data.TextLineDataset([few, pipe])))

        @tf.function
        def step(it):
            total.assign_add(tf.cast(tf.strings.length(next(it)) > 0,
                                     tf.float32))

        for _ in range(400):
            coordinator.schedule(step, args=(iterator,))
        error = _raised_by(coordinator.join)
        _report_failure(error, moves, coordinator,
                        trained=float(total.numpy()))
        _write_to(pipe).join(10)  # lets both blocked reads return


def _read_lines(filename):
    return tf.data.TextLineDataset(filename).map(
        lambda line: (tf.strings.to_number(tf.strings.split(line)[1:2]),
                      tf.constant([1.0])))


def shard_stuck(pipe):
    # Three files of 64 lines and the pipe, a shard each: whichever worker
    # takes the pipe's shard blocks opening it, then so does the other.
    moves = _Moves()
    files = [_lines_file(64, "line") for _ in range(3)]
    data = keras_ps.ShardedInput(files[:1] + [pipe] + files[1:],
                                 read_fn=_read_lines, batch_size=8, seed=1)
    with _two_workers() as (strategy, coordinator):
        with strategy.scope():
            model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse", steps_per_execution=4)
        error = _raised_by(lambda: model.fit(data, epochs=1, verbose=0))
        _report_failure(error, moves, coordinator)
        for _ in range(2):
            _write_to(pipe).join(10)


if __name__ == "__main__":
    mode, pipe = sys.argv[1], sys.argv[2]
    {"iterator": iterator_stuck, "function": function_stuck,
     "shard": shard_stuck, "everywhere": every_worker_stuck}[mode](pipe)
