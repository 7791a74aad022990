"""SidecarEvaluator: evaluate each new training checkpoint beside the cluster.

The evaluator is a process of its own (an `evaluator` task, see
`python -m keras_ps.evaluator`). It needs no cluster: it holds a plain Keras
model, restores each checkpoint that `keras_ps.callbacks.SidecarCheckpoint`
publishes, and runs Keras' own `evaluate` on the local machine, so the
training cluster spends no time on evaluation.
"""

import dataclasses
import logging
import os
import tempfile
import time
import warnings

import keras
import tensorflow as tf

from keras_ps.errors import CheckpointMismatchError
from keras_ps.errors import SidecarTimeoutError
from keras_ps.sidecar import format as fmt
from keras_ps.sidecar import tf_checkpoints

logger = logging.getLogger(__name__)

Checkpoint = fmt.Checkpoint

# Seconds between "still waiting" log lines while no new checkpoint appears,
# and between warnings while checkpoint_dir does not exist (the first look
# warns at once: a wrong path would otherwise wait without a word).
_WAIT_LOG_INTERVAL = 30.0
_MISSING_DIR_WARN_INTERVAL = 60.0
# The optimizer group of a weights file: the evaluator does not need it.
_OPTIMIZER_GROUP = "optimizer"


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One evaluation: the checkpoint and the metrics `evaluate` returned."""

    checkpoint: Checkpoint
    metrics: dict


def _weight_shapes(path):
    """{h5 dataset path: shape} of a `.weights.h5` file, optimizer excluded."""
    import h5py

    shapes = {}

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset) and \
                name.split("/", 1)[0] != _OPTIMIZER_GROUP:
            shapes[name] = tuple(obj.shape)

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return shapes


def _comparable(shapes):
    """The entries whose shapes must match: Keras saves a layer's variables
    as `vars/0`, `vars/1`, ... A layer that saves its own state under names
    of its own (a DynamicEmbedding's live keys and rows, as many as it
    holds) checks what it loads itself: only its group must be there."""
    fixed = {}
    for name, shape in shapes.items():
        group, _, last = name.rpartition("/")
        if last.isdigit():
            fixed[name] = shape
        else:
            fixed[group + "/*"] = "its own state"
    return fixed


def _mismatch(expected, found):
    """A description of the first difference between two weight maps, or None."""
    expected, found = _comparable(expected), _comparable(found)
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    reshaped = sorted(k for k in set(expected) & set(found)
                      if expected[k] != found[k])
    if reshaped:
        key = reshaped[0]
        return (f"weight {key!r} has shape {found[key]} in the checkpoint but "
                f"{expected[key]} in the model"
                + (f" ({len(reshaped) - 1} more differ)" if len(reshaped) > 1
                   else ""))
    if missing:
        return (f"the model's weight {missing[0]!r} (shape "
                f"{expected[missing[0]]}) is not in the checkpoint"
                + (f" ({len(missing) - 1} more missing)" if len(missing) > 1
                   else ""))
    if unexpected:
        return (f"the checkpoint's weight {unexpected[0]!r} (shape "
                f"{found[unexpected[0]]}) has no place in the model"
                + (f" ({len(unexpected) - 1} more)" if len(unexpected) > 1
                   else ""))
    return None


class SidecarEvaluator:
    """Evaluates every new checkpoint of a training job, in its own process.

    `start()` waits for checkpoints written by
    `keras_ps.callbacks.SidecarCheckpoint` in `checkpoint_dir`, restores the
    newest one not evaluated yet into `model` (a plain, unsharded Keras model
    built like the trained one; sharded weights restore into it), evaluates
    it on `data`, writes the metrics at the checkpoint's training step, and
    calls `callbacks`. It never evaluates a checkpoint twice. When training
    outruns it, the older unevaluated checkpoints are skipped; a checkpoint
    deleted while being read is skipped too; each skip is logged and listed
    in `skipped`. It stops after `max_evaluations`, or after the checkpoint
    training marked final (its last epoch).

    TensorBoard: with `log_dir`, event files go to `log_dir/validation` with
    the tags `keras.callbacks.TensorBoard` writes there during `fit`:
    `evaluation_<metric>_vs_iterations` at the training step and
    `epoch_<metric>` at the (0-based) epoch, so the sidecar's curves overlay
    the training curves when both use the same `log_dir`.

    Callbacks get Keras' `on_test_begin`/`on_test_end` (with the metrics)
    from `model.evaluate`; a callback with an `on_checkpoint_restored(checkpoint)`
    method (like `keras_ps.callbacks.SidecarEvaluatorModelExport`) is first
    told which `Checkpoint` is being evaluated. If the model has an
    optimizer, its `iterations` is set to the checkpoint's step, so Keras'
    own TensorBoard callback logs at the right step too.

    Args:
        model: a compiled Keras model (the evaluation's loss and metrics
            come from `compile`). An unbuilt one is built by calling it on
            the first batch of `data`.
        data: what `model.evaluate` takes: a `tf.data.Dataset`, a
            `keras.utils.PyDataset`, or a tuple `(x, y)` / `(x, y,
            sample_weight)` of arrays.
        checkpoint_dir: the directory `SidecarCheckpoint` writes, or where
            training saves `tf.train.Checkpoint(model=model,
            optimizer=model.optimizer)` with a `tf.train.CheckpointManager`
            (TF's format: the model's weights are restored, the step is the
            saved `optimizer.iterations`; such a checkpoint has no epoch and
            is never final, so set `max_evaluations` or `timeout`).
        steps: batches per evaluation (`None`: all of `data`).
        max_evaluations: stop after this many evaluations (`None`: stop after
            the final checkpoint).
        callbacks: Keras callbacks for each evaluation.
        poll_interval: seconds between looks at `checkpoint_dir`.
        log_dir: TensorBoard log directory (`None`: no event files).
        timeout: seconds to wait for a new checkpoint before raising
            `SidecarTimeoutError` (`None`: wait forever).

    Example:
    ```python
    model = build_model()   # same architecture as training, no strategy
    model.compile(loss="binary_crossentropy", metrics=["accuracy"])
    keras_ps.SidecarEvaluator(model, val_dataset, "/shared/ckpt",
                              log_dir="/shared/logs").start()
    ```
    """

    def __init__(self, model, data, checkpoint_dir, steps=None,
                 max_evaluations=None, callbacks=None, poll_interval=2.0,
                 log_dir=None, timeout=None):
        if not isinstance(model, keras.Model):
            raise TypeError(
                "SidecarEvaluator needs a Keras model. Received: "
                f"model of type {type(model).__name__}.")
        if not checkpoint_dir:
            raise ValueError(
                "SidecarEvaluator needs the directory training writes "
                f"checkpoints to. Received: checkpoint_dir={checkpoint_dir!r}.")
        for arg, value in (("steps", steps), ("max_evaluations", max_evaluations)):
            if value is not None and (not isinstance(value, int)
                                      or isinstance(value, bool) or value < 1):
                raise ValueError(
                    f"{arg} must be a positive integer or None. Received: "
                    f"{arg}={value!r}.")
        for arg, value in (("poll_interval", poll_interval), ("timeout", timeout)):
            if (value is not None or arg == "poll_interval") and not (
                    isinstance(value, (int, float)) and value > 0):
                raise ValueError(
                    f"{arg} must be a positive number of seconds. Received: "
                    f"{arg}={value!r}.")
        if not model.compiled:
            raise ValueError(
                "SidecarEvaluator's model is not compiled. Received: model="
                f"{model.name!r}. Fix: model.compile(loss=..., "
                "metrics=[...]) as in training (no strategy needed).")
        self.model = model
        self.data = data
        self.checkpoint_dir = os.fspath(checkpoint_dir)
        self.steps = steps
        self.max_evaluations = max_evaluations
        self.callbacks = list(callbacks or [])
        self.poll_interval = float(poll_interval)
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.timeout = timeout
        self.evaluations = []   # Evaluation, in order
        self.skipped = []       # (checkpoint name, reason)
        self._expected_shapes = None
        self._writer = None
        self._tf_steps = {}  # tf.train checkpoint prefix -> its training step
        if not model.built:
            tf_checkpoints.build_from_data(model, data)

    # -- the loop ---------------------------------------------------------------------
    def start(self):
        """Evaluates checkpoints until the final one or `max_evaluations`.

        Returns:
            The list of `Evaluation`s made by this call.

        Raises:
            SidecarTimeoutError: no new checkpoint for `timeout` seconds.
            CheckpointMismatchError: a checkpoint does not fit `model`.
        """
        self._read_model_shapes()
        made = []
        last = None  # the newest checkpoint evaluated or skipped
        waiting_since = time.monotonic()
        next_log = waiting_since + _WAIT_LOG_INTERVAL
        next_warning = waiting_since  # while checkpoint_dir does not exist
        logger.info("[evaluator] watching %s for checkpoints",
                    self.checkpoint_dir)
        while True:
            names = self._list_checkpoints()
            new = [n for n in names
                   if last is None or self._step_of(n) > self._step_of(last)]
            if new:
                evaluation, newest_seen = self._evaluate_newest(new)
                last = newest_seen
                waiting_since = time.monotonic()
                next_log = waiting_since + _WAIT_LOG_INTERVAL
                if evaluation is not None:
                    made.append(evaluation)
                    if self._done(evaluation.checkpoint, len(made)):
                        return made
                continue
            if last is not None and self._marked_final_since(last):
                logger.info("[evaluator] checkpoint %s was marked final after "
                            "it was evaluated; stopping", last)
                return made
            now = time.monotonic()
            if now >= next_warning and not tf.io.gfile.isdir(
                    self.checkpoint_dir):
                logger.warning(
                    "[evaluator] checkpoint_dir %r does not exist: no "
                    "checkpoint has appeared there yet (%.0f s so far). "
                    "Waiting for training to create it; check that training "
                    "writes to this path (SidecarCheckpoint(checkpoint_dir), "
                    "on storage this machine sees).", self.checkpoint_dir,
                    now - waiting_since)
                next_warning = now + _MISSING_DIR_WARN_INTERVAL
            if self.timeout is not None and now - waiting_since >= self.timeout:
                raise SidecarTimeoutError(
                    f"No new checkpoint in the checkpoint directory for "
                    f"{self.timeout:g} s. Received: checkpoint_dir="
                    f"{self.checkpoint_dir!r}, timeout={self.timeout!r}, "
                    f"evaluations so far={len(made)}. Fix: train with "
                    "keras_ps.callbacks.SidecarCheckpoint(checkpoint_dir) on "
                    "the same directory, or raise timeout.")
            if now >= next_log:
                logger.info(
                    "[evaluator] waiting for a %scheckpoint in %s (%.0f s so "
                    "far)", "new " if last else "", self.checkpoint_dir,
                    now - waiting_since)
                next_log = now + _WAIT_LOG_INTERVAL
            time.sleep(self.poll_interval)

    def _done(self, checkpoint, count):
        if checkpoint.final:
            logger.info("[evaluator] evaluated the final checkpoint %s; "
                        "stopping", checkpoint.name)
            return True
        if self.max_evaluations is not None and count >= self.max_evaluations:
            logger.info("[evaluator] made max_evaluations=%d evaluations; "
                        "stopping", self.max_evaluations)
            return True
        return False

    def _marked_final_since(self, name):
        if tf_checkpoints.is_tf_checkpoint(name):
            return False  # tf.train checkpoints carry no "final" mark
        try:
            return fmt.read_checkpoint(self.checkpoint_dir, name).final
        except (FileNotFoundError, ValueError):
            return False

    def _skip(self, name, reason):
        self.skipped.append((name, reason))
        logger.info("[evaluator] skipped checkpoint %s: %s", name, reason)

    def _evaluate_newest(self, new):
        """Evaluates the newest restorable checkpoint of `new` (oldest first).

        Returns:
            (Evaluation or None, the newest name of `new`): every name in
            `new` is then evaluated or skipped.
        """
        candidates = list(reversed(new))
        for i, name in enumerate(candidates):
            checkpoint = self._restore(name)
            if checkpoint is None:
                self._skip(name, "deleted while being read")
                continue
            for older in reversed(candidates[i + 1:]):
                self._skip(older, f"a newer checkpoint ({name}) was ready")
            return self._evaluate(checkpoint), candidates[0]
        return None, candidates[0]

    # -- one checkpoint -----------------------------------------------------------------
    def _read_model_shapes(self):
        if self._expected_shapes is None:
            with tempfile.TemporaryDirectory(prefix="keras_ps_eval_") as tmp:
                path = os.path.join(tmp, "model.weights.h5")
                self.model.save_weights(path)
                self._expected_shapes = _weight_shapes(path)

    def _restore(self, name):
        """Loads a checkpoint into the model.

        Returns:
            The `Checkpoint`, or None if it was deleted while being read.

        Raises:
            CheckpointMismatchError: its weights do not fit the model.
        """
        if tf_checkpoints.is_tf_checkpoint(name):
            return self._restore_tf(name)
        try:
            checkpoint = fmt.read_checkpoint(self.checkpoint_dir, name)
        except FileNotFoundError:
            return None
        try:
            found = _weight_shapes(checkpoint.path)
        except OSError:
            if not os.path.exists(checkpoint.path):
                return None
            raise
        problem = _mismatch(self._expected_shapes, found)
        if problem is not None:
            raise CheckpointMismatchError(
                f"Checkpoint {name} was written by a different model: "
                f"{problem}. Received: checkpoint={checkpoint.path!r}, "
                f"model={self.model.name!r}. Fix: build the evaluator's model "
                "exactly like the trained one (same layers, same shapes).")
        try:
            with warnings.catch_warnings():
                # The evaluator's optimizer is unbuilt; the training
                # optimizer's state in the file is not needed to evaluate.
                warnings.filterwarnings(
                    "ignore", message="Skipping variable loading for optimizer")
                self.model.load_weights(checkpoint.path)
        except (OSError, ValueError):
            if not os.path.exists(checkpoint.path):
                return None
            raise
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            optimizer.iterations.assign(checkpoint.step)
        return checkpoint

    def _evaluate(self, checkpoint):
        logger.info("[evaluator] evaluating checkpoint %s (epoch %s, step %d)",
                    checkpoint.name, checkpoint.epoch, checkpoint.step)
        for callback in self.callbacks:
            hook = getattr(callback, "on_checkpoint_restored", None)
            if callable(hook):
                hook(checkpoint)
        if isinstance(self.data, tuple):
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(self.data)
            metrics = self.model.evaluate(
                x, y, sample_weight=sample_weight, steps=self.steps,
                callbacks=self.callbacks, verbose=0, return_dict=True)
        else:
            metrics = self.model.evaluate(
                self.data, steps=self.steps, callbacks=self.callbacks,
                verbose=0, return_dict=True)
        metrics = {k: float(v) for k, v in metrics.items()}
        self._write_summaries(checkpoint, metrics)
        evaluation = Evaluation(checkpoint, metrics)
        self.evaluations.append(evaluation)
        logger.info("[evaluator] evaluated checkpoint %s (epoch %s, step %d): "
                    "%s", checkpoint.name, checkpoint.epoch, checkpoint.step,
                    " ".join(f"{k}={v:.6g}" for k, v in metrics.items()))
        return evaluation

    def _write_summaries(self, checkpoint, metrics):
        if self.log_dir is None:
            return
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(
                os.path.join(self.log_dir, "validation"))
        with self._writer.as_default():
            for key, value in metrics.items():
                tf.summary.scalar(f"evaluation_{key}_vs_iterations", value,
                                  step=checkpoint.step)
                if checkpoint.epoch is not None:
                    tf.summary.scalar(f"epoch_{key}", value,
                                      step=checkpoint.epoch)
        self._writer.flush()

    # -- tf.train.Checkpoint files (tf.train.CheckpointManager, TF's format) ----------
    def _list_checkpoints(self):
        """Names of every checkpoint in the directory, by training step:
        keras_ps' manifests and the prefixes tf.train's `checkpoint` file lists."""
        names = fmt.list_checkpoints(self.checkpoint_dir)
        for prefix in tf_checkpoints.tf_checkpoint_prefixes(self.checkpoint_dir):
            if prefix not in self._tf_steps:
                try:
                    self._tf_steps[prefix] = tf_checkpoints.tf_checkpoint_step(prefix)
                except (tf.errors.NotFoundError, tf.errors.DataLossError):
                    continue  # deleted (max_to_keep) while being listed
            names.append(prefix)
        return sorted(names, key=self._step_of)

    def _step_of(self, name):
        if tf_checkpoints.is_tf_checkpoint(name):
            return self._tf_steps[name]
        return fmt.step_of(name)

    def _restore_tf(self, prefix):
        """Restores the model's weights (the `model` of a
        `tf.train.Checkpoint(model=..., optimizer=...)`) from `prefix`."""
        if not tf.io.gfile.exists(prefix + ".index"):
            return None
        try:
            status = tf.train.Checkpoint(model=tf_checkpoints.ModelWeights(self.model)).read(
                prefix)
            status.assert_existing_objects_matched()
            status.expect_partial()  # the training optimizer's state stays
        except (tf.errors.NotFoundError, tf.errors.DataLossError):
            if not tf.io.gfile.exists(prefix + ".index"):
                return None
            raise
        except (AssertionError, ValueError) as e:
            raise CheckpointMismatchError(
                f"Checkpoint {prefix} does not fit the evaluator's model: "
                f"{str(e)[:500]} Received: checkpoint={prefix!r}, model="
                f"{self.model.name!r}. Fix: save tf.train.Checkpoint("
                "model=model, optimizer=model.optimizer) in training and "
                "build the evaluator's model exactly like the trained one."
            ) from None
        step = self._tf_steps[prefix]
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            optimizer.iterations.assign(step)
        return Checkpoint(name=os.path.basename(prefix), path=prefix,
                          epoch=None, step=step, final=False)
