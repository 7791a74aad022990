"""Running one function per device at once, each in a thread with its own
eager executor: how a backup writes, and a restore reads, on every ps at
the same time (keras_ps.backups._io, keras_ps.backups._apply)."""

import threading

from keras_ps import _exit_guard
from keras_ps import _tf_adapter


def per_device(function, devices):
    """[function(device) for device in devices], run at once, each in a
    thread with its own eager executor (an error stays in its thread; the
    first device's error is raised).

    The threads are daemons in exit sections (keras_ps._exit_guard): the
    process' exit waits for them (up to its limit) instead of for the
    whole of their work, and work that asks `_exit_guard.exiting()` between
    its steps (a compaction's blocks) stops at the next."""
    if len(devices) <= 1:
        return [function(d) for d in devices]
    results, errors = [None] * len(devices), [None] * len(devices)

    def run(i, section):
        try:
            with section, _tf_adapter.own_executor():
                results[i] = function(devices[i])
        except BaseException as error:  # noqa: BLE001  (raised below)
            errors[i] = error

    with _exit_guard.tf_section():
        sections = _exit_guard.helper_sections(len(devices))
        threads = [threading.Thread(target=run, args=(i, section), daemon=True,
                                    name=f"keras_ps-backup-{devices[i]}")
                   for i, section in enumerate(sections)]
        started = 0
        try:
            for thread in threads:
                thread.start()
                started += 1
        finally:  # a thread that could not start: its section ends here
            for section in sections[started:]:
                with section:
                    pass
            for thread in threads[:started]:
                thread.join()
    for error in errors:
        if error is not None:
            raise error
    return results
