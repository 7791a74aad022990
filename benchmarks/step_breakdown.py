"""Where a row-wise Model.fit step's time goes, and the floor of this machine.

Model as benchmarks/fit_calls.py: Embedding(R, 64) on 2 ps
(FixedShardsPartitioner(2)), MLP 128-64-1, Adagrad(0.1) (row-wise on the
table), batch 256 x 16 Zipf-like ids, steps_per_execution=10, a
`keras_ps.LocalCluster` of 2 ps and 2 workers (one `python -m
keras_ps.server` process per task); the coordinator is the measuring process.

Each repeat is a new process with a new cluster. In it:

1. fit: the model is trained with `Model.fit` (300 steps to warm up, then
   300 timed steps on both workers): steps/s as users see it.
2. Ablation, on worker 0 alone, one remote call at a time: tf.functions
   that each do one part of a step, 10 times in a `tf.while_loop` as the
   packed train function does, called the way the coordinator's worker
   thread calls a closure (the packed `run_all`, a cancellable concrete
   function, under the worker's device, then the token fetched). Every
   step-like part reads its batch (`next(iterator)`); the part's cost is its
   time minus `input`'s. Parts, interleaved in rounds so the shared
   machine's load hits all of them alike:
     empty          one remote call of an empty function (per call)
     empty_sched    the same through coordinator.schedule + fetch (per call)
     input          next(iterator) only
     lookup_ps0/1   the distinct ids' rows gathered from one ps
     lookup         the Embedding layer's lookup (both ps, as in the step)
     dense_reads    the MLP's variables read from their ps (the partitioner
                    splits each kernel over both ps: 9 variables)
     compute        forward + backward of the MLP on local tensors (the
                    rows, weights made on the worker), as the step's math
     grad_send      each ps' rows of a gradient sent to it (reduced there)
     sparse_update  optimizer.apply of IndexedSlices gradients to the
                    table's shards (row-wise Adagrad on the ps)
     dense_update   optimizer.apply of the MLP's dense gradients
     step           the real packed train function (10 train steps)
     step_unrolled  the same 10 train steps written out, no tf.while_loop
     dense_adagrad_per_var / _grouped
                    Keras' Adagrad formula run on the ps for the MLP's
                    variables, their gradients sent one tensor per variable,
                    or one flat tensor per ps (split there)
3. Floor, between the same processes:
     floor_transfer one round trip per ps per step moving the step's bytes:
                    each ps' share of the distinct rows (and the MLP's
                    weights) to the worker and the same bytes back;
                    also with 1-row tensors (the round trips' latency alone);
                    the MLP's bytes alone, one tensor per variable each way
                    or one flat tensor per ps each way
     kernels        on each ps, run there (no RPC in the loop): the row
                    gather, TF's one-kernel ResourceSparseApplyAdagradV2 and
                    keras_ps' row-wise Adagrad on that ps' rows (the real
                    shard and its accumulator; keras_ps' C++ kernel where
                    the tasks loaded it, as in fit), 50 times per call

    .venv/bin/python benchmarks/step_breakdown.py --rows 1000000 --repeats 3
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fit_large_tables import BATCH, DIM, IDS, STEPS_PER_EXECUTION  # noqa: E402
from fit_large_tables import dataset_fn_for, table_model  # noqa: E402

FIT_STEPS = 300
ROUNDS = 5
CALLS_PER_ROUND = 6
KERNEL_LOOPS = 50
PS_DEVICE = "/job:ps/replica:0/task:{}/device:CPU:0"


def _cpu_s(pid):
    """User + system CPU seconds of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_one(rows):
    import numpy as np
    import tensorflow as tf

    import keras
    import keras_ps
    # Benchmark only: internals of keras_ps (the coordinator's packed
    # functions, a step's traced functions) to call them as its worker
    # threads do, and TF's cancellation manager through the adapter.
    from keras_ps import _tf_adapter
    from keras_ps._keras.optimizers import slot
    from keras_ps.partitioners import FixedShardsPartitioner
    from keras_ps.strategy._per_worker import dispatch_scope, worker_device
    from keras_ps import _native
    from keras_ps.tables import _rowwise
    from keras_ps.training import _step_functions

    cluster = keras_ps.LocalCluster(num_workers=2, num_ps=2)
    strategy = keras_ps.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=FixedShardsPartitioner(2))
    keras.utils.set_random_seed(0)
    with strategy.scope():
        optimizer = keras.optimizers.Adagrad(0.1)
        model = table_model(keras, rows, optimizer, ["accuracy"])
    creator = keras_ps.DatasetCreator(dataset_fn_for(tf, rows))

    pids = {"coordinator": os.getpid()}
    for job in ("ps", "worker"):
        for i in range(2):
            pids[f"{job}{i}"] = cluster.pid(job, i)

    def cpu():
        return {name: _cpu_s(pid) for name, pid in pids.items()}

    def cpu_delta(before):
        after = cpu()
        return {name: after[name] - before[name] for name in pids}

    # -- 1. fit, both workers ---------------------------------------------------
    model.fit(creator, epochs=1, steps_per_epoch=FIT_STEPS, verbose=0)
    cpu_before = cpu()
    start = time.perf_counter()
    model.fit(creator, epochs=1, steps_per_epoch=FIT_STEPS, verbose=0)
    fit_s = time.perf_counter() - start
    fit_cpu = cpu_delta(cpu_before)

    # -- the model's pieces -----------------------------------------------------
    embedding = model.layers[0]
    table = embedding.embeddings  # a ShardedWeight: one shard per ps
    shards_keras = list(table.keras_variables)
    shards = list(table.variables)
    accumulators = [slot(optimizer, "_accumulators", v) for v in shards_keras]
    offsets = table._parts()[1]  # row offset of each shard
    dense_keras = [v for l in model.layers[2:] for v in l.trainable_weights]
    dense = [v.value for v in dense_keras]
    assert len(shards) == 2, shards
    ps_of = lambda v: int(v.device.split("task:")[1].split("/")[0])
    assert [ps_of(s) for s in shards] == [0, 1]

    # Distinct rows per batch, per shard (what one step moves each way).
    from fit_large_tables import make_batch
    counts = np.zeros((20, 2))
    for i in range(20):
        ids = np.unique(make_batch(tf, rows, 0, i)[0].numpy())
        counts[i] = [(ids < offsets[1]).sum(), (ids >= offsets[1]).sum()]
    rows_per_ps = [int(round(c)) for c in counts.mean(axis=0)]
    dense_bytes = sum(int(np.prod(v.shape)) * 4 for v in dense)

    coordinator = keras_ps.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn_for(tf, rows)))
    it0 = iterator.values[0]
    packing = coordinator._packing

    def repeat(body):
        """`body()` STEPS_PER_EXECUTION times, as the packed train step."""
        first = body()
        _, last = tf.while_loop(
            lambda i, _: i < STEPS_PER_EXECUTION - 1,
            lambda i, _: (i + 1, body()), (tf.constant(0), first))
        return last

    def batch_ids(it):
        ids, labels = next(it)
        flat = tf.reshape(ids, [-1])
        unique, position = tf.unique(flat)
        return unique, position, labels

    def route(unique):
        positions, locals_ = table._route(unique)
        return positions, locals_

    def fn(f, name):
        f.__name__ = name
        return tf.function(f, autograph=False)

    # -- 2. the parts -------------------------------------------------------------
    parts = {}

    parts["empty"] = fn(lambda it: tf.constant(0.0), "empty")

    def input_only(it):
        def body():
            ids, labels = next(it)
            return tf.cast(tf.reduce_sum(ids), tf.float32) + tf.reduce_sum(labels)
        return repeat(body)
    parts["input"] = fn(input_only, "input")

    def lookup_one(p):
        def f(it):
            def body():
                unique, _, _ = batch_ids(it)
                _, locals_ = route(unique)
                with tf.device(shards[p].device):
                    got = tf.gather(shards[p], locals_[p])
                return tf.reduce_sum(got)
            return repeat(body)
        return f
    parts["lookup_ps0"] = fn(lookup_one(0), "lookup_ps0")
    parts["lookup_ps1"] = fn(lookup_one(1), "lookup_ps1")

    def lookup(it):
        def body():
            ids, _ = next(it)
            return tf.reduce_sum(embedding(ids))
        return repeat(body)
    parts["lookup"] = fn(lookup, "lookup")

    def dense_reads(it):
        def body():
            ids, _ = next(it)
            total = tf.cast(tf.reduce_sum(ids), tf.float32)
            for v in dense:
                total += tf.reduce_sum(tf.convert_to_tensor(v))
            return total
        return repeat(body)
    parts["dense_reads"] = fn(dense_reads, "dense_reads")

    def compute(it):
        seed = tf.constant([1, 2], tf.int64)
        shapes = [(IDS * DIM, 128), (128,), (128, 64), (64,), (64, 1), (1,)]
        weights = [tf.random.stateless_normal(s, seed) * 0.05 for s in shapes]

        def body():
            unique, position, labels = batch_ids(it)
            table_rows = tf.fill([tf.size(unique), DIM], 0.01)
            with tf.GradientTape() as tape:
                tape.watch([table_rows] + weights)
                w1, b1, w2, b2, w3, b3 = weights
                x = tf.reshape(tf.gather(table_rows, position), [BATCH, IDS * DIM])
                h = tf.nn.relu(x @ w1 + b1)
                h = tf.nn.relu(h @ w2 + b2)
                p = tf.clip_by_value(tf.sigmoid(h @ w3 + b3), 1e-7, 1 - 1e-7)
                loss = -tf.reduce_mean(labels * tf.math.log(p)
                                       + (1 - labels) * tf.math.log(1 - p))
                accuracy = tf.reduce_mean(tf.cast(
                    tf.equal(labels, tf.round(p)), tf.float32))
            grads = tape.gradient(loss, [table_rows] + weights)
            grads[0] = tf.convert_to_tensor(grads[0])
            # Each shard's rows of the gradient, as the step's lookup gradient.
            positions, _ = route(unique)
            total = loss + accuracy
            for pos in positions:
                total += tf.reduce_sum(tf.gather(grads[0], pos))
            for g in grads[1:]:
                total += tf.reduce_sum(g)
            return total
        return repeat(body)
    parts["compute"] = fn(compute, "compute")

    sinks = []
    for p in range(2):
        with tf.device(PS_DEVICE.format(p)):
            sinks.append(tf.Variable(0.0, name=f"sink{p}"))

    def grad_send(it):
        def body():
            unique, _, _ = batch_ids(it)
            positions, _ = route(unique)
            g = tf.fill([tf.size(unique), DIM], 1e-4)
            for p in range(2):
                part = tf.gather(g, positions[p])
                with tf.device(sinks[p].device):
                    sinks[p].assign_add(tf.reduce_sum(part))
            return tf.constant(0.0)
        return repeat(body)
    parts["grad_send"] = fn(grad_send, "grad_send")

    def sparse_update(it):
        def body():
            unique, _, _ = batch_ids(it)
            positions, locals_ = route(unique)
            g = tf.fill([tf.size(unique), DIM], 1e-4)
            grads = [tf.IndexedSlices(tf.gather(g, positions[p]), locals_[p],
                                      tf.constant(shards[p].shape.as_list(), tf.int64))
                     for p in range(2)]
            optimizer.apply(grads, shards_keras)
            return tf.constant(0.0)
        return repeat(body)
    parts["sparse_update"] = fn(sparse_update, "sparse_update")

    def dense_update(it):
        def body():
            ids, _ = next(it)
            grads = [tf.fill(v.shape, 1e-4) for v in dense]
            optimizer.apply(grads, dense_keras)
            return tf.cast(tf.reduce_sum(ids), tf.float32)
        return repeat(body)
    parts["dense_update"] = fn(dense_update, "dense_update")

    parts["step"] = _step_functions.for_model(model, "train_step").get(STEPS_PER_EXECUTION)

    # -- 3a. floor: the step's bytes, one round trip per ps per step --------------
    floor_vars = []
    for p in range(2):
        with tf.device(PS_DEVICE.format(p)):
            floor_vars.append((
                tf.Variable(tf.zeros([rows_per_ps[p], DIM])),
                tf.Variable(tf.zeros([rows_per_ps[p], DIM]))))
    dense_on = [[v for v in dense if ps_of(v) == p] for p in range(2)]
    dense_back = []
    for p in range(2):
        with tf.device(PS_DEVICE.format(p)):
            dense_back.append([tf.Variable(tf.zeros(v.shape)) for v in dense_on[p]])

    tiny_vars = []
    for p in range(2):
        with tf.device(PS_DEVICE.format(p)):
            tiny_vars.append((tf.Variable(tf.zeros([1, DIM])),
                              tf.Variable(tf.zeros([1, DIM]))))

    def floor_transfer(with_dense, pairs=floor_vars):
        def f(it):
            def body():
                ids, _ = next(it)
                for p in range(2):
                    src, dst = pairs[p]
                    got = [tf.convert_to_tensor(src)]
                    if with_dense:
                        got += [tf.convert_to_tensor(v) for v in dense_on[p]]
                    got = [g * 1.0001 for g in got]  # made on the worker
                    with tf.device(src.device):
                        dst.assign(got[0])
                        if with_dense:
                            for v, g in zip(dense_back[p], got[1:]):
                                v.assign(g)
                return tf.cast(tf.reduce_sum(ids), tf.float32)
            return repeat(body)
        return f
    parts["floor_rows"] = fn(floor_transfer(False), "floor_rows")
    parts["floor_rows_dense"] = fn(floor_transfer(True), "floor_rows_dense")
    parts["floor_tiny"] = fn(floor_transfer(False, tiny_vars), "floor_tiny")

    def dense_trip(grouped):
        # The MLP's bytes only, as separate tensors (one per variable each
        # way) or grouped: one flat tensor per ps each way.
        def f(it):
            def body():
                ids, _ = next(it)
                for p in range(2):
                    if not dense_on[p]:
                        continue
                    if grouped:
                        with tf.device(PS_DEVICE.format(p)):
                            flat = tf.concat([tf.reshape(v, [-1]) for v in dense_on[p]], 0)
                        flat = flat * 1.0001
                        with tf.device(PS_DEVICE.format(p)):
                            sizes = [int(np.prod(v.shape)) for v in dense_on[p]]
                            for v, g in zip(dense_back[p], tf.split(flat, sizes)):
                                v.assign(tf.reshape(g, v.shape))
                    else:
                        got = [tf.convert_to_tensor(v) * 1.0001 for v in dense_on[p]]
                        with tf.device(PS_DEVICE.format(p)):
                            for v, g in zip(dense_back[p], got):
                                v.assign(g)
                return tf.cast(tf.reduce_sum(ids), tf.float32)
            return repeat(body)
        return f
    parts["floor_dense"] = fn(dense_trip(False), "floor_dense")
    parts["floor_dense_grouped"] = fn(dense_trip(True), "floor_dense_grouped")

    dense_accumulators = [slot(optimizer, "_accumulators", v) for v in dense_keras]

    def adagrad_on_ps(grouped):
        # Keras' Adagrad formula on each MLP variable, on its ps; the
        # gradients sent one tensor per variable, or one flat tensor per ps.
        def f(it):
            lr = tf.constant(1e-6)
            def body():
                ids, _ = next(it)
                grads = [tf.fill(v.shape, 1e-4) for v in dense]
                for p in range(2):
                    mine = [i for i, v in enumerate(dense) if ps_of(v) == p]
                    if not mine:
                        continue
                    if grouped:
                        flat = tf.concat([tf.reshape(grads[i], [-1]) for i in mine], 0)
                        with tf.device(PS_DEVICE.format(p)):
                            sizes = [int(np.prod(dense[i].shape)) for i in mine]
                            parts_p = [tf.reshape(g, dense[i].shape) for i, g in
                                       zip(mine, tf.split(flat, sizes))]
                    else:
                        parts_p = [grads[i] for i in mine]
                    for i, g in zip(mine, parts_p):
                        with tf.device(dense[i].device):
                            acc = dense_accumulators[i]
                            acc.assign_add(tf.square(g))
                            dense[i].assign_sub(lr * g / tf.sqrt(acc + 1e-7))
                return tf.cast(tf.reduce_sum(ids), tf.float32)
            return repeat(body)
        return f
    parts["dense_adagrad_per_var"] = fn(adagrad_on_ps(False), "dense_adagrad_per_var")
    parts["dense_adagrad_grouped"] = fn(adagrad_on_ps(True), "dense_adagrad_grouped")

    def step_unrolled(it):
        logs = None
        for _ in range(STEPS_PER_EXECUTION):
            logs = model.train_step(next(it))
        return logs
    parts["step_unrolled"] = fn(step_unrolled, "step_unrolled")

    # -- timing -------------------------------------------------------------------
    cancellation = _tf_adapter.new_cancellation_manager()

    def direct_call(f):
        calls = [((it0,), {})]
        pack = packing.prepare(f, calls)
        run = cancellation.get_cancelable_function(pack.function)
        with tf.device(worker_device(0)), dispatch_scope(0, 2):
            _, token = run(*pack.args)
        token.numpy()

    def scheduled_call(f):
        coordinator.schedule(f, args=(iterator,)).fetch()

    callers = {name: direct_call for name in parts}
    callers["empty_sched"] = scheduled_call
    parts["empty_sched"] = parts["empty"]
    times = {name: [] for name in parts}
    cpu_s = {name: {p: 0.0 for p in pids} for name in parts}
    first_call_s = {}
    for name, f in parts.items():  # traces and first runs, not timed
        start = time.perf_counter()
        callers[name](f)
        first_call_s[name] = time.perf_counter() - start
    for _ in range(ROUNDS):
        for name, f in parts.items():
            cpu_before = cpu()
            for _ in range(CALLS_PER_ROUND):
                start = time.perf_counter()
                callers[name](f)
                times[name].append(time.perf_counter() - start)
            for p, used in cpu_delta(cpu_before).items():
                cpu_s[name][p] += used

    # -- 3b. floor: kernels run on each ps ------------------------------------------
    def kernel_loop(p, what):
        shard, accum = shards[p], accumulators[p]
        low, high = offsets[p], offsets[p + 1]

        def body(i):
            seed = tf.stack([tf.cast(i, tf.int64), tf.constant(p, tf.int64)])
            u = tf.random.stateless_uniform([BATCH * IDS], seed, 0.0,
                                            math.log(rows + 1))
            ids = tf.minimum(tf.cast(tf.floor(tf.exp(u)), tf.int64) - 1, rows - 1)
            ids = tf.boolean_mask(ids, (ids >= low) & (ids < high)) - low
            ids, _ = tf.unique(ids)
            g = tf.fill([tf.size(ids), DIM], 1e-4)
            if what == "ids":
                return tf.reduce_sum(g[:, :1]) + tf.cast(tf.reduce_sum(ids), tf.float32)
            if what == "gather":
                got = tf.raw_ops.ResourceGather(resource=shard.handle,
                                                indices=ids, dtype=tf.float32)
                return tf.reduce_sum(got[:, :1]) + tf.reduce_sum(g[:, :1])
            if what == "tf_adagrad":
                tf.raw_ops.ResourceSparseApplyAdagradV2(
                    var=shard.handle, accum=accum.handle, lr=1e-6,
                    epsilon=1e-7, grad=g, indices=ids, use_locking=True)
                return tf.constant(0.0)
            # What fit runs: keras_ps' C++ kernel where every task loaded it.
            _rowwise.adagrad(shard, accum, tf.IndexedSlices(g, ids), 1e-6, 1e-7,
                             kernels=_native.kernels_for(strategy))
            return tf.constant(0.0)

        def loop():
            return tf.while_loop(lambda i, _: i < KERNEL_LOOPS,
                                 lambda i, _: (i + 1, body(i)),
                                 (tf.constant(0), tf.constant(0.0)))[1]
        return tf.function(loop, autograph=False)

    kernel_times = {}
    kernel_fns = {(p, what): kernel_loop(p, what) for p in range(2)
                  for what in ("ids", "gather", "tf_adagrad", "keras_ps_adagrad")}
    for key, f in kernel_fns.items():
        with tf.device(PS_DEVICE.format(key[0])):
            f().numpy()
        kernel_times[key] = []
    kernel_cpu = {key: 0.0 for key in kernel_fns}
    for _ in range(ROUNDS):
        for key, f in kernel_fns.items():
            ps_cpu = _cpu_s(pids[f"ps{key[0]}"])
            start = time.perf_counter()
            with tf.device(PS_DEVICE.format(key[0])):
                f().numpy()
            kernel_times[key].append((time.perf_counter() - start) / KERNEL_LOOPS)
            kernel_cpu[key] += _cpu_s(pids[f"ps{key[0]}"]) - ps_cpu

    iterations = int(optimizer.iterations.numpy())
    cluster.shutdown()
    return {
        "rows": rows,
        "fit_steps_per_s": FIT_STEPS / fit_s,
        "fit_cpu_s": fit_cpu,
        "cpu_s": cpu_s,
        "rows_per_ps": rows_per_ps,
        "dense_bytes": dense_bytes,
        "call_s": times,
        "first_call_s": first_call_s,
        "kernel_s": {f"ps{p}/{what}": v for (p, what), v in kernel_times.items()},
        "kernel_cpu_s": {f"ps{p}/{what}": v / (ROUNDS * KERNEL_LOOPS)
                         for (p, what), v in kernel_cpu.items()},
        "iterations": iterations,
    }


# -- parent: children, summaries ------------------------------------------------------
def run_child(rows, timeout=1800):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--_child", str(rows)],
        capture_output=True, text=True, env=env, timeout=timeout)
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
        return {"rows": rows, "error": f"exit {out.returncode}: " + out.stderr[-3000:]}
    return json.loads(lines[-1][len("RESULT "):])


PER_CALL = ("empty", "empty_sched")


def summarize(run):
    """Milliseconds per step (per call for PER_CALL) of each part, medians
    over the run's calls; derived figures."""
    ms = {}
    for name, values in run["call_s"].items():
        per = 1 if name in PER_CALL else STEPS_PER_EXECUTION
        ms[name] = 1000 * statistics.median(values) / per
    k = {name: 1000 * statistics.median(v) for name, v in run["kernel_s"].items()}
    base = ms["input"]
    d = {
        "fit step (2 workers), ms": 1000 / run["fit_steps_per_s"],
        "fit steps/s": run["fit_steps_per_s"],
        "step (1 worker, 1 call at a time), ms": ms["step"],
        "remote call, empty fn, ms/call": ms["empty"],
        "coordinator schedule+fetch overhead, ms/call": ms["empty_sched"] - ms["empty"],
        "input (next(iterator)), ms": base,
        "lookup ps0 only, ms": ms["lookup_ps0"] - base,
        "lookup ps1 only, ms": ms["lookup_ps1"] - base,
        "lookup both ps (Embedding layer), ms": ms["lookup"] - base,
        "dense reads (MLP variables), ms": ms["dense_reads"] - base,
        "compute fwd+bwd on local tensors, ms": ms["compute"] - base,
        "gradient rows sent to the ps, ms": ms["grad_send"] - base,
        "sparse update (optimizer.apply, table), ms": ms["sparse_update"] - base,
        "dense update (optimizer.apply, MLP), ms": ms["dense_update"] - base,
    }
    parts = ["input (next(iterator)), ms", "lookup both ps (Embedding layer), ms",
             "dense reads (MLP variables), ms", "compute fwd+bwd on local tensors, ms",
             "sparse update (optimizer.apply, table), ms",
             "dense update (optimizer.apply, MLP), ms"]
    d["sum of the parts, ms"] = sum(d[p] for p in parts)
    d["step - sum of the parts (metrics, waiting, overlap), ms"] = (
        ms["step"] - d["sum of the parts, ms"])
    d["floor: step's rows, one round trip per ps, ms"] = ms["floor_rows"] - base
    d["floor: rows + MLP weights, one round trip per ps, ms"] = (
        ms["floor_rows_dense"] - base)
    d["same round trips with 1-row tensors (latency only), ms"] = (
        ms["floor_tiny"] - base)
    d["step, 10 train steps unrolled (no while_loop), ms"] = ms["step_unrolled"]
    for key, name in (
            ("MLP bytes, one tensor per variable each way, ms", "floor_dense"),
            ("MLP bytes, one flat tensor per ps each way, ms", "floor_dense_grouped"),
            ("dense Adagrad on the ps, gradients one per variable, ms",
             "dense_adagrad_per_var"),
            ("dense Adagrad on the ps, gradients one flat tensor per ps, ms",
             "dense_adagrad_grouped")):
        if name in ms:  # parts added after the first runs
            d[key] = ms[name] - base
    for what in ("gather", "tf_adagrad", "keras_ps_adagrad"):
        d[f"kernel on the ps: {what} (ps0 + ps1), ms"] = sum(
            k[f"ps{p}/{what}"] - k[f"ps{p}/ids"] for p in range(2))
    if "kernel_cpu_s" in run:
        kc = {name: 1000 * v for name, v in run["kernel_cpu_s"].items()}
        for what in ("gather", "tf_adagrad", "keras_ps_adagrad"):
            d[f"CPU ms on the ps: {what} kernel (ps0 + ps1)"] = sum(
                kc[f"ps{p}/{what}"] - kc[f"ps{p}/ids"] for p in range(2))
    d["floor (rows + MLP bytes + gather + TF adagrad kernel), ms"] = (
        d["floor: rows + MLP weights, one round trip per ps, ms"]
        + d["kernel on the ps: gather (ps0 + ps1), ms"]
        + d["kernel on the ps: tf_adagrad (ps0 + ps1), ms"])
    d["floor + compute, ms"] = (d["floor (rows + MLP bytes + gather + TF adagrad kernel), ms"]
                                + d["compute fwd+bwd on local tensors, ms"])
    calls = ROUNDS * CALLS_PER_ROUND
    cpu = {name: {p: 1000 * used / (calls * (1 if name in PER_CALL else
                                              STEPS_PER_EXECUTION))
                  for p, used in by_proc.items()}
           for name, by_proc in run["cpu_s"].items()}
    total = {name: sum(by_proc.values()) for name, by_proc in cpu.items()}
    d["CPU ms/step, fit (2 workers), all 5 processes"] = 1000 * sum(
        run["fit_cpu_s"].values()) / FIT_STEPS
    for p in ("coordinator", "ps0", "ps1", "worker0", "worker1"):
        d[f"CPU ms/step, fit, {p}"] = 1000 * run["fit_cpu_s"][p] / FIT_STEPS
    d["CPU ms/step, step (1 worker), all processes"] = total["step"]
    for p in ("coordinator", "ps0", "ps1", "worker0"):
        d[f"CPU ms/step, step (1 worker), {p}"] = cpu["step"][p]
    d["CPU ms/call, empty remote call"] = total["empty"]
    d["CPU ms/call, empty through coordinator.schedule"] = total["empty_sched"]
    for name in ("input", "lookup", "dense_reads", "compute", "grad_send",
                 "sparse_update", "dense_update", "floor_rows",
                 "floor_rows_dense", "floor_tiny", "step_unrolled",
                 "floor_dense", "floor_dense_grouped", "dense_adagrad_per_var",
                 "dense_adagrad_grouped"):
        if name not in total:
            continue
        extra = 0 if name == "input" else total["input"]
        d[f"CPU ms/step, {name}" + ("" if name == "input" else " (minus input)")] = (
            total[name] - extra)
    d["step (1 worker) / floor"] = ms["step"] / d[
        "floor (rows + MLP bytes + gather + TF adagrad kernel), ms"]
    d["step (1 worker) / (floor + compute)"] = ms["step"] / d["floor + compute, ms"]
    d["fit step (2 workers) / floor"] = d["fit step (2 workers), ms"] / d[
        "floor (rows + MLP bytes + gather + TF adagrad kernel), ms"]
    return d


def spread(values, digits=2):
    return (f"{min(values):.{digits}f} / **{statistics.median(values):.{digits}f}**"
            f" / {max(values):.{digits}f}")


def markdown(runs):
    lines = []
    for rows in sorted({r["rows"] for r in runs}):
        ok = [r for r in runs if r["rows"] == rows and "error" not in r]
        if not ok:
            continue
        summaries = [summarize(r) for r in ok]
        first = ok[0]
        lines += [
            f"R = {rows:,}: {len(ok)} runs; distinct rows per step "
            f"ps0 {first['rows_per_ps'][0]:,} / ps1 {first['rows_per_ps'][1]:,} "
            f"({sum(first['rows_per_ps']) * DIM * 4 / 2**20:.2f} MB each way), "
            f"MLP weights {first['dense_bytes'] / 2**20:.2f} MB each way; "
            f"load (1 min) {spread([r['load_before'][0] for r in ok], 1)}",
            "",
            "| figure | min / **median** / max |",
            "|---|---|",
        ]
        keys = list(dict.fromkeys(k for s in summaries for k in s))
        for key in keys:
            values = [s[key] for s in summaries if key in s]
            lines.append(f"| {key} | {spread(values)} |")
        lines.append("")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1000000",
                        help="comma-separated table sizes, run one at a time")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the raw runs here")
    parser.add_argument("--from-json", help="format saved runs instead")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        print("RESULT " + json.dumps(run_one(int(args._child))), flush=True)
        os._exit(0)
    if args.from_json:
        with open(args.from_json) as f:
            runs = json.load(f)
    else:
        runs = []
        for rows in [int(r) for r in args.rows.split(",")]:
            for r in range(args.repeats):
                before = os.getloadavg()
                start = time.perf_counter()
                result = run_child(rows)
                result.update(repeat=r, load_before=before,
                              load_after=os.getloadavg(),
                              wall_s=time.perf_counter() - start)
                runs.append(result)
                if "error" in result:
                    print(f"R={rows:,} run {r}: FAILED {result['error'][-2000:]}",
                          file=sys.stderr, flush=True)
                    continue
                s = summarize(result)
                print(f"R={rows:,} run {r}: fit {s['fit steps/s']:.1f} steps/s, "
                      f"step {s['step (1 worker, 1 call at a time), ms']:.2f} ms, "
                      f"floor {s['floor (rows + MLP bytes + gather + TF adagrad kernel), ms']:.2f}"
                      f" ms, load {before[0]:.1f}, {result['wall_s']:.0f} s",
                      file=sys.stderr, flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(runs, f)
    print("\n".join(markdown(runs)))


if __name__ == "__main__":
    main()
