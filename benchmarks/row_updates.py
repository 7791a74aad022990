"""The row-wise optimizer updates alone: TF's ops against keras_ps' C++ kernels.

One process, no cluster: a table of R x 64 float32 rows and its slots as
local variables, batches of 4,096 ids made distinct, log-uniform (Zipf-like:
about 2,000 rows an apply at 5M rows) or uniform (--ids uniform: about 4,000),
each update applied 50 times in one tf.function call, 10 calls a round, every
apply with a batch of its own (500 in all), so that, as in training, the rows
of an apply are mostly not in a cache. Prints microseconds per apply, min and
median over the rounds, for Adagrad and LazyAdam, each as TF's ops
(keras_ps.tables._rowwise with kernels=None) and with keras_ps' kernel.

--after-lookup times what a ps does for a step instead: each apply's rows
gathered from the table first (a lookup), then the kernel's update, and the
lookup alone; an update's own cost is then (lookup + update) - lookup, with
the table's rows cached by the lookup and the slots' rows not, as in
training.

    .venv/bin/python benchmarks/row_updates.py --rows 5000000 --rounds 7
    .venv/bin/python benchmarks/row_updates.py --rows 1000000 --ids uniform
    .venv/bin/python benchmarks/row_updates.py --rows 500000 --ids uniform \
        --after-lookup
"""

import argparse
import os
import statistics
import sys
import time

DIM, IDS, APPLIES, CALLS = 64, 4096, 50, 10


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=5_000_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ids", choices=("zipf", "uniform"), default="zipf")
    parser.add_argument("--after-lookup", action="store_true",
                        help="each update after a gather of its rows, and "
                        "the gather alone (the kernels only)")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import numpy as np
    import tensorflow as tf

    from keras_ps import _native
    from keras_ps.tables import _rowwise

    kernels = _native.library()
    if kernels is None:
        sys.exit("keras_ps' C++ kernels cannot be built here (see the warning)")
    rows, rng = args.rows, np.random.default_rng(0)
    table = tf.Variable(rng.normal(size=(rows, DIM)).astype("float32"))
    accumulator = tf.Variable(tf.fill((rows, DIM), 0.1))
    m = tf.Variable(tf.zeros((rows, DIM)))
    v = tf.Variable(tf.zeros((rows, DIM)))
    last_step = tf.Variable(tf.zeros((rows,), tf.int64))
    step = tf.Variable(tf.constant(1, tf.int64))

    def batch():
        if args.ids == "uniform":
            ids = rng.integers(0, rows, IDS)
        else:
            ids = np.exp(rng.uniform(0, np.log(rows + 1), IDS)).astype(np.int64) - 1
        ids = np.unique(np.minimum(ids, rows - 1))
        return (tf.constant(rng.normal(size=(len(ids), DIM)).astype("float32")),
                tf.constant(ids))

    # One call's APPLIES batches, each used by one apply (the loop is
    # written out: the batches differ in length).
    batches = [[batch() for _ in range(APPLIES)] for _ in range(CALLS)]

    signature = [[(tf.TensorSpec([None, DIM], tf.float32),
                   tf.TensorSpec([None], tf.int64))] * APPLIES]

    def timed(update):
        @tf.function(input_signature=signature)
        def applies(call_batches):
            for values, ids in call_batches:
                _rowwise.mark_distinct(ids)
                update(tf.IndexedSlices(values, ids))
        return applies

    adagrad = lambda g: _rowwise.adagrad(  # noqa: E731
        table, accumulator, g, 0.1, 1e-7, kernels=kernels)
    lazy_adam = lambda g: _rowwise.lazy_adam(  # noqa: E731
        table, m, v, last_step, g, step.assign_add(1), 1e-3, 0.9, 0.999,
        1e-7, kernels=kernels)
    if args.after_lookup:
        # A lookup's rows go somewhere (an unused gather would be pruned):
        # one float of them into `sink`, in both the lookup alone and
        # before an update, so the two differ by the update only.
        sink = tf.Variable(0.0)

        def lookup(g):
            return sink.assign(tf.reduce_sum(tf.gather(table, g.indices)[:, 0]))

        def looked_up(update):
            def after_lookup(g):
                with tf.control_dependencies([lookup(g)]):
                    update(g)
            return after_lookup

        functions = {
            "lookup alone": timed(lookup),
            "lookup, adagrad": timed(looked_up(adagrad)),
            "lookup, lazy_adam": timed(looked_up(lazy_adam)),
        }
    else:
        functions = {
            "adagrad, TF's ops": timed(lambda g: _rowwise.adagrad(
                table, accumulator, g, 0.1, 1e-7)),
            "adagrad, kernel": timed(adagrad),
            "lazy_adam, TF's ops": timed(lambda g: _rowwise.lazy_adam(
                table, m, v, last_step, g, step.assign_add(1), 1e-3, 0.9,
                0.999, 1e-7)),
            "lazy_adam, kernel": timed(lazy_adam),
        }
    for function in functions.values():  # trace (one signature for every call)
        function(batches[0])
    times = {name: [] for name in functions}
    for _ in range(args.rounds):
        for name, function in functions.items():
            start = time.perf_counter()
            for call_batches in batches:
                function(call_batches)
            times[name].append((time.perf_counter() - start)
                               / (CALLS * APPLIES) * 1e6)
    sizes = [len(ids) for call_batches in batches for _, ids in call_batches]
    print(f"rows {rows:,}, {args.ids} ids, {statistics.median(sizes):.0f} "
          f"distinct rows an apply (median), {args.rounds} rounds")
    for name, xs in times.items():
        print(f"{name:22s} us per apply: min {min(xs):7.1f}, "
              f"median {statistics.median(xs):7.1f}")
    if args.after_lookup:
        alone = statistics.median(times["lookup alone"])
        own = {name: statistics.median(times[f"lookup, {name}"]) - alone
               for name in ("adagrad", "lazy_adam")}
        print(f"the update after the lookup, medians: adagrad "
              f"{own['adagrad']:.1f} us, lazy_adam {own['lazy_adam']:.1f} us, "
              f"lazy_adam / adagrad {own['lazy_adam'] / own['adagrad']:.2f}x")


if __name__ == "__main__":
    main()
