"""Every use of Keras internals (`keras.src...`) in keras_ps, one module per concern.

Keras 3.15 has no public extension points for what these modules do; each hook
says which one is missing. Each hook leaves models that are not built under a
keras_ps strategy exactly as plain Keras handles them, keeps Keras' own
function as `__keras_ps_original__`, and has its internals pinned in
tests/api/test_keras_internals.py, so a Keras upgrade that moves one fails
loudly there. Supported range: see setup.cfg.

- `hooks`: installing a wrapper over a Keras function, once.
- `fit_routing`: Model.fit/evaluate/predict of a keras_ps model go to keras_ps.
- `atomic_updates`: `assign_add`/`assign_sub` of ps variables as one atomic op.
- `sharding`: sharded layer weights (creation, lookup, saving).
- `optimizers`: how optimizers update variables that live on a ps.
- `initializers`: which initializers a large variable can be drawn with in
  row blocks on its ps.
- `saving`: Keras weights files of weights on the ps, a block of rows at a time.
"""
