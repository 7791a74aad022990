"""What a ShardedVariable is in a SavedModel's graph, and how functions
loaded from a SavedModel read one.

`tf.saved_model.save` writes a `tf.Variable` made under a partitioner as one
variable of the full shape (as TF's strategy does), and a Keras weight's
shards as the variables they are. `tf.saved_model.load` under a strategy
with a `variable_partitioner` makes each saved variable the partitioner
splits a ShardedVariable on the ps, restored from the SavedModel (TF's
strategy does the same, and its loaded functions then raise).

A loaded function was traced reading each variable it captured through one
resource handle, which shards cannot give. So a function that only reads
the variable (Keras' serving functions read each weight whole) gets, at
each call, a copy of the variable's value made from its shards, on the
coordinator (or on the ps a keras_ps SavedModel pins the read to): it runs
and gives the values it gave before saving, and a gradient through it
reaches the shards. A function that writes it (or uses its handle
otherwise) raises `LoadedFunctionError` when called, naming the variable
and what to do.
"""

import logging
import re
import weakref

import tensorflow as tf

from keras_ps import _tf_adapter
from keras_ps.errors import LoadedFunctionError

logger = logging.getLogger(__name__)

# Ops that only read the resource they are given; and ops that call a
# function with it (followed into that function).
_READS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd",
                    "VariableShape"})
_CALLS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
# A copy at least this large is worth a warning: it is read whole per call.
_LARGE_COPY_BYTES = 64 << 20
# {loaded concrete function: (its GraphDef, {name: FunctionDef})}
_graphs = weakref.WeakKeyDictionary()


class NoValues(tf.__internal__.tracking.Trackable):
    """A Keras ShardedWeight in a SavedModel's graph: its shards (its
    children there) hold the values, so it saves nothing itself."""

    def _serialize_to_tensors(self):
        return {}

    def _restore_from_tensors(self, restored_tensors):
        return tf.no_op()


def restored_capture(sharded, concrete_function, internal_capture):
    """What `concrete_function` captures for `sharded` (TF's
    `__tf_experimental_restore_capture__` protocol): a `StagedRead` if the
    function only reads it, else a `RefusedCapture`."""
    name = getattr(concrete_function, "name", None) or "<loaded function>"
    if isinstance(name, bytes):
        name = name.decode()
    # `__inference_serve_123` -> `serve`: the name it was saved under.
    name = re.sub(r"_\d+$", "", name.removeprefix("__inference_"))
    if concrete_function not in _graphs:  # one per function, not per capture
        graph_def = concrete_function.graph.as_graph_def()
        _graphs[concrete_function] = (graph_def, {
            f.signature.name: f for f in graph_def.library.function})
    graph_def, library = _graphs[concrete_function]
    devices = _read_devices(graph_def.node, internal_capture.op.name, library)
    if devices is None:
        return RefusedCapture(sharded, name)
    # A SavedModel of a keras_ps model pins a read of each shard to its ps:
    # the copy goes there (else where the calling process makes variables),
    # if this cluster has that task (a SavedModel of a larger one may not).
    device = devices[0] if len(devices) == 1 else None
    if device is not None and not _task_exists(device):
        device = None
    nbytes = sharded.shape.num_elements() * sharded.dtype.size
    if nbytes >= _LARGE_COPY_BYTES:
        logger.warning(
            "The function %r loaded from a SavedModel reads %r (shape %s, "
            "%.0f MiB), loaded as %d shards under a variable_partitioner: "
            "each call copies its whole value from the shards%s. To serve, "
            "load the SavedModel outside strategy.scope() or without a "
            "variable_partitioner.", name, sharded.name,
            tuple(sharded.shape), nbytes / (1 << 20), len(sharded.variables),
            f" to {device}" if device else " to this process")
    return StagedRead(sharded, device)


def _task_exists(device):
    """Whether this process' cluster has the job and task of `device`."""
    wanted = tf.DeviceSpec.from_string(device)
    for logical in tf.config.list_logical_devices():
        spec = tf.DeviceSpec.from_string(logical.name)
        if spec.job == wanted.job and (wanted.task is None
                                       or spec.task == wanted.task):
            return True
    return False


def _read_devices(nodes, source, library):
    """The devices asked for by the reads of the resource `source` (a node
    or argument name) among `nodes` and inside the functions they call with
    it (sorted, "" left out), or None if some use of it is not a read."""
    devices = set()
    for node in nodes:
        inputs = [i for i in node.input if not i.startswith("^")]
        for position, name in enumerate(inputs):
            if name not in (source, source + ":0"):
                continue
            if node.op in _READS:
                devices.add(node.device)
                continue
            callee = library.get(node.attr["f"].func.name) \
                if node.op in _CALLS else None
            if callee is None or position >= len(callee.signature.input_arg):
                return None
            argument = callee.signature.input_arg[position].name
            inner = _read_devices(callee.node_def, argument, library)
            if inner is None:
                return None
            devices.update(inner or [node.device])
    return sorted(devices - {""})


class StagedRead:
    """Called by TF at each call of a loaded function for the handle of a
    variable it reads: copies the ShardedVariable's value from its shards
    into one variable on `device` (None: where this process makes
    variables, the coordinator) and gives its handle. The handle's gradient
    is the value's, so a gradient of the function's outputs flows back to
    the shards."""

    def __init__(self, sharded, device):
        self._sharded = sharded
        self._device = device
        self._copy = None

    def __call__(self):
        if self._copy is None:
            with tf.init_scope(), tf.device(self._device):
                self._copy = _tf_adapter.uninitialized_variable(
                    shape=self._sharded.shape, dtype=self._sharded.dtype,
                    name=f"{self._sharded.name}/loaded_copy")
        copy = self._copy

        @tf.custom_gradient
        def staged(value):
            with tf.control_dependencies([copy.assign(value)]):
                handle = tf.identity(copy.handle)

            def grad(gradient, variables=()):
                return gradient, [None] * len(variables)

            return handle, grad

        return staged(self._sharded.read_value())


class RefusedCapture:
    """What a loaded function that writes a ShardedVariable (or passes its
    handle on) captures in its place: raises `LoadedFunctionError` when TF
    asks it for the handle, at each call of the function."""

    def __init__(self, sharded, function_name):
        self._name = sharded.name
        self._shape = tuple(sharded.shape)
        self._num_shards = len(sharded.variables)
        self._function_name = function_name

    def __call__(self):
        raise LoadedFunctionError(
            f"The function {self._function_name!r} loaded from a SavedModel "
            f"writes the variable {self._name!r} (shape {self._shape}), which "
            f"loaded as a keras_ps ShardedVariable of {self._num_shards} "
            "shards because tf.saved_model.load ran under a strategy with a "
            "variable_partitioner. A loaded function was traced with one "
            "variable and cannot update shards (nor can TF's "
            "ParameterServerStrategy's). The values are loaded (read them "
            "from the loaded object's variables). To call it, load the "
            "SavedModel outside strategy.scope(), or under a "
            "keras_ps.ParameterServerStrategy without variable_partitioner "
            "(its variables then live on the ps); to train a Keras model "
            "sharded, build it under the scope and load its weights "
            "(model.load_weights).")
