"""For the backup tests: reading keras_ps.callbacks.BackupAndRestore's
state file, a small model with a table trained row-wise, and a real job in
another process holding a backup directory's lock (in fit, or with a custom
loop's IncrementalBackup)."""

import contextlib
import json
import os
import sys
import threading

from _paths import TESTS
from _polling import wait_until
from _results import start_child


def read_backup_state(backup_dir):
    """The newest backup's state (epoch, step, ...), or None while there is
    none or it is being replaced."""
    try:
        with open(os.path.join(backup_dir, "backup_state.json")) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def table_model(resolver, rows, dim, ids):
    """Embedding(rows, dim) over `ids` ids an example, then Dense(1),
    compiled with keras_ps' LazyAdam (its slots built). A strategy of its
    own over `resolver` (the connection is reused) places the variables
    from the first ps on, as for every other model of the process."""
    import keras

    import keras_ps

    strategy = keras_ps.ParameterServerStrategy(resolver)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((ids,), dtype="int32"),
            keras.layers.Embedding(rows, dim), keras.layers.Flatten(),
            keras.layers.Dense(1)])
        model.compile(keras_ps.optimizers.LazyAdam(0.01), "mse")
        model.optimizer.build(model.trainable_variables)
    return model


@contextlib.contextmanager
def holding_job(spec, backup_dir, mode="hold", timeout=180):
    """A real training job in its own process (tests/_fit_job.py `mode`) on
    the cluster `spec` (a dict), holding `backup_dir`'s lock and waiting
    for a line on its stdin: "hold", inside `fit` with
    `BackupAndRestore(backup_dir)` at the end of its first batch;
    "hold_incremental", with `IncrementalBackup(model, backup_dir)` after
    its first backup. Yields its Popen once it said so, with `.output()`
    (its lines so far); SIGKILLed on the way out unless the test ended
    it.

    A new interpreter, not forked from the test zygote: twice in about
    ten suite runs, a holding job forked from it had its first backup's
    remote call refused by a ps of the session cluster with gRPC's
    "Unable to parse request" (the ps could not read the request), which
    these jobs never met in the many runs they were fresh processes; the
    cause is not known."""
    job = start_child(
        [sys.executable, os.path.join(TESTS, "_fit_job.py"), mode,
         json.dumps({k: list(v) for k, v in spec.items()}), backup_dir],
        stdin=True, fresh=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1",
                 PYTHONFAULTHANDLER="1"))
    lines = []

    def read():
        for line in job.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    job.output = lambda: "".join(lines)
    try:
        wait_until(lambda: "HOLDING\n" in lines or job.poll() is not None,
                   timeout, f"the holding job ({mode}) to hold {backup_dir}")
        assert "HOLDING\n" in lines and job.poll() is None, (
            f"exit code {job.poll()}:\n{job.output()[-6000:]}")
        yield job
    finally:
        if job.poll() is None:
            job.kill()
        job.wait(30)
        reader.join(30)
