"""How a test's child process reports: one `RESULT {json}` line per report."""

import faulthandler
import json
import signal

PREFIX = "RESULT "

# A child that imports this prints every thread's stack on SIGUSR1: a test
# whose child timed out sends it before the kill, so the hang is seen.
faulthandler.register(signal.SIGUSR1, all_threads=True)


def say(**values):
    """Prints one report (in the child process)."""
    print(PREFIX + json.dumps(values), flush=True)


def reports(output):
    """Every report in a child's output, in order."""
    return [json.loads(line[len(PREFIX):]) for line in output.splitlines()
            if line.startswith(PREFIX)]


def last_report(output):
    """The child's last report; fails with its output when there is none."""
    found = reports(output)
    assert found, f"no {PREFIX.strip()} line in the output:\n{output[-3000:]}"
    return found[-1]
