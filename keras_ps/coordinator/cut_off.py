"""Workers cut off from a parameter server that the coordinator reaches.

A worker whose calls fail on a connection while it answers probes, holds
this job's context and every ps answers the coordinator is most likely
cut off from a ps by the network between the two (a firewall rule or
security group that lets the coordinator through, a broken route): its
calls fail on their first use of that ps, so nothing of them reaches
it (a failed step's updates on the other ps may apply, as for any step
that fails). It is put
out and re-admitted as after any failure, but each round in a row waits
longer before its re-admission (without the wait it was re-admitted
several times a second for as long as the cut lasted, each re-admission
holding every worker's next call a moment), and the user is told once
which worker and what error. A call that runs on it again ends its
rounds. When every worker of the job has been cut off for the config's
`cut_off_timeout` seconds, no worker can train: the job fails with
`NoWorkersAvailableError` naming the cause, never retried for good.
"""

import logging
import re
import threading
import time

from keras_ps import _constants
from keras_ps.errors import NoWorkersAvailableError

logger = logging.getLogger(__name__)

# Seconds before the re-admission of round 2 (round 1, a blip, is
# re-admitted at once); doubled each round, up to MAX_WAIT_S.
FIRST_WAIT_S = 0.5
MAX_WAIT_S = 30.0

# Lines of TF's error text that say nothing of the cause.
_FILLER = re.compile(r"Graph execution error:|Detected at node|<stack trace"
                     r"|File \"|\d+ root error\(s\) found|\[\[|$")
_STATUS = re.compile(r"UNAVAILABLE|DEADLINE_EXCEEDED|ABORTED|CANCELLED"
                     r"|failed to connect|onnection|Socket closed")
_PS_NAMED = re.compile(r"remote target /job:ps/replica:0/task:(\d+)")


def wait_before_readmission(rounds):
    """Seconds to wait before re-admitting a worker put out `rounds` times
    in a row for a cut connection (0 for the first round)."""
    if rounds < 2:
        return 0.0
    return min(MAX_WAIT_S, FIRST_WAIT_S * 2 ** (rounds - 2))


def gist(error):
    """What the user is shown of `error` (never used to classify it): its
    first line naming a status or a connection (else its first line that
    says anything), and the ps tasks its text names."""
    text = str(error)
    lines = [line.strip() for line in text.splitlines()]
    said = [line for line in lines if not _FILLER.match(line)]
    named = [line for line in said if _STATUS.search(line)]
    ps = sorted({int(i) for i in _PS_NAMED.findall(text)})
    return ((named or said or [""])[0][:300]
            + (f" (it names ps {', '.join(map(str, ps))})" if ps else ""))


class CutOffWorkers:
    """Per worker index, the rounds in a row its calls failed on a
    connection while it and every ps answered (thread-safe).

    Args:
        members: () -> the indices of the workers of the job now (those
            out of training included; not those that left).
        timeout: seconds every worker may stay cut off before the job
            fails (0: never).
        clock: () -> seconds (monotonic).
    """

    def __init__(self, members, timeout, clock=time.monotonic):
        self._members, self._timeout, self._clock = members, timeout, clock
        self._lock = threading.Lock()
        # worker index -> [rounds, since (first round), address, gist]
        self._cut = {}

    def put_out(self, index, address, error):
        """Counts a round of worker `index`; returns the job's error when
        every worker of the job has been cut off (2 rounds or more: it
        failed again after a re-admission) for `timeout` seconds, else
        None."""
        now = self._clock()
        with self._lock:
            entry = self._cut.setdefault(index, [0, now, address, ""])
            entry[0] += 1
            entry[2:] = [address, gist(error)]
            rounds = entry[0]
            members = self._members()
            cut = {i: list(self._cut[i]) for i in members
                   if i in self._cut and self._cut[i][0] >= 2}
        if (self._timeout and members and len(cut) == len(members)
                and now - max(e[1] for e in cut.values()) >= self._timeout):
            fatal = every_worker_cut_off(cut, error, self._timeout)
            fatal.__cause__ = error
            return fatal
        if rounds == 2:
            logger.warning(
                "[worker:%d] %s fails its calls on a connection (%s: %s) "
                "while it answers and every ps answers the coordinator: it "
                "is most likely cut off from a ps by the network. Its calls "
                "go to the other workers; it is re-admitted after %.1fs, "
                "then after twice as long each time (at most %.0fs), until "
                "a call runs on it. Check that it can reach every ps "
                "address (a firewall rule, a security group, a route).",
                index, address, type(error).__name__, entry[3],
                wait_before_readmission(rounds), MAX_WAIT_S)
        return None

    def wait(self, index):
        """Seconds worker `index` waits before its next re-admission."""
        with self._lock:
            return wait_before_readmission(self._cut.get(index, [0])[0])

    def wait_out(self, index, changed, out):
        """Waits, while `out()` holds, before the next re-admission of worker
        `index`. `changed`: the worker's condition, notified (under its
        lock) when its state moves (it leaves, the job stops)."""
        wait = self.wait(index)
        if wait:
            with changed:
                changed.wait_for(lambda: not out(), wait)

    def ran(self, index):
        """A call ran on worker `index`: its rounds end."""
        if index not in self._cut:  # the common case, without the lock
            return
        with self._lock:
            entry = self._cut.pop(index, None)
        if entry is not None and entry[0] >= 2:
            logger.warning("[worker:%d] %s runs calls again, %.0fs after it "
                           "was cut off", index, entry[2],
                           self._clock() - entry[1])


def every_worker_cut_off(cut, error, timeout):
    """The job's error when every worker (`cut`: {index: [rounds, since,
    address, gist]}) has failed its calls on a connection for `timeout`
    seconds while it and every ps answered the coordinator."""
    named = "; ".join(f"worker {i} ({entry[2]}): {entry[3]}"
                      for i, entry in sorted(cut.items()))
    return NoWorkersAvailableError(
        "No worker can run a call: every worker's calls have failed on a "
        f"connection ({type(error).__name__}) for {timeout:.0f}s, through "
        "re-admissions, while each worker and every ps answered the "
        f"coordinator's probes. Last errors: {named}. The workers are most "
        "likely cut off from a ps by the network: check that each worker "
        "can reach every ps address of the cluster spec (a firewall rule or "
        "security group that lets only the coordinator through, a ps "
        "listening on an address the workers cannot reach, a route), then "
        "run the job again (with keras_ps.callbacks.BackupAndRestore it "
        "resumes from its last backup). To wait longer for the network, "
        f"set {_constants.CUT_OFF_TIMEOUT_ENV_VAR} to more seconds (0: wait "
        "forever).")
