"""keras_ps: parameter-server training for Keras 3."""

import os as _os

# Calls to a dead task must fail at once instead of waiting for it to return;
# this has to be in the environment before TF starts gRPC.
_os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
# Streaming enqueue keeps RPCs outstanding to a worker; when that worker dies
# the stream can stall the caller's next remote op forever. One RPC at a time
# per worker (as TF's own strategy sets) makes failures surface as errors.
_os.environ.setdefault("TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE", "False")
_os.environ.setdefault("TF_PS_DISABLE_ASYNC_EXECUTOR_GLOBALLY", "True")

from keras_ps import cluster  # noqa: E402
from keras_ps import partitioners  # noqa: E402
from keras_ps.cluster import LocalCluster  # noqa: E402
from keras_ps.cluster import create_in_process_cluster  # noqa: E402
from keras_ps.coordinator import ClusterCoordinator  # noqa: E402
from keras_ps.coordinator import PerWorkerValues  # noqa: E402
from keras_ps.coordinator import RemoteValue  # noqa: E402
from keras_ps.errors import KerasPSError  # noqa: E402
from keras_ps.evaluation import SidecarEvaluator  # noqa: E402
from keras_ps.sharded_variable import ShardedVariable  # noqa: E402
from keras_ps.strategy import ParameterServerStrategy  # noqa: E402
from keras_ps.training import DatasetCreator  # noqa: E402
from keras_ps import _keras_adapter  # noqa: E402

_keras_adapter.install()

from keras_ps import callbacks  # noqa: E402  (keras_ps.callbacks, like keras.callbacks)

__version__ = "0.1.0"

__all__ = [
    "ClusterCoordinator",
    "DatasetCreator",
    "KerasPSError",
    "LocalCluster",
    "ParameterServerStrategy",
    "PerWorkerValues",
    "RemoteValue",
    "ShardedVariable",
    "SidecarEvaluator",
    "callbacks",
    "cluster",
    "create_in_process_cluster",
    "partitioners",
]
