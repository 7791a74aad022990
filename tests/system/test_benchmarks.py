"""Smoke tests of the benchmark report (benchmarks/run_all.py).

They check that the scripts run end to end and write a well-formed table and
plot; they never assert on speed (the machine is shared and noisy)."""

import os
import re
import subprocess
import sys

import pytest

from _paths import REPO as ROOT  # noqa: E402
RUN_ALL = os.path.join(ROOT, "benchmarks", "run_all.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytest.importorskip("matplotlib")
pytest.importorskip("tf_keras")  # the benchmark extra: TF's native Model.fit path


def _run_all(tmp_path, *args, timeout):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", MPLBACKEND="Agg")
    env.pop("TF_USE_LEGACY_KERAS", None)
    out = subprocess.run(
        [sys.executable, RUN_ALL, "--quick", "--repeats", "1", "--out", str(tmp_path),
         *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    return (tmp_path / "RESULTS.md").read_text()


def _table(markdown):
    """The rows of the results table, each a list of its cells."""
    lines = markdown.splitlines()
    start = lines.index("| benchmark | TF native | keras_ps | ratio (min / median / max) "
                        "| target | met |")
    assert lines[start + 1] == "|---|---|---|---|---|---|"
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 6, line
        rows.append(cells)
    return rows


def _check_common(markdown, tmp_path, expected_rows):
    assert re.search(rf"Machine: {os.cpu_count()} cores", markdown)
    assert re.search(r"TensorFlow 2\.\d+\.\d+, Keras 3\.\d+\.\d+", markdown)
    rows = _table(markdown)
    assert [r[0].split(",")[0].split(" ")[0] for r in rows] == expected_rows
    for row in rows:
        # min / **median** / max, each a number, then a unit.
        assert re.fullmatch(r"-?[\d.]+ / \*\*-?[\d.]+\*\* / -?[\d.]+(x| pt| MB)", row[3]), row
        assert row[5] in ("yes", "**no**"), row
    png = tmp_path / "scaling.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "![throughput vs workers](scaling.png)" in markdown


@pytest.mark.timeout(240)
def test_run_all_quick_subset_writes_table_and_plot(tmp_path):
    # The cheaper half of run_all (about 40 s on an idle 2-core machine).
    markdown = _run_all(tmp_path, "--only", "tiny,fit,scaling", timeout=230)
    _check_common(markdown, tmp_path, ["CTL", "Model.fit", "same"])
    scaling_rows = re.findall(r"^\| (\d+) \| (\d+) \|", markdown, re.M)
    assert [w for w, _ in scaling_rows] == ["1", "4"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_all_quick_every_benchmark(tmp_path):
    markdown = _run_all(tmp_path, timeout=590)
    _check_common(markdown, tmp_path,
                  ["CTL", "CTL", "Model.fit", "same", "Sharded", "same", "same",
                   "same", "same", "same", "Dynamic", "CTL"])
    assert (tmp_path / "large_tables.png").read_bytes()[:8] == PNG_MAGIC
    scaling_rows = re.findall(r"^\| (\d+) \| (\d+) \|", markdown, re.M)
    assert [w for w, _ in scaling_rows] == ["1", "4", "16"]
