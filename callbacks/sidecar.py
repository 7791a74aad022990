"""Callbacks for sidecar evaluation: `SidecarCheckpoint` on the training side,
`SidecarEvaluatorModelExport` on the evaluator's side."""

import logging
import os

import keras

from keras_ps.backups import _checks
from keras_ps.sidecar import format as fmt
from keras_ps.tables import _row_chunks

logger = logging.getLogger(__name__)


class SidecarCheckpoint(keras.callbacks.Callback):
    """Writes the checkpoints that `keras_ps.SidecarEvaluator` evaluates.

    At each epoch end it saves the model's weights with the training step
    (`optimizer.iterations`) and the epoch. Under keras_ps `fit` the steps in
    flight have finished by then, so the weights hold every step counted.
    Each checkpoint is written under a temporary name and published by
    atomic renames (weights, then a small manifest), so the evaluator never
    reads a half-written one. The last epoch's checkpoint (`total_epochs`,
    else the `epochs` given to `fit`, or whatever epoch training stopped at)
    is marked final: the evaluator stops after evaluating it.

    Sharded weights are saved as one full tensor each, so the evaluator's
    plain, unsharded model loads them.

    Args:
        checkpoint_dir: where checkpoints go (created if missing); the
            evaluator's `checkpoint_dir`. One directory per training job.
        total_epochs: the epoch count whose last checkpoint is final. Default:
            the `epochs` argument of `fit`.
        max_to_keep: how many checkpoints to keep (the oldest are deleted);
            `None` keeps all.

    Example:
    ```python
    model.fit(keras_ps.DatasetCreator(dataset_fn), epochs=10, steps_per_epoch=100,
              callbacks=[keras_ps.callbacks.SidecarCheckpoint("/shared/ckpt")])
    ```
    """

    def __init__(self, checkpoint_dir, total_epochs=None, max_to_keep=5):
        super().__init__()
        if not checkpoint_dir:
            raise ValueError(
                "SidecarCheckpoint needs a checkpoint directory. Received: "
                f"checkpoint_dir={checkpoint_dir!r}. Fix: pass the directory "
                "the evaluator reads.")
        if total_epochs is not None and (
                isinstance(total_epochs, bool)
                or not isinstance(total_epochs, int) or total_epochs < 1):
            raise ValueError(
                "total_epochs must be a positive integer or None. Received: "
                f"total_epochs={total_epochs!r}.")
        if max_to_keep is not None and (
                isinstance(max_to_keep, bool)
                or not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(
                "max_to_keep must be a positive integer or None. Received: "
                f"max_to_keep={max_to_keep!r}.")
        self.checkpoint_dir = os.fspath(checkpoint_dir)
        _checks.check_directory(self.checkpoint_dir, "checkpoint_dir")
        self.total_epochs = total_epochs
        self.max_to_keep = max_to_keep
        self._last = None  # (name, epoch, step, final) of the newest write

    def _step(self):
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None:
            raise ValueError(
                "SidecarCheckpoint needs a compiled model (it records "
                "optimizer.iterations as the training step). Received: a model "
                "without an optimizer. Fix: call model.compile(...) first.")
        return int(keras.ops.convert_to_numpy(optimizer.iterations))

    def _is_final(self, epoch):
        total = self.total_epochs or (self.params or {}).get("epochs")
        return total is not None and epoch + 1 >= total

    def on_train_begin(self, logs=None):
        # KERAS_PS_SAVE_CHUNK_BYTES is read at each save: a bad value
        # fails now, not after the first epoch; so does a file in the way.
        _row_chunks.chunk_bytes()
        _checks.make_directory(self.checkpoint_dir, "checkpoint_dir")

    def on_epoch_end(self, epoch, logs=None):
        self.save(epoch, final=self._is_final(epoch))

    def on_train_end(self, logs=None):
        # Training stopped early (EarlyStopping, stop_training): the last
        # checkpoint written is the final one.
        if self._last is not None and not self._last[3]:
            name, epoch, step, _ = self._last
            fmt.write_manifest(self.checkpoint_dir, name, epoch, step, True)
            self._last = (name, epoch, step, True)
            logger.info("[chief] marked checkpoint %s final", name)

    def save(self, epoch, final=False):
        """Writes one checkpoint now (also called at each epoch end).

        Returns:
            The checkpoint's name.

        Raises:
            ValueError: `final` is not True or False.
        """
        _checks.check_bools(final=final)
        _checks.make_directory(self.checkpoint_dir, "checkpoint_dir")
        step = self._step()
        name = fmt.checkpoint_name(step)
        tmp = fmt.temporary_weights_path(self.checkpoint_dir, name)
        self.model.save_weights(tmp, overwrite=True)
        os.replace(tmp, os.path.join(self.checkpoint_dir,
                                     name + fmt.WEIGHTS_SUFFIX))
        fmt.write_manifest(self.checkpoint_dir, name, epoch, step, final)
        self._last = (name, epoch, step, final)
        logger.info("[chief] sidecar checkpoint %s written: epoch %d, step %d%s",
                    name, epoch, step, " (final)" if final else "")
        if self.max_to_keep is not None:
            names = fmt.list_checkpoints(self.checkpoint_dir)
            for old in names[:max(0, len(names) - self.max_to_keep)]:
                fmt.remove_checkpoint(self.checkpoint_dir, old)
        return name


class SidecarEvaluatorModelExport(keras.callbacks.Callback):
    """Exports the best model by a metric as a `SidecarEvaluator` goes.

    Give it to `keras_ps.SidecarEvaluator(callbacks=[...])`. After each
    evaluation it compares `logs[monitor]` with the best value so far and,
    when it is better, saves the evaluator's model (with the checkpoint's
    weights) to `export_filepath`: a `.keras` path saves the whole model, a
    `.weights.h5` path only the weights. The path may use `{epoch}` (1-based,
    as in `keras.callbacks.ModelCheckpoint`) and `{step}` (the training
    step) of the evaluated checkpoint. Each export is written to a temporary
    file and renamed, so a reader never sees a partial model.

    Args:
        export_filepath: where to export, e.g. `"best/model-{epoch:03d}.keras"`.
        monitor: the metric to compare, a key of `model.evaluate`'s logs
            (`"loss"`, `"accuracy"`, ...).
        mode: `"min"` (lower is better) or `"max"`.

    Example:
    ```python
    export = keras_ps.callbacks.SidecarEvaluatorModelExport(
        "/shared/best.keras", monitor="accuracy", mode="max")
    keras_ps.SidecarEvaluator(model, data, "/shared/ckpt",
                              callbacks=[export]).start()
    ```
    """

    def __init__(self, export_filepath, monitor="loss", mode="min"):
        super().__init__()
        path = os.fspath(export_filepath or "")
        if not path.endswith((".keras", ".weights.h5")):
            raise ValueError(
                "export_filepath must end in .keras (whole model) or "
                f".weights.h5 (weights only). Received: export_filepath={path!r}.")
        if mode not in ("min", "max"):
            raise ValueError(
                f"mode must be 'min' or 'max'. Received: mode={mode!r}.")
        self.export_filepath = path
        self._path(1, 0)  # a bad placeholder fails here, not after an evaluation
        self.monitor = monitor
        self.mode = mode
        self.best = None
        self.exported = []  # paths written, oldest first
        self._checkpoint = None

    def _path(self, epoch, step):
        try:
            return self.export_filepath.format(epoch=epoch, step=step)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                "export_filepath may hold only the placeholders {epoch} and "
                "{step} (with a format, e.g. {epoch:03d}); a literal brace is "
                "written twice, {{ or }}. Received: export_filepath="
                f"{self.export_filepath!r} ({type(e).__name__}: {e}).") from None

    def on_checkpoint_restored(self, checkpoint):
        """Called by `SidecarEvaluator` with the checkpoint about to be
        evaluated (a `keras_ps.sidecar.format.Checkpoint`)."""
        self._checkpoint = checkpoint

    def _better(self, value):
        if self.best is None:
            return True
        return value < self.best if self.mode == "min" else value > self.best

    def on_test_end(self, logs=None):
        logs = logs or {}
        if self.monitor not in logs:
            raise ValueError(
                "SidecarEvaluatorModelExport cannot find its metric in the "
                f"evaluation logs. Received: monitor={self.monitor!r}, logs "
                f"have {sorted(logs)}. Fix: pass one of those as monitor.")
        value = float(logs[self.monitor])
        if not self._better(value):
            return
        checkpoint = self._checkpoint
        path = self._path(
            # tf.train checkpoints have no epoch (None).
            checkpoint.epoch + 1
            if checkpoint and checkpoint.epoch is not None else 0,
            checkpoint.step if checkpoint else 0)
        directory = os.path.dirname(path) or "."
        os.makedirs(directory, exist_ok=True)
        base = os.path.basename(path)
        tmp = os.path.join(directory, f".tmp-{os.getpid()}-{base}")
        if path.endswith(".keras"):
            self.model.save(tmp)
        else:
            self.model.save_weights(tmp, overwrite=True)
        os.replace(tmp, path)
        previous, self.best = self.best, value
        self.exported.append(path)
        logger.info("[evaluator] exported %s (%s=%.6g, best before: %s)%s",
                    path, self.monitor, value, previous,
                    f" from {checkpoint.name}" if checkpoint else "")
