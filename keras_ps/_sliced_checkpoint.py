"""Checkpointing a large sharded variable as slices, one per shard.

Each slice is read and written by the shard's own ps, so no process holds the
whole variable; the entry restores into any number of shards or a plain
variable, as TF's own ShardedVariable's does.
"""

from keras_ps import _tf_adapter


def _gather_sliced_saveables(self):
    """Checkpoint entry of a large sharded variable: its key holds one slice
    per shard (as TF's own ShardedVariable saves), each read and written by
    the shard's ps and restored straight into the shard, so no process holds
    the whole variable. It restores into any number of shards or into a
    plain variable, and a plain variable's entry restores into it."""
    def factory(name=self._name):
        return [_tf_adapter.resource_variable_saveable(
            v, self._slice_spec(i), name) for i, v in enumerate(self._variables)]
    return {"VARIABLE_VALUE": factory}


_sliced_classes = {}


def sliced_class(cls):
    """`cls` checkpointed as slices: TF takes a class's
    `_gather_saveables_for_checkpoint` when the class defines it before any
    `_serialize_to_tensors` in its MRO."""
    if cls.__name__.startswith("_Sliced"):
        return cls
    if cls not in _sliced_classes:
        _sliced_classes[cls] = type(f"_Sliced{cls.__name__}", (cls,), {
            "_gather_saveables_for_checkpoint": _gather_sliced_saveables,
            "__module__": cls.__module__})
    return _sliced_classes[cls]
