"""Optimizers for large embedding tables: `LazyAdam`.

Keras' SGD (without momentum), Adagrad and Ftrl (without L2 shrinkage) already
update only the looked-up rows of a table on the ps under a keras_ps strategy,
with Keras' exact result (see docs/large_tables.md). Adam cannot:
its dense update moves every row at every step, even with a zero gradient.
`LazyAdam` is the explicit row-wise variant.
"""

import keras

from keras_ps._keras import lazy_adam as _hooks
from keras_ps._keras import row_tracking as _row_tracking


# Registered so that `keras.models.load_model` of a model compiled with it
# finds the class (with keras_ps imported).
@keras.saving.register_keras_serializable(package="keras_ps")
class LazyAdam(keras.optimizers.Adam):
    """Adam that updates only the rows of a sparse gradient (an embedding's).

    Same arguments as `keras.optimizers.Adam`. Dense gradients (the MLP's)
    get Adam's ordinary update (on a ps: the fused one-kernel update). For a
    sparse gradient (`tf.IndexedSlices`: an `Embedding` lookup, sharded or
    not, or any gather), only the gradient's rows of the weight, `m` and `v`
    are read and written, on the ps holding them.

    Semantics, for a row `r` with gradient `g` at step `t` (1-based), last
    updated at step `s` (`s = 0`: never), `k = t - s` (1 when another
    worker's apply at the same or a later step updated the row first: dense
    Adam decays the moments at each apply too; `s` then stays the later
    step):

    - moments: `m = beta_1^k * m + (1 - beta_1) * g` and
      `v = beta_2^k * v + (1 - beta_2) * g^2`: exactly dense Adam's moments
      for that row, whose zero gradients over the `k - 1` skipped steps only
      decayed them. (The classic LazyAdam leaves them undecayed, so a rare
      row's stale momentum and variance keep their full weight.)
    - bias correction: the global step `t`, as dense Adam
      (`alpha = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t)`).
    - the row itself does not move while untouched; when it is next touched
      it first moves by what dense Adam's `k - 1` skipped steps would have
      moved it (its decaying momentum, `alpha * m / (sqrt(v) + epsilon) *
      (rho + ... + rho^(k-1))` with `rho = beta_1 / sqrt(beta_2)`), then takes
      this step's update. The catch-up uses this step's `alpha` for the
      skipped steps and keeps epsilon once; it is the skipped-steps
      correction proposed on TensorFlow's tracker ("SparseAdam") after the
      classic LazyAdam fell short of Adam's accuracy. A row never touched again keeps
      its value (dense Adam would move it by at most ~9 more updates of its
      last momentum with the default betas).

    Memory: one more slot, an int64 per row (8 bytes) recording `s`, next to
    the two float moments per element.

    Repeated ids in a batch are summed before the update, as in the dense
    gradient. On a ps, a float32 table's rows are updated by one C++ kernel
    (keras_ps/_native, built once per machine) in one pass over each row,
    under the locks of the table and its slots: two workers' updates of a
    row come one after the other. Where the kernel cannot be built (no C++
    compiler or no TF headers, as in keras_ps' Docker image), or with
    `KERAS_PS_NATIVE=0`, the same update runs as TF's ops (gathers,
    elementwise ops, scatters: about 1 ms more of the busier ps' CPU per
    step at 10M rows), and concurrent workers updating the same row race on its
    moments like any asynchronous parameter-server update.

    Options that cannot be row-wise raise a `ValueError` naming the fix:
    `amsgrad=True`, `global_clipnorm` (needs every gradient's norm first),
    and a `weight_decay` that applies to a weight with a sparse gradient
    (exclude the table with `exclude_from_weight_decay`).

    Example:
    ```python
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,), dtype="int32"),
                                  keras.layers.Embedding(10_000_000, 64), ...])
        model.compile(keras_ps.optimizers.LazyAdam(1e-3), "mse")
    ```
    """

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999,
                 epsilon=1e-7, amsgrad=False, name="lazy_adam", **kwargs):
        if amsgrad:
            raise ValueError(
                "LazyAdam cannot update row by row with amsgrad: the maximum "
                "of a row's second moment would have to be kept for every row "
                f"at every step. Received: amsgrad={amsgrad!r}. Use "
                "amsgrad=False, or keras.optimizers.Adam(amsgrad=True) (dense).")
        if kwargs.get("global_clipnorm") is not None:
            raise ValueError(
                "LazyAdam cannot clip by the global norm row by row: that norm "
                "needs every gradient made dense first. Received: "
                f"global_clipnorm={kwargs['global_clipnorm']!r}. Use clipnorm= "
                "(each weight's own norm, computed on its rows) or "
                "keras.optimizers.Adam (dense).")
        super().__init__(learning_rate=learning_rate, beta_1=beta_1,
                         beta_2=beta_2, epsilon=epsilon, amsgrad=False,
                         name=name, **kwargs)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._row_steps = _hooks.add_row_step_slots(self, var_list)

    def update_step(self, gradient, variable, learning_rate):
        _hooks.lazy_adam_update(self, gradient, variable, learning_rate,
                                self._row_steps)

    def get_config(self):
        config = super().get_config()
        config.pop("amsgrad", None)
        return config


# Its sparse update is row-wise and marks its rows: an incremental backup
# (keras_ps.IncrementalBackup) writes only the changed rows of a table and
# of these slots.
_row_tracking.register_row_slots(
    LazyAdam, ("_momentums", "_velocities", "_row_steps"))
