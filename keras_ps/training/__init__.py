"""Training: Keras 3 `Model.fit`, `evaluate` and `predict` on a
parameter-server cluster.

This package owns the fit loops (`training`: steps per epoch;
`sharded_fit`: an epoch as every shard of a `keras_ps.ShardedInput` once),
what both do at an epoch's end and where they resume (`_fit_epochs`), their
inputs (`inputs`: `DatasetCreator`, datasets, validation), batch logs fetched
only when read (`logs`) and exactly-once evaluation (`exact_evaluation`).
Importing it routes the `fit` / `evaluate` / `predict` of a model built under
a keras_ps strategy here; steps run through `keras_ps.coordinator`.
"""

from keras_ps.training.inputs import DatasetCreator
from keras_ps.training.training import evaluate
from keras_ps.training.training import fit
from keras_ps.training.training import predict

__all__ = ["DatasetCreator", "evaluate", "fit", "predict"]
