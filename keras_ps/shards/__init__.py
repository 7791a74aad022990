"""Dynamic data shards: every training record once per epoch.

`ShardedInput` states the data once; the coordinator hands its shards out
to whichever worker is free and tracks each one in a `ShardLedger`
(`ShardState`: pending, handed out, lost, done, failed).
"""

from keras_ps.shards.epoch import ShardedEpoch
from keras_ps.shards.epoch import ShardReadError
from keras_ps.shards.ledger import ShardLedger
from keras_ps.shards.ledger import ShardState
from keras_ps.shards.sharded_input import ShardedInput

__all__ = ["ShardLedger", "ShardReadError", "ShardState", "ShardedEpoch",
           "ShardedInput"]
