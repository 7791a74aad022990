"""The ratios benchmarks/fit_calls.py prints under its table, from saved runs:
pairs are the systems of one repeat, and pooled files keep their repeats
apart."""

import json
import os
import subprocess
import sys

from _paths import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import fit_calls  # noqa: E402

TF, ADAGRAD, LAZY = (fit_calls.TF_NATIVE, "keras_ps_adagrad_unrolled",
                     "keras_ps_lazyadam_unrolled")


def _run(system, repeat, steady, whole, startup):
    return {"system": system, "repeat": repeat, "steady_steps_per_s": steady,
            "whole_call_s": [whole, whole], "startup_s": startup}


RUNS = [
    _run(TF, 0, 50.0, 4.0, 1.0), _run(ADAGRAD, 0, 150.0, 2.0, 0.5),
    _run(LAZY, 0, 120.0, 2.5, 1.5),
    _run(TF, 1, 60.0, 3.0, 0.2), _run(ADAGRAD, 1, 120.0, 1.5, 0.1),
    _run(LAZY, 1, 132.0, 1.5, 0.1),
    _run(TF, 2, 55.0, 3.3, 0.3), _run(ADAGRAD, 2, 100.0, 1.1, 0.4),
    {"system": LAZY, "repeat": 2, "error": "killed"},
]


def test_pairs_of_a_repeat_and_the_systems_medians():
    assert fit_calls.ratios(RUNS) == [
        f"- {ADAGRAD} / {TF}, 3 pairs: steady steps/s 1.82 / **2.00** / 3.00x; "
        "whole call 2, TF's time / ours 2.00 / **2.00** / 3.00x; "
        "start-up of call 3 shorter than TF's in 2 of 3",
        f"- {LAZY} / {TF}, 2 pairs: steady steps/s 2.20 / **2.30** / 2.40x; "
        "whole call 2, TF's time / ours 1.60 / **1.80** / 2.00x; "
        "start-up of call 3 shorter than TF's in 1 of 2",
        # 120/150, 132/120; medians 126 / 135 over the two pairs (repeat 2's
        # Adagrad has no LazyAdam run beside it).
        f"- {LAZY} / {ADAGRAD}, 2 pairs: steady steps/s 0.80 / **0.95** / 1.10x; "
        "the systems' medians 0.93x; 1 pairs under 0.9x",
    ]


def test_pooled_files_keep_their_repeats_apart(tmp_path):
    first = [_run(TF, 0, 50.0, 4.0, 1.0), _run(ADAGRAD, 0, 100.0, 2.0, 0.5)]
    second = [_run(TF, 0, 40.0, 4.0, 1.0), _run(ADAGRAD, 0, 120.0, 2.0, 2.0)]
    paths = []
    for name, runs in (("a.json", first), ("b.json", second)):
        (tmp_path / name).write_text(json.dumps(runs))
        paths.append(str(tmp_path / name))
    assert fit_calls.ratios(fit_calls.load_runs(paths)) == [
        f"- {ADAGRAD} / {TF}, 2 pairs: steady steps/s 2.00 / **2.50** / 3.00x; "
        "whole call 2, TF's time / ours 2.00 / **2.00** / 2.00x; "
        "start-up of call 3 shorter than TF's in 1 of 2"]


def test_from_json_prints_the_table_and_the_ratios_of_pooled_files():
    paths = [os.path.join(REPO, "benchmarks", name) for name in (
        "fit_calls_more_repeats_uniform_raw.json",
        "fit_calls_more_repeats_uniform_reversed_raw.json")]
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "fit_calls.py"),
         "--from-json", ",".join(paths)],
        capture_output=True, text=True, timeout=120, check=True).stdout
    assert f"| {ADAGRAD} |" in out
    assert f"- {LAZY} / {ADAGRAD}, 18 pairs: steady steps/s " in out


def test_cpu_a_step_by_the_pairs_where_both_runs_measured_it():
    def with_cpu(run, ps, workers):
        return dict(run, steady_cpu_ms_per_step={
            "coordinator": 1.0, "ps0": ps, "ps1": ps,
            "worker0": workers, "worker1": workers})

    runs = [with_cpu(_run(ADAGRAD, 0, 100.0, 2.0, 0.5), 3.0, 4.0),
            with_cpu(_run(LAZY, 0, 90.0, 2.0, 0.5), 4.0, 4.0),
            with_cpu(_run(ADAGRAD, 1, 100.0, 2.0, 0.5), 3.0, 4.5),
            with_cpu(_run(LAZY, 1, 100.0, 2.0, 0.5), 3.0, 4.5),
            # Saved before the benchmark read CPU times: no CPU ratio.
            _run(ADAGRAD, 2, 100.0, 2.0, 0.5), _run(LAZY, 2, 80.0, 2.0, 0.5)]
    # All tasks: 17 against 15 ms in repeat 0, 16 against 16 in repeat 1.
    assert fit_calls.ratios(runs) == [
        f"- {LAZY} / {ADAGRAD}, 3 pairs: steady steps/s 0.80 / **0.90** / "
        "1.00x; the systems' medians 0.90x; 1 pairs under 0.9x; CPU a step "
        f"of all tasks, {LAZY} / {ADAGRAD}: 1.00 / **1.07** / 1.13x over 2 "
        "pairs"]
    # The table's cell: all tasks, then the two ps; runs without CPU times
    # left out.
    adagrad = [run for run in runs if run["system"] == ADAGRAD]
    assert fit_calls._cpu_cell(adagrad) == \
        "15.0 / **15.5** / 16.0 (6.0 / **6.0** / 6.0)"
    assert fit_calls._cpu_cell(adagrad[2:]) == "-"
