"""keras_ps: parameter-server training for Keras 3.

The public names below are loaded on first use (PEP 562), so processes that
never run TensorFlow code (the elastic agent, the rendezvous server) and
`python -m keras_ps.server` start without importing TensorFlow's Python API.
Loading any of them but `KerasPSError`, `cluster`, `LocalCluster`,
`create_in_process_cluster`, `elastic` and `partitioners` first imports
`keras_ps.training`, which installs keras_ps' Keras hooks (keras_ps/_keras):
Model.fit routing, sharded weights, atomic updates and optimizer updates on the
parameter servers.
"""

import importlib
import os as _os

# Calls to a dead task must fail at once instead of waiting for it to return;
# this has to be in the environment before TF starts gRPC.
_os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
# Streaming enqueue keeps RPCs outstanding to a worker; when that worker dies
# the stream can stall the caller's next remote op forever. One RPC at a time
# per worker (as TF's own strategy sets) makes failures surface as errors.
_os.environ.setdefault("TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE", "False")
_os.environ.setdefault("TF_PS_DISABLE_ASYNC_EXECUTOR_GLOBALLY", "True")

__version__ = "0.1.0"

# name -> (module, attribute or None for the module itself)
_EXPORTS = {
    "ClusterCoordinator": ("keras_ps.coordinator", "ClusterCoordinator"),
    "DatasetCreator": ("keras_ps.training", "DatasetCreator"),
    "IncrementalBackup": ("keras_ps.backups.incremental_backup", "IncrementalBackup"),
    "KerasPSError": ("keras_ps.errors", "KerasPSError"),
    "LocalCluster": ("keras_ps.cluster", "LocalCluster"),
    "ParameterServerStrategy": ("keras_ps.strategy", "ParameterServerStrategy"),
    "PerWorkerValues": ("keras_ps.coordinator", "PerWorkerValues"),
    "RemoteValue": ("keras_ps.coordinator", "RemoteValue"),
    "ShardedInput": ("keras_ps.shards", "ShardedInput"),
    "ShardedVariable": ("keras_ps.tables.sharded_variable", "ShardedVariable"),
    "SidecarEvaluator": ("keras_ps.sidecar.evaluator", "SidecarEvaluator"),
    "callbacks": ("keras_ps.callbacks", None),
    "cluster": ("keras_ps.cluster", None),
    "create_in_process_cluster": ("keras_ps.cluster", "create_in_process_cluster"),
    "elastic": ("keras_ps.elastic", None),
    "layers": ("keras_ps.layers", None),
    "optimizers": ("keras_ps.optimizers", None),
    "partitioners": ("keras_ps.partitioners", None),
    "shards": ("keras_ps.shards", None),
    "training": ("keras_ps.training", None),
}

# Modules that need neither Keras nor the hooks (`from keras_ps import cluster`
# in `python -m keras_ps.server` must stay free of TensorFlow's Python API).
_WITHOUT_KERAS = ("keras_ps.cluster", "keras_ps.elastic", "keras_ps.errors",
                  "keras_ps.partitioners")

__all__ = sorted(name for name in _EXPORTS if name not in ("elastic", "training"))


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'keras_ps' has no attribute {name!r}")
    module_name, attribute = _EXPORTS[name]
    module = importlib.import_module(module_name)
    if module_name not in _WITHOUT_KERAS:
        # The top of the package: it imports the strategy (which installs the
        # placement hooks) and installs the Model.fit routing.
        importlib.import_module("keras_ps.training")
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
