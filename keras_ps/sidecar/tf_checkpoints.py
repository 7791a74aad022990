"""Reading the checkpoints `tf.train.CheckpointManager` writes, for the
sidecar evaluator: which files are checkpoints, the training step each holds
(its optimizer's `iterations`), and restoring only the model from one.
"""

import os

import keras
import tensorflow as tf

from keras_ps.errors import CheckpointMismatchError


def is_tf_checkpoint(name):
    # keras_ps' checkpoints are bare names; tf.train's are path prefixes.
    return os.sep in name


def tf_checkpoint_prefixes(directory):
    """The checkpoints tf.train's `checkpoint` state file in `directory` lists."""
    try:
        state = tf.train.get_checkpoint_state(directory)
    except (tf.errors.NotFoundError, tf.errors.DataLossError, ValueError):
        return []  # missing, or rewritten while being read
    if state is None:
        return []
    prefixes = list(state.all_model_checkpoint_paths) or [
        state.model_checkpoint_path]
    return [os.path.abspath(p) for p in prefixes
            if p and tf.io.gfile.exists(p + ".index")]


# The optimizer step counter in a checkpoint: Keras 3's, then tf_keras'.
ITERATIONS_KEYS = ("/_iterations/.ATTRIBUTES/VARIABLE_VALUE",
                    "/iter/.ATTRIBUTES/VARIABLE_VALUE")


def tf_checkpoint_step(prefix):
    """The optimizer's `iterations` saved in the tf.train checkpoint `prefix`.

    Raises:
        CheckpointMismatchError: the checkpoint holds no optimizer iterations
            (TF's own evaluator refuses such checkpoints too).
    """
    reader = tf.train.load_checkpoint(prefix)
    keys = sorted((k for k in reader.get_variable_to_shape_map()
                   if k.endswith(ITERATIONS_KEYS)), key=len)
    if not keys:
        raise CheckpointMismatchError(
            f"Checkpoint {prefix} holds no optimizer iterations, so the "
            "evaluator cannot tell which training step it is (TF's "
            "SidecarEvaluator refuses it too). Received: checkpoint="
            f"{prefix!r}. Fix: save tf.train.Checkpoint(model=model, "
            "optimizer=model.optimizer) in training, or use "
            "keras_ps.callbacks.SidecarCheckpoint.")
    return int(reader.get_tensor(keys[0]))


class ModelWeights(tf.__internal__.tracking.Trackable):
    """A model as a checkpoint sees it, without its optimizer: the
    evaluator's optimizer is not the trained one (no slots), so only the
    weights are matched and restored."""

    def __init__(self, model):
        self._model = model

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        children = self._model._trackable_children(save_type, **kwargs)
        return {k: v for k, v in children.items() if k != "optimizer"}


def first_inputs(data):
    """One batch of model inputs from evaluation `data`, or None."""
    if isinstance(data, tf.data.Dataset):
        for element in data.take(1):
            x, _, _ = keras.utils.unpack_x_y_sample_weight(
                element if isinstance(element, tuple) else (element,))
            return x
        return None
    if isinstance(data, keras.utils.PyDataset):
        batch = data[0]
    elif isinstance(data, (tuple, list)) and data:
        batch = tuple(data)
    else:
        return None
    x, _, _ = keras.utils.unpack_x_y_sample_weight(
        batch if isinstance(batch, tuple) else (batch,))
    try:
        return tf.nest.map_structure(lambda a: tf.convert_to_tensor(a)[:1], x)
    except (TypeError, ValueError):
        return None


def build_from_data(model, data):
    """Builds `model` by calling it on one batch of `data` (TF's evaluator
    restores into an unbuilt model too).

    Raises:
        ValueError: no batch can be taken from `data`.
    """
    x = first_inputs(data)
    if x is None:
        raise ValueError(
            "SidecarEvaluator's model is not built, and no batch could be "
            "taken from `data` to build it, so its weights cannot be matched "
            "with a checkpoint. Received: an unbuilt "
            f"{type(model).__name__} and data of type {type(data).__name__}. "
            "Fix: pass non-empty data, start the model with keras.Input, or "
            "call model.build(input_shape).")
    model(x, training=False)
