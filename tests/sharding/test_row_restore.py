"""keras_ps' C++ restore of a backup's row file (KerasPsApplyRowFile): the
same variables, bit for bit, as the restore made of TF's ops, for files
written by keras_ps' writer and by TF's ops; a damaged or unfitting file
named, with nothing written; a read held before the restore kept.

Restores of whole backups through it (full + deltas, into other numbers of
shards, on a cluster whose tasks load the kernels) are checked in
tests/fit/test_incremental_backups.py.
"""

import time

import numpy as np
import pytest
import tensorflow as tf

from keras_ps import _native
from keras_ps.backups import _apply
from keras_ps.backups import _row_files
from _page_cache import cached_pages, drop_from_cache, filesystem

pytestmark = pytest.mark.timeout(300)


def _kernels():
    lib = _native.library()
    assert lib is not None, "the kernels could not be built on this machine"
    return lib


def _write(path, ids, parts, native):
    """Writes a row file of `ids` and `parts`; its manifest record."""
    tensors = [tf.constant(ids, tf.int64)] + [tf.constant(p) for p in parts]
    length, fingerprint, sizes = _row_files._write(
        str(path), tensors, _kernels() if native else None)
    return {"bytes": int(length), "fingerprint": int(fingerprint),
            "sizes": sizes.numpy().tolist()}


def _apply_file(path, record, variables, offsets, components, kernels,
                next_path=""):
    """Applies the file with keras_ps' Applier's function (C++ op with
    `kernels`, TF's ops without)."""
    device = variables[0].device
    specs = tuple((v.dtype, tuple(v.shape)) for v in variables)
    contained = (False,) * len(variables)
    function = _apply._apply_function(device, specs, contained, kernels)
    function(tf.constant(str(path)), tf.constant(str(next_path)),
             tf.constant(record["bytes"], tf.int64),
             tf.constant(record["fingerprint"], tf.int64),
             tf.constant(record["sizes"], tf.int64),
             tf.constant(components, tf.int32), variables,
             tf.constant(offsets, tf.int64))


def _variables(starts):
    return [tf.Variable(s) for s in starts]


CASES = {
    # A full backup's file: consecutive ids, each in the one variable.
    "consecutive": dict(ids=np.arange(100, 164), first=100, rows=64,
                        shapes=[(64,), (64,), ()], dtypes=["float32",
                                                           "float32", "int64"]),
    # A delta's: ids in any order, some outside this shard (another holds
    # them), some runs of consecutive ids inside it.
    "scattered": dict(ids=np.array([7, 3, 4, 5, 250, 0, 99, 98, 1, 2, 59]),
                      first=0, rows=100, shapes=[(5, 3)], dtypes=["float16"]),
    # A file of another split: rows below and above this shard's.
    "shard": dict(ids=np.arange(0, 200, 3), first=100, rows=50,
                  shapes=[(16,), (16,)], dtypes=["float32", "float32"]),
    "outside": dict(ids=np.array([500, 501, 502]), first=0, rows=100,
                    shapes=[(8,)], dtypes=["float64"]),
    "empty": dict(ids=np.zeros((0,), np.int64), first=0, rows=10,
                  shapes=[(4,)], dtypes=["int32"]),
}


def _case(name, seed=0):
    case = CASES[name]
    rng = np.random.default_rng(seed)
    n = len(case["ids"])
    parts, starts = [], []
    for shape, dtype in zip(case["shapes"], case["dtypes"]):
        parts.append((rng.standard_normal((n,) + shape) * 100).astype(dtype))
        starts.append((rng.standard_normal((case["rows"],) + shape)
                       * 100).astype(dtype))
    return case, parts, starts


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("writer", ["native", "tf_ops"])
def test_the_restore_op_writes_the_bits_of_tf_ops(name, writer, tmp_path):
    case, parts, starts = _case(name)
    path = tmp_path / "rows.0"
    record = _write(path, case["ids"], parts, native=writer == "native")
    components = list(range(1, len(parts) + 1))
    offsets = [case["first"]] * len(parts)
    native, reference = _variables(starts), _variables(starts)
    _apply_file(path, record, native, offsets, components, _kernels())
    _apply_file(path, record, reference, offsets, components, None)
    ids = case["ids"]
    inside = (ids >= case["first"]) & (ids < case["first"] + case["rows"])
    for got, want, start, part in zip(native, reference, starts, parts):
        assert got.numpy().tobytes() == want.numpy().tobytes()
        # And what that is: the file's rows where they fall, the rest kept.
        expected = start.copy()
        expected[ids[inside] - case["first"]] = part[inside]
        assert got.numpy().tobytes() == expected.tobytes()
    if name in ("outside", "empty"):
        assert native[0].numpy().tobytes() == starts[0].tobytes()


def test_a_file_not_in_the_page_cache_is_restored_the_same(tmp_path):
    # Read from the disk (dropped from the cache, as a file written with
    # O_DIRECT or paged out is), large enough for several reads.
    case = dict(CASES["consecutive"], ids=np.arange(100, 100 + 5000),
                rows=6000)
    rng = np.random.default_rng(1)
    parts = [rng.standard_normal((5000, 64)).astype("float32")]
    start = rng.standard_normal((6000, 64)).astype("float32")
    path = tmp_path / "rows.0"
    record = _write(path, case["ids"], parts, native=True)
    drop_from_cache(str(path))
    variable = tf.Variable(start)
    _apply_file(path, record, [variable], [0], [1], _kernels())
    expected = start.copy()
    expected[100:5100] = parts[0]
    assert variable.numpy().tobytes() == expected.tobytes()


def test_the_next_file_is_read_ahead(tmp_path):
    # A restore applies its files one by one; applying one starts a thread
    # that reads the next into the page cache, so the disk reads it while
    # this one is applied. A next file that is missing costs nothing.
    case, parts, starts = _case("consecutive")
    first, after = tmp_path / "rows.0", tmp_path / "rows.1"
    record = _write(first, case["ids"], parts, native=True)
    after.write_bytes(np.random.default_rng(2).bytes(4 * 2**20))
    drop_from_cache(str(after))
    resident, pages = cached_pages(str(after))
    if resident:
        pytest.skip(f"{tmp_path} ({filesystem(tmp_path)}) kept the pages")
    variables = _variables(starts)
    _apply_file(first, record, variables, [100] * 3, [1, 2, 3], _kernels(),
                next_path=after)
    deadline = time.monotonic() + 60
    while cached_pages(str(after))[0] < pages and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cached_pages(str(after)) == (pages, pages)
    _apply_file(first, record, _variables(starts), [100] * 3, [1, 2, 3],
                _kernels(), next_path=tmp_path / "missing.2")


def test_the_restore_op_counts_the_rows_it_wrote(tmp_path):
    case, parts, starts = _case("scattered")
    path = tmp_path / "rows.0"
    record = _write(path, case["ids"], parts, native=True)
    variable = tf.Variable(starts[0])
    written = _kernels().keras_ps_apply_row_file(
        str(path), "", record["bytes"], record["fingerprint"],
        record["sizes"], [1], [0], [variable.handle])
    assert int(written) == 10  # 11 ids, 250 outside the 100 rows


def test_a_damaged_file_is_named_and_nothing_is_written(tmp_path):
    case, parts, starts = _case("consecutive")
    path = tmp_path / "rows.0"
    record = _write(path, case["ids"], parts, native=True)
    content = bytearray(path.read_bytes())
    content[-3] ^= 0xFF
    path.write_bytes(bytes(content))
    variables = _variables(starts)
    with pytest.raises(tf.errors.DataLossError,
                       match=f"fingerprint mismatch {path}"):
        _apply_file(path, record, variables, [100] * 3, [1, 2, 3], _kernels())
    for variable, start in zip(variables, starts):
        assert variable.numpy().tobytes() == start.tobytes()
    with pytest.raises(tf.errors.NotFoundError, match=str(tmp_path / "gone")):
        _apply_file(tmp_path / "gone", record, variables, [100] * 3,
                    [1, 2, 3], _kernels())


def test_a_path_that_is_no_scalar_is_named(tmp_path):
    case, parts, starts = _case("consecutive")
    path = tmp_path / "rows.0"
    record = _write(path, case["ids"], parts, native=True)
    variable = tf.Variable(starts[0])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"must be scalars. Received input 0 of shape \[2\]"):
        _kernels().keras_ps_apply_row_file(
            [str(path), str(path)], "", record["bytes"],
            record["fingerprint"], record["sizes"], [1], [100],
            [variable.handle])
    assert variable.numpy().tobytes() == starts[0].tobytes()


def test_rows_that_do_not_fit_the_variable_are_refused_whole(tmp_path):
    # The second variable's rows are 64 wide, the variable's 32: an error
    # naming the file before any row is written, the first variable's too.
    case, parts, starts = _case("consecutive")
    path = tmp_path / "rows.0"
    record = _write(path, case["ids"], parts, native=True)
    narrow = tf.Variable(np.zeros((64, 32), np.float32))
    first = tf.Variable(starts[0])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=f"part 2 of {path} does not hold rows"):
        _kernels().keras_ps_apply_row_file(
            str(path), "", record["bytes"], record["fingerprint"],
            record["sizes"], [1, 2], [100, 100], [first.handle, narrow.handle])
    assert first.numpy().tobytes() == starts[0].tobytes()
    assert not narrow.numpy().any()


def test_a_read_held_before_the_restore_keeps_its_values(tmp_path):
    # A read of the variable may share its buffer; the restore writes into a
    # copy then, as TF's scatters do.
    case, parts, starts = _case("consecutive")
    path = tmp_path / "rows.0"
    record = _write(path, case["ids"], parts, native=True)
    variable = tf.Variable(starts[0])
    held = variable.read_value()
    _kernels().keras_ps_apply_row_file(
        str(path), "", record["bytes"], record["fingerprint"],
        record["sizes"], [1], [100], [variable.handle])
    assert held.numpy().tobytes() == starts[0].tobytes()
    assert variable.numpy().tobytes() == parts[0].tobytes()


def test_string_rows_are_restored_with_tf_ops(tmp_path):
    # The C++ op copies rows as bytes; a group holding strings is applied
    # with TF's ops even where the kernels are loaded.
    path = tmp_path / "rows.0"
    record = _write(path, np.array([2, 0]), [np.array([b"two", b"zero"])],
                    native=False)
    variable = tf.Variable([b"a", b"b", b"c"])
    _apply_file(path, record, [variable], [0], [1], _kernels())
    assert variable.numpy().tolist() == [b"zero", b"b", b"two"]
