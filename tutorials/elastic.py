"""Elastic parameter-server training: workers join and leave during Model.fit.

Everything runs on this machine's loopback as real processes:

1. a rendezvous server (in this process; `python -m keras_ps.elastic.launch
   --standalone` on a real cluster) and one ps (`python -m keras_ps.server
   --rdzv_endpoint`, which announces its address to the rendezvous);
2. two workers, each started by its own agent (`python -m
   keras_ps.elastic.launch --nnodes=2:3 --address=... -- TASK`);
3. `model.fit` with a `keras_ps.elastic.ElasticClusterResolver`: the
   coordinator follows the rendezvous membership;
4. in epoch 0 a third agent starts (the cluster grows to 3: its per-worker
   dataset is created, nobody restarts); later it gets SIGTERM (the cluster
   shrinks back to 2: its in-flight steps are retried on the others).

With `--input shards` the data are a `keras_ps.ShardedInput`: the
coordinator hands out shards of the data to whichever worker is free, so the
third worker takes shards as soon as it is admitted, the shards it holds
when it leaves go back to the queue, and every record is trained once per
epoch (the result adds the records trained per epoch, and those trained
twice: the steps the leaving worker had started, which its shard's retry
runs again; the optimizer's iterations are the plan plus those steps).

The last line printed is `RESULT {json}`: steps run per worker, optimizer
iterations against the plan, seconds from the third agent's launch to its
worker's first step, and whether the first two workers kept their pids.

Run:
    python tutorials/elastic.py --steps_per_epoch 40 --epochs 4
    python tutorials/elastic.py --epochs 4 --input shards
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import portpicker  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_ps  # noqa: E402
from keras_ps.cluster import wait_for_port  # noqa: E402
from keras_ps.elastic import RendezvousConfig  # noqa: E402
from keras_ps.elastic import RendezvousServer  # noqa: E402

PER_EXECUTION = 2
HOST = "127.0.0.1"


def free_address():
    return f"{HOST}:{portpicker.pick_unused_port()}"


class Agent:
    """One `keras_ps.elastic.launch` agent subprocess running a worker."""

    def __init__(self, rdzv_endpoint, log_dir, name):
        self.address = free_address()
        self.log_path = os.path.join(log_dir, f"{name}.log")
        task = [sys.executable, "-m", "keras_ps.server", "--job_name",
                "worker", "--task_index", "0", "--cluster_spec",
                '{"worker": ["{address}"]}']
        command = [sys.executable, "-m", "keras_ps.elastic.launch",
                   f"--rdzv_endpoint={rdzv_endpoint}", "--nnodes=2:3",
                   f"--address={self.address}", "--monitor_interval=0.5",
                   "--max_restarts=0", "--"] + task
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log,
                                            stderr=subprocess.STDOUT, env=env)

    def task_pid(self, timeout=60.0):
        """The worker's pid, as the agent printed it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self.log_path, errors="replace") as log:
                found = re.search(r"task pid=(\d+)", log.read())
            if found:
                return int(found.group(1))
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"agent for {self.address} printed no task pid; "
                           f"see {self.log_path}")

    def stop(self, timeout=30.0):
        """SIGTERM; returns the agent's exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def data(n=4096):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = x[:, :4].sum(1, keepdims=True) > x[:, 4:].sum(1, keepdims=True)
    return x, y.astype("float32")


def dataset_creator():
    x, y = data()

    def dataset_fn(context):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(
            context.num_input_pipelines, context.input_pipeline_id)
        return ds.shuffle(512, seed=context.input_pipeline_id).batch(32) \
            .repeat()

    return keras_ps.DatasetCreator(dataset_fn)


def sharded_input():
    """The same records as dynamic shards: 16 ranges of 256, handed out by
    the coordinator (a shard is not tied to a worker, so a joining worker
    changes nothing about the data)."""
    x, y = data()
    return keras_ps.ShardedInput((x, y), batch_size=32, records_per_shard=256,
                                 seed=1)


class GrowAndShrink(keras.callbacks.Callback):
    """Starts a third agent in epoch 0 and stops it once it ran steps."""

    def __init__(self, rdzv_endpoint, log_dir, grow_at, min_steps_run):
        super().__init__()
        self.rdzv_endpoint, self.log_dir = rdzv_endpoint, log_dir
        self.grow_at, self.min_steps_run = grow_at, min_steps_run
        self.third = None
        self.coordinator = None
        self.report = {"third_ran": 0, "first_step_seconds": None}
        self._first_step = threading.Event()
        self._shrunk = False
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def _third_worker(self):
        for w in self.coordinator.workers:
            if w.address == self.third.address:
                return w
        return None

    def on_train_batch_end(self, batch, logs=None):
        if self.third is None and (self._epoch, batch) >= (0, self.grow_at):
            self._grow()
        elif self.third is not None and not self._shrunk:
            worker = self._third_worker()
            if worker is not None and \
                    worker.closures_run >= self.min_steps_run:
                self._shrink(worker)

    def _grow(self):
        launched = time.monotonic()
        self.third = Agent(self.rdzv_endpoint, self.log_dir, "agent-2")
        print(f"[elastic] third agent launched for {self.third.address}",
              flush=True)

        def first_step():
            while time.monotonic() - launched < 120:
                worker = self._third_worker()
                if worker is not None and worker.closures_run > 0:
                    self.report["first_step_seconds"] = round(
                        time.monotonic() - launched, 3)
                    self._first_step.set()
                    return
                time.sleep(0.005)

        threading.Thread(target=first_step, daemon=True).start()
        # A job this small would end before a worker process boots (TF's
        # import takes seconds); hold the fit until the new worker answers,
        # so it has steps left to take. A real job does not need this.
        if not wait_for_port(self.third.address, 90, self.third.process):
            raise RuntimeError(f"third worker did not start; see "
                               f"{self.third.log_path}")
        self.report["serving_seconds"] = round(time.monotonic() - launched, 3)
        self.report["third_pid"] = self.third.task_pid()

    def _shrink(self, worker):
        self.report["third_ran"] = worker.closures_run
        self.report["third_agent_exit"] = self.third.stop()
        self._shrunk = True
        print(f"[elastic] third agent stopped after {worker.closures_run} "
              "steps", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps_per_epoch", type=int, default=40)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--input", choices=["dataset_fn", "shards"],
                        default="dataset_fn")
    args = parser.parse_args(argv)
    if args.steps_per_epoch < 4 or args.epochs < 2:
        parser.error("--steps_per_epoch must be >= 4 and --epochs >= 2")

    log_dir = tempfile.mkdtemp(prefix="keras_ps_elastic_")
    rdzv = RendezvousServer(RendezvousConfig(gather_timeout=0.5))
    rdzv_endpoint = f"{HOST}:{rdzv.start()}"
    ps_address = free_address()
    ps = subprocess.Popen(
        [sys.executable, "-m", "keras_ps.server", "--job_name", "ps",
         "--cluster_spec", json.dumps({"ps": [ps_address]}),
         # It announces its address to the rendezvous: a replacement on
         # another address is followed there (docs/ps_recovery.md).
         "--rdzv_endpoint", rdzv_endpoint],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    agents = [Agent(rdzv_endpoint, log_dir, f"agent-{i}") for i in range(2)]
    grow = None
    try:
        # ps=1: the ps' address comes from its announcement (ps=[address]
        # works too, when the addresses are known in advance).
        resolver = keras_ps.elastic.ElasticClusterResolver(
            rdzv_endpoint, ps=1, min_workers=2, poll_interval=1.0,
            startup_timeout=90)
        if not wait_for_port(ps_address, 90):
            raise RuntimeError(f"{ps_address} did not start; logs: {log_dir}")
        for i in range(len(agents)):
            # An agent that gave up reaching the rendezvous (a very busy
            # machine) is started again, twice at most.
            for attempt in range(1, 3):
                if wait_for_port(agents[i].address, 90, agents[i].process):
                    break
                agents[i].stop()
                agents[i] = Agent(rdzv_endpoint, log_dir,
                                  f"agent-{i}-{attempt}")
            else:
                if not wait_for_port(agents[i].address, 90, agents[i].process):
                    raise RuntimeError(f"{agents[i].address} did not start; "
                                       f"logs: {log_dir}")
        pids = [a.task_pid() for a in agents]
        strategy = keras_ps.ParameterServerStrategy(resolver)
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = keras.Sequential([
                keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(1, activation="sigmoid")])
            model.compile(keras.optimizers.Adam(0.02), "binary_crossentropy",
                          steps_per_execution=PER_EXECUTION)
        coordinator = keras_ps.ClusterCoordinator(strategy)
        # With shards the batch index of the callbacks counts shards.
        grow = GrowAndShrink(rdzv_endpoint, log_dir,
                             grow_at=4 if args.input == "shards" else
                             min(9, args.steps_per_epoch // 2),
                             min_steps_run=2)
        grow.coordinator = coordinator
        if args.input == "shards":
            history = model.fit(sharded_input(), epochs=args.epochs,
                                callbacks=[grow], verbose=0)
            # An epoch is every record once: 4096 records, 128 steps of 32.
            planned = args.epochs * 128
        else:
            history = model.fit(dataset_creator(), epochs=args.epochs,
                                steps_per_epoch=args.steps_per_epoch,
                                callbacks=[grow], verbose=0)
            planned = args.epochs * args.steps_per_epoch
        result = dict(
            planned=planned,
            iterations=int(model.optimizer.iterations.numpy()),
            per_execution=PER_EXECUTION, max_pack=coordinator.max_pack,
            per_worker={w.address: w.closures_run
                        for w in coordinator.workers if w.address},
            states=[w.state.value for w in coordinator.workers],
            pids_unchanged=pids == [a.task_pid() for a in agents],
            first_two_alive=all(a.process.poll() is None for a in agents),
            log_dir=log_dir, **grow.report)
        if args.input == "shards":
            result.update(
                records_trained=history.history["records_trained"],
                records_retrained=history.history["records_retrained"],
                shards_lost=history.history["shards_lost"])
        coordinator.shutdown()
        resolver.close()
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        for agent in agents + ([grow.third] if grow and grow.third else []):
            agent.stop()
        ps.send_signal(signal.SIGTERM)
        try:
            ps.wait(30)
        except subprocess.TimeoutExpired:
            ps.kill()
            ps.wait()
        rdzv.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
