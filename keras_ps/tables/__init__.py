"""Large tables: variables split by rows over the parameter servers.

This package owns what a table is and how its rows live on the ps, with no
Keras internals: `ShardedVariable` and its ops (`sharded_variable`,
`_sharded_variable_ops`), how many shards a variable gets (`partitioners`,
public as `keras_ps.partitioners`), the Keras weight that groups the shards
and their optimizer slots (`_sharded_weights`; their restore after a
checkpoint restored before the optimizer was built, `_slot_restore`), the
check that row ids are in a table (`_slicing`), row-wise optimizer math
(`_rowwise`) and which rows it changed (`_dirty_rows`), creation on the ps in
row blocks (`_blockwise_init`), and weights files and TF checkpoints written
a block or a slice of rows at a time (`_row_chunks`). The Keras hooks that
put these under Keras layers and optimizers are in `keras_ps._keras`;
`keras_ps.optimizers.LazyAdam` is the row-wise Adam; backups of tables are in
`keras_ps.backups`; the dynamic-vocabulary table (`DynamicEmbedding`), a
Keras layer on the strategy, is `keras_ps.dynamic_embedding`.
"""

from keras_ps.tables.sharded_variable import ShardedVariable

__all__ = ["ShardedVariable"]
