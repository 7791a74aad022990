"""The sidecar evaluator: evaluates each checkpoint training writes, beside it.

- `evaluator`: `SidecarEvaluator` (public as `keras_ps.SidecarEvaluator`);
- `format`: the checkpoint files `keras_ps.callbacks.SidecarCheckpoint`
  writes and the evaluator reads;
- `cli`: the `python -m keras_ps.evaluator` command (console script
  `keras-ps-evaluator`).

Its callbacks (`SidecarCheckpoint`, `SidecarEvaluatorModelExport`) are in
`keras_ps.callbacks`.
"""
