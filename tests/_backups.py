"""For the backup tests: reading keras_ps.callbacks.BackupAndRestore's
state file, and a small model with a table trained row-wise."""

import json
import os


def read_backup_state(backup_dir):
    """The newest backup's state (epoch, step, ...), or None while there is
    none or it is being replaced."""
    try:
        with open(os.path.join(backup_dir, "backup_state.json")) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def table_model(resolver, rows, dim, ids):
    """Embedding(rows, dim) over `ids` ids an example, then Dense(1),
    compiled with keras_ps' LazyAdam (its slots built). A strategy of its
    own over `resolver` (the connection is reused) places the variables
    from the first ps on, as for every other model of the process."""
    import keras

    import keras_ps

    strategy = keras_ps.ParameterServerStrategy(resolver)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((ids,), dtype="int32"),
            keras.layers.Embedding(rows, dim), keras.layers.Flatten(),
            keras.layers.Dense(1)])
        model.compile(keras_ps.optimizers.LazyAdam(0.01), "mse")
        model.optimizer.build(model.trainable_variables)
    return model
