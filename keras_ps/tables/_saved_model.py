"""What a ShardedVariable is in a SavedModel's graph, and what its loaded
functions do once it loads sharded.

`tf.saved_model.save` writes a `tf.Variable` made under a partitioner as one
variable of the full shape (as TF's strategy does), and a Keras weight's
shards as the variables they are. `tf.saved_model.load` under a strategy
with a `variable_partitioner` makes each saved variable the partitioner
splits a ShardedVariable on the ps, restored from the SavedModel. A loaded
function was traced reading each captured variable through one resource
handle, which shards cannot give: such a function raises
`LoadedFunctionError`, naming the variable and what to do, when called.
TF's strategy loads the same way and its functions raise too ("a loaded
non-Keras model ... not currently supported"), without saying which
variable or how to serve.
"""

import re

import tensorflow as tf

from keras_ps.errors import LoadedFunctionError


class NoValues(tf.__internal__.tracking.Trackable):
    """A Keras ShardedWeight in a SavedModel's graph: its shards (its
    children there) hold the values, so it saves nothing itself."""

    def _serialize_to_tensors(self):
        return {}

    def _restore_from_tensors(self, restored_tensors):
        return tf.no_op()


class UnreadableCapture:
    """What a loaded function captures in place of a variable that loaded
    sharded: TF calls it on each call of the function for the variable's
    handle, and it raises `LoadedFunctionError` instead."""

    def __init__(self, sharded, function_name):
        self._name = sharded.name
        self._shape = tuple(sharded.shape)
        self._num_shards = len(sharded.variables)
        self._function_name = function_name

    def __call__(self):
        raise LoadedFunctionError(
            f"The function {self._function_name!r} loaded from a SavedModel "
            f"reads the variable {self._name!r} (shape {self._shape}), which "
            f"loaded as a keras_ps ShardedVariable of {self._num_shards} "
            "shards because tf.saved_model.load ran under a strategy with a "
            "variable_partitioner. A loaded function was traced with one "
            "variable and cannot read shards (nor can TF's "
            "ParameterServerStrategy's). The values are loaded (read them "
            "from the loaded object's variables). To call its functions, "
            "load the SavedModel outside strategy.scope(), or under a "
            "keras_ps.ParameterServerStrategy without variable_partitioner "
            "(its variables then live on the ps); to train a Keras model "
            "sharded, build it under the scope and load its weights "
            "(model.load_weights).")


def unreadable_capture(sharded, concrete_function):
    """The capture to give `concrete_function` for `sharded` (TF's
    `__tf_experimental_restore_capture__` protocol)."""
    name = getattr(concrete_function, "name", None) or "<loaded function>"
    if isinstance(name, bytes):
        name = name.decode()
    # `__inference_serve_123` -> `serve`: the name it was saved under.
    name = re.sub(r"_\d+$", "", name.removeprefix("__inference_"))
    return UnreadableCapture(sharded, name)
