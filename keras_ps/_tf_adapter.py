"""Every use of TensorFlow internals (`tensorflow.python...`) in keras_ps.

TF 2.21 has no public API for these; each function says which one is missing.
tests/test_public_api.py (test_tf_internals_still_exist) exercises each so a TF upgrade that moves them fails
loudly there, not deep inside training. Supported range: see setup.cfg.
"""

from tensorflow.python.distribute import distribute_lib
from tensorflow.python.eager import context
from tensorflow.python.eager import executor
from tensorflow.python.framework import ops

# Strategy plumbing: `tf.distribute.Strategy`/`StrategyExtended` are public
# classes, but the hooks a new strategy must override (`_create_variable`,
# `_update`, `_reduce_to`, `_call_for_each_replica`, ...) are their private
# methods. keras_ps/strategy.py overrides them; this test pins they exist.
STRATEGY_HOOKS = (
    "_create_variable", "_update", "_update_non_slot", "_reduce_to",
    "_gather_to_implementation", "_call_for_each_replica", "_local_results",
    "_use_merge_call", "_experimental_distribute_dataset",
    "_distribute_datasets_from_function",
    "_experimental_distribute_values_from_function", "_num_replicas_in_sync",
)
StrategyExtendedBase = distribute_lib.StrategyExtendedV1


def update_server_def(server_def):
    """Pushes a new cluster to every task without restarting anyone.

    Public `tf.config.experimental_connect_to_cluster` only creates contexts;
    updating membership in place needs `context.update_server_def`.
    """
    context.context().update_server_def(server_def)


def own_executor():
    """A context manager giving the calling thread its own synchronous eager
    executor. With the shared default executor, an error of a call to one
    (dead) worker can surface in another worker thread's next call, which
    then retries a step that had run (no public API for executors)."""
    return context.executor_scope(executor.new_executor(
        enable_async=False, enable_streaming_enqueue=False))


def get_server_def():
    return context.context().get_server_def()


def capture_call_time_value(closure, spec, name):
    """A placeholder in the current tf.function graph fed by `closure()` at
    every call (no public API; TF's own worker-index helper uses it)."""
    graph = ops.get_default_graph()
    return graph.capture_call_time_value(closure, spec, key=name)


def inside_function():
    return ops.inside_function()
