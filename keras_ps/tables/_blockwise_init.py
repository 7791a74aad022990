"""Large variables made on their ps in row blocks: no second copy at creation.

TF creates a variable by computing its whole initial value as a tensor and
then assigning it; the assign copies, because the value is still referenced
when the variable adopts it. So creating a variable of S bytes costs 2S on
its ps for a moment (3S for Keras' `Constant`, which multiplies a tensor of
ones), and a ps holding one 1.2 GB shard of a table and its optimizer slots
peaks at the sum plus a whole shard. Measured on a ps process: a 512 MB
variable raised the ps' peak RSS by 1.04 GB made whole, by 0.55 GB made in
blocks of 16 MB.

Here a variable of at least BLOCKWISE_MIN_BYTES whose initial value can be
computed row block by row block (a `BlockInitialValue`) is created from an
uninitialised buffer of its shape (`Empty(init=False)`: no page is touched
until written), then filled in blocks of about BLOCK_BYTES, each computed on the ps and
written in place. The ps then peaks at the variable plus a block's
temporaries (two for `Constant`). Pure TensorFlow; the Keras side (which initializers qualify)
is in keras_ps._keras.sharding.
"""

import tensorflow as tf

from keras_ps.tables import _row_chunks

# Variables from this size are made in blocks; smaller ones as TF does.
BLOCKWISE_MIN_BYTES = 256 * 2**20
BLOCK_BYTES = 16 * 2**20


class BlockInitialValue:
    """A variable's initial value that can also be computed in row blocks.

    Calling it gives the whole value (what any other variable creator gets).

    Args:
        full: `() -> tensor` of `shape`, the whole value.
        block: `(index, rows) -> tensor` of shape `[rows] + shape[1:]`, the
            `index`-th block (same distribution as `full`, not the same
            numbers for a random initializer).
        shape, dtype: of the variable.
    """

    def __init__(self, full, block, shape, dtype):
        self._full = full
        self.block = block
        self.shape = tf.TensorShape(shape)
        self.dtype = tf.as_dtype(dtype)

    def __call__(self):
        return self._full()

    @property
    def nbytes(self):
        if not self.shape.is_fully_defined():
            return 0
        return self.shape.num_elements() * self.dtype.size


def _made_in_blocks(value):
    return (isinstance(value, BlockInitialValue) and value.shape.rank
            and value.nbytes >= BLOCKWISE_MIN_BYTES and tf.executing_eagerly())


def create(next_creator, kwargs):
    """`next_creator(**kwargs)`; a large `BlockInitialValue` is written in
    blocks on the variable's device (the caller's device scope)."""
    value = kwargs.get("initial_value")
    if not _made_in_blocks(value):
        return next_creator(**kwargs)
    shape, dtype = value.shape, value.dtype
    kwargs = dict(kwargs, initial_value=lambda: tf.raw_ops.Empty(
        shape=shape.as_list(), dtype=dtype, init=False))
    variable = next_creator(**kwargs)
    row_bytes = max(1, shape[1:].num_elements() * dtype.size)
    rows_per_block = max(1, BLOCK_BYTES // row_bytes)
    with tf.device(variable.device):
        for index, start in enumerate(range(0, shape[0], rows_per_block)):
            stop = min(start + rows_per_block, shape[0])
            block = tf.cast(value.block(index, stop - start), dtype)
            _row_chunks.assign_rows(variable, start, block)
            del block  # the block's buffer is freed before the next one
    return variable
