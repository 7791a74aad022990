"""Keras initializers that keras_ps can run in row blocks (`keras.src...`).

Missing public API: a tf.distribute variable creator receives only a callable
initial value; neither the Keras initializer behind it nor the variable's
shape. We wrap the TF backend's `Variable._initialize_with_initializer` so a
weight or slot whose initializer draws each element on its own (zeros, ones,
constant, uniform, normal, truncated normal) hands the creator a
`keras_ps.tables._blockwise_init.BlockInitialValue`: a large one is then made on its
ps in row blocks, without a second copy of it (see that module). Other
initializers (Glorot, He, orthogonal, identity... whose numbers depend on the
whole shape) and any variable not made under a keras_ps strategy keep Keras'
own path.
"""

import functools

import keras
from keras.src.backend.tensorflow import core as tf_core

from keras_ps.tables import _blockwise_init
from keras_ps import _keras as hooks

VARIABLE_CLASS = tf_core.Variable

# Exact classes only: a subclass may draw differently.
ELEMENTWISE = (keras.initializers.Zeros, keras.initializers.Ones,
               keras.initializers.Constant, keras.initializers.RandomUniform,
               keras.initializers.RandomNormal,
               keras.initializers.TruncatedNormal)


def block_seed(seed, index):
    """The int seed of block `index` of an initializer seeded `seed`."""
    return (seed * 1_000_003 + index) % 2**31


def block_function(initializer):
    """`(index, shape, dtype) -> tensor` drawing block `index` of a weight
    initialised by `initializer`, or None when it cannot be drawn in blocks.

    A random initializer seeded with an int (Keras gives an unseeded one a
    fixed int seed too) draws block `index` with `block_seed(seed, index)`,
    so blocks differ and a rerun gives the same numbers; one seeded with a
    `keras.random.SeedGenerator` draws each block from the generator."""
    if type(initializer) not in ELEMENTWISE:
        return None
    seed = getattr(initializer, "seed", None)
    if not isinstance(seed, int) or isinstance(seed, bool):
        return lambda index, shape, dtype: initializer(shape, dtype=dtype)
    config = initializer.get_config()

    def block(index, shape, dtype):
        drawn = type(initializer).from_config(
            dict(config, seed=block_seed(seed, index)))
        return drawn(shape, dtype=dtype)

    return block


def _blockwise_initialize(keras_initialize_with_initializer):
    @functools.wraps(keras_initialize_with_initializer)
    def _initialize_with_initializer(self, initializer):
        block = block_function(initializer)
        if block is None:
            return keras_initialize_with_initializer(self, initializer)
        shape, dtype = tuple(self._shape), self._dtype
        self._initialize(_blockwise_init.BlockInitialValue(
            lambda: initializer(shape, dtype=dtype),
            lambda index, rows: block(index, (rows,) + shape[1:], dtype),
            shape, dtype))

    return _initialize_with_initializer


def install():
    """Installs the hook (the caller makes it once per process)."""
    hooks.wrap(VARIABLE_CLASS, "_initialize_with_initializer",
               _blockwise_initialize)
