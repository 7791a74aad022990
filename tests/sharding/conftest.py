"""Fixtures of the sharding tests."""

import pytest


@pytest.fixture(scope="module")
def two_shards(cluster, strategy):
    """A strategy splitting each weight in 2 shards, on the shared cluster
    (same cluster as the shared strategy: the connection is reused)."""
    import keras_ps
    from keras_ps.partitioners import FixedShardsPartitioner

    return keras_ps.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=FixedShardsPartitioner(2))
