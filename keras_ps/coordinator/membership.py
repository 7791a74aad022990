"""The coordinator's workers: who is a member, who is healthy, who joins.

`Workers` holds one `Worker` (keras_ps/coordinator/worker.py) per worker
task index, follows a new membership while training runs (an elastic
rendezvous moves workers in and out; nobody is restarted) and answers the
questions the rest of the coordinator asks about them: how many take
closures now, whether a new trace is safe, whether `join` has waited too
long for a healthy worker.
"""

import logging
import threading
import time

from keras_ps import errors
from keras_ps.cluster import _network
from keras_ps.coordinator import worker as worker_lib
from keras_ps.coordinator.cut_off import CutOffWorkers
from keras_ps.coordinator.worker_states import GONE

logger = logging.getLogger(__name__)

_S = worker_lib.WorkerState


class Workers:
    """The worker places of one coordinator, by task index.

    Args:
        config: the coordinator's `CoordinatorConfig` (probe and no-worker
            timeouts).
    """

    def __init__(self, config):
        self._config = config
        self._services = None
        self._list = []
        self._lock = threading.Lock()  # membership updates
        self._unhealthy_since = None
        # Workers whose calls fail on a connection while every ps answers.
        self.cut_off = CutOffWorkers(self.in_job, config.cut_off_timeout)

    def start(self, services, addresses):
        """Starts a worker thread for each address (the cluster spec's)."""
        self._services = services
        self._list = [worker_lib.Worker(services, i, address)
                      for i, address in enumerate(addresses)]
        for w in self._list:
            w.start()

    def all(self):
        """The Worker objects now (a new list: a join may replace one)."""
        return list(self._list)

    def count(self):
        """How many worker places there are (left ones included)."""
        return len(self._list)

    def __getitem__(self, index):
        return self._list[index]

    def members(self):
        """For each worker index: is it in the cluster now?"""
        return [w.state in worker_lib.IN_CLUSTER for w in self._list]

    def members_by_index(self):
        """{index: address} of the workers in the cluster now."""
        return {w.index: w.address for w in self._list
                if w.state in worker_lib.IN_CLUSTER}

    def in_job(self):
        """The indices of the workers of the job now, out of training or
        not (not those refused, left or stopped, nor a new member not
        admitted yet)."""
        return [w.index for w in self._list
                if w.state not in GONE and w.state is not _S.JOINING]

    def num_healthy(self):
        """How many workers take closures now."""
        return sum(w.state in worker_lib.RUNNABLE for w in self._list)

    def update(self, addresses):
        """Follows a new membership: `addresses` by task index (`None` for a
        free place). A new address joins, a missing one leaves; an address
        refused as no worker task's is not asked again while it stays."""
        with self._lock:
            addresses = list(addresses)
            for index, address in enumerate(addresses):
                current = self._list[index] if index < len(self._list) else None
                if current is not None and current.address == address and \
                        current.state is not _S.LEFT:
                    continue
                if current is not None:
                    current.leave("left the membership" if address is None
                                  else f"replaced by {address}")
                if address is not None:
                    self._join(index, address)
            for w in self._list[len(addresses):]:
                w.leave("left the membership")
            self._unhealthy_since = None

    def _join(self, index, address):
        worker = worker_lib.Worker(self._services, index, address,
                                   state=_S.JOINING)
        if index < len(self._list):
            self._list[index] = worker
        else:
            self._list.extend(
                worker_lib.Worker(self._services, i, None, state=_S.LEFT)
                for i in range(len(self._list), index))
            self._list.append(worker)
        logger.info("[worker:%d] %s joins", index, address)
        worker.start()

    def mark_unreachable(self, index):
        """A worker whose dataset could not be made: it does not answer."""
        self._list[index].transition(_S.FAILED, "does not answer")

    def admitted(self):
        """A worker was (re)admitted: `join`'s no-worker clock starts over."""
        self._unhealthy_since = None

    def raise_if_none_healthy(self):
        """Raises NoWorkersAvailableError when no worker has been healthy for
        the config's `no_worker_timeout` seconds."""
        if self.num_healthy():
            self._unhealthy_since = None
            return
        now = time.monotonic()
        if self._unhealthy_since is None:
            self._unhealthy_since = now
            logger.warning("[chief] no healthy worker; waiting for one to return")
        timeout = self._config.no_worker_timeout
        if timeout and now - self._unhealthy_since > timeout:
            raise errors.NoWorkersAvailableError(
                f"No worker has been reachable for {timeout:.0f}s "
                f"(workers: {[w.address for w in self._list]}). Restart the "
                "worker tasks, or raise KERAS_PS_NO_WORKER_TIMEOUT.")

    def trace_is_safe(self):
        """False while a worker may be hung (given up as hung, or a member
        not answering a probe now): a function run for the first time is
        registered on every worker, and waits for a hung one."""
        for w in list(self._list):
            if w.state is _S.HUNG:
                return False
            if w.state in worker_lib.IN_CLUSTER and not _network.probe(
                    w.address, self._config.probe_timeout):
                return False
        return True

    def stop(self):
        for w in self._list:
            w.stop()
