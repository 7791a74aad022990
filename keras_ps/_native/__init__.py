"""keras_ps' C++ kernels (row_updates.cc, row_files.cc, row_restore.cc,
notices.cc): built once per machine, loaded by every process of a cluster.

TF has no kernel for LazyAdam's row update: made of TF's ops it is three
gathers, sixteen elementwise ops and four scatters, each a pass over all the
gradient's rows with a buffer of its own. `KerasPsLazyAdamRows` does it in one
pass over each row. Keras' Adagrad has no TF kernel either (TF's sparse
Adagrad puts epsilon outside the square root): `KerasPsAdagradRows` replaces
its scatter-add, gather and scatter-sub. `KerasPsWriteTensors` writes a
backup's row file with one copy of its bytes (TF's ops make three);
`KerasPsApplyRowFile` restores one: it checks the file and copies each row
from its bytes into the variable holding it (TF's ops make three copies
more), with a thread reading the restore's next file into the page cache
meanwhile.
`KerasPsPreemptionNotice` and `KerasPsReleasePreempted` carry a ps' SIGTERM
to the coordinator and its release back (keras_ps.cluster.ps_notices).
`KerasPsSumRows` adds up a lookup's gradient rows by distinct id on a worker,
the same floats in the same order as TF's UnsortedSegmentSum, about ten
times faster for rows of 64 floats. They are built into one library, once
per machine and TF install (keras_ps._native._build: about 15 s of one
core; later processes load the cached file in milliseconds).

keras_ps' Docker image builds it in its build stage and ships the library
in the cache directory it names. Where it cannot be built (no compiler; no
TF headers, as in an image that leaves them out), or with
`KERAS_PS_NATIVE=0`, keras_ps runs the same updates made of TF's ops: the
results agree to float rounding.

A graph holding one of these ops runs only where every process that handles
it has loaded the library: the coordinator, which traces it; each worker,
which splits the function between tasks; each ps, which runs the kernel.
`python -m keras_ps.server` and `LocalCluster` load it, and
`kernels_for(strategy)` asks every task of the cluster before a graph uses
it (servers started otherwise, e.g. a plain `tf.distribute.Server`, get the
update made of TF's ops). A task that comes back during the job (a ps
recovered, a worker re-admitted) is asked again (`recheck`): one that came
back without them (another keras_ps version, a machine that cannot build
them) would fail every graph traced with them ("Op type not registered"),
so the strategy's graphs are then traced again with TF's ops; once every
task has them again (that one replaced in turn), `regain` turns the
strategy back to them.
"""

import contextlib
import ctypes
import logging
import os
import threading
import time
import weakref

from keras_ps import _constants
from keras_ps import _tf_adapter
from keras_ps._native._build import NativeBuildError
from keras_ps._native._build import build

logger = logging.getLogger(__name__)

# What KerasPsNativeVersion returns (kVersion in row_updates.cc).
VERSION = 8
# Seconds each task has to say whether it loaded the library (one op run on
# it; milliseconds on a live task, even a busy one).
ASK_TIMEOUT_S = 10.0


def enabled():
    """False when `KERAS_PS_NATIVE=0` turns the kernels off."""
    return _constants.env_switch(_constants.NATIVE_ENV_VAR, 1)


def check_direct_io():
    """Refuses a `KERAS_PS_DIRECT_IO` other than 0, 1 or deltas and writes it
    back exactly so (an empty one is removed: the default, 0). The C++
    writer reads "1" as every backup row file written with O_DIRECT,
    "deltas" as a delta's files only, anything else as none, so "true" or
    " 1" would have left it off without a word."""
    name = _constants.DIRECT_IO_ENV_VAR
    raw = os.environ.get(name)
    if raw is None:
        return
    if raw.strip() == "":
        del os.environ[name]
    elif raw.strip() in ("0", "1", "deltas"):
        os.environ[name] = raw.strip()
    else:
        raise ValueError(
            f"Environment variable {name} must be 0 (off, the default: every "
            "backup row file through the page cache), deltas (a delta's row "
            "files with O_DIRECT, full backups through the page cache) or 1 "
            f"(every row file with O_DIRECT). Received: {name}={raw!r}. "
            "Unset it for the default.")



def load_in_server():
    """Loads the kernels into a process that only serves (no TF Python API):
    a task must have them before a function using them reaches it.

    Returns:
        What happened, for the task's start-up line.
    """
    if not enabled():
        return "native kernels off (KERAS_PS_NATIVE=0)"
    check_direct_io()
    global _server_library
    if _server_library is not None:
        # A task forked from LocalCluster's fork server has them already. The
        # library's sources may have changed since it was loaded (keras_ps
        # updated in place): loading another build would register the same
        # ops twice, which TF answers by aborting the process.
        return "native kernels loaded"
    try:
        path = build()
        # Loading registers the ops and kernels with TF's registries (the
        # library's static initializers), as tf.load_op_library does.
        _server_library = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except (NativeBuildError, OSError) as error:
        return f"native kernels not loaded: {error}"
    return "native kernels loaded"


_server_library = None


def server_library():
    """The library `load_in_server` loaded (a ctypes handle), or None."""
    return _server_library


_library = None
_library_lock = threading.Lock()
_library_error = None


def library():
    """The kernels' Python module in this process (`tf.load_op_library`), or
    None where they cannot be built (logged once, with the reason)."""
    global _library, _library_error
    if not enabled():
        return None
    with _library_lock:
        if _library is None and _library_error is None:
            check_direct_io()
            try:
                import tensorflow as tf

                _library = tf.load_op_library(build())
            # A build error, or TF refusing the library (tf.errors.OpError:
            # it was built against another TF): either way, TF's ops do.
            except Exception as error:
                _library_error = error
                logger.warning(
                    "[native] keras_ps' C++ kernels are not used: %s. LazyAdam "
                    "and Adagrad run their row updates made of TF's ops "
                    "(slower per step, same results).", error)
        return _library


_answers = weakref.WeakKeyDictionary()
_answers_lock = threading.Lock()
_trace = threading.local()


@contextlib.contextmanager
def tracing_for(strategy):
    """Within: the graphs this thread traces run on `strategy`'s cluster (see
    kernels_in_trace). The coordinator's worker threads trace the scheduled
    functions under it."""
    previous = getattr(_trace, "strategy", None)
    _trace.strategy = strategy
    try:
        yield
    finally:
        _trace.strategy = previous


def kernels_in_trace():
    """The kernels' module if every task of the cluster this thread traces for
    (see tracing_for) has loaded them; None outside such a trace."""
    strategy = getattr(_trace, "strategy", None)
    return None if strategy is None else kernels_for(strategy)


def kernels_for(strategy):
    """The kernels' module if every process that runs a graph of `strategy`
    has loaded them, else None.

    For a keras_ps ParameterServerStrategy, each ps and worker is asked once
    (an op run on it, every task at once); a task that cannot be reached, or
    does not answer within ASK_TIMEOUT_S, is not counted against them. Any
    other strategy runs in this process alone.
    """
    lib = library()
    if lib is None:
        return None
    spec = getattr(strategy, "cluster_spec", None)
    if not isinstance(spec, dict) or "ps" not in spec:
        return lib
    with _answers_lock:  # the coordinator's threads trace at once: ask once
        if strategy not in _answers:
            _answers[strategy] = _ask_tasks(lib, spec)
        answer = _answers[strategy]
    return lib if answer else None


def kernels_on(devices):
    """The kernels' module if each of `devices` (device names of tasks) has
    loaded them, else None; each device is asked (an op run on it)."""
    lib = library()
    if lib is None:
        return None
    return lib if _all_loaded(lib, list(devices)) else None


def _ask_tasks(lib, spec):
    return _all_loaded(lib, [
        f"/job:{job}/replica:0/task:{index}/device:CPU:0"
        for job in ("ps", "worker") for index in range(len(spec[job]))])


def _all_loaded(lib, devices):
    """No task of `devices` answered that it lacks this library's version
    (one that did not answer is not counted against them)."""
    return all(answer is not False for answer in _answers_of(lib, devices))


def _answers_of(lib, devices, timeout=ASK_TIMEOUT_S):
    """_answer for each of `devices`, asked at once; a task that has not
    answered after `timeout` seconds (a stopped or hung process: TF's remote
    call has no deadline) is not counted (None), and its question is left
    to finish on a daemon thread."""
    answers = [None] * len(devices)

    def ask(i):
        answers[i] = _answer(lib, devices[i])

    threads = [threading.Thread(target=ask, args=(i,), daemon=True,
                                name=f"keras_ps-native-ask-{i}")
               for i in range(len(devices))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    result = []
    for i, (device, thread) in enumerate(zip(devices, threads)):
        thread.join(max(0.0, deadline - time.monotonic()))
        silent = thread.is_alive()
        result.append(None if silent else answers[i])
        if silent:
            logger.warning(
                "[native] %s did not answer within %.0f s whether it has "
                "loaded keras_ps' C++ kernels (stopped or hung?); not counted",
                _task_of(device), timeout)
    return result


def task_names(devices):
    """"ps:0" and the like, for the tasks of `devices`."""
    return [_task_of(device) for device in devices]


def _task_of(device):
    import tensorflow as tf

    spec = tf.DeviceSpec.from_string(device)
    return f"{spec.job}:{spec.task}"


def _answer(lib, device):
    """Whether the task of `device` has loaded this library's version (None:
    it did not answer, and is not counted against them)."""
    import tensorflow as tf

    if "/job:" not in (device or ""):
        return True  # this process, which loaded it
    task = _task_of(device)
    # An executor of its own, whose error is then forgotten: a task without
    # the op fails the question, and under the shared executor that error
    # came out of the next op run on another task.
    executor = _tf_adapter.new_executor(asynchronous=False)
    try:
        # Asked now, also from inside a trace (the first apply of a train
        # function asks): init_scope leaves the graph being traced, and a
        # thread of _answers_of has none.
        # `.numpy()`: AutoGraph, converting a user's tf.function, turns
        # `int(tensor)` into a tensor, and the comparison below into one.
        with tf.init_scope(), _tf_adapter.executor_scope(executor), \
                tf.device(device):
            version = int(lib.keras_ps_native_version().numpy())
    except tf.errors.UnavailableError as error:
        logger.info("[native] %s did not answer (%s); not counted", task,
                    str(error).splitlines()[0])
        return None
    except tf.errors.OpError as error:
        logger.warning(
            "[native] %s has not loaded keras_ps' C++ kernels (%s): LazyAdam's "
            "and Adagrad's row updates, the lookups' gradient sums and the "
            "backups' row files are made of TF's ops (slower, same results). "
            "Start tasks with `python -m keras_ps.server` to use them.", task,
            str(error).splitlines()[0])
        return False
    finally:
        _tf_adapter.clear_executor_error(executor)
    if version != VERSION:
        logger.warning(
            "[native] %s has keras_ps' C++ kernels version %d, this process "
            "%d: LazyAdam's and Adagrad's row updates, the lookups' gradient "
            "sums and the backups' row files are made of TF's ops. Run one "
            "keras_ps version on every task.", task, version, VERSION)
        return False
    return True


_generation = 0


def generation():
    """Bumped each time `recheck` finds a task without the kernels, or
    `regain` every task with them again: what asked `kernels_on` before (a
    backup writer) asks again."""
    return _generation


def recheck(strategy, devices):
    """Asks the tasks of `devices`, which came back during the job (started
    again, or new), whether they loaded this library's version.

    Returns:
        The tasks ("ps:0") that did not, when the strategy's graphs were
        traced with the kernels: the caller traces them again (those
        cannot run on those tasks); else []. When one did not,
        `kernels_for(strategy)` is None from now on, and `generation()`
        moves on: writers that asked `kernels_on` ask again.
    """
    global _generation
    # Loaded in this process already, or nothing here used them yet: what
    # uses them first asks the tasks then (and a build is not started here).
    lib = _library
    devices = list(devices)
    with _answers_lock:
        traced_with = bool(_answers.get(strategy))
    # A worker runs the kernels only in the strategy's traces, and those use
    # them only once the tasks said yes; a ps also runs the backups' writers
    # and readers, which ask apart (kernels_on).
    if lib is None or not (traced_with or any("/job:ps/" in d
                                              for d in devices)):
        return []
    missing = [_task_of(device) for device, answer
               in zip(devices, _answers_of(lib, devices)) if answer is False]
    if missing:
        with _answers_lock:
            _answers[strategy] = False
            _generation += 1
    return missing if traced_with else []


def regain(strategy):
    """After a task came back with the kernels (`recheck` found none
    without): when the strategy's answer had turned to no (a task came back
    without them before), asks every task again. True when all have them
    now: the strategy's answer is yes again and `generation()` moves on;
    the caller traces its functions again, with the kernels."""
    global _generation
    with _answers_lock:
        if _library is None or _answers.get(strategy) is not False:
            return False
    if not _ask_tasks(_library, strategy.cluster_spec):
        return False
    with _answers_lock:
        _answers[strategy] = True
        _generation += 1
    return True
