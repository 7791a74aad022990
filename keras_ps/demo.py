"""`python -m keras_ps.demo` (or `./run.sh demo`): the README's first command.

Starts a local cluster of real processes (2 ps, 3 workers), trains a
click-through-style model whose embedding table is sharded over both ps,
kills one worker (SIGKILL) halfway, and shows training carry on.
The data follow a known rule (a label is 1 when the item id is even and the
user id is below 500), so the accuracy means something.
"""

import argparse
import logging
import os
import sys
import tempfile
import time

# TF's C++ runtime logs every RPC to a task that is gone (the killed worker,
# and every task at shutdown); the demo's own output says what happened.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="keras_ps.demo")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--no-kill", action="store_true",
                        help="do not kill a worker halfway")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("keras_ps").setLevel(logging.INFO)

    import keras
    import tensorflow as tf

    import keras_ps
    from keras_ps.partitioners import MinSizePartitioner

    # Each (worker, pack size) is its own trace; TF's retracing warning is noise.
    tf.get_logger().setLevel("ERROR")
    log_dir = tempfile.mkdtemp(prefix="keras_ps_demo_")
    print(f"Starting a local cluster: 2 ps, 3 workers (logs in {log_dir})")
    cluster = keras_ps.LocalCluster(num_workers=3, num_ps=2, log_dir=log_dir)
    try:
        strategy = keras_ps.ParameterServerStrategy(
            cluster.resolver,
            variable_partitioner=MinSizePartitioner(min_shard_bytes=16 << 10,
                                                    max_shards=2))
        coordinator = keras_ps.ClusterCoordinator(strategy)
        num_items, num_users, dim = 2000, 1000, 16
        with strategy.scope():
            items = tf.Variable(tf.random.normal([num_items, dim], stddev=0.1, seed=1),
                                name="item_embedding")
            users = tf.Variable(tf.random.normal([num_users, dim], stddev=0.1, seed=2),
                                name="user_embedding")
            w1 = tf.Variable(tf.random.normal([2 * dim, 32], stddev=0.2, seed=3))
            b1 = tf.Variable(tf.zeros([32]))
            w2 = tf.Variable(tf.random.normal([32, 1], stddev=0.2, seed=4))
            b2 = tf.Variable(tf.zeros([1]))
            correct = tf.Variable(0.0)
            seen = tf.Variable(0.0)
        print(f"item embedding {tuple(items.shape)} in shards "
              f"{[(tuple(v.shape), v.device.split('/')[1]) for v in items.variables]}")

        def dataset_fn(context):
            def make(seed):
                item = tf.random.stateless_uniform(
                    [args.batch], [seed, 0], 0, num_items, tf.int64)
                user = tf.random.stateless_uniform(
                    [args.batch], [seed, 1], 0, num_users, tf.int64)
                label = tf.cast((item % 2 == 0) & (user < 500), tf.float32)
                return item, user, label
            seeds = tf.data.Dataset.range(context.input_pipeline_id, 10**9,
                                          context.num_input_pipelines)
            return seeds.map(make).prefetch(2)

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
        dense = [w1, b1, w2, b2]

        @tf.function
        def train_step(it):
            item, user, label = next(it)
            shards = items.variables + users.variables
            with tf.GradientTape() as tape:
                tape.watch(shards)
                x = tf.concat([items.embedding_lookup(item),
                               users.embedding_lookup(user)], axis=1)
                h = tf.nn.relu(x @ w1 + b1)
                logits = tf.squeeze(h @ w2 + b2, 1)
                loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
                    label, logits))
            grads = tape.gradient(loss, shards + dense)
            for var, grad in zip(shards + dense, grads):
                if isinstance(grad, tf.IndexedSlices):
                    var.scatter_sub(tf.IndexedSlices(grad.values * 2.0, grad.indices))
                elif grad is not None:
                    var.assign_sub(grad * 0.5)
            hits = tf.reduce_sum(tf.cast((logits > 0) == (label > 0.5), tf.float32))
            correct.assign_add(hits)
            seen.assign_add(float(args.batch))
            return loss

        progbar = keras.utils.Progbar(args.steps, stateful_metrics=["loss", "acc"])
        start = time.perf_counter()
        chunk = 50
        killed = False
        last = None
        for done in range(0, args.steps, chunk):
            results = [coordinator.schedule(train_step, args=(iterator,))
                       for _ in range(min(chunk, args.steps - done))]
            if not args.no_kill and not killed and done >= args.steps // 2:
                cluster.kill("worker", 2)
                killed = True
                print("\n>>> killed worker 2 (SIGKILL); its steps move to the others")
            coordinator.join()
            last = results[-1].fetch()
            acc = correct.numpy() / max(seen.numpy(), 1)
            correct.assign(0.0)
            seen.assign(0.0)
            progbar.update(done + len(results), [("loss", last), ("acc", acc)])
        elapsed = time.perf_counter() - start
        print("\nSummary")
        print(f"  steps: {args.steps} in {elapsed:.1f}s ({args.steps / elapsed:.1f} steps/s)")
        for w in coordinator.workers:
            print(f"  worker {w.index}: {w.closures_run} steps, {w.state.value}")
        print(f"  final loss {last:.3f}, accuracy of the last {chunk} steps {acc:.3f}")
        print(f"  task logs: {log_dir}")
        coordinator.shutdown()
        return 0
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # Skip TF's teardown: it would try to reach the tasks we just stopped.
    os._exit(code)
