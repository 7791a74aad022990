"""A trained model with dynamic tables, as a plain Keras model.

Each `DynamicEmbedding` becomes `IntegerLookup`/`StringLookup` over its live
keys followed by an `Embedding` whose row 0 is the default row and row `i`
the `i`-th key's row: unknown keys map to the default row, as in training
outside a row. Every other layer is kept as it is (its weights are read when
the model is saved). The result is built from Keras layers only, so its
`.keras` file (or `model.export()`) loads and serves where keras_ps is not
installed.
"""

import keras
import numpy as np

from keras_ps.dynamic_embedding.layer import DynamicEmbedding


def _oov_token(keys, key_dtype):
    """A token that is not a live key (Keras' lookups reserve it)."""
    if key_dtype == "string":
        token, live = "[UNK]", set(keys.tolist())
        while token.encode() in live or token in live:
            token = "#" + token
        return token
    token, live = -1, set(int(k) for k in keys)
    while token in live:
        token -= 1
    return token


def plain_layer(layer):
    """`layer` (a built DynamicEmbedding) as a plain Keras Sequential."""
    state = layer.live_state()
    keys = state["keys"]
    key_dtype = layer.config.key_dtype
    if key_dtype == "string":
        vocabulary = [k.decode() if isinstance(k, bytes) else k for k in keys]
        lookup = keras.layers.StringLookup(
            vocabulary=vocabulary or None, oov_token=_oov_token(keys, key_dtype),
            name=f"{layer.name}_lookup")
    else:
        vocabulary = [int(k) for k in keys]
        lookup = keras.layers.IntegerLookup(
            vocabulary=vocabulary or None, oov_token=_oov_token(keys, key_dtype),
            vocabulary_dtype="int64", name=f"{layer.name}_lookup")
    table = np.concatenate([layer.default_row_value()[np.newaxis],
                            state["rows"].astype(np.float32)])
    embedding = keras.layers.Embedding(
        len(table), layer.output_dim, name=f"{layer.name}_embedding",
        embeddings_initializer=keras.initializers.Constant(0.0))
    embedding.build()
    embedding.embeddings.assign(table)
    return keras.Sequential([lookup, embedding], name=layer.name)


def export_plain_model(model):
    """`model` with each DynamicEmbedding replaced by plain Keras layers.

    Args:
        model: a functional or Sequential Keras model (built).

    Returns:
        A new, uncompiled Keras model computing the same predictions, made
        of Keras layers only; save it with `model.save("m.keras")` or
        `model.export(...)`.

    Example:
    ```python
    plain = keras_ps.layers.export_plain_model(model)
    plain.save("serving.keras")   # loads without keras_ps
    ```
    """
    with keras.name_scope("export"):
        def clone(layer):
            if isinstance(layer, DynamicEmbedding):
                return plain_layer(layer)
            return layer

        cloned = keras.models.clone_model(model, clone_function=clone)
    # A new functional model over the clone's graph: no compile state (the
    # training model's optimizer and loss may be keras_ps' own classes).
    return keras.Model(cloned.inputs, cloned.outputs, name=model.name)
