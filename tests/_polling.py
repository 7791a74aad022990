"""Waiting on a condition with a deadline, for tests (never a bare sleep)."""

import time


def wait_until(predicate, timeout, what, interval=0.02):
    """Polls `predicate` every `interval` seconds until it returns a truthy
    value, which it returns; fails the test, naming `what`, after `timeout`
    seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
