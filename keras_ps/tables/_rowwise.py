"""Row-wise optimizer updates: only the rows a sparse gradient names.

Pure TensorFlow (no Keras internals). Each function takes the `tf.Variable`s
of one weight (or one shard) and its slots, and a `tf.IndexedSlices`
gradient, and updates only the gradient's rows, in place, with as few ops as
TF has kernels for. When the table is tracked for incremental backups
(keras_ps.tables._dirty_rows), each also marks the rows it updated; otherwise that
adds nothing. Callers run them under `tf.device(variable.device)`, so
the work happens on the ps holding the variable and only the gradient's rows
travel.

Every function first sums the rows of repeated ids (`deduplicate`): a dense
gradient holds each row once, the sum of its repeats, and the formulas below
are those of the dense update applied to that dense gradient. A lookup sums
them before they leave the worker (`expand`).
"""

import tensorflow as tf

from keras_ps import _native
from keras_ps.tables import _dirty_rows


def expand(rows, position):
    """`tf.gather(rows, position)`: a lookup's `rows`, read once per distinct
    id, expanded to every id (`position`, int32 from tf.unique: each id's
    distinct row). Its gradient sums each id's repeats back into its
    distinct row on the worker, before the rows cross to their ps.

    TF's gradient of the gather hands the repeats on unsummed, and the next
    op sums them with UnsortedSegmentSum: one Eigen expression per row, about
    0.3 ms of a worker's CPU per step for 4096 ids of 64 floats. keras_ps'
    `KerasPsSumRows` adds the same floats in the same order (TF's result bit
    for bit) in about a tenth of that, where every task of the cluster the
    coordinator traces for has loaded it (keras_ps._native.kernels_in_trace);
    elsewhere TF's op does it.
    """
    # The cheap checks first: the kernels' question asks every task once.
    kernels = (None if tf.executing_eagerly() or rows.dtype != tf.float32
               or position.dtype != tf.int32 else _native.kernels_in_trace())
    if kernels is None:
        return tf.gather(rows, position)

    @tf.custom_gradient
    def expanded(rows):
        def sum_repeats(upstream):
            return kernels.keras_ps_sum_rows(
                tf.convert_to_tensor(upstream), position,
                tf.shape(rows, out_type=tf.int32)[0])
        return tf.gather(rows, position), sum_repeats

    return expanded(rows)


# Graph attribute: references of the row-index tensors known to hold each
# index once (see `mark_distinct`).
_DISTINCT_ATTR = "_keras_ps_distinct_indices"


def mark_distinct(indices):
    """Records that `indices` (a graph tensor) holds each row index once, as
    the rows a sharded lookup gathers do: the gradient of that gather then
    needs no summing of repeats on the ps."""
    if tf.executing_eagerly():
        return
    graph = indices.graph
    marked = getattr(graph, _DISTINCT_ATTR, None)
    if marked is None:
        marked = set()
        setattr(graph, _DISTINCT_ATTR, marked)
    marked.add(indices.ref())


def _known_distinct(indices):
    if not hasattr(indices, "graph") or tf.executing_eagerly():
        return False
    marked = getattr(indices.graph, _DISTINCT_ATTR, ())
    # A gather's gradient names its indices reshaped to 1-D.
    while indices.ref() not in marked and indices.op.type in ("Reshape", "Identity"):
        indices = indices.op.inputs[0]
    return indices.ref() in marked


def deduplicate(gradient):
    """(values, indices) of `gradient` with each index once, repeats summed.

    A gradient whose indices are known to be distinct (`mark_distinct`) is
    returned as it is: summing would give the same values.

    Args:
        gradient: a `tf.IndexedSlices` over axis 0 (indices of any rank).
    """
    indices = tf.reshape(gradient.indices, [-1])
    values = tf.reshape(gradient.values, tf.concat(
        [[-1], tf.shape(gradient.values)[tf.rank(gradient.indices):]], 0))
    if _known_distinct(gradient.indices):
        return values, indices
    unique, position = tf.unique(indices)
    summed = tf.math.unsorted_segment_sum(values, position, tf.size(unique))
    return summed, unique


def sgd(variable, gradient, learning_rate):
    """`variable -= learning_rate * gradient` on the gradient's rows (one op).

    Repeated ids need no summing: the scatter adds each repeat."""
    values = tf.cast(gradient.values, variable.dtype)
    lr = tf.cast(learning_rate, variable.dtype)
    indices = tf.reshape(gradient.indices, [-1])
    values = tf.reshape(values, tf.concat(
        [[-1], tf.shape(values)[tf.rank(gradient.indices):]], 0))
    update = tf.raw_ops.ResourceScatterSub(
        resource=variable.handle, indices=indices, updates=values * lr)
    _dirty_rows.mark_rows(variable, indices, after=[update])


def adagrad(variable, accumulator, gradient, learning_rate, epsilon,
            kernels=None):
    """Keras 3's Adagrad on the gradient's rows:
    `accumulator += g^2; variable -= lr * g / sqrt(accumulator + epsilon)`.

    (TF's ResourceSparseApplyAdagradV2 puts epsilon outside the square root,
    `sqrt(accumulator) + epsilon`, so it is not used.) Three ops: scatter-add
    into the accumulator, gather its new rows, scatter-sub into the variable.

    Args:
        kernels: keras_ps' C++ kernels (keras_ps._native.kernels_for), or
            None. With them a float32 weight is updated in one pass over
            each row, under the locks of both variables (the same results
            to float rounding).
    """
    values, indices = deduplicate(gradient)
    if kernels is not None and variable.dtype == tf.float32:
        update = kernels.keras_ps_adagrad_rows(
            var=variable.handle, accumulator=accumulator.handle,
            grad=tf.cast(values, tf.float32), indices=tf.cast(indices, tf.int64),
            lr=tf.cast(learning_rate, tf.float32),
            epsilon=tf.cast(epsilon, tf.float32))
        _dirty_rows.mark_rows(variable, indices, after=[update])
        return
    values = tf.cast(values, variable.dtype)
    tf.raw_ops.ResourceScatterAdd(resource=accumulator.handle, indices=indices,
                                  updates=tf.square(values))
    rows = tf.raw_ops.ResourceGather(resource=accumulator.handle,
                                     indices=indices, dtype=variable.dtype)
    lr = tf.cast(learning_rate, variable.dtype)
    eps = tf.cast(epsilon, variable.dtype)
    update = tf.raw_ops.ResourceScatterSub(
        resource=variable.handle, indices=indices,
        updates=lr * values / tf.sqrt(rows + eps))
    _dirty_rows.mark_rows(variable, indices, after=[update])


def ftrl(variable, accumulator, linear, gradient, learning_rate, l1, l2, beta,
         learning_rate_power):
    """Keras 3's Ftrl (without L2 shrinkage) on the gradient's rows, with TF's
    one-kernel `ResourceSparseApplyFtrl`.

    Keras computes `quadratic = accum_new^-p / lr + 2 * (l2 + beta / (2 lr))`
    where the kernel computes `accum_new^-p / lr + 2 * l2`: the kernel is given
    `l2 + beta / (2 lr)`. The rest of the formula is the same.
    """
    values, indices = deduplicate(gradient)
    dtype = variable.dtype
    lr = tf.cast(learning_rate, dtype)
    update = tf.raw_ops.ResourceSparseApplyFtrl(
        var=variable.handle, accum=accumulator.handle, linear=linear.handle,
        grad=tf.cast(values, dtype), indices=indices, lr=lr,
        l1=tf.cast(l1, dtype), l2=tf.cast(l2, dtype) + tf.cast(beta, dtype) / (2 * lr),
        lr_power=tf.cast(learning_rate_power, dtype), use_locking=True)
    _dirty_rows.mark_rows(variable, indices, after=[update])


def lazy_adam(variable, m, v, last_step, gradient, step, learning_rate, beta_1,
              beta_2, epsilon, kernels=None):
    """Adam on the gradient's rows only; see keras_ps.optimizers.LazyAdam.

    For each row `r` named by the gradient, at step `t` (1-based), with `k =
    max(t - last_step[r], 1)` (steps since the row was last updated; `t` for
    a row never updated, whose moments are 0; 1 for a second update at the
    same step, from another worker), `alpha = lr * sqrt(1 - beta_2^t) /
    (1 - beta_1^t)` and `rho = beta_1 / sqrt(beta_2)`:

        drift = alpha * m[r] / (sqrt(v[r]) + epsilon)
                * (rho + rho^2 + ... + rho^(k-1))
        m[r] = beta_1^k * m[r] + (1 - beta_1) * g[r]
        v[r] = beta_2^k * v[r] + (1 - beta_2) * g[r]^2
        variable[r] -= drift + alpha * m[r] / (sqrt(v[r]) + epsilon)
        last_step[r] = max(last_step[r], t)

    The moments are exactly dense Adam's (its zero-gradient steps only decay
    them). `drift` is what dense Adam's k - 1 skipped steps would have moved
    the row by, `alpha_j * beta_1^i m / sqrt(beta_2^i v)`, summed with the
    current `alpha` and epsilon kept once (exact when the learning rate and
    bias correction no longer change and epsilon is small against sqrt(v)):
    the skipped-steps correction proposed on TensorFlow's tracker
    ("SparseAdam"), applied when the row is next touched. Three gathers, two
    scatter-updates, one scatter-max, one scatter-sub.

    Args:
        variable, m, v: `tf.Variable`s of one shape; `last_step`: an int64
            `tf.Variable` of shape `[variable.shape[0]]`.
        gradient: `tf.IndexedSlices`.
        step: the 1-based step number `t` (int64 scalar).
        learning_rate, beta_1, beta_2, epsilon: scalars.
        kernels: keras_ps' C++ kernels (keras_ps._native.kernels_for), or
            None. With them a float32 weight is updated in one pass over
            each row, under the locks of all four variables.
    """
    values, indices = deduplicate(gradient)
    if kernels is not None and variable.dtype == tf.float32:
        update = kernels.keras_ps_lazy_adam_rows(
            var=variable.handle, m=m.handle, v=v.handle,
            last_step=last_step.handle, grad=tf.cast(values, tf.float32),
            indices=tf.cast(indices, tf.int64), step=tf.cast(step, tf.int64),
            lr=tf.cast(learning_rate, tf.float32),
            beta_1=tf.cast(beta_1, tf.float32),
            beta_2=tf.cast(beta_2, tf.float32),
            epsilon=tf.cast(epsilon, tf.float32))
        _dirty_rows.mark_rows(variable, indices, after=[update])
        return
    dtype = variable.dtype
    g = tf.cast(values, dtype)
    step = tf.cast(step, tf.int64)
    t = tf.cast(step, dtype)
    b1, b2 = tf.cast(beta_1, dtype), tf.cast(beta_2, dtype)
    eps = tf.cast(epsilon, dtype)
    last = tf.raw_ops.ResourceGather(resource=last_step.handle, indices=indices,
                                     dtype=tf.int64)
    # Two workers applying at the same step (both read `iterations` before
    # either added 1) update a row they share one after the other: dense
    # Adam decays its moments at each of the two applies, so the second
    # counts as one step too (k = 1, no drift), not as none (k = 0 would
    # skip the decay and move the row back by one step of its old momentum).
    k = tf.cast(tf.maximum(step - last, 1), dtype)
    k = tf.reshape(k, [-1] + [1] * (variable.shape.rank - 1))
    m_rows = tf.raw_ops.ResourceGather(resource=m.handle, indices=indices, dtype=dtype)
    v_rows = tf.raw_ops.ResourceGather(resource=v.handle, indices=indices, dtype=dtype)
    alpha = (tf.cast(learning_rate, dtype) * tf.sqrt(1 - tf.pow(b2, t))
             / (1 - tf.pow(b1, t)))
    rho = b1 / tf.sqrt(b2)
    skipped = rho * (1 - tf.pow(rho, k - 1)) / (1 - rho)  # rho + ... + rho^(k-1)
    drift = alpha * skipped * m_rows / (tf.sqrt(v_rows) + eps)
    m_rows = tf.pow(b1, k) * m_rows + (1 - b1) * g
    v_rows = tf.pow(b2, k) * v_rows + (1 - b2) * tf.square(g)
    updates = [
        tf.raw_ops.ResourceScatterUpdate(resource=m.handle, indices=indices,
                                         updates=m_rows),
        tf.raw_ops.ResourceScatterUpdate(resource=v.handle, indices=indices,
                                         updates=v_rows),
        # The larger of the two: an apply whose `t` was read before another
        # worker's later step reached this row must not set it back, or the
        # row's next update would count a step it never skipped (drift and
        # decay for it).
        tf.raw_ops.ResourceScatterMax(
            resource=last_step.handle, indices=indices,
            updates=tf.fill(tf.shape(indices), step)),
        tf.raw_ops.ResourceScatterSub(
            resource=variable.handle, indices=indices,
            updates=drift + alpha * m_rows / (tf.sqrt(v_rows) + eps))]
    _dirty_rows.mark_rows(variable, indices, after=updates)
