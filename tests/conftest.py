"""Shared fixtures. A process can connect to one cluster only (TF's eager
context), so the tests of one pytest process share one real multi-process
LocalCluster (the suite runs two such processes: -n 2 in setup.cfg); tests
that kill tasks run their own coordinator process (tests/_fault_job.py)."""

import os

# Teardown of the shared cluster makes TF log every failed RPC at ERROR level.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import portpicker  # noqa: E402
import pytest  # noqa: E402


# The files that take longest (their own clusters and coordinator jobs, a
# few minutes each), started first: the two test processes (-n 2 --dist
# loadfile) then end close together instead of one running a long file
# alone at the end. In an order that gives the files that mostly wait
# (for a timeout, a stuck call, a silent ps: test_ps_recovery,
# test_stuck_calls, test_worker_faults) a file beside them that keeps the
# cores busy, instead of two waiting files side by side with the cores
# idle (measured from the suite's durations and the machine's idle time;
# the two test processes take these files as they become free). The
# Docker tests come after these, once the image .ci/run builds in the
# background is likely ready.
LONGEST_FIRST = [
    "fit/test_incremental_backups.py", "fit/test_ps_recovery.py",
    "sharding/test_dynamic_embedding.py", "fit/test_shards.py",
    "system/test_tutorials.py", "coordinator/test_stuck_calls.py",
    "fit/test_fit.py", "coordinator/test_worker_faults.py",
    "fit/test_fit_faults.py",
    "sharding/test_dynamic_incremental.py", "system/test_docker.py",
]


def pytest_collection_modifyitems(items):
    def rank(item):
        path = item.nodeid.split("::")[0]
        for i, name in enumerate(LONGEST_FIRST):
            if path.endswith(name):
                return i
        return len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order


@pytest.fixture(scope="session")
def cluster():
    import keras_ps

    with keras_ps.LocalCluster(num_workers=2, num_ps=3) as local:
        yield local


@pytest.fixture(scope="session")
def strategy(cluster):
    import tensorflow as tf

    import keras_ps

    spec = dict(cluster.spec)
    # Kubernetes operators list the evaluator in every task's TF_CONFIG;
    # TF's native coordinator hangs on it (tensorflow/tensorflow#46169).
    spec["evaluator"] = [f"localhost:{portpicker.pick_unused_port()}"]
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec), rpc_layer="grpc")
    return keras_ps.ParameterServerStrategy(resolver)


@pytest.fixture(scope="session")
def coordinator(strategy):
    import keras_ps

    coordinator = keras_ps.ClusterCoordinator(strategy)
    yield coordinator
    coordinator.shutdown()
