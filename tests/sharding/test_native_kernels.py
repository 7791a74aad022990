"""keras_ps' C++ kernels (keras_ps/_native): LazyAdam's row update in one
pass, the backups' row-file writer (its restore: test_row_restore.py), and
what happens where they cannot be used.

The kernel's results are checked against a numpy reference, beside the same
update made of TF's ops, in tests/sharding/test_rowwise_updates.py
(test_lazy_adam_matches_numpy_reference). Here: the tasks of a cluster load
them; bad input gets TF's error naming the value; a machine without a
compiler, and tasks that did not load them, train with TF's ops and say why.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import keras_ps
from keras_ps import _native
from keras_ps._native import _build
from keras_ps.tables import _sharded_weights
from _page_cache import cached_pages, skip_unless_written_direct
from _paths import TESTS
from _results import last_report, run_child

pytestmark = pytest.mark.timeout(300)

JOB = os.path.join(TESTS, "_native_job.py")


def run_job(mode, env, *args):
    code, output = run_child([sys.executable, JOB, mode, *args], 240,
                             env=dict(os.environ, **env), cwd=TESTS)
    assert code == 0, output[-6000:]
    return output, last_report(output, code)


def test_the_clusters_tasks_load_the_kernels(cluster, strategy):
    for job in ("ps", "worker"):
        with open(os.path.join(cluster.log_dir, f"{job}-0.log")) as f:
            assert "native kernels loaded" in f.read()
    assert _native.kernels_for(strategy) is not None


def test_a_row_index_out_of_range_is_named():
    lib = _native.library()
    assert lib is not None, "the kernels could not be built on this machine"
    var, m, v = (tf.Variable(tf.zeros((4, 2))) for _ in range(3))
    last = tf.Variable(tf.zeros((4,), tf.int64))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"row index 7 is not in \[0, 4\)"):
        lib.keras_ps_lazy_adam_rows(
            var=var.handle, m=m.handle, v=v.handle, last_step=last.handle,
            grad=tf.ones((2, 2)), indices=tf.constant([1, 7], tf.int64),
            step=tf.constant(1, tf.int64), lr=0.1, beta_1=0.9, beta_2=0.999,
            epsilon=1e-7)
    # Nothing was written: the indices are checked before any row changes.
    assert not var.numpy().any() and not last.numpy().any()


def test_a_slot_that_is_its_variable_is_refused():
    # The kernels update a row's arrays through pointers they assume
    # distinct; one variable passed twice is named instead of updated.
    lib = _native.library()
    assert lib is not None, "the kernels could not be built on this machine"
    var, v = tf.Variable(tf.ones((4, 2))), tf.Variable(tf.ones((4, 2)))
    last = tf.Variable(tf.zeros((4,), tf.int64))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="inputs var and m are one variable: the "
                             "variable and its slots must be distinct"):
        lib.keras_ps_lazy_adam_rows(
            var=var.handle, m=var.handle, v=v.handle, last_step=last.handle,
            grad=tf.ones((1, 2)), indices=tf.constant([1], tf.int64),
            step=tf.constant(1, tf.int64), lr=0.1, beta_1=0.9, beta_2=0.999,
            epsilon=1e-7)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="inputs var and accumulator are one variable: "
                             "the variable and its slots must be distinct"):
        lib.keras_ps_adagrad_rows(
            var=var.handle, accumulator=var.handle, grad=tf.ones((1, 2)),
            indices=tf.constant([1], tf.int64), lr=0.1, epsilon=1e-7)
    assert (var.numpy() == 1).all() and not last.numpy().any()


def _same_floats(a, b):
    """Equal bit for bit, NaNs aside (only where they are is compared: which
    NaN an add returns is the CPU's choice)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    nan = np.isnan(a)
    np.testing.assert_array_equal(nan, np.isnan(b))
    np.testing.assert_array_equal(a[~nan].view(np.uint32),
                                  b[~nan].view(np.uint32))


def _repeated_ids(rng, n, distinct):
    """n ids of [0, distinct) that repeat, as tf.unique's positions of a
    batch of Zipf ids are: a few ids very often, most once."""
    return (np.minimum(rng.zipf(1.3, n), distinct) - 1).astype(np.int32)


@pytest.mark.parametrize("case", [
    # A batch of 256 x 16 ids of 64 floats (the benchmarks' step), with a
    # -0.0, an inf and a NaN among the gradient's values.
    lambda rng: (rng.standard_normal((4096, 64)).astype(np.float32),
                 _repeated_ids(rng, 4096, 1500), 1500),
    # Rows of rank 2, and segments no row names (zeros).
    lambda rng: (rng.standard_normal((300, 3, 5)).astype(np.float32),
                 _repeated_ids(rng, 300, 40) * 2, 90),
    lambda rng: (np.zeros((0, 4), np.float32), np.zeros((0,), np.int32), 3),
], ids=["batch", "rank3_empty_segments", "no_rows"])
def test_the_sum_of_rows_is_tfs_unsorted_segment_sum_bit_for_bit(case):
    lib = _native.library()
    assert lib is not None, "the kernels could not be built on this machine"
    data, ids, segments = case(np.random.default_rng(11))
    if data.size:
        data.flat[:3] = [-0.0, np.inf, np.nan]
    expected = tf.math.unsorted_segment_sum(data, ids, segments).numpy()
    got = lib.keras_ps_sum_rows(data, ids, segments).numpy()
    _same_floats(got, expected)
    if data.size:
        assert np.isnan(got).any() and np.isinf(got).any()


def test_the_sum_of_rows_names_an_id_out_of_range():
    lib = _native.library()
    assert lib is not None, "the kernels could not be built on this machine"
    for bad in (5, -1):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=rf"segment_ids\[1\] = {bad} is not in \[0, 3\)"):
            lib.keras_ps_sum_rows(tf.ones((2, 4)), tf.constant([0, bad]), 3)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"segment_ids must hold one id per row of data \(2\)"):
        lib.keras_ps_sum_rows(tf.ones((2, 4)), tf.constant([0]), 3)


def _lookup_gradient(table, ids, weights):
    """The gradient, per variable of `table`, of a loss over its rows `ids`
    (keras_ps' lookup: each distinct id read once): (values, indices)."""
    variables = getattr(table, "variables", [table])
    with tf.GradientTape() as tape:
        rows = _sharded_weights.take_rows(table, ids)
        loss = tf.reduce_sum(rows * weights)
    grads = tape.gradient(loss, variables)
    return [g.values for g in grads], [g.indices for g in grads]


@pytest.mark.parametrize("sharded", [True, False], ids=["two_shards", "one_ps"])
def test_a_lookups_gradient_is_summed_by_the_kernel_on_the_workers(
        sharded, two_shards, strategy, coordinator):
    # Traced by the coordinator, the repeats of a lookup's ids have their
    # gradients summed by KerasPsSumRows on the worker; the result is bit
    # for bit that of TF's UnsortedSegmentSum (the same function traced
    # outside the coordinator, run from this process).
    rng = np.random.default_rng(5)
    with (two_shards if sharded else strategy).scope():
        table = tf.Variable(rng.standard_normal((50, 8)).astype(np.float32))
    assert isinstance(table, keras_ps.ShardedVariable) == sharded
    ids = tf.constant(_repeated_ids(rng, 512, 50).reshape(64, 8), tf.int64)
    weights = tf.constant(rng.standard_normal((64, 8, 8)).astype(np.float32))

    def op_types(fn):
        graph = fn.get_concrete_function(ids, weights).graph
        return {op.type for op in graph.get_operations()}

    on_worker = tf.function(lambda i, w: _lookup_gradient(table, i, w))
    with _native.tracing_for(strategy):  # as the coordinator traces it
        assert "KerasPsSumRows" in op_types(on_worker)
    with_tf_ops = tf.function(lambda i, w: _lookup_gradient(table, i, w))
    assert "KerasPsSumRows" not in op_types(with_tf_ops)
    assert "UnsortedSegmentSum" in op_types(with_tf_ops)

    got = coordinator.schedule(on_worker, args=(ids, weights)).fetch()
    expected = with_tf_ops(ids, weights)
    for g, e in zip(tf.nest.flatten(got), tf.nest.flatten(expected)):
        if e.dtype == tf.float32:
            _same_floats(g, e)
        else:
            np.testing.assert_array_equal(g, e)
    assert sum(v.shape[0] for v in got[0]) == len(np.unique(ids))


# Runs LazyAdam's and Adagrad's row kernels of the library at argv[1] on
# fixed rows and writes the results to argv[2] (one library per process: a
# second one's ops would clash with the first's names).
_ROW_KERNEL_RESULTS = """
import sys
import numpy as np
import tensorflow as tf
lib = tf.load_op_library(sys.argv[1])
rng = np.random.default_rng(7)
rows, dim, step = 40, 67, 200  # 67: every vector width leaves a remainder
start = [rng.normal(size=(rows, dim)).astype(np.float32),
         (0.1 * rng.normal(size=(rows, dim))).astype(np.float32),
         rng.uniform(0.001, 0.3, size=(rows, dim)).astype(np.float32)]
# Gaps of 1 (no drift), up to 64 (looked up) and beyond (computed).
last = rng.choice([0, 1, 100, 136, 150, 199, 200], size=rows).astype(np.int64)
ids = rng.permutation(rows)[:30].astype(np.int64)
grad = rng.normal(size=(30, dim)).astype(np.float32)
grad[0, :5] = [0.0, -0.0, 1e-30, 3e4, -3e4]
var, m, v = (tf.Variable(x) for x in start)
steps = tf.Variable(last)
lib.keras_ps_lazy_adam_rows(
    var=var.handle, m=m.handle, v=v.handle, last_step=steps.handle, grad=grad,
    indices=ids, step=tf.constant(step, tf.int64), lr=0.05, beta_1=0.9,
    beta_2=0.999, epsilon=1e-7)
table, accumulator = tf.Variable(start[0]), tf.Variable(start[2])
lib.keras_ps_adagrad_rows(var=table.handle, accumulator=accumulator.handle,
                          grad=grad, indices=ids, lr=0.3, epsilon=1e-7)
np.savez(sys.argv[2], start=start[0], ids=ids, lazy_var=var.numpy(),
         lazy_m=m.numpy(), lazy_v=v.numpy(), lazy_steps=steps.numpy(),
         adagrad_var=table.numpy(), adagrad_accumulator=accumulator.numpy())
"""


def test_every_vector_width_of_the_row_kernels_gives_the_baselines_bits(
        tmp_path):
    # The row functions are built for AVX-512, AVX2 and the baseline and run
    # in the widest this CPU has; against a build of the baseline alone,
    # every float is the same.
    baseline = str(tmp_path / "baseline.so")
    _build._compile(baseline,
                    extra_flags=("-DKERAS_PS_VECTOR_VERSIONS=inline",),
                    sources=[s for s in _build.SOURCES
                             if s.endswith("row_updates.cc")])
    results = {}
    for name, library in (("baseline", baseline), ("versions", _native.build())):
        out = str(tmp_path / f"{name}.npz")
        code, output = run_child(
            [sys.executable, "-c", _ROW_KERNEL_RESULTS, library, out], 240)
        assert code == 0, output[-4000:]
        results[name] = np.load(out)
    for key in results["baseline"].files:
        if key in ("lazy_steps", "ids"):
            np.testing.assert_array_equal(results["versions"][key],
                                          results["baseline"][key])
        else:
            _same_floats(results["versions"][key], results["baseline"][key])
    # Both updates moved every row they name, and no other.
    base = results["baseline"]
    named = np.isin(np.arange(len(base["start"])), base["ids"])
    for key in ("lazy_var", "adagrad_var"):
        moved = (base[key] != base["start"]).any(axis=1)
        np.testing.assert_array_equal(moved, named)


@pytest.mark.parametrize("tensors", [
    lambda: [tf.range(5, dtype=tf.int64), tf.random.normal((5, 64)),
             tf.cast(tf.random.uniform((5, 3), 0, 9, tf.int32), tf.int64)],
    lambda: [tf.zeros((0,), tf.int64), tf.zeros((0, 64))],  # no row
    lambda: [tf.constant(7, tf.int64), tf.constant([True, False]),
             tf.ones((2, 0, 3), tf.float16), tf.constant(2.5, tf.float64),
             tf.random.normal((300, 129))],  # scalars, an empty dim
], ids=["rows", "empty", "mixed"])
@pytest.mark.parametrize("direct_io", ["1", "0"], ids=["direct", "buffered"])
def test_the_row_file_writer_writes_the_bytes_of_tf_ops(tensors, direct_io,
                                                        tmp_path, monkeypatch):
    # KerasPsWriteTensors writes what serialize_tensor + strings.join +
    # write_file write, byte for byte, with the same length, fingerprint
    # (tf.fingerprint of the bytes) and part sizes; each part parses back.
    # Both ways of writing: O_DIRECT (lengths that are no multiple of the
    # 4096 bytes it writes at a time), and through TF's Env.
    from keras_ps.backups import _row_files

    monkeypatch.setenv("KERAS_PS_DIRECT_IO", direct_io)
    lib = _native.library()
    assert lib is not None, "the kernels could not be built on this machine"
    values = tensors()
    native_path = str(tmp_path / "made" / "here" / "native.0")  # no folder
    length, fingerprint, sizes = lib.keras_ps_write_tensors(native_path,
                                                            values)
    tf_path = str(tmp_path / "tf_ops.0")
    expected = _row_files._write(tf_path, values, kernels=None)
    with open(native_path, "rb") as f:
        written = f.read()
    with open(tf_path, "rb") as f:
        assert written == f.read()
    assert int(length) == len(written) == int(expected[0])
    assert int(fingerprint) == int(expected[1])
    assert sizes.numpy().tolist() == expected[2].numpy().tolist()
    content = tf.io.read_file(native_path)
    for index, value in enumerate(values):
        parsed = _row_files.part(content, sizes, index, value.dtype)
        assert parsed.shape == value.shape
        assert parsed.numpy().tobytes() == value.numpy().tobytes()


def test_the_row_file_writer_bypasses_the_page_cache_on_a_local_disk(
        tmp_path, monkeypatch):
    # On ext4, XFS or Btrfs a row file is written with O_DIRECT (none of
    # its pages is left in the page cache: the kernel neither copies them
    # there nor writes them back later) with KERAS_PS_DIRECT_IO=1, or with
    # "deltas" when the caller marks it (direct_by_default: a delta's
    # files); unset (the default) or 0, through the cache.
    skip_unless_written_direct(tmp_path)
    lib = _native.library()
    assert lib is not None, "the kernels could not be built on this machine"
    rows = [tf.random.normal((4000, 64)), tf.range(4000, dtype=tf.int64)]
    seen = {}
    for setting in ("1", "deltas", "0", None):
        if setting is None:
            monkeypatch.delenv("KERAS_PS_DIRECT_IO", raising=False)
        else:
            monkeypatch.setenv("KERAS_PS_DIRECT_IO", setting)
        for by_default in (True, False):
            path = str(tmp_path / f"rows-{setting}-{by_default}.0")
            lib.keras_ps_write_tensors(path, rows,
                                       direct_by_default=by_default)
            seen[setting, by_default] = cached_pages(path)
    assert all(pages > 200 for _, pages in seen.values()), seen
    for (setting, by_default), (resident, pages) in seen.items():
        if setting == "1" or (setting == "deltas" and by_default):
            assert resident == 0, seen
        else:
            assert resident >= pages // 2, seen  # the check sees cached pages


@pytest.mark.parametrize("direct_io", ["1", "0"], ids=["direct", "buffered"])
def test_the_row_file_writer_names_a_path_that_is_a_folder(
        direct_io, tmp_path, monkeypatch):
    # The file cannot be opened (a folder has its name): the error names
    # it, with O_DIRECT as through TF's Env, and the folder is untouched.
    monkeypatch.setenv("KERAS_PS_DIRECT_IO", direct_io)
    lib = _native.library()
    assert lib is not None, "the kernels could not be built on this machine"
    folder = tmp_path / "rows.0"
    folder.mkdir()
    with pytest.raises(tf.errors.OpError, match=str(folder)):
        lib.keras_ps_write_tensors(str(folder), [tf.range(3, dtype=tf.int64)])
    assert folder.is_dir() and not any(folder.iterdir())


def test_the_row_file_writer_names_a_file_it_cannot_write(tmp_path):
    lib = _native.library()
    assert lib is not None, "the kernels could not be built on this machine"
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    path = str(blocker / "rows.0")
    with pytest.raises(tf.errors.OpError, match=str(blocker)):
        lib.keras_ps_write_tensors(path, [tf.range(3, dtype=tf.int64)])


def test_without_a_compiler_lazy_adam_trains_with_tf_ops(tmp_path):
    env = {"CXX": "/nonexistent/c++", "KERAS_PS_CACHE_DIR": str(tmp_path)}
    output, result = run_job("no_compiler", env)
    assert result["library"] is False
    assert result["rows_changed"] > 0 and np.isfinite(result["loss"])
    # The user is told why, and what to do.
    assert ("keras_ps' C++ kernels are not used: no C++ compiler "
            "'/nonexistent/c++' on PATH. Install one") in output
    # The failure is kept: later processes do not try the build again.
    assert result["build_again"].startswith("no C++ compiler")
    assert "kept in " in result["build_again"]
    assert "remove that file to build again" in result["build_again"]
    failed = [name for name in os.listdir(tmp_path) if name.endswith(".failed")]
    assert len(failed) == 1, os.listdir(tmp_path)


def test_tasks_without_the_kernels_get_lazy_adam_made_of_tf_ops():
    output, result = run_job("tasks_without_kernels", {})
    assert result["library"] is True  # the coordinator has them...
    assert result["for_strategy"] is False  # ...its tasks do not
    assert "native kernels off (KERAS_PS_NATIVE=0)" in result["ps_log"]
    assert "ps:0 has not loaded keras_ps' C++ kernels" in output
    assert result["iterations"] == 4 and np.isfinite(result["loss"])


@pytest.mark.parametrize("job", ["ps", "worker"])
def test_a_task_back_without_the_kernels_gets_the_steps_traced_again(
        job, tmp_path):
    # A ps recovered, or a worker re-admitted, on a server without keras_ps'
    # kernels (another keras_ps version, a machine that cannot build them):
    # the traces that use them would fail there at every call ("Op type not
    # registered 'KerasPsLazyAdamRows'", which ended fit). They are traced
    # again with TF's ops, and the same fit call finishes. The ps is then
    # replaced in turn by a server with the kernels: the job goes back to
    # them (it stayed on TF's ops for the rest of the process).
    again = job == "ps"
    output, result = run_job("back_without_kernels", {}, job,
                             str(tmp_path / "backup"), *["again"] * again)
    assert result["traced_with_kernels"] is True
    assert result["for_strategy"] is again
    assert result["came_back"] and result["came_back"][0].startswith(
        f"[chief] {job}:0 came back without keras_ps' C++ kernels"), \
        result["came_back"]
    assert "python -m keras_ps.server` of this keras_ps version" in \
        result["came_back"][0]
    assert len(result["kernels_again"]) == again, result["kernels_again"]
    if again:
        assert result["kernels_again"][0].startswith(
            "[chief] every task has keras_ps' C++ kernels again (ps:0 came "
            "back with them): every function ("), result["kernels_again"]
    # A ps loss rolls back to the last backup, so the optimizer's count ends
    # at the plan; a worker's may run one packed execution twice.
    assert result["planned"] <= result["iterations"] <= result["planned"] + 2
    assert sum(result["recoveries"]) == (2 if job == "ps" else 0)
    assert result["worker_0_ran_after"] > 0  # on the new server, for a worker
    # The backups after it (every 8 steps: fit raises when one fails) are
    # written on that ps with TF's ops too.
    assert np.isfinite(result["loss"])


def test_a_stopped_task_asked_for_the_kernels_is_named_not_waited_for():
    # TF's remote call has no deadline: asked whether it loaded the kernels,
    # a stopped worker would never answer. Every task is asked at once and
    # given ASK_TIMEOUT_S; the stopped one is named and not counted.
    _, result = run_job("worker_stopped_when_asked", {})
    assert result["for_strategy"] is True
    assert result["on_stopped"] is True
    assert len(result["not_answered"]) == 2, result["not_answered"]
    for line in result["not_answered"]:
        assert line.startswith("[native] worker:1 did not answer within 10 s")


def test_an_unwritable_cache_directory_is_named_with_the_fix(tmp_path,
                                                               monkeypatch):
    # A file where the directory should be: no process can write there.
    blocked = tmp_path / "not_a_directory"
    blocked.write_text("")
    monkeypatch.setenv("KERAS_PS_CACHE_DIR", str(blocked))
    with pytest.raises(_native.NativeBuildError,
                       match=r"cannot write to the cache directory .*"
                             r"not_a_directory.*Set KERAS_PS_CACHE_DIR"):
        _native.build()
    assert "native kernels not loaded: cannot write to the cache directory" \
        in _native.load_in_server()


def test_a_task_that_has_the_kernels_loads_no_other_build(tmp_path):
    # A task forked from LocalCluster's fork server inherits the library it
    # loaded. When keras_ps' sources changed on disk since (updated in
    # place), build() names another file; loading that one too would
    # register every op again, which TF answers by aborting the process (a
    # restarted ps that never served: fit waited for it for minutes).
    script = "\n".join([
        "import shutil",
        "from keras_ps import _native",
        "print(_native.load_in_server(), flush=True)",
        f"copy = {str(tmp_path / 'another-build.so')!r}",
        "shutil.copy(_native.build(), copy)",
        "_native.build = lambda: copy",
        # TF checks a registration against its registry once it has run
        # an op (a fork server's task has).
        "import tensorflow as tf",
        "tf.add(1, 1)",
        "print(_native.load_in_server(), flush=True)",
        "print('still running', flush=True)"])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True,
                          text=True, timeout=240, cwd=TESTS,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "native kernels loaded", "native kernels loaded", "still running"]
