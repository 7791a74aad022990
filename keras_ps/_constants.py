"""Every tuning knob of keras_ps: its environment variable and its default.

Read once, when a component that uses the knob is created; an explicit
constructor argument wins over the environment.
"""

import math
import os

# The most closures of one function the coordinator packs into a single remote
# call to a worker. Packing is what makes dispatch cheap; 1 turns it off.
MAX_PACK_ENV_VAR = "KERAS_PS_MAX_PACK"
DEFAULT_MAX_PACK = 16

# Seconds a connectivity probe of one task (an HTTP/2 handshake with its gRPC
# server) may take before the task counts as unreachable.
PROBE_TIMEOUT_ENV_VAR = "KERAS_PS_PROBE_TIMEOUT"
DEFAULT_PROBE_TIMEOUT = 2.0
# Shorter probes fail against healthy tasks: a loaded machine takes tens of
# milliseconds to answer, and a worker whose probes always fail is set aside
# as hung and never re-admitted.
MIN_PROBE_TIMEOUT = 0.1

# Seconds between probes of a failed or joining worker while waiting for it
# to answer. A probe of a port nobody serves yet is refused at once, so this
# is cheap; it is how long a worker that has just started waits to be seen.
RECOVERY_INTERVAL_ENV_VAR = "KERAS_PS_RECOVERY_INTERVAL"
DEFAULT_RECOVERY_INTERVAL = 0.1

# Seconds to wait before trying again when a worker answered but rebuilding
# its context failed (each try briefly pauses every worker's calls).
REBUILD_RETRY_DELAY = 1.0

# Seconds a new strategy waits for every ps and worker task to answer before
# it connects (a task may still be starting or restarting).
CONNECT_TIMEOUT_ENV_VAR = "KERAS_PS_CONNECT_TIMEOUT"
DEFAULT_CONNECT_TIMEOUT = 60.0

# Whether a failed worker that answers again is re-admitted (its eager context
# and per-worker datasets are rebuilt). 0 keeps lost workers out for good.
READMIT_WORKERS_ENV_VAR = "KERAS_PS_READMIT_WORKERS"
DEFAULT_READMIT_WORKERS = 1

# Seconds join() tolerates having no healthy worker before it raises
# NoWorkersAvailableError (0 waits forever, as TF does).
NO_WORKER_TIMEOUT_ENV_VAR = "KERAS_PS_NO_WORKER_TIMEOUT"
DEFAULT_NO_WORKER_TIMEOUT = 0.0

# Seconds every worker of a job may stay cut off from a ps that the
# coordinator reaches (each worker's calls failing on a connection while it
# and every ps answer) before the job fails with NoWorkersAvailableError
# naming the cause (keras_ps/coordinator/cut_off.py). 0 waits forever.
CUT_OFF_TIMEOUT_ENV_VAR = "KERAS_PS_CUT_OFF_TIMEOUT"
DEFAULT_CUT_OFF_TIMEOUT = 60.0

# Seconds a connection between tasks may go without an answer from the
# peer's host (its kernel: a stopped process on a live host still answers)
# before the kernel gives it up and its calls fail (keepalive probes and
# TCP_USER_TIMEOUT, keras_ps/cluster/_dead_peers.py): a machine that vanished
# without resetting its connections. 0 leaves TF's connections as they are
# (a call to a vanished machine then waits about 15 minutes).
PEER_TIMEOUT_ENV_VAR = "KERAS_PS_PEER_TIMEOUT"
DEFAULT_PEER_TIMEOUT = 30.0

# Exactly-once evaluation splits the data into this many shards per worker:
# more shards balance better and redo less after a worker loss.
EVAL_SHARDS_PER_WORKER_ENV_VAR = "KERAS_PS_EVAL_SHARDS_PER_WORKER"
DEFAULT_EVAL_SHARDS_PER_WORKER = 4

# Seconds a `ShardedInput` may spend counting the records of a dataset whose
# size tf.data does not know (a filter, a generator) before it gives up: such
# a dataset may never end (a .repeat() before the filter). 0: no limit. While
# it counts it logs a warning every COUNT_LOG_INTERVAL seconds.
COUNT_TIMEOUT_ENV_VAR = "KERAS_PS_COUNT_TIMEOUT"
DEFAULT_COUNT_TIMEOUT = 600.0
COUNT_LOG_INTERVAL = 10.0

# Seconds `BackupAndRestore` (or `IncrementalBackup`) waits for its
# directory's lock when the job holding it names another host: a network
# file system keeps a lost machine's lock for a while (about 90 s on
# NFSv4), and the chief started again elsewhere after a preemption meets
# it. A holder on this host is alive (the kernel drops a dead process'
# lock): no wait. 0: never wait.
BACKUP_LOCK_WAIT_ENV_VAR = "KERAS_PS_BACKUP_LOCK_WAIT"
DEFAULT_BACKUP_LOCK_WAIT = 120.0

# How many steps of a scheduled training or evaluation function are written
# out one after another in each iteration of its tf.while_loop (0 or 1: one
# step an iteration). A loop whose body reads and updates variables on the ps
# sends, at every iteration, the loop's condition and a control signal to
# each ps and one back from it (benchmarks/step_messages.py): K steps an
# iteration pay them once per K steps. With K at least the function's step
# count there is no loop. Keras' own train_step / test_step write out K an
# iteration and the rest after the loop; a custom step whose logs are not the
# metrics' results writes out all of them when they are at most K, else
# loops; a model with a DynamicEmbedding always loops. Written out, a
# function costs more once: the coordinator traces K copies of the step and
# each worker sets up a larger graph (for the benchmarks' model, 2 ps and 2
# workers in separate processes, at 10M rows: the execution that switches
# takes about 1.7 s more with K = 5, 3.3 s with K = 10), and then runs each
# execution faster (1.05-1.57x the loop's steady rate with K = 5, about 2x
# TF's own path where the loop gives 1.4-1.9x; K = 10 another 4-10% over
# K = 5, 6% less CPU per step).
UNROLL_STEPS_ENV_VAR = "KERAS_PS_UNROLL_STEPS"
DEFAULT_UNROLL_STEPS = 10

# ...and after how many executions of one function in the loop form it is
# traced again with K steps an iteration (0: from the first). The extra set-up
# (3.3 s at 10M rows in the benchmarks) pays for itself after about 100
# executions (the loop against K = 10: about 30-50 ms saved per execution of
# 10 steps), so short jobs (a few hundred steps, most tests) never pay it and
# a long training run pays it once.
# Counted per model, step (train or test) and step count, across fit and
# evaluate calls, until the next compile().
UNROLL_AFTER_ENV_VAR = "KERAS_PS_UNROLL_AFTER"
DEFAULT_UNROLL_AFTER = 100

# Whether a training, evaluation or prediction step moves the small dense
# variables of each ps (an MLP's kernels and biases, each at most
# GROUPED_TRANSFER_MAX_ELEMENTS elements) as one tensor per ps and dtype each
# way, their reads to the worker and their gradients back, instead of one
# tensor per variable (keras_ps/tables/_grouped_transfers.py): a tensor that
# crosses processes costs about the same CPU whatever its size. 0 moves one
# tensor per variable, as TF does.
GROUP_TRANSFERS_ENV_VAR = "KERAS_PS_GROUP_TRANSFERS"
DEFAULT_GROUP_TRANSFERS = 1
GROUPED_TRANSFER_MAX_ELEMENTS = 1 << 18

# Whether fit and evaluate hand their dataset iterators to a holder on each
# worker instead of dropping them (keras_ps/coordinator/iterator_release.py):
# TF's destructor of an iterator can stall the worker's next request for
# seconds. 0 drops them the plain way, as TF does.
RELEASE_ITERATORS_ENV_VAR = "KERAS_PS_RELEASE_ITERATORS"
DEFAULT_RELEASE_ITERATORS = 1

# Seconds a remote call may run before the coordinator probes its worker; a
# worker that is then unreachable (e.g. SIGSTOPped, hung host) is declared
# failed and its closures run elsewhere. A busy worker still answers the
# probe, so long steps are never cut short.
HANG_TIMEOUT_ENV_VAR = "KERAS_PS_HANG_TIMEOUT"
DEFAULT_HANG_TIMEOUT = 10.0

# Seconds a remote call may run on a worker that answers probes before it is
# given up as stuck (a read that never returns, a deadlock in TF's runtime):
# its closures run on the other workers, and the worker is re-admitted once
# the call returns or its process restarts. Unset or "auto": a call is
# stuck once it has run STUCK_FACTOR times as long, per closure, as the
# longest finished call of its function (at least STUCK_FLOOR_S); a
# function with no finished call yet is never given up. 0: never.
STUCK_TIMEOUT_ENV_VAR = "KERAS_PS_STUCK_TIMEOUT"
STUCK_FACTOR = 20
STUCK_FLOOR_S = 120.0

# Seconds a recovery waits for a lost parameter server to answer again on
# its address (a restart policy, a replacement machine) before giving up.
PS_RECOVERY_TIMEOUT_ENV_VAR = "KERAS_PS_PS_RECOVERY_TIMEOUT"
DEFAULT_PS_RECOVERY_TIMEOUT = 300.0

# Seconds a ps of `python -m keras_ps.server` serves on after SIGTERM while a
# coordinator watches it, waiting for its backup and release
# (keras_ps.cluster.ps_notices); `--preemption_grace` wins over it. 0: stop
# at once.
PREEMPTION_GRACE_ENV_VAR = "KERAS_PS_PREEMPTION_GRACE"


def _check_bounds(name, raw, value, default, minimum, above):
    """`value` (parsed from `raw`) within the knob's bounds, or an error
    that names the variable, its value and the default."""
    wanted = None
    if not math.isfinite(value):
        wanted = "a finite number"
    elif above is not None and not value > above:
        wanted = f"greater than {above}"
    elif minimum is not None and not value >= minimum:
        wanted = f"at least {minimum}"
    if wanted:
        raise ValueError(
            f"Environment variable {name} must be {wanted}. Received: "
            f"{name}={raw!r}. Unset it to use the default {default}.")
    return value


def env_float(name, default, minimum=None, above=None):
    """Reads a float knob; a malformed value, one below `minimum`, one not
    above `above`, NaN or an infinity is an error that names it."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return float(default)
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"Environment variable {name} must be a number. Received: "
            f"{name}={raw!r}. Unset it to use the default {default}."
        ) from None
    return _check_bounds(name, raw, value, default, minimum, above)


def env_switch(name, default):
    """Reads a 0/1 switch. Anything else is an error that names it: "false"
    or "off" read as a number other than 0 would turn the switch on."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return bool(default)
    if raw.strip() in ("0", "1"):
        return raw.strip() == "1"
    raise ValueError(
        f"Environment variable {name} must be 0 (off) or 1 (on). Received: "
        f"{name}={raw!r}. Unset it to use the default {int(bool(default))}.")


def env_seconds_or_auto(name):
    """Reads a seconds knob whose default is "auto" (None)."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() in ("", "auto"):
        return None
    try:
        value = float(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value):
        raise ValueError(
            f"Environment variable {name} must be a number of seconds or "
            f"'auto'. Received: {name}={raw!r}. Unset it (or set 'auto') for "
            "the default, or 0 to turn it off.")
    return value


def env_int(name, default, minimum=None):
    """Reads an int knob; a malformed value or one below `minimum` is an
    error that names it."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return int(default)
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"Environment variable {name} must be an integer. Received: "
            f"{name}={raw!r}. Unset it to use the default {default}."
        ) from None
    return _check_bounds(name, raw, value, default, minimum, None)

# The most bytes of one weight that saving or loading a Keras weights file
# (`model.save`, `save_weights`, `load_weights`, `load_model`) moves at once
# between the coordinator and a ps: a sharded weight or a weight on a ps is
# written and read in blocks of rows of at most this size.
SAVE_CHUNK_BYTES_ENV_VAR = "KERAS_PS_SAVE_CHUNK_BYTES"
DEFAULT_SAVE_CHUNK_BYTES = 64 * 2**20

# Whether keras_ps' C++ kernels (keras_ps/_native: LazyAdam's and Adagrad's
# row updates in one pass over each row) are built and used; 0 runs the same
# updates made of TF's ops everywhere. Built once per machine and TF install into
# CACHE_DIR_ENV_VAR's directory (default ~/.cache/keras_ps).
NATIVE_ENV_VAR = "KERAS_PS_NATIVE"
# Which backup row files the C++ writer writes with O_DIRECT where the disk
# takes it: unset or 0, none; deltas, a delta's, merged ones too (full
# backups go through the page cache); 1 every file. The writer reads the
# variable itself; keras_ps checks and normalises it first.
DIRECT_IO_ENV_VAR = "KERAS_PS_DIRECT_IO"
CACHE_DIR_ENV_VAR = "KERAS_PS_CACHE_DIR"
