"""A process that exits while a keras_ps thread traces a function waits for
the trace instead of ending the thread inside TF's C++ call (which aborted
the process: "terminate called ... FATAL: exception not rethrown")."""

import subprocess
import sys
import textwrap

import pytest

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
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(marker)],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
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
