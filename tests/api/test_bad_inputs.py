"""The bad-input catalogue: each wrong input a user can give keras_ps, the
exception it raises, and that the message names the bad value and the fix.

docs/bad_inputs.md lists the same cases as a table. Every case runs against
real parts: one module-wide in-process cluster (1 ps, 2 workers) for the cases
that need one, a real RendezvousServer with a token on a portpicker port, and
real `python -m keras_ps.server` processes for the command line.
"""

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import portpicker  # noqa: E402
import psutil  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_ps  # noqa: E402
from keras_ps import cluster as cluster_lib  # noqa: E402
from keras_ps import elastic  # noqa: E402
from keras_ps.errors import ClusterConfigError  # noqa: E402
from keras_ps.errors import PartitionerError  # noqa: E402
from keras_ps.sidecar.evaluator import CheckpointMismatchError  # noqa: E402

from _backups import holding_job  # noqa: E402
from _paths import REPO  # noqa: E402
TOKEN = "bad-inputs-s3cret"


# -- shared real parts, each made on first use ------------------------------------
class _Env:
    """What the cases act on. The cluster, strategy, coordinator and
    rendezvous server are created by the first case that needs them and
    shared by the rest of the module."""

    def __init__(self, tmp_path_factory, cluster):
        self._tmp = tmp_path_factory
        self._cluster = cluster
        self._resolver = None
        self._strategy = None
        self._coordinator = None
        self._server = None
        self._clients = []

    def tmp(self):
        return str(self._tmp.mktemp("case"))

    @property
    def resolver(self):
        if self._resolver is None:
            # The session's cluster: a process holds one connection, and
            # the other tests' strategies share it.
            self._resolver = self._cluster.resolver
        return self._resolver

    @property
    def spec(self):
        """The session cluster's spec, for a job of another process."""
        return self._cluster.spec

    @property
    def strategy(self):
        if self._strategy is None:
            self._strategy = keras_ps.ParameterServerStrategy(self.resolver)
        return self._strategy

    def strategy_with(self, partitioner):
        """A second strategy on the same cluster (the connection is reused)."""
        self.strategy  # connect with the plain strategy first
        return keras_ps.ParameterServerStrategy(
            self.resolver, variable_partitioner=partitioner)

    @property
    def coordinator(self):
        if self._coordinator is None:
            self._coordinator = keras_ps.ClusterCoordinator(self.strategy)
        return self._coordinator

    def drain(self):
        """Consumes an error a case left in the coordinator, so the next
        case starts clean."""
        if self._coordinator is not None:
            try:
                self._coordinator.join()
            except Exception:  # noqa: BLE001 - the case already checked it
                pass

    @property
    def rendezvous(self):
        if self._server is None:
            self._server = elastic.RendezvousServer(
                elastic.RendezvousConfig(token=TOKEN, gather_timeout=0.0),
                port=portpicker.pick_unused_port())
            self._server.start()
        return self._server

    def client(self, token=TOKEN):
        client = elastic.RendezvousClient(self.rendezvous.endpoint,
                                          token=token, timeout=5.0,
                                          poll_timeout=1.0)
        self._clients.append(client)
        return client

    def close(self):
        for client in self._clients:
            client.close()
        if self._server is not None:
            self._server.stop(grace=0)
        if self._coordinator is not None:
            self._coordinator.shutdown()


@pytest.fixture(scope="module")
def env(tmp_path_factory, cluster):
    shared = _Env(tmp_path_factory, cluster)
    yield shared
    shared.close()


def full_message(error):
    """What the user reads: the message and any notes keras_ps added."""
    return "\n".join([str(error)] + list(getattr(error, "__notes__", ())))


# -- the catalogue -------------------------------------------------------------------
CASES = []


def case(case_id, exception, *needles, timeout=30):
    """Registers `fn(env)` as a case: it must raise `exception` whose message
    holds every one of `needles` (the bad value and the fix)."""
    def register(fn):
        CASES.append(pytest.param(fn, exception, needles, id=case_id,
                                  marks=pytest.mark.timeout(timeout)))
        return fn
    return register


@contextlib.contextmanager
def _message_names(*texts):
    """Lets the block's error through once its message holds `texts`: the
    values a case knows only when it runs (a port, an address)."""
    try:
        yield
    except Exception as error:
        message = full_message(error)
        missing = [text for text in texts if text not in message]
        assert not missing, f"{missing} not in the message:\n{message}"
        raise


def _spec(**jobs):
    return {job: [f"localhost:{port}" for port in ports]
            for job, ports in jobs.items()}


# TF_CONFIG and cluster specs -------------------------------------------------------
@case("tf_config_unset", ClusterConfigError,
      "TF_CONFIG is not set", "Set it to JSON like")
def tf_config_unset(env):
    saved = os.environ.pop("TF_CONFIG", None)
    try:
        cluster_lib.resolver_from_tf_config()
    finally:
        if saved is not None:
            os.environ["TF_CONFIG"] = saved


@case("tf_config_not_json", ClusterConfigError,
      "not valid JSON", "'{\"cluster\": {\"ps\": ['", "Expected JSON like")
def tf_config_not_json(env):
    cluster_lib.parse_tf_config('{"cluster": {"ps": [')


@case("tf_config_not_an_object", ClusterConfigError,
      "must be a JSON object", "Received: ['worker']", "Expected JSON like")
def tf_config_not_an_object(env):
    cluster_lib.parse_tf_config('["worker"]')


@case("tf_config_no_task", ClusterConfigError,
      "no task section", "task=None", '"task": {"type"')
def tf_config_no_task(env):
    cluster_lib.parse_tf_config(json.dumps({"cluster": _spec(ps=[2001],
                                                             worker=[2002])}))


@case("tf_config_no_cluster", ClusterConfigError,
      "no cluster section", "worker:0", 'Add "cluster"')
def tf_config_no_cluster(env):
    cluster_lib.parse_tf_config('{"task": {"type": "worker", "index": 0}}')


@case("tf_config_unknown_task_type", ClusterConfigError,
      "type='master'", "Expected one of ['chief', 'ps', 'worker', 'evaluator']")
def tf_config_unknown_task_type(env):
    cluster_lib.parse_tf_config(json.dumps({
        "cluster": _spec(ps=[2001], worker=[2002]),
        "task": {"type": "master", "index": 0}}))


@case("tf_config_index_not_int", ClusterConfigError,
      "index='first'", "Expected an integer", '"index": 0')
def tf_config_index_not_int(env):
    cluster_lib.parse_tf_config(json.dumps({
        "cluster": _spec(ps=[2001], worker=[2002]),
        "task": {"type": "worker", "index": "first"}}))


@case("tf_config_index_out_of_range", ClusterConfigError,
      "worker:3", "lists 2 worker task(s)", "Expected an index from 0 to 1")
def tf_config_index_out_of_range(env):
    cluster_lib.parse_tf_config(json.dumps({
        "cluster": _spec(ps=[2001], worker=[2002, 2003]),
        "task": {"type": "worker", "index": 3}}))


@case("cluster_unknown_job", ClusterConfigError,
      "Received: 'trainer'", "Expected one of ['chief', 'ps', 'worker'")
def cluster_unknown_job(env):
    cluster_lib.normalize_cluster_spec(_spec(ps=[2001], trainer=[2002]))


@case("cluster_duplicate_address", ClusterConfigError,
      "'localhost:2001'", "ps:0", "worker:0", "Every task needs its own host:port")
def cluster_duplicate_address(env):
    cluster_lib.normalize_cluster_spec(_spec(ps=[2001], worker=[2001]))


@case("cluster_same_server_two_spellings", ClusterConfigError,
      "'127.0.0.1:2001'", "ps:0", "worker:0",
      "as 'localhost:2001' for ps:0: one server",
      "Every task needs its own host:port")
def cluster_same_server_two_spellings(env):
    # The strings differ: TF failed later with "Context id ... already exists".
    cluster_lib.normalize_cluster_spec({"ps": ["localhost:2001"],
                                        "worker": ["127.0.0.1:2001"]})


@case("cluster_address_without_port", ClusterConfigError,
      "worker:0", "Received: 'localhost'", "Expected 'host:port'")
def cluster_address_without_port(env):
    cluster_lib.normalize_cluster_spec({"ps": ["localhost:2001"],
                                        "worker": ["localhost"]})


@case("cluster_port_out_of_range", ClusterConfigError,
      "'localhost:70000'", "port in 1..65535")
def cluster_port_out_of_range(env):
    cluster_lib.normalize_cluster_spec({"ps": ["localhost:70000"]})


@case("cluster_sparse_indices", ClusterConfigError,
      "'worker'", "indices [0, 2]", "0..n-1")
def cluster_sparse_indices(env):
    cluster_lib.normalize_cluster_spec(
        {"worker": {"0": "localhost:2001", "2": "localhost:2002"}})


@case("cluster_task_keys_not_indices", ClusterConfigError,
      "Received keys ['first']", "keys its tasks by index",
      "Use a list of addresses")
def cluster_task_keys_not_indices(env):
    cluster_lib.normalize_cluster_spec({"ps": {"first": "localhost:2001"}})


@case("cluster_job_not_a_list", ClusterConfigError,
      "Received: 'localhost:2001'", "Use a dict like {'ps': ['host:port'")
def cluster_job_not_a_list(env):
    cluster_lib.normalize_cluster_spec({"ps": "localhost:2001"})


@case("strategy_no_ps_job", ClusterConfigError,
      "no 'ps' job", "Received jobs: ['worker']", "at least one ps")
def strategy_no_ps_job(env):
    keras_ps.ParameterServerStrategy(
        cluster_lib.resolver_from_spec(_spec(worker=[2002])))


@case("strategy_not_a_resolver", TypeError,
      "cluster_resolver={'ps'", "resolver_from_spec")
def strategy_not_a_resolver(env):
    keras_ps.ParameterServerStrategy(_spec(ps=[2001], worker=[2002]))


@case("local_cluster_no_workers", ClusterConfigError,
      "num_workers=0", "at least one worker and one ps")
def local_cluster_no_workers(env):
    keras_ps.LocalCluster(num_workers=0, num_ps=1)


@case("local_cluster_log_dir_is_a_file", ClusterConfigError,
      "is not a directory", "created if missing")
def local_cluster_log_dir_is_a_file(env):
    with tempfile.NamedTemporaryFile() as file:
        keras_ps.LocalCluster(num_workers=1, num_ps=1, log_dir=file.name)


@case("local_cluster_python_cannot_start", RuntimeError,
      "fork server (the process its tasks are forked from",
      "exited with code 1 before it could load TF's server libraries",
      "its last words: ", "fork-server.log")
def local_cluster_python_cannot_start(env):
    # A Python that cannot start (a broken environment handed to the tasks):
    # the process the tasks are forked from exits first.
    keras_ps.LocalCluster(num_workers=1, num_ps=1, log_dir=env.tmp(),
                          env={"PYTHONHOME": "/nonexistent"})


@case("local_cluster_task_refuses_its_env", RuntimeError,
      "Task ps:0 exited with code 2 before it answered",
      "KERAS_PS_DIRECT_IO='true'", "must be 0 (off", "deltas (a delta's",
      "or 1 (every", "ps-0.log")
def local_cluster_task_refuses_its_env(env):
    # The tasks' own environment: the parent's check does not see it, the
    # task's server refuses it, and the cluster's error quotes the task's.
    keras_ps.LocalCluster(num_workers=1, num_ps=1, log_dir=env.tmp(),
                          env={"KERAS_PS_DIRECT_IO": "true"})


@case("local_cluster_negative_intra_op_threads", ClusterConfigError,
      "intra_op_threads=-1", "share this machine's cores", "0 for TF's default")
def local_cluster_negative_intra_op_threads(env):
    keras_ps.LocalCluster(num_workers=1, num_ps=1, intra_op_threads=-1)


def _refused_before_a_task_starts(**kwargs):
    """LocalCluster(**kwargs), which must fail before it starts a process."""
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    try:
        keras_ps.LocalCluster(**kwargs)
    finally:
        started = [child for child in psutil.Process().children(recursive=True)
                   if child.pid not in before]
        assert not started, f"processes started before the error: {started}"


@case("local_cluster_num_workers_a_string", TypeError,
      "num_workers='2' of type str", "must be an integer",
      "Pass an integer, 1 or more (num_workers=2)")
def local_cluster_num_workers_a_string(env):
    # It failed with "'<' not supported between instances of 'str' and 'int'".
    _refused_before_a_task_starts(num_workers="2", num_ps=1)


@case("local_cluster_num_ps_a_float", TypeError,
      "num_ps=1.0 of type float", "Pass an integer, 1 or more")
def local_cluster_num_ps_a_float(env):
    _refused_before_a_task_starts(num_workers=1, num_ps=1.0)


@case("local_cluster_negative_num_ps", ClusterConfigError,
      "num_ps=-1", "at least one worker and one ps", "Pass counts of 1 or more")
def local_cluster_negative_num_ps(env):
    _refused_before_a_task_starts(num_workers=1, num_ps=-1)


@case("local_cluster_env_value_not_a_string", TypeError,
      "env['KERAS_PS_NATIVE']=0", "both strings",
      "Pass env={'KERAS_PS_NATIVE': '0'}")
def local_cluster_env_value_not_a_string(env):
    # It failed in subprocess with "expected str, bytes or os.PathLike
    # object, not int", naming no variable.
    _refused_before_a_task_starts(num_workers=1, num_ps=1,
                                  env={"KERAS_PS_NATIVE": 0})


@case("local_cluster_env_not_a_dict", TypeError,
      "env=['KERAS_PS_NATIVE=0'] of type list",
      "must be a dict of environment variables", "Pass e.g. env={")
def local_cluster_env_not_a_dict(env):
    _refused_before_a_task_starts(num_workers=1, num_ps=1,
                                  env=["KERAS_PS_NATIVE=0"])


@case("local_cluster_log_dir_not_a_path", TypeError,
      "log_dir=3 of type int", "Pass the path of a directory")
def local_cluster_log_dir_not_a_path(env):
    _refused_before_a_task_starts(num_workers=1, num_ps=1, log_dir=3)


@case("local_cluster_start_timeout_a_string", TypeError,
      "start_timeout='60'", "Pass a positive number of seconds")
def local_cluster_start_timeout_a_string(env):
    # It failed only after the tasks had started, comparing seconds.
    _refused_before_a_task_starts(num_workers=1, num_ps=1,
                                  start_timeout="60")


@case("local_cluster_start_timeout_zero", ClusterConfigError,
      "start_timeout=0", "Pass a positive number of seconds")
def local_cluster_start_timeout_zero(env):
    _refused_before_a_task_starts(num_workers=1, num_ps=1, start_timeout=0)


@case("chief_port_taken", ClusterConfigError,
      "The coordinator cannot serve as chief:0", "is already in use",
      "Stop the process holding it",
      "give chief:0 a free port in the cluster spec (TF_CONFIG",
      "leave the chief out of the spec")
def chief_port_taken(env):
    # TF's own error was "Could not start gRPC server", naming no address.
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        chief = f"localhost:{holder.getsockname()[1]}"
        spec = dict(env.resolver.cluster_spec().as_dict(), chief=[chief])
        tf_config = json.dumps({"cluster": spec,
                                "task": {"type": "chief", "index": 0}})
        with _message_names(f"chief:0 ({chief})"):
            _with_env("TF_CONFIG", tf_config,
                      lambda: keras_ps.ParameterServerStrategy(
                          cluster_lib.resolver_from_tf_config()))


@case("cluster_ps_is_the_rendezvous_server", ClusterConfigError,
      "is not a TensorFlow server",
      "UNIMPLEMENTED: this is a keras_ps rendezvous server",
      "must be TF servers (`python -m keras_ps.server`",
      "the rdzv_endpoint of ElasticClusterResolver")
def cluster_ps_is_the_rendezvous_server(env):
    # TF's own error was "Method not found!" from "/job:ps/replica:0/task:0".
    workers = env.resolver.cluster_spec().as_dict()["worker"]
    endpoint = env.rendezvous.endpoint
    with _message_names(f"ps:0 at {endpoint!r}"):
        keras_ps.ParameterServerStrategy(cluster_lib.resolver_from_spec(
            {"ps": [endpoint], "worker": workers}))


# The coordinator ---------------------------------------------------------------------
@case("schedule_python_function", TypeError,
      "fn='plain_step'", "tf.function(fn)")
def schedule_python_function(env):
    def plain_step():
        return 1

    env.coordinator.schedule(plain_step)


@case("schedule_remote_value_argument", TypeError,
      "<RemoteValue", ".fetch()")
def schedule_remote_value_argument(env):
    one = tf.function(lambda: tf.constant(1))
    remote = env.coordinator.schedule(one)
    env.coordinator.schedule(tf.function(lambda x: x + 1), args=(remote,))


@case("next_on_per_worker_values", TypeError,
      "next() was called on PerWorkerValues",
      "Call next(iterator) inside the tf.function")
def next_on_per_worker_values(env):
    dataset = env.coordinator.create_per_worker_dataset(
        lambda: tf.data.Dataset.range(4).repeat())
    next(iter(dataset))


@case("for_loop_over_per_worker_values", TypeError,
      "cannot be iterated on the coordinator", "coordinator.schedule(fn")
def for_loop_over_per_worker_values(env):
    dataset = env.coordinator.create_per_worker_dataset(
        lambda: tf.data.Dataset.range(4).repeat())
    for _ in iter(dataset):
        pass


def _optimizer_made_outside(env):
    with env.strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    return model, keras.optimizers.SGD(0.01, momentum=0.9,
                                       name="made_outside")


_MADE_OUTSIDE = ("Optimizer 'made_outside' was created outside "
                 "`strategy.scope()`", "(_DefaultDistributionStrategy)",
                 "Received: optimizer='made_outside' (SGD) used for",
                 "a weight on /job:ps/",
                 "Fix: create the optimizer inside `with strategy.scope():`")


@case("custom_loop_optimizer_made_outside_scope", ValueError, *_MADE_OUTSIDE)
def custom_loop_optimizer_made_outside_scope(env):
    # TF's coordinator failed with "Mixing different tf.distribute.Strategy
    # objects"; keras_ps' trained with the optimizer's state on the
    # coordinator. Refused when the step is traced, before it runs: the
    # error comes at the next call (here join).
    model, optimizer = _optimizer_made_outside(env)
    before = model.get_weights()

    @tf.function
    def train_step():
        x, y = tf.constant([[1.0, 2.0]]), tf.constant([[1.0]])
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    env.coordinator.schedule(train_step)
    try:
        env.coordinator.join()
    finally:
        assert int(optimizer.iterations.numpy()) == 0
        for kept, now in zip(before, model.get_weights()):
            np.testing.assert_array_equal(kept, now)


@case("optimizer_made_outside_scope_built_for_ps_weights", ValueError,
      *_MADE_OUTSIDE)
def optimizer_made_outside_scope_built_for_ps_weights(env):
    # Under the scope TF failed with "Mixing different tf.distribute.Strategy
    # objects"; outside it the slots were made on the coordinator.
    model, optimizer = _optimizer_made_outside(env)
    with env.strategy.scope():
        optimizer.build(model.trainable_variables)


class DataFileMissing(Exception):
    pass


@case("dataset_fn_raises", DataFileMissing,
      "no such file: /data/train.csv", "dataset_fn", "worker 0",
      "Fix the error in dataset_fn")
def dataset_fn_raises(env):
    def dataset_fn():
        raise DataFileMissing("no such file: /data/train.csv")

    env.coordinator.create_per_worker_dataset(dataset_fn)


@case("dataset_fn_creates_variable", ValueError,
      "name='vocab'", "under strategy.scope() before calling "
      "create_per_worker_dataset")
def dataset_fn_creates_variable(env):
    def dataset_fn():
        table = tf.Variable([1, 2, 3], name="vocab")
        return tf.data.Dataset.range(3).map(lambda i: tf.gather(table, i))

    env.coordinator.create_per_worker_dataset(dataset_fn)


@case("dataset_fn_returns_non_dataset", TypeError,
      "Received: list", "must return a tf.data.Dataset")
def dataset_fn_returns_non_dataset(env):
    env.coordinator.create_per_worker_dataset(lambda: [1, 2, 3])


@case("per_worker_dataset_of_int", TypeError,
      "Received: 42", "needs a dataset_fn or a tf.data.Dataset")
def per_worker_dataset_of_int(env):
    env.coordinator.create_per_worker_dataset(42)


@case("dataset_runs_out_in_scheduled_function", tf.errors.OutOfRangeError,
      "End of sequence", "ran out of data", ".repeat()")
def dataset_runs_out_in_scheduled_function(env):
    dataset = env.coordinator.create_per_worker_dataset(
        lambda: tf.data.Dataset.range(2))
    iterator = iter(dataset)

    @tf.function
    def step(it):
        return next(it)

    for _ in range(8):
        env.coordinator.schedule(step, args=(iterator,))
    env.coordinator.join()


@tf.function
def nan_step():
    loss = tf.math.log(tf.constant(-1.0))
    return tf.debugging.check_numerics(
        loss, "loss is NaN; lower the learning rate")


@case("nan_loss_check_numerics_fetch", tf.errors.InvalidArgumentError,
      "loss is NaN; lower the learning rate", "Tensor had NaN values",
      "scheduled function 'nan_step' failed")
def nan_loss_check_numerics_fetch(env):
    env.coordinator.schedule(nan_step).fetch(timeout=20)


@case("nan_loss_check_numerics_join", tf.errors.InvalidArgumentError,
      "loss is NaN; lower the learning rate", "Tensor had NaN values",
      "scheduled function 'nan_step' failed")
def nan_loss_check_numerics_join(env):
    env.coordinator.schedule(nan_step)
    env.coordinator.join()


@case("max_pack_zero", ValueError,
      "max_pack=0", "Use 1 to turn packing off")
def max_pack_zero(env):
    keras_ps.ClusterCoordinator(env.strategy, max_pack=0)


@case("coordinator_without_strategy", TypeError,
      "strategy=None", "keras_ps.ParameterServerStrategy")
def coordinator_without_strategy(env):
    keras_ps.ClusterCoordinator(None)


def _with_env(name, value, fn):
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        fn()
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


@case("env_max_pack_not_int", ValueError,
      "KERAS_PS_MAX_PACK='lots'", "must be an integer", "Unset it")
def env_max_pack_not_int(env):
    _with_env("KERAS_PS_MAX_PACK", "lots",
              lambda: keras_ps.ClusterCoordinator(env.strategy))


@case("env_max_pack_zero", ValueError,
      "KERAS_PS_MAX_PACK=0", "Use 1 to turn packing off")
def env_max_pack_zero(env):
    _with_env("KERAS_PS_MAX_PACK", "0",
              lambda: keras_ps.ClusterCoordinator(env.strategy))


@case("env_hang_timeout_not_number", ValueError,
      "KERAS_PS_HANG_TIMEOUT='10s'", "must be a number", "Unset it")
def env_hang_timeout_not_number(env):
    _with_env("KERAS_PS_HANG_TIMEOUT", "10s",
              lambda: keras_ps.ClusterCoordinator(env.strategy))


@case("env_cut_off_timeout_negative", ValueError,
      "KERAS_PS_CUT_OFF_TIMEOUT='-1'", "must be at least 0",
      "Unset it to use the default")
def env_cut_off_timeout_negative(env):
    _with_env("KERAS_PS_CUT_OFF_TIMEOUT", "-1",
              lambda: keras_ps.ClusterCoordinator(env.strategy))


@case("env_peer_timeout_below_a_second", ValueError,
      "KERAS_PS_PEER_TIMEOUT='0.5'", "must be 0 (off) or at least 1 second",
      "Unset it for the default 30")
def env_peer_timeout_below_a_second(env):
    _with_env("KERAS_PS_PEER_TIMEOUT", "0.5",
              lambda: keras_ps.ParameterServerStrategy(env.resolver))


@case("env_probe_timeout_negative", ValueError,
      "KERAS_PS_PROBE_TIMEOUT='-1'", "must be at least 0.1",
      "Unset it to use the default")
def env_probe_timeout_negative(env):
    _with_env("KERAS_PS_PROBE_TIMEOUT", "-1",
              lambda: keras_ps.ClusterCoordinator(env.strategy))


@case("env_probe_timeout_too_short", ValueError,
      "KERAS_PS_PROBE_TIMEOUT='0.0001'", "must be at least 0.1",
      "Unset it to use the default")
def env_probe_timeout_too_short(env):
    # Every probe of a healthy worker would time out: it would be set aside
    # as hung and never re-admitted, and fit would wait for ever.
    _with_env("KERAS_PS_PROBE_TIMEOUT", "0.0001",
              lambda: keras_ps.ClusterCoordinator(env.strategy))


@case("env_hang_timeout_not_finite", ValueError,
      "KERAS_PS_HANG_TIMEOUT='nan'", "must be a finite number",
      "Unset it to use the default")
def env_hang_timeout_not_finite(env):
    _with_env("KERAS_PS_HANG_TIMEOUT", "nan",
              lambda: keras_ps.ClusterCoordinator(env.strategy))


@case("env_readmit_workers_not_a_switch", ValueError,
      "KERAS_PS_READMIT_WORKERS='2'", "must be 0 (off) or 1 (on)",
      "Unset it to use the default 1")
def env_readmit_workers_not_a_switch(env):
    _with_env("KERAS_PS_READMIT_WORKERS", "2",
              lambda: keras_ps.ClusterCoordinator(env.strategy))


@case("env_native_not_a_switch", ValueError,
      "KERAS_PS_NATIVE='false'", "must be 0 (off) or 1 (on)")
def env_native_not_a_switch(env):
    # "false" once left the kernels on: only "0" turned them off.
    _with_env("KERAS_PS_NATIVE", "false", lambda: keras_ps.LocalCluster(
        num_workers=1, num_ps=1, log_dir=env.tmp()))


@case("env_direct_io_not_a_switch", ValueError,
      "KERAS_PS_DIRECT_IO='yes'", "must be 0 (off, the default",
      "deltas (a delta's row files with O_DIRECT", "or 1 (every row file",
      "Unset it for the default")
def env_direct_io_not_a_switch(env):
    # The C++ writer takes only "1" and "deltas" as on: "yes" would have
    # left it off without a word.
    _with_env("KERAS_PS_DIRECT_IO", "yes", lambda: keras_ps.LocalCluster(
        num_workers=1, num_ps=1, log_dir=env.tmp()))


@case("env_stuck_timeout_not_seconds", ValueError,
      "KERAS_PS_STUCK_TIMEOUT='20s'", "number of seconds or 'auto'",
      "0 to turn it off")
def env_stuck_timeout_not_seconds(env):
    _with_env("KERAS_PS_STUCK_TIMEOUT", "20s",
              lambda: keras_ps.ClusterCoordinator(env.strategy))


@case("env_stuck_timeout_negative", ValueError,
      "stuck_timeout=-5.0", "0 (never) or a positive number")
def env_stuck_timeout_negative(env):
    _with_env("KERAS_PS_STUCK_TIMEOUT", "-5",
              lambda: keras_ps.ClusterCoordinator(env.strategy))


@case("env_stuck_timeout_without_watchdog", ValueError,
      "stuck_timeout=30.0", "hang_timeout=0.0", "watchdog that gives calls "
      "up is off", "set hang_timeout (KERAS_PS_HANG_TIMEOUT) to a positive",
      "or unset KERAS_PS_STUCK_TIMEOUT")
def env_stuck_timeout_without_watchdog(env):
    _with_env("KERAS_PS_HANG_TIMEOUT", "0", lambda: _with_env(
        "KERAS_PS_STUCK_TIMEOUT", "30",
        lambda: keras_ps.ClusterCoordinator(env.strategy)))


@case("env_stuck_timeout_below_hang_timeout", ValueError,
      "stuck_timeout=5.0", "hang_timeout=10.0",
      "only once it has run the hang timeout",
      "set stuck_timeout (KERAS_PS_STUCK_TIMEOUT) to at least hang_timeout")
def env_stuck_timeout_below_hang_timeout(env):
    _with_env("KERAS_PS_STUCK_TIMEOUT", "5",
              lambda: keras_ps.ClusterCoordinator(env.strategy))


# Model.fit ----------------------------------------------------------------------------
def _model(strategy=None, compiled=True):
    def build():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        if compiled:
            model.compile(optimizer="sgd", loss="mse")
        return model

    if strategy is None:
        return build()
    with strategy.scope():
        return build()


X = np.zeros((16, 4), "float32")
Y = np.zeros((16, 1), "float32")


@case("compile_model_made_outside_scope", ValueError,
      "Model 'made_outside' was created outside `strategy.scope()`",
      "'made_outside/dense", "is on /job:", "train it on the coordinator",
      "Create the model inside `with strategy.scope():`")
def compile_model_made_outside_scope(env):
    # Keras 3 keeps the strategy current when a model is created: this one
    # would have trained on the coordinator without a word.
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)],
                             name="made_outside")
    with env.strategy.scope():
        model.compile(optimizer="sgd", loss="mse")


@case("embedding_id_past_the_table", tf.errors.InvalidArgumentError,
      "An id is out of range for", "a table of 10 rows",
      "ids must be less than 10", "input_dim", "IntegerLookup",
      "The largest id:] [12]")
def embedding_id_past_the_table(env):
    # In 2 shards of 5 rows, id 12 reached the second as its row 7, and
    # TF's error named that: "indices[0] = 7 is not in [0, 5)".
    strategy = env.strategy_with(keras_ps.partitioners.FixedShardsPartitioner(2))
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,), dtype="int32"),
                                  keras.layers.Embedding(10, 2),
                                  keras.layers.Flatten()])
    model.predict(np.array([[3], [12]], "int32"), verbose=0)


@case("fit_without_steps_per_epoch", ValueError,
      "steps_per_epoch=None", "Pass steps_per_epoch=<number of batches")
def fit_without_steps_per_epoch(env):
    _model(env.strategy).fit(X, Y, epochs=1, verbose=0)


@case("fit_steps_per_epoch_zero", ValueError,
      "steps_per_epoch=0", "must be a positive integer")
def fit_steps_per_epoch_zero(env):
    _model(env.strategy).fit(X, Y, epochs=1, steps_per_epoch=0, verbose=0)


@case("fit_validation_freq_zero", ValueError,
      "validation_freq=0", "a positive integer", "a list of the epochs")
def fit_validation_freq_zero(env):
    _model(env.strategy).fit(X, Y, epochs=1, steps_per_epoch=2, verbose=0,
                             validation_data=(X, Y), validation_freq=0)


@case("fit_validation_data_infinite", ValueError,
      "validation_data of infinite cardinality", "validation_steps=None",
      "remove .repeat()", "pass validation_steps=N")
def fit_validation_data_infinite(env):
    repeated = tf.data.Dataset.from_tensor_slices((X, Y)).batch(4).repeat()
    # A callback that fails the test if a step trains: the check comes first.
    _model(env.strategy).fit(X, Y, epochs=1, steps_per_epoch=2, verbose=0,
                             validation_data=repeated,
                             callbacks=[_NoTrainingStep()])


@case("predict_infinite_without_steps", ValueError,
      "infinite cardinality and steps=None", "remove .repeat()",
      "pass steps=N")
def predict_infinite_without_steps(env):
    repeated = tf.data.Dataset.from_tensor_slices(X).batch(4).repeat()
    _model(env.strategy).predict(repeated, verbose=0,
                                 callbacks=[_NoPredictStep()])


@case("predict_dataset_creator_infinite_without_steps", ValueError,
      "infinite cardinality and steps=None", "pass steps=N")
def predict_dataset_creator_infinite_without_steps(env):
    def dataset_fn(input_context):
        return tf.data.Dataset.from_tensor_slices(X).batch(4).repeat()
    _model(env.strategy).predict(keras_ps.DatasetCreator(dataset_fn),
                                 verbose=0, callbacks=[_NoPredictStep()])


class _NoPredictStep(keras.callbacks.Callback):
    def on_predict_batch_begin(self, batch, logs=None):
        raise AssertionError("a batch was predicted before the check")


class _NoTrainingStep(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        raise AssertionError("a step was scheduled before the check")


@case("env_eval_shards_per_worker_zero", ValueError,
      "KERAS_PS_EVAL_SHARDS_PER_WORKER='0'", "must be at least 1",
      "Unset it to use the default 4")
def env_eval_shards_per_worker_zero(env):
    model = _model(env.strategy)
    _with_env("KERAS_PS_EVAL_SHARDS_PER_WORKER", "0",
              lambda: model.evaluate(X, Y, batch_size=4, verbose=0))


@case("env_save_chunk_bytes_zero", ValueError,
      "KERAS_PS_SAVE_CHUNK_BYTES='0'", "must be at least 1",
      "Unset it to use the default")
def env_save_chunk_bytes_zero(env):
    model = _model(env.strategy)
    path = os.path.join(env.tmp(), "model.weights.h5")
    _with_env("KERAS_PS_SAVE_CHUNK_BYTES", "0",
              lambda: model.save_weights(path))


def _fit_refused_before_a_step(model, callback):
    """Fits `model` with `callback`; the error must come before any step
    is scheduled (`_NoTrainingStep`)."""
    model.fit(X, Y, epochs=2, steps_per_epoch=2, verbose=0,
              validation_data=(X, Y), callbacks=[_NoTrainingStep(), callback])


@case("env_save_chunk_bytes_with_backup", ValueError,
      "KERAS_PS_SAVE_CHUNK_BYTES='64M'", "must be an integer",
      "Unset it to use the default")
def env_save_chunk_bytes_with_backup(env):
    # Read when a backup is written: refused when fit starts, not after
    # the first epoch and its validation.
    model = _model(env.strategy)
    backup = keras_ps.callbacks.BackupAndRestore(env.tmp())
    _with_env("KERAS_PS_SAVE_CHUNK_BYTES", "64M",
              lambda: _fit_refused_before_a_step(model, backup))


@case("env_native_with_backup", ValueError,
      "KERAS_PS_NATIVE='false'", "must be 0 (off) or 1 (on)",
      "Unset it to use the default")
def env_native_with_backup(env):
    # Read by an incremental backup's first write.
    model = _model(env.strategy)
    backup = keras_ps.callbacks.BackupAndRestore(env.tmp(), incremental=True)
    _with_env("KERAS_PS_NATIVE", "false",
              lambda: _fit_refused_before_a_step(model, backup))


@case("env_save_chunk_bytes_with_sidecar_checkpoint", ValueError,
      "KERAS_PS_SAVE_CHUNK_BYTES='0'", "must be at least 1",
      "Unset it to use the default")
def env_save_chunk_bytes_with_sidecar_checkpoint(env):
    model = _model(env.strategy)
    writer = keras_ps.callbacks.SidecarCheckpoint(env.tmp())
    _with_env("KERAS_PS_SAVE_CHUNK_BYTES", "0",
              lambda: _fit_refused_before_a_step(model, writer))


@case("fit_negative_batch_size", ValueError,
      "batch_size=-4", "must be a positive integer",
      "None for the default 32")
def fit_negative_batch_size(env):
    _model(env.strategy).fit(X, Y, batch_size=-4, epochs=1,
                             steps_per_epoch=2, verbose=0)


@case("fit_fractional_batch_size", ValueError,
      "batch_size=8.5", "must be a positive integer")
def fit_fractional_batch_size(env):
    _model(env.strategy).fit(X, Y, batch_size=8.5, epochs=1,
                             steps_per_epoch=2, verbose=0)


@case("fit_negative_validation_batch_size", ValueError,
      "validation_batch_size=-1", "must be a positive integer")
def fit_negative_validation_batch_size(env):
    # Refused before the first epoch trains, not when validation starts.
    _model(env.strategy).fit(X, Y, epochs=1, steps_per_epoch=2, verbose=0,
                             validation_data=(X, Y), validation_batch_size=-1,
                             callbacks=[_NoTrainingStep()])


@case("evaluate_negative_batch_size", ValueError,
      "batch_size=-2", "must be a positive integer")
def evaluate_negative_batch_size(env):
    _model(env.strategy).evaluate(X, Y, batch_size=-2, verbose=0)


def _no_batch():
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(4).filter(
        lambda x, y: False)


@case("fit_empty_dataset", ValueError,
      "The data given to fit yields no batch", "no .repeat() is needed",
      "a filter that drops every example")
def fit_empty_dataset(env):
    _model(env.strategy).fit(_no_batch(), epochs=1, steps_per_epoch=3,
                             verbose=0)


@case("fit_empty_dataset_of_known_size", ValueError,
      "The data given to fit yields no batch", "check the data")
def fit_empty_dataset_of_known_size(env):
    # tf.data knows it is empty: refused before anything is scheduled.
    empty = tf.data.Dataset.from_tensor_slices((X[:0], Y[:0])).batch(4)
    _model(env.strategy).fit(empty, epochs=1, steps_per_epoch=3, verbose=0,
                             callbacks=[_NoTrainingStep()])


@case("evaluate_steps_empty_dataset", ValueError,
      "The data given to evaluate yields no batch", "no .repeat() is needed")
def evaluate_steps_empty_dataset(env):
    _model(env.strategy).evaluate(_no_batch(), steps=3, verbose=0)


@case("fit_numpy_mismatched_lengths", ValueError,
      "x has 16 rows", "y has 10 rows", "same number of rows",
      "pass arrays of equal length")
def fit_numpy_mismatched_lengths(env):
    _model(env.strategy).fit(X, Y[:10], epochs=1, steps_per_epoch=2,
                             verbose=0)


@case("fit_python_generator", TypeError,
      "x of type generator", "tf.data.Dataset.from_generator",
      "DatasetCreator")
def fit_python_generator(env):
    batches = ((X, Y) for _ in range(3))
    _model(env.strategy).fit(batches, epochs=1, steps_per_epoch=2, verbose=0)


@case("fit_dataset_with_y", ValueError,
      "y=ndarray", "y and sample_weight must be None")
def fit_dataset_with_y(env):
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(4)
    _model(env.strategy).fit(dataset, Y, epochs=1, steps_per_epoch=2,
                             verbose=0)


@case("fit_class_weight", ValueError,
      "class_weight={0: 1.0}", "(x, y, sample_weight)")
def fit_class_weight(env):
    _model(env.strategy).fit(X, Y, class_weight={0: 1.0}, epochs=1,
                             steps_per_epoch=2, verbose=0)


# Dynamic data shards (keras_ps.ShardedInput) --------------------------------------
def _read_records(filename):
    spec = {"x": tf.io.FixedLenFeature([4], tf.float32),
            "y": tf.io.FixedLenFeature([1], tf.float32)}
    return tf.data.TFRecordDataset(filename).map(
        lambda r: tuple(tf.io.parse_single_example(r, spec).values()))


def _record_files(directory, count, records=8):
    paths = []
    for f in range(count):
        path = os.path.join(directory, f"part-{f}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for _ in range(records):
                writer.write(tf.train.Example(features=tf.train.Features(
                    feature={"x": tf.train.Feature(float_list=tf.train.FloatList(
                        value=[0.0] * 4)),
                        "y": tf.train.Feature(float_list=tf.train.FloatList(
                            value=[0.0]))})).SerializeToString())
        paths.append(path)
    return paths


@case("sharded_input_no_file_matches", ValueError,
      "no file matching", "Received: data='/nonexistent/train-*.tfrecord'",
      "check the path")
def sharded_input_no_file_matches(env):
    keras_ps.ShardedInput("/nonexistent/train-*.tfrecord",
                          read_fn=_read_records)


@case("sharded_input_files_without_read_fn", ValueError,
      "needs read_fn", "Received: read_fn=None with 2 files",
      "read_fn=lambda f: tf.data.TFRecordDataset(f)")
def sharded_input_files_without_read_fn(env):
    keras_ps.ShardedInput(["a.tfrecord", "b.tfrecord"])


@case("sharded_input_empty_arrays", ValueError,
      "received no records", "an empty arrays", "check the data")
def sharded_input_empty_arrays(env):
    keras_ps.ShardedInput((np.zeros((0, 4)), np.zeros((0, 1))))


@case("sharded_input_infinite_dataset", ValueError,
      "needs finite data", "infinite cardinality", "remove .repeat()")
def sharded_input_infinite_dataset(env):
    keras_ps.ShardedInput(tf.data.Dataset.range(4).repeat())


def _forever_filtered():
    """A dataset that repeats forever behind a filter: tf.data does not
    know its size, so ShardedInput counts it."""
    return tf.data.Dataset.range(4).repeat().filter(lambda n: n >= 0)


def _forever_generated():
    def forever():
        while True:
            yield np.zeros(4, "float32")

    return tf.data.Dataset.from_generator(
        forever, output_signature=tf.TensorSpec([4], tf.float32))


@case("sharded_input_repeat_then_filter", ValueError,
      "gave up counting", "found no end", "KERAS_PS_COUNT_TIMEOUT=1",
      "remove .repeat()", "assert_cardinality(N)")
def sharded_input_repeat_then_filter(env):
    _with_env("KERAS_PS_COUNT_TIMEOUT", "1",
              lambda: keras_ps.ShardedInput(_forever_filtered()))


@case("sharded_input_endless_generator", ValueError,
      "gave up counting", "a generator that never stops",
      "KERAS_PS_COUNT_TIMEOUT=1", "assert_cardinality(N)")
def sharded_input_endless_generator(env):
    _with_env("KERAS_PS_COUNT_TIMEOUT", "1",
              lambda: keras_ps.ShardedInput(_forever_generated()))


@case("sharded_input_read_fn_with_arrays", ValueError,
      "only for a list of files", "with data of type ndarray",
      "dataset.map(fn)")
def sharded_input_read_fn_with_arrays(env):
    keras_ps.ShardedInput(X, read_fn=_read_records)


@case("fit_sharded_with_steps_per_epoch", ValueError,
      "takes no steps_per_epoch", "steps_per_epoch=5",
      "drop steps_per_epoch")
def fit_sharded_with_steps_per_epoch(env):
    _model(env.strategy).fit(keras_ps.ShardedInput((X, Y)), epochs=1,
                             steps_per_epoch=5, verbose=0)


@case("evaluate_sharded_input", TypeError,
      "does not take a ShardedInput", "Received: x=ShardedInput(",
      "finite tf.data.Dataset")
def evaluate_sharded_input(env):
    _model(env.strategy).evaluate(keras_ps.ShardedInput((X, Y)), verbose=0)


@case("fit_sharded_missing_file", keras_ps.shards.ShardReadError,
      "Shard 2 of 3", "missing.tfrecord", "failed on 3 attempts",
      "NotFoundError", "check that the file exists", timeout=90)
def fit_sharded_missing_file(env):
    directory = env.tmp()
    files = _record_files(directory, 2) + [
        os.path.join(directory, "missing.tfrecord")]
    _model(env.strategy).fit(
        keras_ps.ShardedInput(files, read_fn=_read_records, shuffle=False),
        epochs=1, verbose=0)


@case("fit_sharded_corrupt_record", keras_ps.shards.ShardReadError,
      "corrupt.tfrecord", "failed on 2 attempts", "DataLossError",
      "read_fn parses its records", timeout=90)
def fit_sharded_corrupt_record(env):
    directory = env.tmp()
    corrupt = os.path.join(directory, "corrupt.tfrecord")
    files = _record_files(directory, 1)
    with open(files[0], "rb") as good, open(corrupt, "wb") as bad:
        data = bytearray(good.read())
        data[20] ^= 0xFF  # flips a byte inside the first record
        bad.write(bytes(data))
    _model(env.strategy).fit(
        keras_ps.ShardedInput([corrupt] + files, read_fn=_read_records,
                              max_attempts=2),
        epochs=1, verbose=0)


@case("fit_not_compiled", ValueError,
      "not compiled", "call `compile()` before `fit()`")
def fit_not_compiled(env):
    _model(env.strategy, compiled=False).fit(X, Y, steps_per_epoch=2,
                                             verbose=0)


@case("dataset_creator_not_callable", TypeError,
      "dataset_fn='train.csv'", "callable dataset_fn(input_context)")
def dataset_creator_not_callable(env):
    keras_ps.DatasetCreator("train.csv")


# Partitioners -------------------------------------------------------------------------
def _variable_with(env, partitioner):
    with env.strategy_with(partitioner).scope():
        tf.Variable(tf.zeros([8, 4]), name="embedding")


@case("partitioner_returns_int", PartitionerError,
      "'embedding'", "returned 2", "not a list", "[num_shards, 1]")
def partitioner_returns_int(env):
    _variable_with(env, lambda shape, dtype, axis=0: 2)


@case("partitioner_wrong_length", PartitionerError,
      "returned [2]", "1 entries", "Expected 2 entries", "[num_shards, 1]")
def partitioner_wrong_length(env):
    _variable_with(env, lambda shape, dtype, axis=0: [2])


@case("partitioner_zero_shards", PartitionerError,
      "returned [0, 1]", "entry 0 at axis 0", "positive ints: [num_shards, 1]")
def partitioner_zero_shards(env):
    _variable_with(env, lambda shape, dtype, axis=0: [0, 1])


@case("partitioner_negative_shards", PartitionerError,
      "returned [-3, 1]", "entry -3 at axis 0", "[num_shards, 1]")
def partitioner_negative_shards(env):
    _variable_with(env, lambda shape, dtype, axis=0: [-3, 1])


@case("partitioner_axis_1", PartitionerError,
      "returned [1, 2]", "partitions axis 1", "return [num_shards, 1]")
def partitioner_axis_1(env):
    _variable_with(env, lambda shape, dtype, axis=0: [1, 2])


@case("partitioner_not_callable", TypeError,
      "variable_partitioner=4", "must be callable")
def partitioner_not_callable(env):
    keras_ps.ParameterServerStrategy(env.resolver, variable_partitioner=4)


@case("partitioner_a_class", TypeError,
      "variable_partitioner=<class", "FixedShardsPartitioner'>",
      "e.g. FixedShardsPartitioner(2), not its class")
def partitioner_a_class(env):
    # Called as a partitioner, the class failed with "__init__() takes 2
    # positional arguments but 3 were given" when a variable was made.
    keras_ps.ParameterServerStrategy(
        env.resolver,
        variable_partitioner=keras_ps.partitioners.FixedShardsPartitioner)


@case("fused_adam_not_bool", TypeError,
      "fused_adam='yes'", "must be True or False")
def fused_adam_not_bool(env):
    keras_ps.ParameterServerStrategy(env.resolver, fused_adam="yes")


@case("fixed_shards_zero", ValueError,
      "num_shards=0", "Expected a positive integer")
def fixed_shards_zero(env):
    keras_ps.partitioners.FixedShardsPartitioner(0)


class _Counts(tf.Module):
    def __init__(self):
        super().__init__()
        self.table = tf.Variable(tf.zeros([8, 4]), name="table")

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def count(self, ids):
        self.table.scatter_add(tf.IndexedSlices(tf.ones([2, 4]), ids))
        return tf.constant(0)


@case("saved_model_function_writes_a_sharded_load",
      keras_ps.errors.LoadedFunctionError, "'count'", "writes the variable 'table'",
      "outside strategy.scope()", "without variable_partitioner")
def saved_model_function_writes_a_sharded_load(env):
    path = env.tmp()
    tf.saved_model.save(_Counts(), path)
    partitioner = keras_ps.partitioners.FixedShardsPartitioner(2)
    with env.strategy_with(partitioner).scope():
        loaded = tf.saved_model.load(path)
    loaded.count(tf.constant([0, 7], tf.int64))


# Row-wise updates of large tables -----------------------------------------------------
@case("lazy_adam_amsgrad", ValueError,
      "Received: amsgrad=True", "keras.optimizers.Adam(amsgrad=True)")
def lazy_adam_amsgrad(env):
    keras_ps.optimizers.LazyAdam(amsgrad=True)


@case("lazy_adam_global_clipnorm", ValueError,
      "Received: global_clipnorm=1.0", "Use clipnorm=")
def lazy_adam_global_clipnorm(env):
    keras_ps.optimizers.LazyAdam(global_clipnorm=1.0)


@case("lazy_adam_weight_decay_on_table", ValueError,
      "Received: weight_decay=0.01", "exclude_from_weight_decay(")
def lazy_adam_weight_decay_on_table(env):
    with env.strategy.scope():
        table = keras.Variable(np.zeros((8, 2), "float32"), name="embeddings")
        optimizer = keras_ps.optimizers.LazyAdam(weight_decay=0.01)
        optimizer.build([table])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table.value, [1, 2]))
        optimizer.apply(tape.gradient(loss, [table.value]), [table])

    step()


# Restoring checkpoints ---------------------------------------------------------------
def _other_model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    return model


@case("sidecar_restore_other_model", CheckpointMismatchError,
      "written by a different model", "'sequential", "(4, 1)", "(4, 3)",
      "build the evaluator's model exactly like the trained one")
def sidecar_restore_other_model(env):
    directory = env.tmp()
    writer = keras_ps.callbacks.SidecarCheckpoint(directory)
    writer.set_model(_model())
    writer.save(0, final=True)
    keras_ps.SidecarEvaluator(_other_model(), (X, Y), directory,
                              timeout=5, poll_interval=0.1).start()


@case("backup_restore_other_model", ValueError,
      "backup-1.weights.h5", "different model", "delete the backup directory")
def backup_restore_other_model(env):
    directory = env.tmp()
    _model().save_weights(os.path.join(directory, "backup-1.weights.h5"))
    with open(os.path.join(directory, "backup_state.json"), "w") as f:
        json.dump({"epoch": 1, "step": 0, "serial": 1,
                   "weights": "backup-1.weights.h5"}, f)
    callback = keras_ps.callbacks.BackupAndRestore(directory)
    callback.set_model(_other_model())
    callback.on_train_begin()


@case("backup_state_file_not_an_object", keras_ps.errors.BackupCorruptError,
      "backup_state.json", "it holds a JSON list, not an object",
      "['backup-1.weights.h5']", "put back a copy of the file",
      "delete the backup directory")
def backup_state_file_not_an_object(env):
    directory = env.tmp()
    _model().save_weights(os.path.join(directory, "backup-1.weights.h5"))
    with open(os.path.join(directory, "backup_state.json"), "w") as f:
        json.dump([], f)
    callback = keras_ps.callbacks.BackupAndRestore(directory)
    callback.set_model(_model())
    callback.on_train_begin()


def _a_file(env):
    path = os.path.join(env.tmp(), "a_file")
    with open(path, "w") as f:
        f.write("x")
    return path


@case("backup_dir_used_by_another_job", keras_ps.errors.BackupDirInUseError,
      "is in use by another training job", "backup.lock",
      f"on host {socket.gethostname()}", "Fix: give this job a different "
      "backup_dir, or stop the other job first", timeout=240)
def backup_dir_used_by_another_job(env):
    # Another process' fit holds the directory; this fit is refused when it
    # starts, before any step (_NoTrainingStep), naming that process.
    directory = env.tmp()
    with holding_job(env.spec, directory) as holder:
        backup = keras_ps.callbacks.BackupAndRestore(directory)
        try:
            _fit_refused_before_a_step(_model(env.strategy), backup)
        except keras_ps.errors.BackupDirInUseError as error:
            assert f"pid {holder.pid} on host" in str(error), str(error)
            assert holder.poll() is None, holder.output()[-3000:]
            raise


@case("backup_dir_is_a_file", ValueError,
      "backup_dir must be a directory (created if missing)", "is a file",
      "Received: backup_dir=", "pass the path of a directory")
def backup_dir_is_a_file(env):
    keras_ps.callbacks.BackupAndRestore(_a_file(env))


@case("sidecar_checkpoint_dir_is_a_file", ValueError,
      "checkpoint_dir must be a directory (created if missing)",
      "a_file/ckpt' is inside", "which is a file",
      "pass the path of a directory")
def sidecar_checkpoint_dir_is_a_file(env):
    keras_ps.callbacks.SidecarCheckpoint(os.path.join(_a_file(env), "ckpt"))


@case("sidecar_checkpoint_dir_made_a_file_before_fit", ValueError,
      "checkpoint_dir must be a directory", "is a file",
      "pass the path of a directory")
def sidecar_checkpoint_dir_made_a_file_before_fit(env):
    # Refused when fit starts, not at the first epoch's end.
    directory = os.path.join(env.tmp(), "ckpt")
    writer = keras_ps.callbacks.SidecarCheckpoint(directory)
    with open(directory, "w") as f:
        f.write("x")
    _fit_refused_before_a_step(_model(env.strategy), writer)


@case("backup_save_freq_zero", ValueError,
      "save_freq=0", "'epoch', a positive integer number of steps, or False")
def backup_save_freq_zero(env):
    keras_ps.callbacks.BackupAndRestore(env.tmp(), save_freq=0)


@case("backup_save_freq_false_alone", ValueError,
      "save_before_preemption is False", "nothing would be backed up",
      "Fix: save_freq='epoch' or a number of steps, or "
      "save_before_preemption=True")
def backup_save_freq_false_alone(env):
    keras_ps.callbacks.BackupAndRestore(env.tmp(), save_freq=False)


@case("backup_save_before_preemption_not_a_bool", ValueError,
      "save_before_preemption='yes'", "True or False")
def backup_save_before_preemption_not_a_bool(env):
    keras_ps.callbacks.BackupAndRestore(env.tmp(),
                                        save_before_preemption="yes")


@case("backup_double_checkpoint_not_a_bool", ValueError,
      "double_checkpoint='yes'", "True or False")
def backup_double_checkpoint_not_a_bool(env):
    keras_ps.callbacks.BackupAndRestore(env.tmp(), double_checkpoint="yes")


@case("backup_delete_checkpoint_not_a_bool", ValueError,
      "delete_checkpoint='no'", "True or False")
def backup_delete_checkpoint_not_a_bool(env):
    # "no" read as True once deleted the backup the user meant to keep.
    keras_ps.callbacks.BackupAndRestore(env.tmp(), delete_checkpoint="no")


@case("backup_background_deltas_not_a_bool", ValueError,
      "background_deltas='no'", "True or False")
def backup_background_deltas_not_a_bool(env):
    keras_ps.callbacks.BackupAndRestore(env.tmp(), background_deltas="no")


@case("backup_incremental_zero", ValueError,
      "incremental=0", "'auto', True or False")
def backup_incremental_zero(env):
    # 0 once passed the check and then turned incremental backups on.
    keras_ps.callbacks.BackupAndRestore(env.tmp(), incremental=0)


@case("backup_incremental_not_a_choice", ValueError,
      "incremental='yes'", "'auto', True or False")
def backup_incremental_not_a_choice(env):
    keras_ps.callbacks.BackupAndRestore(env.tmp(), incremental="yes")


def _built(model):
    model.optimizer.build(model.trainable_variables)
    return model


@case("incremental_backup_of_variables", TypeError,
      "Keras model", "{'model': model, 'optimizer': optimizer}")
def incremental_backup_of_variables(env):
    keras_ps.IncrementalBackup([tf.Variable(1.0)], env.tmp())


@case("incremental_backup_max_deltas_zero", ValueError,
      "max_deltas=0", "integer >= 1")
def incremental_backup_max_deltas_zero(env):
    keras_ps.IncrementalBackup(_model(), env.tmp(), max_deltas=0)


@case("incremental_backup_merge_below_too_big", ValueError,
      "merge_below=1.5", "from 0 (compaction always writes a full backup)")
def incremental_backup_merge_below_too_big(env):
    keras_ps.IncrementalBackup(_model(), env.tmp(), merge_below=1.5)


@case("incremental_backup_env_native_not_a_switch", ValueError,
      "KERAS_PS_NATIVE='false'", "must be 0 (off) or 1 (on)",
      "Unset it to use the default")
def incremental_backup_env_native_not_a_switch(env):
    # Read at the first save: refused when the object is made.
    _with_env("KERAS_PS_NATIVE", "false",
              lambda: keras_ps.IncrementalBackup(_model(), env.tmp()))


@case("incremental_backup_background_compaction_not_a_bool", ValueError,
      "background_compaction='no'", "True or False")
def incremental_backup_background_compaction_not_a_bool(env):
    keras_ps.IncrementalBackup(_model(), env.tmp(), background_compaction="no")


@case("incremental_backup_optimizer_not_built", ValueError,
      "not built", "optimizer.build(model.trainable_variables)")
def incremental_backup_optimizer_not_built(env):
    keras_ps.IncrementalBackup(_model(), env.tmp()).save_full()


@case("incremental_delta_without_full", ValueError,
      "A delta needs the backup it builds on", "call save_full() first")
def incremental_delta_without_full(env):
    keras_ps.IncrementalBackup(_built(_model()), env.tmp()).save_delta()


@case("incremental_restore_other_model", ValueError,
      "written by a different model", "(4, 1)", "(4, 3)",
      "give a changed model its own backup directory")
def incremental_restore_other_model(env):
    directory = env.tmp()
    with keras_ps.IncrementalBackup(_built(_model()), directory) as backup:
        backup.save_full()
    with keras_ps.IncrementalBackup(_built(_other_model()),
                                    directory) as backup:
        backup.restore()


@case("incremental_backup_dir_locked_by_another_job",
      keras_ps.errors.BackupDirInUseError,
      "directory '", "is in use by another training job", "backup.lock",
      f"on host {socket.gethostname()} (IncrementalBackup)",
      "Fix: give this job a different directory, or stop the other job "
      "first", timeout=240)
def incremental_backup_dir_locked_by_another_job(env):
    # Another process' custom loop holds the directory with its own
    # IncrementalBackup; this one is refused at its first save, naming it.
    directory = env.tmp()
    with holding_job(env.spec, directory, "hold_incremental") as holder:
        try:
            keras_ps.IncrementalBackup(_built(_model()), directory).save()
        except keras_ps.errors.BackupDirInUseError as error:
            assert f"pid {holder.pid} on host" in str(error), str(error)
            assert holder.poll() is None, holder.output()[-3000:]
            raise


@case("incremental_backup_lock_not_a_held_lock", ValueError,
      "lock=True", "Fix: leave lock out")
def incremental_backup_lock_not_a_held_lock(env):
    keras_ps.IncrementalBackup(_model(), env.tmp(), lock=True)


@case("sidecar_max_to_keep_a_bool", ValueError,
      "max_to_keep=True", "a positive integer or None")
def sidecar_max_to_keep_a_bool(env):
    keras_ps.callbacks.SidecarCheckpoint(env.tmp(), max_to_keep=True)


@case("sidecar_export_unknown_placeholder", ValueError,
      "export_filepath='best/{epoch}-{loss}.keras'", "KeyError: 'loss'",
      "only the placeholders {epoch} and {step}", "written twice")
def sidecar_export_unknown_placeholder(env):
    keras_ps.callbacks.SidecarEvaluatorModelExport("best/{epoch}-{loss}.keras")


@case("sidecar_model_not_compiled", ValueError,
      "not compiled", "model.compile(loss=")
def sidecar_model_not_compiled(env):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    keras_ps.SidecarEvaluator(model, (X, Y), env.tmp())


# Rendezvous ------------------------------------------------------------------------
@case("elastic_resolver_ps_a_string", TypeError,
      "ps='localhost:2001', a string", "Pass ps=['localhost:2001']")
def elastic_resolver_ps_a_string(env):
    # It was read as a list of one-letter addresses: "Received: 'l'".
    elastic.ElasticClusterResolver(env.rendezvous.endpoint, ps="localhost:2001",
                                   token=TOKEN)


@case("elastic_resolver_min_workers_a_string", ValueError,
      "min_workers='2'", "an integer, 1 or more")
def elastic_resolver_min_workers_a_string(env):
    elastic.ElasticClusterResolver(env.rendezvous.endpoint,
                                   ps=["localhost:2001"], min_workers="2",
                                   token=TOKEN)


@case("elastic_resolver_endpoint_is_a_worker", elastic.RendezvousError,
      "is not a keras_ps rendezvous server", "UNIMPLEMENTED",
      "a TF ps or worker task answers so",
      "python -m keras_ps.elastic.launch --standalone", "as rdzv_endpoint")
def elastic_resolver_endpoint_is_a_worker(env):
    # It failed with "rendezvous call failed with UNIMPLEMENTED: ".
    worker = env.resolver.cluster_spec().as_dict()["worker"][0]
    resolver = elastic.ElasticClusterResolver(
        worker, ps=["localhost:2001"], token=TOKEN, startup_timeout=5)
    try:
        with _message_names(f"{worker} is not"):
            resolver.cluster_spec()
    finally:
        resolver.close()


@case("elastic_agent_endpoint_is_a_worker", elastic.RendezvousError,
      "is not a keras_ps rendezvous server", "UNIMPLEMENTED",
      "--rdzv_endpoint of the agent")
def elastic_agent_endpoint_is_a_worker(env):
    from keras_ps.elastic.agent import AgentConfig, ElasticAgent

    worker = env.resolver.cluster_spec().as_dict()["worker"][0]
    config = AgentConfig(rdzv_endpoint=worker, address="127.0.0.1:21010",
                         min_nodes=1, max_nodes=1, task=("true",),
                         token=TOKEN, join_timeout=5)
    with elastic.RendezvousClient(worker, token=TOKEN, timeout=5) as client:
        with _message_names(f"{worker} is not"):
            ElasticAgent(config, client=client).run()


@case("rendezvous_wrong_token", elastic.RendezvousAuthError,
      "wrong rendezvous token", "x-keras-ps-token", "token=")
def rendezvous_wrong_token(env):
    env.client(token="not-the-token").get_cluster_spec(
        "127.0.0.1:21001", 1, 1, timeout=5)


@case("rendezvous_no_token", elastic.RendezvousAuthError,
      "missing or wrong rendezvous token", "KERAS_PS_RDZV_TOKEN")
def rendezvous_no_token(env):
    env.client(token=None).leave("127.0.0.1:21001")


@case("rendezvous_min_nodes_zero", elastic.RendezvousInvalidArgumentError,
      "min_nodes", "got 0", "must be >= 1")
def rendezvous_min_nodes_zero(env):
    env.client().get_cluster_spec("127.0.0.1:21002", 0, 1, timeout=5)


@case("rendezvous_max_below_min", elastic.RendezvousInvalidArgumentError,
      "max_nodes", "got 1", "must be >= min_nodes (2)")
def rendezvous_max_below_min(env):
    env.client().get_cluster_spec("127.0.0.1:21003", 2, 1, timeout=5)


@case("rendezvous_bad_node_address", elastic.RendezvousInvalidArgumentError,
      "'worker-3'", "is not HOST:PORT")
def rendezvous_bad_node_address(env):
    env.client().get_cluster_spec("worker-3", 1, 1, timeout=5)


@case("rendezvous_empty_barrier_tag", elastic.RendezvousInvalidArgumentError,
      "tag", "got ''", "non-empty string")
def rendezvous_empty_barrier_tag(env):
    env.client().barrier("127.0.0.1:21004", "", timeout=5)


@case("rendezvous_data_too_large", elastic.RendezvousInvalidArgumentError,
      "at most 1048576 bytes", "got 1048577 bytes")
def rendezvous_data_too_large(env):
    env.client().synchronize("127.0.0.1:21005", "blobs",
                             b"x" * (1024 * 1024 + 1), timeout=5)


@case("rendezvous_ps_index_out_of_range",
      elastic.RendezvousInvalidArgumentError,
      "index must be a ps index from 0 to 1023", "got -1")
def rendezvous_ps_index_out_of_range(env):
    env.client().announce_ps(-1, "127.0.0.1:21006", "ps-process-1")


@case("rendezvous_ps_bad_address", elastic.RendezvousInvalidArgumentError,
      "'ps-0' is not HOST:PORT")
def rendezvous_ps_bad_address(env):
    env.client().announce_ps(0, "ps-0", "ps-process-1")


@case("rendezvous_ps_no_incarnation", elastic.RendezvousInvalidArgumentError,
      "incarnation must be a string of 1 to 128 characters", "got ''")
def rendezvous_ps_no_incarnation(env):
    env.client().announce_ps(0, "127.0.0.1:21006", "")


@case("rendezvous_client_bad_endpoint", ValueError,
      "endpoint 'rdzv.local'", "is not HOST:PORT")
def rendezvous_client_bad_endpoint(env):
    elastic.RendezvousClient("rdzv.local", token=TOKEN)


@case("rendezvous_client_missing_root_cert", ValueError,
      "TLS root certificate '/nonexistent/rdzv.pem'",
      "No such file or directory",
      "Give the certificate the rendezvous server was started with")
def rendezvous_client_missing_root_cert(env):
    elastic.RendezvousClient("127.0.0.1:2", tls_root_cert="/nonexistent/rdzv.pem")


@case("rendezvous_client_root_cert_not_pem", ValueError,
      "holds no PEM certificate", "-----BEGIN CERTIFICATE-----",
      "Give the certificate the rendezvous server was started with")
def rendezvous_client_root_cert_not_pem(env):
    elastic.RendezvousClient("127.0.0.1:2", tls_root_cert=b"not a certificate")


@case("rendezvous_config_zero_keepalive", ValueError,
      "keepalive_timeout", "got 0", "finite number of seconds > 0")
def rendezvous_config_zero_keepalive(env):
    elastic.RendezvousConfig(keepalive_timeout=0)


@pytest.mark.parametrize("make_error, exception, needles", CASES)
def test_bad_input(make_error, exception, needles, env):
    try:
        with pytest.raises(exception) as raised:
            make_error(env)
    finally:
        env.drain()
    message = full_message(raised.value)
    missing = [needle for needle in needles if needle not in message]
    assert not missing, f"{missing} not in the message:\n{message}"


@pytest.mark.timeout(30)
def test_numpy_bools_are_taken_as_bools(tmp_path):
    """Where a bool is asked for, numpy's is Python's (a mask's element, a
    flag read from an array); only other types are refused."""
    backup = keras_ps.callbacks.BackupAndRestore(
        str(tmp_path), delete_checkpoint=np.False_, incremental=np.True_,
        recover_ps=np.True_, double_checkpoint=np.True_,
        background_deltas=np.False_, save_before_preemption=np.False_)
    assert [backup.delete_checkpoint, backup.incremental, backup.recover_ps,
            backup.double_checkpoint, backup.save_before_preemption] == [
        False, True, True, True, False]
    assert all(type(value) is bool for value in (
        backup.delete_checkpoint, backup.incremental, backup.recover_ps))
    incremental = keras_ps.IncrementalBackup(
        _model(), str(tmp_path), background_deltas=np.True_,
        background_compaction=np.False_)
    assert (incremental.background_deltas,
            incremental.background_compaction) == (True, False)


# The server command line: a one-line error and exit code 2, no traceback -----------
_TF_STARTUP_LINE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\)|"
    r"[IWE]\d{4} [\d:. ]+\d+ \w+\.cc:\d+\])")

SERVER_CASES = [
    pytest.param(["--cluster_spec", '{"ps": [', "--job_name", "ps"],
                 ["--cluster_spec is not valid JSON", "'{\"ps\": ['",
                  "Expected JSON like"], id="server_cluster_spec_not_json"),
    pytest.param(["--cluster_spec", json.dumps(_spec(ps=[2001], worker=[2002])),
                  "--job_name", "chief"],
                 ["task type 'chief'", "python -m keras_ps.evaluator",
                  "Run the chief as your training script"],
                 id="server_job_chief"),
    pytest.param(["--cluster_spec", json.dumps(_spec(ps=[2001], worker=[2002])),
                  "--job_name", "worker", "--task_index", "4"],
                 ["--task_index=4", "lists 1 worker task(s)",
                  "Pass --task_index from 0 to 0"],
                 id="server_task_index_out_of_range"),
    pytest.param(["--cluster_spec", json.dumps(_spec(ps=[2001], worker=[2002])),
                  "--job_name", "wroker"],
                 ["task type 'wroker'", "runs ps and worker tasks"],
                 id="server_job_name_misspelt"),
    pytest.param(["--cluster_spec", json.dumps(_spec(ps=[2001], worker=[2002]))],
                 ["--job_name is required", "Pass --job_name ps"],
                 id="server_missing_job_name"),
    pytest.param([], ["TF_CONFIG is not set and no --cluster_spec was given",
                      "pass --cluster_spec JSON --job_name ps|worker"],
                 id="server_no_task"),
    pytest.param(["--cluster_spec", json.dumps(_spec(ps=[2001], worker=[2002])),
                  "--job_name", "ps", "--intra_op_threads", "-2"],
                 ["--intra_op_threads -2 is negative", "Pass 0 for TF's default"],
                 id="server_negative_intra_op_threads"),
    pytest.param(["--cluster_spec", json.dumps(_spec(ps=[2001], worker=[2002])),
                  "--job_name", "ps", "--preemption_grace", "-5"],
                 ["--preemption_grace -5.0 is not a number of seconds",
                  "Pass 0 to stop at once on SIGTERM"],
                 id="server_negative_preemption_grace"),
    pytest.param(["--cluster_spec", json.dumps(_spec(ps=[2001], worker=[2002])),
                  "--job_name", "worker", "--rdzv_endpoint", "localhost:2003"],
                 ["--rdzv_endpoint localhost:2003 is for ps tasks, not worker:0",
                  "joins the rendezvous through its agent",
                  "Drop --rdzv_endpoint here"],
                 id="server_worker_with_rdzv_endpoint"),
    pytest.param(["--cluster_spec", json.dumps(_spec(ps=[2001], worker=[2002])),
                  "--job_name", "ps", "--rdzv_endpoint", "localhost"],
                 ["--rdzv_endpoint 'localhost': endpoint 'localhost' is not "
                  "HOST:PORT", "Pass the rendezvous' HOST:PORT"],
                 id="server_rdzv_endpoint_without_port"),
    # A first item {"env": {...}} adds to the process' environment.
    pytest.param([{"env": {"KERAS_PS_RDZV_TLS_ROOT_CERT": "/nonexistent/rdzv.pem"}},
                  "--cluster_spec", json.dumps(_spec(ps=[2001], worker=[2002])),
                  "--job_name", "ps", "--rdzv_endpoint", "localhost:2003"],
                 ["TLS root certificate '/nonexistent/rdzv.pem'",
                  "Give the certificate the rendezvous server was started with"],
                 id="server_env_tls_root_cert_missing"),
    pytest.param([{"env": {"KERAS_PS_PREEMPTION_GRACE": "30s"}},
                  "--cluster_spec", json.dumps(_spec(ps=[2001], worker=[2002])),
                  "--job_name", "ps"],
                 ["KERAS_PS_PREEMPTION_GRACE must be a number",
                  "KERAS_PS_PREEMPTION_GRACE='30s'", "Unset it"],
                 id="server_env_preemption_grace_not_number"),
    pytest.param([{"env": {"KERAS_PS_PEER_TIMEOUT": "-3"}},
                  "--cluster_spec", json.dumps(_spec(ps=[2001], worker=[2002])),
                  "--job_name", "worker"],
                 ["KERAS_PS_PEER_TIMEOUT='-3'", "must be at least 0", "Unset it"],
                 id="server_env_peer_timeout_negative"),
    # Any other first item, a dict, is the process' TF_CONFIG.
    pytest.param([{"cluster": _spec(ps=[2001], worker=[2002]),
                   "task": {"type": "ps", "index": 0}},
                  "--job_name", "worker", "--task_index", "1"],
                 ["--job_name worker and --task_index 1 without --cluster_spec",
                  "comes from TF_CONFIG (ps:0)", "Drop them",
                  "pass --cluster_spec too"],
                 id="server_flags_beside_tf_config"),
    # HELD_PORT stands for a port a socket of the test holds (exit code 3,
    # the code a launcher retries on).
    pytest.param([{"cluster": {"ps": ["localhost:HELD_PORT"],
                               "worker": ["localhost:2002"]},
                   "task": {"type": "ps", "index": 0}}],
                 ["port of ps:0 (localhost:HELD_PORT) is already in use",
                  "another process on this machine holds port HELD_PORT",
                  "Stop the process holding it",
                  "give ps:0 a free port in its cluster spec (TF_CONFIG"],
                 id="server_port_taken"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, needles", SERVER_CASES)
def test_server_cli_bad_flags(argv, needles):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_CONFIG", None)
    held = "HELD_PORT" in json.dumps(argv)
    with contextlib.ExitStack() as stack:
        if held:
            holder = stack.enter_context(socket.socket())
            holder.bind(("", 0))
            holder.listen()
            port = str(holder.getsockname()[1])
            argv = json.loads(json.dumps(argv).replace("HELD_PORT", port))
            needles = [n.replace("HELD_PORT", port) for n in needles]
        if argv and isinstance(argv[0], dict):
            if "env" in argv[0]:
                env.update(argv[0]["env"])
            else:
                env["TF_CONFIG"] = json.dumps(argv[0])
            argv = argv[1:]
        result = subprocess.run(
            [sys.executable, "-m", "keras_ps.server", *argv], cwd=REPO,
            env=env, capture_output=True, text=True, timeout=50)
    assert result.returncode == (3 if held else 2), result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    # TF's C++ runtime prints its start-up lines before any Python runs
    # (whatever TF_CPP_MIN_LOG_LEVEL says); keras_ps adds exactly one line.
    ours = [line for line in result.stderr.splitlines()
            if line.strip() and not _TF_STARTUP_LINE.match(line)]
    assert len(ours) == 1, result.stderr
    assert ours[0].startswith("keras_ps.server: error: "), ours[0]
    missing = [needle for needle in needles if needle not in ours[0]]
    assert not missing, f"{missing} not in: {ours[0]}"


@pytest.mark.timeout(10)
def test_doc_table_matches_the_cases():
    """docs/bad_inputs.md has one row per case, named by its test id."""
    with open(os.path.join(REPO, "docs", "bad_inputs.md")) as f:
        rows = re.findall(r"^\| `([a-z0-9_]+)`:", f.read(), re.MULTILINE)
    ids = [p.id for p in CASES + SERVER_CASES]
    assert sorted(rows) == sorted(ids)
    assert len(set(ids)) == len(ids)
