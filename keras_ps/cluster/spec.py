"""Cluster specs and TF_CONFIG: what the tasks of a cluster are and where.

This module imports TensorFlow only inside the functions that need it, so
`python -m keras_ps.server` parses its configuration without TF's Python API.

Task types: `chief` (the coordinator, runs the user's program), `ps`
(parameter servers), `worker`, and `evaluator` (a sidecar that is never part
of the training cluster).
"""

import abc
import json
import os
import sys

from keras_ps._base_errors import ClusterConfigError

TASK_TYPES = ("chief", "ps", "worker", "evaluator")
# Jobs that take part in the eager training cluster. The evaluator is not one:
# listing it in the server def makes TF's native coordinator hang
# (tensorflow/tensorflow#46169).
TRAINING_JOBS = ("chief", "ps", "worker")
_FIX = "Use a dict like {'ps': ['host:port', ...], 'worker': ['host:port', ...]}."
_TF_CONFIG_FIX = (
    'Expected JSON like {"cluster": {"ps": ["host:port"], "worker": '
    '["host:port"]}, "task": {"type": "worker", "index": 0}}.')


class MembershipWatcher(abc.ABC):
    """A cluster resolver whose workers can change while training runs.

    `keras_ps.ClusterCoordinator` calls `watch` on a resolver of this kind
    and follows the membership it reports; `keras_ps.elastic.
    ElasticClusterResolver` is one. A fixed cluster needs none.
    """

    @abc.abstractmethod
    def watch(self, callback):
        """Calls `callback(worker_addresses)` on every membership change.

        Args:
            callback: takes the worker addresses by task index, `None` for a
                free place (what `ClusterCoordinator.update_workers` takes).

        Returns:
            A handle whose `stop()` ends the watch.
        """

    def ps_address(self, index):
        """Where ps `index` serves now, asked without waiting for workers
        (`cluster_spec()` may wait for them): a coordinator waiting for a
        lost ps follows it there. None (the default): this resolver does
        not learn of ps moves."""
        return None


def _check_address(job, index, address):
    if not isinstance(address, str) or ":" not in address:
        raise ClusterConfigError(
            f"Task {job}:{index} has an invalid address. Received: {address!r}. "
            "Expected 'host:port'."
        )
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterConfigError(
            f"Task {job}:{index} has an invalid address. Received: {address!r}. "
            "Expected 'host:port' with a port in 1..65535."
        )


# Names of this machine's loopback interface: one port there is one server.
_LOOPBACK = {"localhost", "127.0.0.1", "::1", "[::1]", "0.0.0.0"}


def _same_server(address):
    """The address' host (lower case, loopback names as one) and port."""
    host, _, port = address.rpartition(":")
    host = host.lower()
    return ("localhost" if host in _LOOPBACK else host), int(port)


def _tf():
    import tensorflow as tf

    return tf


def _as_dict(spec):
    """A resolver's or a tf.train.ClusterSpec's jobs as a dict (else `spec`)."""
    if isinstance(spec, dict) or "tensorflow" not in sys.modules:
        return spec  # neither can exist without TF
    tf = _tf()
    if isinstance(spec, tf.distribute.cluster_resolver.ClusterResolver):
        spec = spec.cluster_spec()
    if isinstance(spec, tf.train.ClusterSpec):
        spec = spec.as_dict()
    return spec


def normalize_cluster_spec(spec):
    """Validates a cluster spec and returns it as {job: [address, ...]}.

    Args:
        spec: a dict, a `tf.train.ClusterSpec` or a cluster resolver.

    Raises:
        ClusterConfigError: unknown job names, malformed or duplicate addresses,
            or sparse task indices.
    """
    spec = _as_dict(spec)
    if not isinstance(spec, dict):
        raise ClusterConfigError(
            f"A cluster spec must be a dict. Received: {spec!r}. {_FIX}"
        )
    result = {}
    seen = {}
    for job, tasks in spec.items():
        if job not in TASK_TYPES:
            raise ClusterConfigError(
                f"Unknown task type in the cluster spec. Received: {job!r}. "
                f"Expected one of {list(TASK_TYPES)}."
            )
        if isinstance(tasks, dict):
            try:
                indices = sorted(int(i) for i in tasks)
            except (TypeError, ValueError):
                raise ClusterConfigError(
                    f"Job {job!r} keys its tasks by index: 0, 1, ... "
                    f"Received keys {sorted(map(str, tasks))}. Use a list "
                    "of addresses, or a dict like {0: 'host:port'}."
                ) from None
            if indices != list(range(len(indices))):
                raise ClusterConfigError(
                    f"Job {job!r} must number its tasks 0..n-1. Received "
                    f"indices {indices}."
                )
            tasks = [tasks[i] if i in tasks else tasks[str(i)] for i in indices]
        if isinstance(tasks, str) or not isinstance(tasks, (list, tuple)):
            raise ClusterConfigError(
                f"Job {job!r} must list its task addresses. Received: "
                f"{tasks!r}. {_FIX}"
            )
        for i, address in enumerate(tasks):
            _check_address(job, i, address)
            key = _same_server(address)
            if key in seen:
                other, other_address = seen[key]
                spelt = ("" if other_address == address else
                         f" (as {other_address!r} for {other}: one server)")
                raise ClusterConfigError(
                    f"Address {address!r} is used by both {other} and "
                    f"{job}:{i}{spelt}. Every task needs its own host:port."
                )
            seen[key] = (f"{job}:{i}", address)
        result[job] = list(tasks)
    return result


def parse_tf_config(raw=None, require_cluster=True):
    """Parses TF_CONFIG (the environment variable, or `raw`).

    Returns:
        (cluster, task_type, task_index): the validated cluster dict (empty if
        absent and not required), the task type and index.

    Raises:
        ClusterConfigError: malformed JSON, unknown task type, an index outside
            the job, or a missing cluster section.
    """
    if raw is None:
        raw = os.environ.get("TF_CONFIG", "")
    if isinstance(raw, str):
        if not raw.strip():
            raise ClusterConfigError(
                "TF_CONFIG is not set. Set it to JSON like "
                '{"cluster": {...}, "task": {"type": "worker", "index": 0}}.'
            )
        try:
            config = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ClusterConfigError(
                f"TF_CONFIG is not valid JSON ({e.msg} at position {e.pos}). "
                f"Received: {raw[:200]!r}. {_TF_CONFIG_FIX}"
            ) from None
    else:
        config = raw
    if not isinstance(config, dict):
        raise ClusterConfigError(
            f"TF_CONFIG must be a JSON object. Received: {config!r}. "
            f"{_TF_CONFIG_FIX}"
        )
    task = config.get("task")
    if not isinstance(task, dict) or "type" not in task:
        raise ClusterConfigError(
            "TF_CONFIG has no task section. Received: "
            f"task={task!r}. Expected \"task\": {{\"type\": ..., \"index\": ...}}."
        )
    task_type = task["type"]
    if task_type not in TASK_TYPES:
        raise ClusterConfigError(
            f"Unknown task type in TF_CONFIG. Received: type={task_type!r}. "
            f"Expected one of {list(TASK_TYPES)}."
        )
    try:
        task_index = int(task.get("index", 0))
    except (TypeError, ValueError):
        raise ClusterConfigError(
            f"TF_CONFIG task index must be an integer. Received: "
            f"index={task.get('index')!r}. Expected an integer, the task's "
            "position in its job: \"index\": 0 for the first."
        ) from None
    if "cluster" not in config:
        if require_cluster:
            raise ClusterConfigError(
                f"TF_CONFIG has no cluster section (task {task_type}:"
                f"{task_index}). Add \"cluster\": {{\"ps\": [...], "
                "\"worker\": [...]}."
            )
        return {}, task_type, task_index
    cluster = normalize_cluster_spec(config["cluster"])
    if task_type != "evaluator":
        tasks = cluster.get(task_type, [])
        if not 0 <= task_index < len(tasks):
            raise ClusterConfigError(
                f"TF_CONFIG task index is out of range. Received: "
                f"{task_type}:{task_index}, but the cluster lists "
                f"{len(tasks)} {task_type} task(s). "
                + (f"Expected an index from 0 to {len(tasks) - 1}."
                   if tasks else
                   f"Add a {task_type!r} job with this task's address to "
                   "the cluster.")
            )
    return cluster, task_type, task_index


def resolver_from_tf_config():
    """A cluster resolver for this process' TF_CONFIG, validated first."""
    cluster, task_type, task_index = parse_tf_config()
    tf = _tf()
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster),
        task_type=task_type,
        task_id=task_index,
        rpc_layer="grpc",
    )


def resolver_from_spec(spec):
    """A cluster resolver for a plain {job: [addresses]} dict."""
    tf = _tf()
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(normalize_cluster_spec(spec)), rpc_layer="grpc"
    )


def training_cluster(spec):
    """The jobs of `spec` that take part in training (drops the evaluator)."""
    spec = normalize_cluster_spec(spec)
    return {job: tasks for job, tasks in spec.items() if job in TRAINING_JOBS}
