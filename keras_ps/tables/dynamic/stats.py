"""The table's live rows, admissions and evictions as Keras metric results.

A metric of the layer, so `Model.fit` puts the numbers in every epoch's logs
(and so in `History` and TensorBoard) with nothing else to configure. They
are running totals read from the shards' counters on the ps; resetting the
metrics (at each epoch) does not reset them.
"""

import keras
import tensorflow as tf

from keras_ps.tables.dynamic import slots as slots_lib


class TableStats(keras.metrics.Metric):
    """`<layer>_live_rows`, `<layer>_admissions`, `<layer>_evictions`."""

    def __init__(self, table, name):
        super().__init__(name=name)
        self._table = table

    def update_state(self, *args, **kwargs):
        del args, kwargs

    def reset_state(self):
        pass

    def result(self):
        totals = tf.add_n([tf.cast(shard.read_stats(), tf.int64)
                           for shard in self._table.shards])
        evicted = (totals[slots_lib.EVICTED_BY_AGE]
                   + totals[slots_lib.EVICTED_BY_CAPACITY])
        return {f"{self.name}_live_rows": totals[slots_lib.LIVE],
                f"{self.name}_admissions": totals[slots_lib.ADMITTED],
                f"{self.name}_evictions": evicted}
