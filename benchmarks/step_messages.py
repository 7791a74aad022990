"""How many tensors cross between processes in one training step.

Each tensor a step moves from one task to another is a message of its own
(a Send on one side, a Recv on the other); on this machine a message costs
about the same CPU whatever its size (benchmarks/step_breakdown.py), so their
count is the step's main cost. This counts them from the graphs TF runs: the
child process trains 20 steps of `fit_calls.py`'s model (100k rows, 2 ps, 2
workers, steps_per_execution=10) with TF_DUMP_GRAPH_PREFIX set, which makes
every task write each partition of each function it runs; the script reads
the partitions of the packed train function and counts the Send nodes by
(from, to, what is sent).

A Send inside the steps' `tf.while_loop` runs once per step; written out
(KERAS_PS_UNROLL_STEPS), each step has Sends of its own, so a line seen 10
times is per step. Lines seen once run once per execution. Figures are per
worker: every worker runs its own copy of the function.

    .venv/bin/python benchmarks/step_messages.py [--systems keras_ps_adagrad,...]

Only keras_ps systems: TF native's coordinator instantiates its functions
the same way, but tf_keras names its loop differently.
"""

import argparse
import collections
import glob
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = 100_000


def _child(system, dump):
    os.environ["TF_DUMP_GRAPH_PREFIX"] = dump
    os.environ["TF_DUMP_GRAPH_NAME_FILTER"] = "*"
    sys.path.insert(0, HERE)
    import fit_calls
    cluster, model, creator, keras = fit_calls.build(system, ROWS)
    fit_calls.timed_fit(keras, model, creator, 1, 20)
    cluster.shutdown()


def _task(device):
    # "/job:ps/replica:0/task:1/device:CPU:0" -> "ps1"
    parts = dict(p.split(":", 1) for p in device.strip("/").split("/")[:3])
    return parts["job"] + parts["task"]


def count(dump, workers=2):
    """{(from task, to task, op that made the tensor): Sends} per worker, over
    the train-function partitions of every worker."""
    from google.protobuf import text_format
    from tensorflow.core.framework import graph_pb2

    # Each worker partitions the function it runs and writes its own
    # partition; each ps writes the partition it received from each worker
    # ("..._partitioned_<id>_<n>_partition__job:ps..."). The worker's copy of
    # a ps partition has the same name for both workers: skipped.
    paths = glob.glob(os.path.join(
        dump, "__inference_run_loop_*_partition__job:*after_partition_passes*"))
    paths = [p for p in paths if "_partitioned_" in p or
             "partition__job:worker" in p]
    counts = collections.Counter()
    for path in sorted(paths):
        with open(path) as f:
            text = f.read()
        graph = graph_pb2.GraphDef()
        text_format.Parse(text, graph)
        nodes = {n.name: n for n in graph.node}
        for node in graph.node:
            if node.op not in ("_Send", "_HostSend"):
                continue
            source = nodes.get(node.input[0].lstrip("^").split(":")[0])
            while source is not None and source.op in ("Identity", "Enter") \
                    and source.input:
                source = nodes.get(source.input[0].lstrip("^").split(":")[0])
            what = source.op if source is not None else "?"
            route = [_task(node.attr[k].s.decode())
                     for k in ("send_device", "recv_device")]
            # One worker's view: "worker" for whichever worker it is.
            route = ["worker" if t.startswith("worker") else t for t in route]
            counts[(*route, what)] += 1
    return {key: n / workers for key, n in counts.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--systems", default="keras_ps_adagrad,"
                        "keras_ps_adagrad_unrolled,keras_ps_lazyadam")
    parser.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        _child(*args._child)
        return
    for system in args.systems.split(","):
        with tempfile.TemporaryDirectory() as dump:
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
            for name in ("KERAS_PS_UNROLL_STEPS", "KERAS_PS_UNROLL_AFTER",
                         "KERAS_PS_GROUP_TRANSFERS"):
                env.pop(name, None)
            subprocess.run([sys.executable, os.path.abspath(__file__),
                            "--_child", system, dump], env=env, check=True,
                           capture_output=True)
            counts = count(dump)
        print(f"\n{system}: Sends in one worker's train function "
              "(from -> to, what, how many)")
        for (src, dst, what), n in sorted(counts.items()):
            print(f"  {src:8s} -> {dst:8s} {what:24s} {n:g}")
        print(f"  total {sum(counts.values()):g}")


if __name__ == "__main__":
    main()
