"""How a test's child process reports: one `RESULT {json}` line per report."""

import json

PREFIX = "RESULT "


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
