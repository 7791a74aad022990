"""keras_ps.partitioners: same results as TF's partitioners, and clear errors."""

import numpy as np
import pytest
import tensorflow as tf

from keras_ps.tables import partitioners as ours
from keras_ps.errors import PartitionerError

theirs = tf.distribute.experimental.partitioners

SHAPES = [(1,), (7,), (1024,), (13, 5), (1024, 1024), (8, 16384), (3, 1),
          (100, 3, 4), (100000, 32), (2, 7, 9), (65536, 64)]
DTYPES = [tf.float32, tf.float64, tf.int64, tf.string]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_fixed_shards_same_as_tf(shape, dtype):
    for num_shards in (1, 2, 3, 5, 64, 100001):
        expected = theirs.FixedShardsPartitioner(num_shards)(
            tf.TensorShape(shape), dtype)
        ours_p = ours.FixedShardsPartitioner(num_shards)
        assert ours_p(shape, dtype) == expected, num_shards
        assert ours_p(list(shape), dtype) == expected
        assert ours_p(tf.TensorShape(shape), dtype) == expected


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_min_size_same_as_tf(shape, dtype):
    for min_bytes in (1, 3, 100, 4096, 256 << 10, 1 << 30):
        for max_shards in (1, 2, 7, 100, 1 << 20):
            for bytes_per_string in (1, 16, 100):
                args = (min_bytes, max_shards, bytes_per_string)
                expected = theirs.MinSizePartitioner(*args)(
                    tf.TensorShape(shape), dtype)
                assert ours.MinSizePartitioner(*args)(shape, dtype) == expected, args


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_max_size_same_as_tf(shape, dtype):
    for max_bytes in (1, 4, 7, 100, 4096, 1 << 20, (64 << 20) - 1):
        for max_shards in (None, 1, 3, 1000):
            for bytes_per_string in (1, 16, 100):
                args = (max_bytes, max_shards, bytes_per_string)
                expected = theirs.MaxSizePartitioner(*args)(
                    tf.TensorShape(shape), dtype)
                assert ours.MaxSizePartitioner(*args)(shape, dtype) == expected, args


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_other_axes_same_as_tf(axis):
    shape = tf.TensorShape([6, 40, 9])
    pairs = [
        (ours.FixedShardsPartitioner(4), theirs.FixedShardsPartitioner(4)),
        (ours.MinSizePartitioner(64, 50), theirs.MinSizePartitioner(64, 50)),
        (ours.MaxSizePartitioner(300), theirs.MaxSizePartitioner(300)),
    ]
    for mine, tfs in pairs:
        assert mine(shape, tf.float32, axis=axis) == tfs(shape, tf.float32, axis=axis)


def test_documented_examples():
    assert ours.MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2)(
        (1024, 1024), tf.float32) == [2, 1]
    assert ours.FixedShardsPartitioner(2)((8, 16384), tf.float32) == [2, 1]
    assert ours.MinSizePartitioner(4, max_shards=2)([6, 1], tf.float32) == [2, 1]
    assert ours.MinSizePartitioner(4, max_shards=10)([6, 1], tf.float32) == [6, 1]
    assert ours.MaxSizePartitioner(4)([6, 1], tf.float32) == [6, 1]
    assert ours.MaxSizePartitioner(4, max_shards=2)([6, 1], tf.float32) == [2, 1]
    assert ours.MaxSizePartitioner(1024)([6, 1], tf.float32) == [1, 1]


def test_dtype_may_be_a_string_name():
    p = ours.MinSizePartitioner(4, max_shards=100)
    assert p((6, 1), "float64") == p((6, 1), tf.float64) == [6, 1]
    assert ours.MaxSizePartitioner(16)((8, 1), "string") == [8, 1]


def test_base_class_is_abstract():
    assert issubclass(ours.FixedShardsPartitioner, ours.Partitioner)
    with pytest.raises(NotImplementedError):
        ours.Partitioner()((4, 4), tf.float32)
    assert sorted(ours.__all__) == sorted([
        "Partitioner", "FixedShardsPartitioner", "MinSizePartitioner",
        "MaxSizePartitioner"])


def test_div_partition():
    ranges = ours.shard_row_ranges(13, 5)
    assert ranges == [(0, 3), (3, 6), (6, 9), (9, 11), (11, 13)]
    assert [list(range(a, b)) for a, b in ranges] == [
        [0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10], [11, 12]]
    assert ours.shard_sizes(13, 5) == [3, 3, 3, 2, 2]


def test_div_partition_grid():
    for rows in range(0, 40):
        for shards in range(1, max(rows, 1) + 1):
            ranges = ours.shard_row_ranges(rows, shards)
            sizes = ours.shard_sizes(rows, shards)
            assert len(ranges) == shards and sum(sizes) == rows
            assert ranges[0][0] == 0 and ranges[-1][1] == rows
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert sizes == sorted(sizes, reverse=True)
            assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("rows, shards", [(-1, 1), (5, 0), (5, 6), (5, 2.0)])
def test_div_partition_rejects_bad_input(rows, shards):
    with pytest.raises(ValueError):
        ours.shard_row_ranges(rows, shards)


NAME, SHAPE = "embedding/embeddings", (8, 16)


@pytest.mark.parametrize("spec, received, needle", [
    (2, "2", "not a list"),
    (None, "None", "not a list"),
    ("2, 1", "'2, 1'", "not a list"),
    ([2], "[2]", "1 entries. Expected 2"),
    ([2, 1, 1], "[2, 1, 1]", "3 entries. Expected 2"),
    ([], "[]", "0 entries"),
    ([0, 1], "[0, 1]", "entry 0 at axis 0"),
    ([-1, 1], "[-1, 1]", "entry -1 at axis 0"),
    ([2, 0], "[2, 0]", "entry 0 at axis 1"),
    ([1.5, 1], "[1.5, 1]", "entry 1.5 at axis 0"),
    ([2.0, 1], "[2.0, 1]", "not an integer"),
    (["2", 1], "['2', 1]", "not an integer"),
    ([True, 1], "[True, 1]", "not an integer"),
    ([2, 2], "[2, 2]", "partitions axis 1"),
    ([1, 4], "[1, 4]", "partitions axis 1"),
])
def test_invalid_partition_specs(spec, received, needle):
    with pytest.raises(PartitionerError) as info:
        ours.validate_partition_spec(spec, SHAPE, NAME)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert f"'{NAME}'" in message
    assert "(8, 16)" in message
    assert f"returned {received}" in message
    assert needle in message
    assert "Expected" in message or "return [num_shards, 1]" in message


def test_axis_1_message_matches_documentation():
    with pytest.raises(PartitionerError) as info:
        ours.validate_partition_spec([2, 2], tf.TensorShape(SHAPE), NAME)
    assert str(info.value) == (
        "Variable 'embedding/embeddings' with shape (8, 16): the "
        "variable_partitioner returned [2, 2], which partitions axis 1. "
        "keras_ps only partitions axis 0; return [num_shards, 1].")


def test_higher_axis_partitioned_in_3d():
    with pytest.raises(PartitionerError, match="partitions axis 2"):
        ours.validate_partition_spec([1, 1, 3], (4, 5, 6), "w")


def test_valid_partition_specs():
    validate = ours.validate_partition_spec
    assert validate([2, 1], SHAPE, NAME) == 2
    assert validate((3, 1), SHAPE, NAME) == 3
    assert validate([1, 1], SHAPE, NAME) == 1
    assert validate([100, 1], SHAPE, NAME) == 8  # capped at the row count
    assert validate([np.int64(4), 1], tf.TensorShape(SHAPE), NAME) == 4
    assert validate([5], (13,), "bias") == 5
    assert validate([2, 1, 1], (4, 5, 6), "kernel") == 2
    assert validate([0, 1], (0, 4), "empty") == 1  # FixedShards on zero rows
    spec = theirs.FixedShardsPartitioner(64)(tf.TensorShape([8, 16]), tf.float32)
    assert validate(spec, SHAPE, NAME) == 8


def test_user_function_partitioner_is_checked():
    def by_columns(shape, dtype, axis=0):
        return [1, 2]

    with pytest.raises(PartitionerError, match="partitions axis 1"):
        ours.validate_partition_spec(by_columns(SHAPE, tf.float32), SHAPE, NAME)


@pytest.mark.parametrize("make, bad", [
    (lambda: ours.FixedShardsPartitioner(0), "num_shards=0"),
    (lambda: ours.FixedShardsPartitioner(-1), "num_shards=-1"),
    (lambda: ours.FixedShardsPartitioner("a"), "num_shards='a'"),
    (lambda: ours.FixedShardsPartitioner(2.5), "num_shards=2.5"),
    (lambda: ours.FixedShardsPartitioner(None), "num_shards=None"),
    (lambda: ours.MinSizePartitioner(0), "min_shard_bytes=0"),
    (lambda: ours.MinSizePartitioner(-5), "min_shard_bytes=-5"),
    (lambda: ours.MinSizePartitioner(10, max_shards=0), "max_shards=0"),
    (lambda: ours.MinSizePartitioner(10, max_shards=None), "max_shards=None"),
    (lambda: ours.MinSizePartitioner(10, bytes_per_string=0), "bytes_per_string=0"),
    (lambda: ours.MaxSizePartitioner(0), "max_shard_bytes=0"),
    (lambda: ours.MaxSizePartitioner(10, max_shards=0), "max_shards=0"),
    (lambda: ours.MaxSizePartitioner(10, max_shards=-2), "max_shards=-2"),
    (lambda: ours.MaxSizePartitioner(10, bytes_per_string=0), "bytes_per_string=0"),
])
def test_constructor_validation(make, bad):
    with pytest.raises(ValueError) as info:
        make()
    message = str(info.value)
    assert f"Received: {bad}." in message
    assert "Expected a positive integer" in message
    # Keras style: what is wrong, then what was received, then what is expected.
    assert message.index("Received:") < message.index("Expected")


def test_max_shards_none_means_no_limit():
    assert ours.MaxSizePartitioner(4, max_shards=None)([1000, 1], tf.float32) == [
        1000, 1]


@pytest.mark.parametrize("shape, axis", [((8, 4), 2), ((8, 4), -3), ((None, 4), 0)])
def test_bad_shape_or_axis(shape, axis):
    for p in (ours.FixedShardsPartitioner(2), ours.MinSizePartitioner(),
              ours.MaxSizePartitioner(16)):
        with pytest.raises(ValueError, match="Received: shape="):
            p(shape, tf.float32, axis=axis)
