"""This process' connection to a cluster, as its coordinator.

TF's eager runtime holds one cluster connection per process
(`tf.config.experimental_connect_to_cluster`). Connecting again to the same
cluster would invalidate every remote handle, so strategies on one cluster
share a connection. Connecting to a different cluster replaces it: the
coordinators of the old connection are shut down first (their threads would
otherwise call into handles TF has dropped), and the old strategies refuse to
make new ones.
"""

import logging
import threading
import time

import tensorflow as tf

from keras_ps import _constants
from keras_ps import _exit_guard
from keras_ps import _tf_adapter
from keras_ps.cluster import _dead_peers
from keras_ps.cluster import _network
from keras_ps.errors import ClusterConfigError
from keras_ps.errors import ClusterUnreachableError

logger = logging.getLogger(__name__)

# Errors a lost or restarted task, or a connection dropped under a call,
# can surface as. Any other error type is the call's own.
CONNECTION_ERRORS = (
    tf.errors.UnavailableError,
    tf.errors.DeadlineExceededError,
    tf.errors.AbortedError,
    tf.errors.CancelledError,
)

COORDINATOR_JOB = "chief"
# The coordinator's own device: results are copied to it, and values made on
# it are copied to a task (not made on the task: see strategy._ps_state).
COORDINATOR_DEVICE = f"/job:{COORDINATOR_JOB}/replica:0/task:0/device:CPU:0"
# What a worker task may see: the ps tasks and the coordinator, never another
# worker, so a dead worker cannot break another worker's context.
WORKER_DEVICE_FILTERS = ("/job:ps", f"/job:{COORDINATOR_JOB}")
PS_DEVICE_FILTERS = ("/job:worker", f"/job:{COORDINATOR_JOB}")


class Connection:
    """One connection of this process to one cluster."""

    def __init__(self, jobs):
        self.jobs = jobs
        self.replaced = False
        self._on_replace = []

    def on_replace(self, callback):
        """Calls `callback()` when another cluster's connection replaces this one."""
        self._on_replace.append(callback)

    def _replace(self):
        self.replaced = True
        for callback in self._on_replace:
            callback()


_current = None
_lock = threading.Lock()


def cluster_device_filters(jobs):
    filters = tf.config.experimental.ClusterDeviceFilters()
    for i in range(len(jobs["worker"])):
        filters.set_device_filters("worker", i, list(WORKER_DEVICE_FILTERS))
    for i in range(len(jobs["ps"])):
        filters.set_device_filters("ps", i, list(PS_DEVICE_FILTERS))
    return filters


def connect(spec):
    """The connection to the cluster `spec` ({job: [address, ...]}).

    Waits until every ps and worker task answers (a task still starting or
    restarting is waited for, up to KERAS_PS_CONNECT_TIMEOUT seconds).

    Raises:
        ClusterUnreachableError: some task did not answer in time.
        ClusterConfigError: another process holds the chief's port, or a
            ps or worker address is a gRPC server of another service.
        ValueError: a bad KERAS_PS_PEER_TIMEOUT.
    """
    global _current
    jobs = {job: list(spec[job]) for job in ("ps", "worker")}
    if spec.get(COORDINATOR_JOB):
        jobs[COORDINATOR_JOB] = list(spec[COORDINATOR_JOB][:1])
    # A call to a task whose machine vanished fails within a bound (a bad
    # KERAS_PS_PEER_TIMEOUT is a ValueError before anything connects).
    _dead_peers.watch([a for addresses in jobs.values() for a in addresses])
    with _lock:
        if _current is not None and _current.jobs == jobs:
            return _current
        chief = jobs.get(COORDINATOR_JOB, [None])[0]
        # This process serves as chief:0 at its address in the spec; TF's
        # error when the port is taken ("Could not start gRPC server")
        # names neither. (Connected before with this chief, it holds it.)
        if (chief is not None and (_current is None or _current.jobs.get(
                COORDINATOR_JOB) != [chief])):
            _check_chief_port(chief)
        _wait_until_tasks_answer(jobs)
        _check_tasks_serve_tensorflow(jobs)
        if _current is not None:
            logger.warning(
                "[chief] connecting to another cluster (ps %s, workers %s); "
                "the coordinators of the previous one are shut down",
                jobs["ps"], jobs["worker"])
            _current._replace()
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(jobs), rpc_layer="grpc")
        try:
            tf.config.experimental_connect_to_cluster(
                resolver, job_name=COORDINATOR_JOB, task_index=0,
                make_master_device_default=False,
                cluster_device_filters=cluster_device_filters(jobs))
        except tf.errors.UnknownError as e:
            if chief is not None:  # taken since the check above?
                _check_chief_port(chief, cause=e)
            raise
        # A new kind of eager op must not wait for a stopped task.
        _tf_adapter.eager_ops_as_plain_ops()
        # Nor may a new function hold every thread while it waits for one.
        _tf_adapter.register_functions_without_the_gil(
            _exit_guard.tf_section)
        _current = Connection(jobs)
        return _current


def _check_chief_port(address, cause=None):
    if not _network.port_is_free(_network.split_address(address)[1]):
        raise ClusterConfigError(
            "The coordinator cannot serve as chief:0: the "
            + _network.address_taken(
                COORDINATOR_JOB, 0, address,
                "the cluster spec (TF_CONFIG, or the resolver's)")
            + " Or "
            "leave the chief out of the spec: the coordinator then serves "
            "on a free port of its own.") from cause


def _check_tasks_serve_tensorflow(jobs):
    """Raises if a ps or worker address is a gRPC server of another service
    (TF's error names neither the address nor what it expected)."""
    for job in ("ps", "worker"):
        for i, address in enumerate(jobs[job]):
            refusal = _network.foreign_service(address, 5.0)
            if refusal is not None:
                raise ClusterConfigError(
                    f"{job}:{i} at {address!r} is not a TensorFlow server: "
                    f"it answered TF's WorkerService with {refusal!r}. The "
                    "ps and worker addresses must be TF servers (`python -m "
                    "keras_ps.server`, or tf.distribute.Server). Check the "
                    f"{job} addresses of the cluster spec; a keras_ps "
                    "rendezvous server's address is the rdzv_endpoint of "
                    "ElasticClusterResolver (or the agent's "
                    "--rdzv_endpoint), not a task.")


_SLOW_START_SECONDS = 10.0  # longer than a task of a healthy cluster takes


def _wait_until_tasks_answer(jobs):
    timeout = _constants.env_float(_constants.CONNECT_TIMEOUT_ENV_VAR,
                                   _constants.DEFAULT_CONNECT_TIMEOUT,
                                   minimum=0)
    deadline = time.monotonic() + timeout
    waiting = [(job, i, address) for job in ("ps", "worker")
               for i, address in enumerate(jobs[job])]
    logged = False
    # Said at WARNING (shown without any logging set up) once the wait is
    # longer than a task takes to start: an address may be wrong.
    warn_at = time.monotonic() + min(_SLOW_START_SECONDS, timeout / 2)
    while True:
        waiting = [t for t in waiting if not _network.probe(t[2], 1.0)]
        if not waiting:
            return
        now = time.monotonic()
        if warn_at is not None and now >= warn_at and now < deadline:
            logger.warning(
                "[chief] still waiting for %s to answer; giving up in %.0f s "
                "(%s=%g). Check that they run at those addresses.",
                ", ".join(f"{job}:{i} ({address})"
                          for job, i, address in waiting),
                deadline - now, _constants.CONNECT_TIMEOUT_ENV_VAR, timeout)
            warn_at = None
        if now >= deadline:
            names = ", ".join(f"{job}:{i} ({address})"
                              for job, i, address in waiting)
            raise ClusterUnreachableError(
                f"Task(s) {names} did not answer within {timeout:g}s, so "
                "keras_ps cannot connect to the cluster. Start them "
                "(`python -m keras_ps.server`), check their addresses, or "
                f"raise {_constants.CONNECT_TIMEOUT_ENV_VAR}.")
        if not logged:
            logger.info("[chief] waiting for %s to answer",
                        [f"{job}:{i}" for job, i, _ in waiting])
            logged = True
        time.sleep(0.1)
