"""The on-disk format shared by `SidecarCheckpoint` (writer) and
`SidecarEvaluator` (reader).

A checkpoint is two files in the checkpoint directory:

- `ckpt-<step>.weights.h5`: `model.save_weights(...)` (sharded weights are
  saved as one full tensor each, so a plain Keras model loads them);
- `ckpt-<step>.json`: the manifest `{"name", "weights", "epoch", "step",
  "final"}`, where `step` is `optimizer.iterations` and `epoch` the 0-based
  index of the epoch that just ended (as in Keras callbacks).

Both are written to a temporary name and published with `os.replace`, the
weights first, so a manifest only ever names a complete weights file. Readers
list manifests, never weights files.
"""

import dataclasses
import json
import os
import re

from keras_ps.backups import _chain

PREFIX = "ckpt-"
MANIFEST_SUFFIX = ".json"
WEIGHTS_SUFFIX = ".weights.h5"
_NAME_RE = re.compile(r"^ckpt-(\d+)\.json$")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One checkpoint written by `keras_ps.callbacks.SidecarCheckpoint`.

    Attributes:
        name: e.g. `"ckpt-0000000120"`.
        path: the weights file (`<checkpoint_dir>/<name>.weights.h5`).
        epoch: 0-based index of the epoch that ended when it was written.
        step: the training step (`optimizer.iterations`) it holds.
        final: whether training marked it as its last checkpoint.
    """

    name: str
    path: str
    epoch: int
    step: int
    final: bool


def checkpoint_name(step):
    return f"{PREFIX}{int(step):010d}"


def temporary_weights_path(directory, name):
    """A hidden name that still ends in `.weights.h5` (Keras requires it)."""
    return os.path.join(directory, f".{name}.tmp-{os.getpid()}{WEIGHTS_SUFFIX}")


def write_manifest(directory, name, epoch, step, final):
    manifest = {"name": name, "weights": name + WEIGHTS_SUFFIX,
                "epoch": int(epoch), "step": int(step), "final": bool(final)}
    _chain.write_atomically(os.path.join(directory, name + MANIFEST_SUFFIX),
                     json.dumps(manifest))


def list_checkpoints(directory):
    """Names of the published checkpoints in `directory`, oldest first.

    A missing directory lists as empty (training may not have created it yet).
    """
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        match = _NAME_RE.match(entry)
        if match:
            found.append((int(match.group(1)), entry[:-len(MANIFEST_SUFFIX)]))
    return [name for _, name in sorted(found)]


def step_of(name):
    """The training step encoded in a checkpoint name."""
    return int(name[len(PREFIX):])


def read_checkpoint(directory, name):
    """Reads a manifest.

    Raises:
        FileNotFoundError: the checkpoint was deleted.
        ValueError: the manifest is not a checkpoint manifest.
    """
    with open(os.path.join(directory, name + MANIFEST_SUFFIX)) as f:
        text = f.read()
    try:
        manifest = json.loads(text)
        return Checkpoint(
            name=name, path=os.path.join(directory, manifest["weights"]),
            epoch=int(manifest["epoch"]), step=int(manifest["step"]),
            final=bool(manifest["final"]))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"Checkpoint manifest {name}{MANIFEST_SUFFIX} is malformed "
            f"({type(e).__name__}: {e}). Received: {text[:200]!r}. Fix: write "
            "checkpoints with keras_ps.callbacks.SidecarCheckpoint.") from None


def remove_checkpoint(directory, name):
    """Deletes a checkpoint, manifest first (so it stops being listed)."""
    for suffix in (MANIFEST_SUFFIX, WEIGHTS_SUFFIX):
        try:
            os.remove(os.path.join(directory, name + suffix))
        except FileNotFoundError:
            pass
