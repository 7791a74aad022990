"""Variable partitioners: how many shards a variable is split into on axis 0.

Pass one as `keras_ps.ParameterServerStrategy(resolver,
variable_partitioner=...)`. Same results as TF's
`tf.distribute.experimental.partitioners` (which keras_ps accepts too). The
implementation lives with the tables, in `keras_ps.tables.partitioners`.
"""

from keras_ps.tables.partitioners import FixedShardsPartitioner
from keras_ps.tables.partitioners import MaxSizePartitioner
from keras_ps.tables.partitioners import MinSizePartitioner
from keras_ps.tables.partitioners import Partitioner

__all__ = ["Partitioner", "FixedShardsPartitioner", "MinSizePartitioner",
           "MaxSizePartitioner"]
