import pytest
import tensorflow as tf

from keras_ps import partitioners as ours
from keras_ps.errors import PartitionerError

theirs = tf.distribute.experimental.partitioners

SHAPES = [(1,), (7,), (1024,), (13, 5), (1024, 1024), (8, 16384), (100, 3, 4),
          (100000, 32)]
DTYPES = [tf.float32, tf.float64, tf.int64, tf.string]


def _tf_fixed(n, shape, dtype):
    shape = tf.TensorShape(shape)
    try:
        return theirs.FixedShardsPartitioner(n)(shape, dtype)
    except TypeError:  # TF's own bug on some shapes ('Dimension' / int)
        return [min(n, shape[0])] + [1] * (shape.rank - 1)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_same_results_as_tf(shape, dtype):
    for n in (1, 2, 3, 5, 64):
        assert ours.FixedShardsPartitioner(n)(shape, dtype) == \
            _tf_fixed(n, shape, dtype)
    for min_bytes in (1, 100, 4096, 256 << 10):
        for max_shards in (1, 2, 7, 100):
            assert ours.MinSizePartitioner(min_bytes, max_shards)(shape, dtype) == \
                theirs.MinSizePartitioner(min_bytes, max_shards)(
                    tf.TensorShape(shape), dtype), (min_bytes, max_shards)
    for max_bytes in (4, 100, 4096, 1 << 20):
        for max_shards in (None, 1, 3):
            assert ours.MaxSizePartitioner(max_bytes, max_shards)(shape, dtype) == \
                theirs.MaxSizePartitioner(max_bytes, max_shards)(
                    tf.TensorShape(shape), dtype), (max_bytes, max_shards)


def test_seed_examples():
    assert ours.MinSizePartitioner(256 << 10, max_shards=2)(
        (1024, 1024), tf.float32) == [2, 1]
    assert ours.FixedShardsPartitioner(2)((8, 16384), tf.float32) == [2, 1]


def test_div_partition():
    ranges = ours.shard_row_ranges(13, 5)
    assert [list(range(a, b)) for a, b in ranges] == [
        [0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10], [11, 12]]


@pytest.mark.parametrize("spec, needle", [
    (2, "returned 2, not a list"),
    (None, "returned None, not a list"),
    ([2], "1 entries; expected 2"),
    ([0, 1], "got 0"),
    ([-1, 1], "got -1"),
    ([1.5, 1], "got 1.5"),
    ([2, 2], "partitions axis 1"),
])
def test_invalid_partition_specs(spec, needle):
    with pytest.raises(PartitionerError) as info:
        ours.validate_partition_spec(spec, (8, 16), "embedding/embeddings")
    message = str(info.value)
    assert needle in message
    assert "'embedding/embeddings'" in message and "(8, 16)" in message


@pytest.mark.parametrize("make, bad", [
    (lambda: ours.FixedShardsPartitioner(0), "num_shards=0"),
    (lambda: ours.FixedShardsPartitioner(-1), "num_shards=-1"),
    (lambda: ours.FixedShardsPartitioner("a"), "num_shards='a'"),
    (lambda: ours.MinSizePartitioner(0), "min_shard_bytes=0"),
    (lambda: ours.MinSizePartitioner(10, max_shards=0), "max_shards=0"),
    (lambda: ours.MaxSizePartitioner(0), "max_shard_bytes=0"),
])
def test_constructor_validation(make, bad):
    with pytest.raises(ValueError, match=bad):
        make()
