"""The sidecar evaluator: evaluates each checkpoint training writes, beside it.

- `evaluator`: `SidecarEvaluator` (public as `keras_ps.SidecarEvaluator`);
- `format`: the checkpoint files `keras_ps.callbacks.SidecarCheckpoint`
  writes and the evaluator reads;
- `tf_checkpoints`: reading the checkpoints `tf.train.CheckpointManager`
  writes (which files, the step each holds, the model alone).

The `python -m keras_ps.evaluator` command (console script
`keras-ps-evaluator`) is `keras_ps.evaluator`.

Its callbacks (`SidecarCheckpoint`, `SidecarEvaluatorModelExport`) are in
`keras_ps.callbacks`.
"""
