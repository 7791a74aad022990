"""The cluster and its servers: which tasks there are, where, and how this
process reaches them.

It owns cluster specs and TF_CONFIG (`spec`), clusters started on this
machine for tests and demos (`local`: `LocalCluster`, in-process servers),
whether a task's gRPC server answers (`_network`), and the coordinator's one
connection of TF's eager runtime to a cluster (`_connection`). The package
and its `spec`, `local` and `_network` modules import TensorFlow only inside
the functions that need it, so `python -m keras_ps.server` and the elastic
agent read their configuration without TF's Python API; the server command
itself is `keras_ps.server`.
"""

from keras_ps.cluster.local import LocalCluster
from keras_ps.cluster.local import create_in_process_cluster
from keras_ps.cluster.local import wait_for_port
from keras_ps.cluster.spec import TASK_TYPES
from keras_ps.cluster.spec import TRAINING_JOBS
from keras_ps.cluster.spec import MembershipWatcher
from keras_ps.cluster.spec import normalize_cluster_spec
from keras_ps.cluster.spec import parse_tf_config
from keras_ps.cluster.spec import resolver_from_spec
from keras_ps.cluster.spec import resolver_from_tf_config
from keras_ps.cluster.spec import training_cluster

__all__ = ["LocalCluster", "MembershipWatcher", "TASK_TYPES", "TRAINING_JOBS",
           "create_in_process_cluster", "normalize_cluster_spec",
           "parse_tf_config", "resolver_from_spec", "resolver_from_tf_config",
           "training_cluster", "wait_for_port"]
