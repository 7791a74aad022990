"""A process that exits while a keras_ps thread traces a function waits for
the trace instead of ending the thread inside TF's C++ call (which aborted
the process: "terminate called ... FATAL: exception not rethrown")."""

import os
import subprocess
import sys
import textwrap

import pytest

from _results import run_child


def _script(directory, text):
    """`text` as a script file in `directory`, for `run_child`, which forks
    a script from the zygote (TF and Keras imported, no TF context made)."""
    path = directory / "script.py"
    path.write_text(text)
    return str(path)


# A daemon thread traces a function of 4,000 ops in a section; the main
# thread returns as soon as the trace has begun, so the interpreter exits
# while it runs. Only a process that waits for the section writes `done`.
SCRIPT = textwrap.dedent("""
    import sys
    import threading

    import tensorflow as tf

    from keras_ps import _exit_guard

    began = threading.Event()

    def body():
        began.set()
        x = tf.constant(0.0)
        for _ in range(2000):
            x = x * 1.0001 + 1.0
        return x

    def trace():
        with _exit_guard.tf_section():
            tf.function(body).get_concrete_function()
            with open(sys.argv[1], "w") as f:
                f.write("done")

    threading.Thread(target=trace, daemon=True).start()
    began.wait()
""")


@pytest.mark.timeout(120)
def test_exit_waits_for_a_trace_under_way(tmp_path):
    marker = tmp_path / "marker"
    code, output = run_child(
        [sys.executable, _script(tmp_path, SCRIPT), str(marker)], 100)
    assert code == 0, output[-3000:]
    assert marker.read_text() == "done"


# Once the exit began, a daemon thread that reaches a section stops there:
# it never enters the TF call (the exit would cut it short).
LATE_SCRIPT = textwrap.dedent("""
    import sys
    import threading
    import time

    from keras_ps import _exit_guard

    go = threading.Event()

    def late():
        go.wait()
        with _exit_guard.tf_section():
            print("ENTERED", flush=True)

    thread = threading.Thread(target=late, daemon=True)
    thread.start()
    assert _exit_guard.wait_for_sections(timeout=5)  # what the exit does
    go.set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until it waits inside tf_section
        frame = sys._current_frames().get(thread.ident)
        names = []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        if "tf_section" in names and "wait" in names:
            print("STOPPED", flush=True)
            break
        time.sleep(0.01)
""")


@pytest.mark.timeout(120)
def test_a_thread_reaching_a_section_after_the_exit_began_stops_there():
    proc = subprocess.run([sys.executable, "-c", LATE_SCRIPT],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["STOPPED"], proc.stdout


# A section inside another of the same thread is part of it: once the exit
# began, the thread goes on through it (stopping there would hold the outer
# section, and the exit would wait for it in vain).
NESTED_SCRIPT = textwrap.dedent("""
    import threading
    import time

    from keras_ps import _exit_guard

    inside, go = threading.Event(), threading.Event()

    def work():
        with _exit_guard.tf_section():
            inside.set()
            go.wait()
            with _exit_guard.tf_section():
                print("NESTED", flush=True)

    threading.Thread(target=work, daemon=True).start()
    inside.wait()
    waited = []
    exit_wait = threading.Thread(  # what the exit does
        target=lambda: waited.append(_exit_guard.wait_for_sections(20)))
    exit_wait.start()
    deadline = time.monotonic() + 60
    while not _exit_guard.exiting() and time.monotonic() < deadline:
        time.sleep(0.01)  # until the exit's wait began
    go.set()
    exit_wait.join()
    print(waited[0], flush=True)
""")


@pytest.mark.timeout(120)
def test_a_section_inside_a_section_goes_on_after_the_exit_began():
    proc = subprocess.run([sys.executable, "-c", NESTED_SCRIPT],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["NESTED", "True"], proc.stdout


# fit with incremental backups on a LocalCluster; a callback raises (a
# user's error) as soon as a compaction is being written in the background:
# the script ends while its thread traces and writes blocks (of 4 KB: about
# 8,000 of them, seconds of writing). With one ps the thread makes the TF
# calls itself; with two, a thread per ps does.
COMPACTION_SCRIPT = textwrap.dedent("""
    import os
    import sys

    os.environ["KERAS_PS_SAVE_CHUNK_BYTES"] = "4096"

    import keras
    import numpy as np

    import keras_ps

    backup_dir, num_ps = sys.argv[1], int(sys.argv[2])
    rows = 200_000


    class RaiseWhileCompacting(keras.callbacks.Callback):
        def __init__(self, backup):
            super().__init__()
            self.backup = backup

        def on_train_batch_end(self, batch, logs=None):
            if self.backup._incremental.compacting:
                raise RuntimeError("the user's error while compacting")


    # Not shut down when the script ends (no `with`): as on a real cluster,
    # the ps answer until this process is gone (its tasks end with it).
    cluster = keras_ps.LocalCluster(num_workers=1, num_ps=num_ps)
    strategy = keras_ps.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=(
            keras_ps.partitioners.FixedShardsPartitioner(num_ps)))
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8,), dtype="int32"),
            keras.layers.Embedding(rows, 16), keras.layers.Flatten(),
            keras.layers.Dense(1)])
        model.compile(keras_ps.optimizers.LazyAdam(1e-3), "mse")
    x = np.random.default_rng(0).integers(0, rows, (256 * 40, 8))
    y = np.zeros((256 * 40, 1), "float32")
    backup = keras_ps.callbacks.BackupAndRestore(
        backup_dir, save_freq=2, incremental=True, max_deltas=2)
    model.fit(x.astype("int32"), y, batch_size=256, epochs=1,
              steps_per_epoch=40, verbose=0,
              callbacks=[backup, RaiseWhileCompacting(backup)])
    print("NEVER RAISED", flush=True)
""")


@pytest.mark.timeout(300)
# One ps (one backup thread) runs apart (-m slow): the suite keeps 2 ps,
# where the exit has two threads' compactions to stop.
@pytest.mark.parametrize("num_ps", [pytest.param(1, marks=pytest.mark.slow),
                                    2])
def test_a_script_ending_during_a_compaction_stops_it_and_exits(num_ps,
                                                                tmp_path):
    code, output = run_child(
        [sys.executable, _script(tmp_path, COMPACTION_SCRIPT),
         str(tmp_path / "backup"), str(num_ps)], 280,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    # The user's error, then an exit that stopped the compaction at its
    # next block (not after its thousands of blocks), never an abort.
    assert code == 1, output[-3000:]
    assert "RuntimeError: the user's error while compacting" in output
    assert "terminate called" not in output, output[-3000:]
    assert "being written in the background is dropped: the process " \
           "exits" in output, output[-3000:]


# The per-ps backup threads' sections are counted before the threads start.
# When one cannot start (Python out of threads), the caller gets the error,
# the thread that did start is waited for, and the section of the one that
# never started ends: the exit does not wait its limit for a thread that
# does not exist.
THREAD_START_SCRIPT = textwrap.dedent("""
    import threading

    from keras_ps import _exit_guard
    from keras_ps.backups import _per_device

    start = threading.Thread.start

    def start_but_the_second_backup_thread(thread):
        if thread.name == "keras_ps-backup-ps1":
            raise RuntimeError("can't start new thread")
        start(thread)

    threading.Thread.start = start_but_the_second_backup_thread
    ran = []
    try:
        _per_device.per_device(ran.append, ["ps0", "ps1"])
    except RuntimeError as error:
        print("RAISED", error, flush=True)
    print("RAN", *ran, flush=True)
    print("EXIT WAITS FOR NOTHING", _exit_guard.wait_for_sections(5))
""")


@pytest.mark.timeout(120)
def test_a_backup_thread_that_cannot_start_leaves_no_section_behind():
    proc = subprocess.run([sys.executable, "-c", THREAD_START_SCRIPT],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "RAISED can't start new thread", "RAN ps0",
        "EXIT WAITS FOR NOTHING True"], proc.stdout
    assert "still run after" not in proc.stderr, proc.stderr[-3000:]
