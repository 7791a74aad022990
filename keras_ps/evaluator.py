"""`python -m keras_ps.evaluator`: run the sidecar evaluator task.

The evaluator needs the user's model and data, so it imports them:
`--model_fn module:function` (or `path/to/file.py:function`) names a function
that takes no arguments and returns `(model, data)`: a compiled, plain
Keras model (no strategy) and what `model.evaluate` takes.

    TF_CONFIG='{"task": {"type": "evaluator", "index": 0}}' \\
    python -m keras_ps.evaluator --model_fn my_job:eval_model \\
        --checkpoint_dir /shared/ckpt --log_dir /shared/logs \\
        --export_filepath /shared/best.keras --monitor loss --mode min

TF_CONFIG is optional; when set, its task type must be `evaluator` (a
cluster section may be present, as Kubernetes operators write it, and is
ignored). Bad input ends the process with a one-line error and exit code 2; a
timeout waiting for checkpoints with a one-line error and exit code 1.
"""

import argparse
import importlib
import importlib.util
import json
import logging
import os
import sys

import keras

from keras_ps import cluster as cluster_lib
from keras_ps.callbacks import SidecarEvaluatorModelExport
from keras_ps.errors import ClusterConfigError
from keras_ps.sidecar import evaluator as evaluator_lib

_PROG = "keras_ps.evaluator"


def _fail(message, code=2):
    print(f"{_PROG}: error: {message}", file=sys.stderr, flush=True)
    return code


class _BadInput(Exception):
    """Bad command-line or TF_CONFIG input (reported with exit code 2)."""


def _positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be a positive {kind.__name__}. Received: {text!r}")
        if value <= 0:
            raise argparse.ArgumentTypeError(
                f"must be a positive {kind.__name__}. Received: {text!r}")
        return value
    return parse


def _parser():
    parser = argparse.ArgumentParser(
        prog=_PROG, description="Evaluate each new training checkpoint "
        "(keras_ps sidecar evaluator task).")
    parser.add_argument("--model_fn", required=True,
                        help="module:function or file.py:function returning "
                        "(model, data)")
    parser.add_argument("--checkpoint_dir", required=True,
                        help="the directory SidecarCheckpoint (or a "
                        "tf.train.CheckpointManager) writes")
    parser.add_argument("--log_dir", help="TensorBoard log directory "
                        "(event files go to LOG_DIR/validation)")
    parser.add_argument("--steps", type=_positive(int),
                        help="batches per evaluation (default: all)")
    parser.add_argument("--max_evaluations", type=_positive(int),
                        help="stop after N evaluations (default: after the "
                        "final checkpoint)")
    parser.add_argument("--timeout", type=_positive(float),
                        help="seconds to wait for a new checkpoint "
                        "(default: forever)")
    parser.add_argument("--poll_interval", type=_positive(float), default=2.0,
                        help="seconds between looks at the directory")
    parser.add_argument("--export_filepath",
                        help="export the best model here (.keras or "
                        ".weights.h5; may use {epoch} and {step})")
    parser.add_argument("--monitor", default="loss",
                        help="metric that picks the best model")
    parser.add_argument("--mode", choices=("min", "max"), default="min")
    return parser


def _check_tf_config():
    if not os.environ.get("TF_CONFIG", "").strip():
        return
    try:
        _, task_type, _ = cluster_lib.parse_tf_config(require_cluster=False)
    except ClusterConfigError as e:
        raise _BadInput(str(e)) from None
    if task_type != "evaluator":
        raise _BadInput(
            "keras_ps.evaluator runs the evaluator task. Received: TF_CONFIG "
            f"task type {task_type!r}. Fix: set \"task\": {{\"type\": "
            "\"evaluator\"}, or run ps/worker tasks with "
            "`python -m keras_ps.server`.")


def _load_model_fn(spec):
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise _BadInput(
            "--model_fn must be module:function or path/to/file.py:function. "
            f"Received: --model_fn={spec!r}.")
    try:
        if target.endswith(".py"):
            if not os.path.isfile(target):
                raise _BadInput(f"--model_fn file does not exist. Received: "
                                f"--model_fn={spec!r}.")
            # As when the file runs as a script: its folder is importable.
            folder = os.path.dirname(os.path.abspath(target))
            if folder not in sys.path:
                sys.path.insert(0, folder)
            module_spec = importlib.util.spec_from_file_location(
                "_keras_ps_model_fn", target)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ImportError as e:
        raise _BadInput(f"--model_fn module cannot be imported ({e}). "
                        f"Received: --model_fn={spec!r}.") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise _BadInput(f"--model_fn names no function {attr!r} in {target}. "
                        f"Received: --model_fn={spec!r}.")
    return fn


def _model_and_data(spec):
    result = _load_model_fn(spec)()
    if not (isinstance(result, tuple) and len(result) == 2
            and isinstance(result[0], keras.Model)):
        raise _BadInput(
            "--model_fn must return (model, data) with a Keras model. "
            f"Received: a {type(result).__name__} from --model_fn={spec!r}.")
    return result


def main(argv=None):
    args = _parser().parse_args(argv)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"{_PROG}: %(message)s"))
    package_logger = logging.getLogger("keras_ps")
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)
    try:
        _check_tf_config()
        model, data = _model_and_data(args.model_fn)
        try:
            callbacks = []
            if args.export_filepath:
                callbacks.append(
                    SidecarEvaluatorModelExport(
                        args.export_filepath, monitor=args.monitor,
                        mode=args.mode))
            evaluator = evaluator_lib.SidecarEvaluator(
                model, data, args.checkpoint_dir, steps=args.steps,
                max_evaluations=args.max_evaluations, callbacks=callbacks,
                poll_interval=args.poll_interval, log_dir=args.log_dir,
                timeout=args.timeout)
        except (ValueError, TypeError) as e:
            raise _BadInput(str(e)) from None
        evaluator.start()
    except (_BadInput, evaluator_lib.CheckpointMismatchError) as e:
        return _fail(str(e))
    except evaluator_lib.SidecarTimeoutError as e:
        return _fail(str(e), code=1)
    finally:
        package_logger.removeHandler(handler)
    summary = {"evaluated": [e.checkpoint.name for e in evaluator.evaluations],
               "skipped": [name for name, _ in evaluator.skipped]}
    print(f"{_PROG}: done {json.dumps(summary)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
