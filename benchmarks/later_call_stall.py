"""The wait at the start of a fit call that follows another one.

When a fit call ends, its per-worker dataset iterators are dropped. TF 2.21
destroys an iterator on the worker thread that serves the coordinator, and
the destructor can wait out the sleep of the iterator's autotuning thread
(which doubles up to 60 s the longer the iterator lived); the next call's
first request to that worker waits with it. keras_ps hands the iterators to a
holder on each worker instead (keras_ps/coordinator/iterator_release.py).

Systems, each in its own process, one at a time, interleaved per repeat:
  tf_native_adagrad            TF's ParameterServerStrategy + ClusterCoordinator
                               + tf_keras (needs tf_keras on PYTHONPATH)
  keras_ps_adagrad             keras_ps as shipped
  keras_ps_adagrad_norelease   keras_ps with KERAS_PS_RELEASE_ITERATORS=0
                               (iterators dropped the plain way, as TF does)

Model and cluster as benchmarks/fit_calls.py (Embedding(R, 64) on 2 ps,
2 workers, batch 256 x 16 Zipf-like ids, MLP, steps_per_execution=10, ps and
workers in their own processes). In each process: fit(100) to warm up, then
for each length N in --lengths, --rounds times: fit(N steps), then
fit(3 epochs x 100 steps); the start-up of that second call is its first
epoch minus the median of its other two.

    PYTHONPATH=.:<tf_keras dir> .venv/bin/python benchmarks/later_call_stall.py --repeats 2
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fit_calls import build, timed_fit  # noqa: E402

SYSTEMS = ("tf_native_adagrad", "keras_ps_adagrad", "keras_ps_adagrad_norelease")
NORELEASE = "_norelease"


def run_one(system, rows, lengths, rounds):
    if system.endswith(NORELEASE):
        os.environ["KERAS_PS_RELEASE_ITERATORS"] = "0"
    cluster, model, creator, keras = build(
        system.removesuffix(NORELEASE), rows, metrics=())
    timed = lambda epochs, steps: timed_fit(keras, model, creator, epochs, steps)  # noqa: E731

    timed(1, 100)
    result = {"system": system, "rows": rows, "startup_s": {}, "before_s": {}}
    for length in lengths:
        startups, befores = [], []
        for _ in range(rounds):
            befores.append(sum(timed(1, length)))
            epochs = timed(3, 100)
            startups.append(epochs[0] - statistics.median(epochs[1:]))
        result["startup_s"][str(length)] = startups
        result["before_s"][str(length)] = befores
    cluster.shutdown()
    return result


def run_child(system, args, timeout=3600):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_USE_LEGACY_KERAS", None)
    env.pop("KERAS_PS_RELEASE_ITERATORS", None)
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--_child", system,
         "--rows", str(args.rows), "--lengths", args.lengths,
         "--rounds", str(args.rounds)],
        capture_output=True, text=True, env=env, timeout=timeout)
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
        return {"system": system, "error": f"exit {out.returncode}: " + out.stderr[-1500:]}
    return json.loads(lines[-1][len("RESULT "):])


def spread(values):
    return (f"{min(values):.2f} / **{statistics.median(values):.2f}** / "
            f"{max(values):.2f}")


def markdown(runs, lengths):
    lines = ["| system | previous call | start-up of the next call, s (min / **median** / max) "
             "| calls with a start-up over 1 s | load (1 min) |",
             "|---|---|---|---|---|"]
    for system in SYSTEMS:
        ok = [r for r in runs if r["system"] == system and "error" not in r]
        if not ok:
            continue
        for length in lengths:
            values = [v for r in ok for v in r["startup_s"][str(length)]]
            before = statistics.median(v for r in ok for v in r["before_s"][str(length)])
            loads = [r["load_before"][0] for r in ok]
            lines.append(
                f"| {system} | fit({length}), {before:.1f} s | {spread(values)} "
                f"| {sum(v > 1.0 for v in values)} of {len(values)} "
                f"| {min(loads):.1f}-{max(loads):.1f} |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--lengths", default="240,2500",
                        help="steps of the call before the measured one")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--json", help="also write the raw runs here")
    parser.add_argument("--from-json", help="format saved runs instead")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if args._child:
        result = run_one(args._child, args.rows, lengths, args.rounds)
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)
    if args.from_json:
        with open(args.from_json) as f:
            runs = json.load(f)
    else:
        runs = []
        for repeat in range(args.repeats):
            for system in args.systems.split(","):
                before = os.getloadavg()
                result = run_child(system, args)
                result.update(repeat=repeat, load_before=before)
                runs.append(result)
                print(f"{system} repeat {repeat}: "
                      f"{result.get('startup_s', result.get('error'))}",
                      file=sys.stderr, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(runs, f)
    print("\n".join(markdown(runs, lengths)))


if __name__ == "__main__":
    main()
