"""Every side-by-side benchmark in one go; writes RESULTS.md and scaling.png.

They go to out/benchmarks/ (ignored by git) unless `--out` names another
folder: benchmarks/RESULTS.md is the project's record of every measurement,
written by hand around these runs, and not a run's default output.

    .venv/bin/python benchmarks/run_all.py                # 3 repeats, ~50 min on 2 cores
    .venv/bin/python benchmarks/run_all.py --repeats 5
    .venv/bin/python benchmarks/run_all.py --quick --out /tmp/bench   # smoke run

Benchmarks (each system in its own process; within a repeat the two systems
run back to back, so each ratio compares neighbours in time):
  tiny     ctl_dispatch.py tiny step, 2 workers, 2 ps (target: keras_ps >= 2x)
  sleep    ctl_dispatch.py 20 ms sleep-bound step, 16 workers (target: keras_ps
           efficiency >= 0.9 of the ideal 800 steps/s)
  fit      fit_embedding.py, Model.fit with a sharded 100k x 32 embedding
           (target: keras_ps >= 1.5x, held-out accuracy within 2 points)
  lookup   embedding_lookup.py, sharded lookup vs lookup on the concatenated
           table (keras_ps only: TF's native path has no Keras 3 layer to run
           it with; target >= 20x, loopback bytes <= 2x the rows read)
  scaling  the sleep-bound step on 1, 2, 4, 8 and 16 workers, both systems
           (the plot; 16 comes from `sleep`)
  large    fit_large_tables.py, Model.fit with Embedding(R, 64), R = 1M, 4M,
           10M: TF native Adam vs keras_ps LazyAdam, TF native Adagrad vs
           keras_ps row-wise Adagrad (targets: LazyAdam >= 50x Adam at 4M;
           Adagrad >= TF native at 10M; keras_ps step time at 10M <= 1.3x
           at 1M; LazyAdam accuracy within 0.5 points of dense Adam at 1M;
           peak RSS <= 1.25x table + slots). Plot: large_tables.png.
           About 35 minutes for 3 repeats.
  shards   dynamic_shards.py (keras_ps only): one worker 3x slower among 4,
           dynamic shards vs a static per-worker split (target: dynamic <=
           1.15x the ideal time); CTL tiny step with shard-driven input vs
           the per-worker iterator (target: >= 0.9x)

Ratios are min / median / max over the repeats; a target counts as met when
the median meets it. `--only tiny,fit` runs a subset.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(os.path.dirname(HERE), "out", "benchmarks")
sys.path.insert(0, HERE)

import ctl_dispatch  # noqa: E402
import dynamic_shards  # noqa: E402
import fit_embedding  # noqa: E402
import fit_large_tables  # noqa: E402

ALL = ("tiny", "sleep", "fit", "lookup", "scaling", "large", "shards")
SCALING_WORKERS = (1, 2, 4, 8, 16)
QUICK_SCALING_WORKERS = (1, 4)  # plus 16 when `sleep` ran
SLEEP_IDEAL_PER_WORKER = 50.0  # 20 ms per step


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def spread(values):
    """(min, median, max) of a list."""
    return min(values), statistics.median(values), max(values)


def ratios(report):
    return [k / n for n, k in zip(report["tf_native"], report["keras_ps"])]


# -- running ---------------------------------------------------------------------
def run_tiny(repeats, quick):
    return ctl_dispatch.measure("tiny", repeats, steps=500 if quick else 4000, log=log)


def run_sleep(repeats, quick, workers=16):
    steps = max(100, 25 * workers) if quick else max(400, 250 * workers)
    return ctl_dispatch.measure("sleep", repeats, steps=steps, num_workers=workers,
                                log=log)


def run_lookup(repeats, quick):
    args = ["--steps", "10", "--concat-steps", "1"] if quick else []
    runs = []
    for r in range(repeats):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
        out = subprocess.run(
            [sys.executable, os.path.join(HERE, "embedding_lookup.py"), "--json"] + args,
            capture_output=True, text=True, env=env, timeout=900)
        lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
        if not lines:
            raise RuntimeError("embedding_lookup.py failed:\n" + out.stderr[-3000:])
        result = json.loads(lines[-1])
        runs.append(result)
        log(f"lookup run {r}: sharded {result['sharded']['steps_per_s']:.2f} steps/s, "
            f"concat {result['concat']['steps_per_s']:.3f} steps/s, "
            f"ratio {result['speed_ratio']:.1f}x")
    return runs


def run_all(names, repeats, quick):
    results = {}
    for name in names:
        start = time.perf_counter()
        log(f"== {name}")
        if name == "tiny":
            results[name] = run_tiny(repeats, quick)
        elif name == "sleep":
            results[name] = run_sleep(repeats, quick)
        elif name == "fit":
            results[name] = fit_embedding.measure(repeats, quick, log=log)
        elif name == "lookup":
            results[name] = run_lookup(repeats, quick)
        elif name == "large":
            rows = fit_large_tables.ROWS[:1] if quick else fit_large_tables.ROWS
            results[name] = fit_large_tables.measure(rows, repeats=repeats, log=log,
                                                     quick=quick)
        elif name == "shards":
            results[name] = dynamic_shards.measure(repeats=repeats, log=log,
                                                   quick=quick)
        elif name == "scaling":
            workers = QUICK_SCALING_WORKERS if quick else SCALING_WORKERS
            if quick and "sleep" in results:
                workers += (16,)
            scaling = {}
            for w in workers:
                if w == 16 and "sleep" in results:
                    scaling[w] = results["sleep"]
                else:
                    scaling[w] = run_sleep(repeats, quick, w)
            results[name] = scaling
        log(f"== {name} took {time.perf_counter() - start:.0f} s")
    return results


# -- reporting --------------------------------------------------------------------
def fmt_spread(values, digits=2, suffix="x"):
    lo, mid, hi = spread(values)
    return f"{lo:.{digits}f} / **{mid:.{digits}f}** / {hi:.{digits}f}{suffix}"


def table_rows(results):
    """Rows of (benchmark, TF native, keras_ps, ratio, target, met)."""
    rows = []
    if "tiny" in results:
        r = results["tiny"]
        q = ratios(r)
        rows.append((
            "CTL tiny step `v.assign_add(next(it))`, 2 workers, 2 ps",
            f"{statistics.median(r['tf_native']):.0f} steps/s",
            f"{statistics.median(r['keras_ps']):.0f} steps/s",
            fmt_spread(q), "keras_ps >= 2x", statistics.median(q) >= 2.0))
    if "sleep" in results:
        r = results["sleep"]
        ideal = 16 * SLEEP_IDEAL_PER_WORKER
        eff = {s: statistics.median(v) / ideal for s, v in r.items()}
        rows.append((
            "CTL 20 ms sleep-bound step, 16 workers, 2 ps (ideal 800 steps/s)",
            f"{statistics.median(r['tf_native']):.0f} steps/s (efficiency "
            f"{eff['tf_native']:.2f})",
            f"{statistics.median(r['keras_ps']):.0f} steps/s (efficiency "
            f"{eff['keras_ps']:.2f})",
            fmt_spread(ratios(r)), "keras_ps efficiency >= 0.90",
            eff["keras_ps"] >= 0.9))
    if "fit" in results:
        f = results["fit"]
        sps, acc = f["steps_per_s"], f["test_accuracy"]
        rows.append((
            "Model.fit, Embedding(100k, 32) on 2 ps + 128-64-1 MLP, batch 256, "
            "steps_per_execution=10, Adam, 2 workers",
            f"{statistics.median(sps['tf_native']):.1f} steps/s",
            f"{statistics.median(sps['keras_ps']):.1f} steps/s",
            fmt_spread(f["ratios"]), "keras_ps >= 1.5x",
            statistics.median(f["ratios"]) >= 1.5))
        diffs = [100 * (k - n) for n, k in zip(acc["tf_native"], acc["keras_ps"])]
        rows.append((
            "  same run: held-out accuracy (difference in points)",
            f"{statistics.median(acc['tf_native']):.3f}",
            f"{statistics.median(acc['keras_ps']):.3f}",
            fmt_spread(diffs, 1, " pt"), "within 2 points",
            abs(statistics.median(diffs)) <= 2.0))
    if "lookup" in results:
        runs = results["lookup"]
        speed = [x["speed_ratio"] for x in runs]
        rows.append((
            "Sharded lookup, 4096 ids in a 1M x 64 table on 2 ps, 1 worker "
            "(baseline: lookup on the concatenated table, keras_ps cluster)",
            f"concat {statistics.median([x['concat']['steps_per_s'] for x in runs]):.2f}"
            " steps/s",
            f"sharded {statistics.median([x['sharded']['steps_per_s'] for x in runs]):.1f}"
            " steps/s",
            fmt_spread(speed, 1), "sharded >= 20x concat",
            statistics.median(speed) >= 20.0))
        byte_ratio = [x["bytes_ratio"] for x in runs]
        rows.append((
            "  same run: loopback bytes per step / rows read (both ways)",
            "", f"{statistics.median([x['sharded']['bytes_per_step'] for x in runs]) / 2**20:.2f}"
            " MB/step", fmt_spread(byte_ratio, 2), "<= 2x",
            statistics.median(byte_ratio) <= 2.0))
        growth = [x["sharded"]["peak_rss_mb"] - x["rss_after_build_mb"] for x in runs]
        table = runs[0]["table_mb"]
        rows.append((
            "  same run: coordinator peak RSS during training minus RSS after build",
            "", f"{statistics.median(growth):.0f} MB (table {table:.0f} MB)",
            fmt_spread(growth, 0, " MB"), "no full copy of the table",
            statistics.median(growth) < table / 2))
    if "large" in results:
        rows.extend(large_table_rows(results["large"]))
    if "shards" in results:
        summary = dynamic_shards.summarize(results["shards"])
        s, t = summary["straggler"], summary["tiny"]
        lo, mid, hi = s["dynamic_over_ideal"]
        rows.append((
            "Dynamic shards: 1 of 4 workers reads 3x slower, one epoch of "
            f"{dynamic_shards.SHARDS} shards, epoch time / ideal (data / total "
            "rate); TF native column: static per-worker split",
            f"static {s['static_over_ideal'][1]:.2f}x ideal",
            f"dynamic {mid:.2f}x ideal",
            f"{lo:.2f} / **{mid:.2f}** / {hi:.2f}x", "dynamic <= 1.15x ideal",
            s["met"]))
        for variant, v in t.items():
            per_execution, per_shard, batch = dynamic_shards.TINY_VARIANTS[
                variant]
            lo, mid, hi = v["shards_over_iterator"]
            rows.append((
                f"  CTL tiny step, shard-driven input ({variant}: "
                f"steps_per_execution={per_execution}, {per_shard} steps a "
                f"shard, batch {batch}) vs per-worker iterator, 2 workers "
                "(TF native column: the iterator)",
                f"{v['iterator_steps_per_s'][1]:.0f} steps/s",
                f"{v['shards_steps_per_s'][1]:.0f} steps/s",
                f"{lo:.2f} / **{mid:.2f}** / {hi:.2f}x",
                "shards >= 0.9x iterator", v["met"]))
    return rows


def large_table_rows(large):
    """Rows with a target for fit_large_tables.py (every figure is in the
    "Large embedding tables" section below the table)."""
    from fit_large_tables import by
    runs = large["runs"]
    sizes = sorted({x["rows"] for x in runs})
    out = []
    for r, native, ours, target, threshold in (
            (4_000_000, "tf_native_adam", "keras_ps_lazyadam", "keras_ps >= 50x", 50.0),
            (10_000_000, "tf_native_adagrad", "keras_ps_adagrad", "keras_ps >= 1x", 1.0)):
        n, k = by(runs, native, r), by(runs, ours, r)
        if n and k:
            q = [b / a for a, b in zip(n, k)]
            out.append((
                f"Model.fit, Embedding({r / 1e6:g}M, 64) on 2 ps + 128-64-1 MLP, "
                f"batch 256 x 16 Zipf ids, 2 workers: {native.split('_')[-1]} vs "
                f"keras_ps {ours.split('_')[-1]}",
                f"{statistics.median(n):.2f} steps/s", f"{statistics.median(k):.2f} steps/s",
                fmt_spread(q), target, statistics.median(q) >= threshold))
    if len(sizes) > 1:
        for system in ("keras_ps_lazyadam", "keras_ps_adagrad"):
            lo, hi = by(runs, system, sizes[0]), by(runs, system, sizes[-1])
            if lo and hi:
                growth = [a / b for a, b in zip(lo, hi)]  # step time ratio
                out.append((f"  same run: {system} step time at {sizes[-1] / 1e6:g}M "
                            f"/ at {sizes[0] / 1e6:g}M", "", "", fmt_spread(growth),
                            "<= 1.3x", statistics.median(growth) <= 1.3))
    lazy = by(runs, "keras_ps_lazyadam", sizes[0], "test_accuracy")
    dense = by(runs, "keras_ps_adam", sizes[0], "test_accuracy")
    if lazy and dense:
        diffs = [100 * (a - b) for a, b in zip(lazy, dense)]
        out.append((f"  same run: held-out accuracy at {sizes[0] / 1e6:g}M, equal "
                    "steps, keras_ps LazyAdam minus keras_ps dense Adam",
                    f"dense Adam {statistics.median(dense):.3f}",
                    f"LazyAdam {statistics.median(lazy):.3f}",
                    fmt_spread(diffs, 1, " pt"), "within 0.5 points",
                    abs(statistics.median(diffs)) <= 0.5))
    for system in ("keras_ps_lazyadam", "keras_ps_adagrad"):
        ratio = [x["peak_rss_gb"] / x["table_and_slots_gb"] for x in runs
                 if x["system"] == system and x["rows"] == sizes[-1] and "error" not in x]
        if ratio:
            out.append((f"  same run: {system} at {sizes[-1] / 1e6:g}M, peak RSS of "
                        "the whole in-process cluster / (table + slots)", "", "",
                        fmt_spread(ratio), "<= 1.25x", statistics.median(ratio) <= 1.25))
        added = [(x["peak_rss_gb"] - x["rss_before_build_gb"]) / x["table_and_slots_gb"]
                 for x in runs if x["system"] == system and x["rows"] == sizes[-1]
                 and "rss_before_build_gb" in x]
        if added:
            out.append((f"  same run: {system} at {sizes[-1] / 1e6:g}M, (peak RSS - "
                        "RSS before the model was built) / (table + slots)", "", "",
                        fmt_spread(added), "<= 1.25x", statistics.median(added) <= 1.25))
    return out


def versions():
    out = {"python": platform.python_version()}
    for name in ("tensorflow", "keras", "tf_keras"):
        try:
            from importlib.metadata import version
            out[name] = version(name)
        except Exception:  # noqa: BLE001 - a missing package is reported as such
            out[name] = "not installed"
    return out


def write_plot(scaling, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    workers = sorted(int(w) for w in scaling)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(workers, [SLEEP_IDEAL_PER_WORKER * w for w in workers], "k:",
            label="ideal (50 steps/s per worker)")
    for system, style, label in (("tf_native", "o-", "TF native ParameterServerStrategy"),
                                 ("keras_ps", "s-", "keras_ps")):
        med = [statistics.median(scaling[w][system]) for w in workers]
        lo = [m - min(scaling[w][system]) for m, w in zip(med, workers)]
        hi = [max(scaling[w][system]) - m for m, w in zip(med, workers)]
        ax.errorbar(workers, med, yerr=[lo, hi], fmt=style, capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xticks(workers, [str(w) for w in workers])
    ax.set_xlabel("workers (in-process cluster, 2 ps)")
    ax.set_ylabel("steps/s")
    ax.set_title(f"20 ms sleep-bound step: throughput vs workers ({os.cpu_count()} cores)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_markdown(results, args, path, elapsed):
    v = versions()
    cmd = "python benchmarks/run_all.py" + (" --quick" if args.quick else "") + \
        f" --repeats {args.repeats}" + (f" --only {args.only}" if args.only else "")
    lines = [
        "# keras_ps benchmark results",
        "",
        f"Generated by `{cmd}` on {datetime.date.today().isoformat()} "
        f"({elapsed / 60:.0f} min).",
        f"Machine: {os.cpu_count()} cores ({platform.machine()}, shared with other "
        f"jobs: absolute numbers are noisy, compare ratios). TensorFlow {v['tensorflow']}, "
        f"Keras {v['keras']}, tf_keras {v['tf_keras']}, Python {v['python']}.",
        f"Repeats: {args.repeats}{' (quick mode: short runs, smoke test only)' if args.quick else ''}. "
        "Each system runs in its own process; within a repeat the two systems run back "
        "to back. Figures are medians; ratios are keras_ps / TF native as min / "
        "**median** / max over the repeats; a target is met when the median meets it.",
        "",
        "| benchmark | TF native | keras_ps | ratio (min / median / max) | target | met |",
        "|---|---|---|---|---|---|",
    ]
    for name, native, ours, ratio, target, met in table_rows(results):
        lines.append(f"| {name} | {native} | {ours} | {ratio} | {target} | "
                     f"{'yes' if met else '**no**'} |")
    if "large" in results:
        lines += [""] + fit_large_tables.markdown(results["large"])
    if "scaling" in results:
        scaling = results["scaling"]
        workers = sorted(int(w) for w in scaling)
        lines += [
            "",
            "## Scaling: 20 ms sleep-bound step vs number of workers",
            "",
            "![throughput vs workers](scaling.png)",
            "",
            "| workers | ideal | TF native steps/s (efficiency) | keras_ps steps/s "
            "(efficiency) | ratio (min / median / max) |",
            "|---|---|---|---|---|",
        ]
        for w in workers:
            r = scaling[w]
            ideal = SLEEP_IDEAL_PER_WORKER * w
            n, k = statistics.median(r["tf_native"]), statistics.median(r["keras_ps"])
            lines.append(f"| {w} | {ideal:.0f} | {n:.0f} ({n / ideal:.2f}) | "
                         f"{k:.0f} ({k / ideal:.2f}) | {fmt_spread(ratios(r))} |")
    lines += ["", "## Raw measurements", "", "```json",
              json.dumps(results, indent=1, sort_keys=True, default=str)[:20000], "```", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="short runs of every benchmark (a smoke test, not a measurement)")
    parser.add_argument("--only", default="",
                        help=f"comma-separated subset of {','.join(ALL)}")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help="directory for RESULTS.md and the plots (default: out/benchmarks/; "
                             "benchmarks/RESULTS.md, the project's record, is never the default)")
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1. Received: --repeats {args.repeats}.")
    names = [n for n in args.only.split(",") if n] if args.only else list(ALL)
    unknown = sorted(set(names) - set(ALL))
    if unknown:
        raise SystemExit(f"--only names unknown benchmarks {unknown}; choose from {ALL}.")
    if "scaling" in names and "sleep" in names:  # scaling reuses sleep's 16 workers
        names.remove("scaling")
        names.insert(names.index("sleep") + 1, "scaling")
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    results = run_all(names, args.repeats, args.quick)
    elapsed = time.perf_counter() - start
    md = os.path.join(args.out, "RESULTS.md")
    write_markdown(results, args, md, elapsed)
    print(f"wrote {md}")
    if "large" in results:
        png = os.path.join(args.out, "large_tables.png")
        fit_large_tables.write_plot(results["large"], png)
        print(f"wrote {png}")
    if "scaling" in results:
        png = os.path.join(args.out, "scaling.png")
        write_plot(results["scaling"], png)
        print(f"wrote {png}")
    with open(md) as f:
        print("".join(f.readlines()[:20]))


if __name__ == "__main__":
    main()
