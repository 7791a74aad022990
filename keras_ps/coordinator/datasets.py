"""Per-worker datasets and iterators, rebuilt when a worker comes back."""

import concurrent.futures
import inspect
import logging
import random
import time
import weakref

import numpy as np
import tensorflow as tf

from keras_ps import _constants
from keras_ps import _exit_guard
from keras_ps import _tf_adapter
from keras_ps.strategy._per_worker import IndexWatch
from keras_ps.strategy._per_worker import PerWorkerValues
from keras_ps.strategy._per_worker import dispatch_scope
from keras_ps.strategy._per_worker import worker_device
from keras_ps.coordinator import failure_handling

logger = logging.getLogger(__name__)

# At most this many workers' datasets or iterators are made at once.
_MAX_THREADS = 16


def _takes_context(fn):
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                          p.VAR_POSITIONAL) for p in params)


def _no_variables(next_creator, **kwargs):
    raise ValueError(
        "dataset_fn created a variable (name="
        f"{kwargs.get('name')!r}). A dataset_fn runs on every worker and may "
        "not create variables: create lookup tables and preprocessing layers "
        "under strategy.scope() before calling create_per_worker_dataset, and "
        "only use them inside dataset_fn.")


def serialized(dataset):
    """A function that rebuilds `dataset` wherever it is called.

    A dataset made on the coordinator travels as its serialized graph and is
    rebuilt on each worker (its variant tensor cannot be copied to another
    task)."""
    graph = tf.raw_ops.DatasetToGraphV2(
        input_dataset=tf.data.experimental.to_variant(dataset))
    spec = dataset.element_spec
    return lambda: tf.data.experimental.from_variant(
        tf.raw_ops.DatasetFromGraph(graph_def=graph), spec)


def _python_random_state():
    """The state of Python's and numpy's global random generators: a
    dataset_fn that draws a seed from them moves it."""
    _, keys, position, *_ = np.random.get_state()
    return random.getstate(), keys.tobytes(), position


def _at_once(indices, make):
    """{index: make(index)} for every index, the calls made in threads of
    their own (each waits on a remote worker, and TF lets go of the GIL
    while it waits)."""
    indices = list(indices)
    if len(indices) <= 1:
        return {index: make(index) for index in indices}
    with concurrent.futures.ThreadPoolExecutor(
            min(len(indices), _MAX_THREADS),
            thread_name_prefix="keras_ps_datasets") as pool:
        return dict(zip(indices, pool.map(make, indices)))


class PerWorkerDataset:
    """A dataset created on every worker by `coordinator.create_per_worker_dataset`.

    `iter()` gives a `PerWorkerValues` of iterators to pass to `schedule`.

    Args:
        dataset_or_fn: a `tf.data.Dataset`, or `dataset_fn()` /
            `dataset_fn(input_context)` returning one.
        strategy: the strategy (its `input_context()` per worker).
        gate: held shared while iterators are created, so a worker's
            re-admission (which rebuilds its datasets) cannot interleave.
        members: () -> for each worker index, whether it is in the cluster now.
        on_unreachable: called with a worker's index when its dataset cannot
            be made because the worker does not answer; the coordinator then
            counts it failed, and its dataset is made when it is re-admitted.
        on_iterators_dropped: called with each worker's iterator (or None)
            left in an `iter()` result that was garbage-collected: the
            coordinator hands them to its release lines.
    """

    def __init__(self, dataset_or_fn, strategy, gate, members,
                 on_unreachable, on_iterators_dropped=None):
        self._members_now = members
        members = members()
        self._strategy = strategy
        self._gate = gate
        self._on_unreachable = on_unreachable
        # Given each worker's iterators left in a dropped iter(self).
        self._on_iterators_dropped = on_iterators_dropped
        if isinstance(dataset_or_fn, tf.data.Dataset):
            self._fn = serialized(dataset_or_fn)
            self._with_context = False
        elif callable(dataset_or_fn):
            self._fn = dataset_or_fn
            self._with_context = _takes_context(dataset_or_fn)
        else:
            raise TypeError(
                "create_per_worker_dataset needs a dataset_fn or a "
                f"tf.data.Dataset. Received: {dataset_or_fn!r}.")
        # (the traced dataset_fn, number of workers) once a trace did not
        # depend on the worker (see _build), for the other workers to run.
        self._shared_trace = None
        # Built now on the workers that answer; a worker that is down or
        # joins later gets its dataset when it is admitted (rebuild).
        built = self._build_on(
            [i for i, member in enumerate(members) if member], len(members))
        self._datasets = [built.get(i) for i in range(len(members))]
        # The PerWorkerValues handed out, rebuilt on recovery. Held weakly:
        # an iterator keeps its dataset alive, not the other way round, so a
        # dataset and its iterators are freed as soon as the user drops them
        # (a cycle would keep them until the garbage collector runs, and
        # every re-admission until then would rebuild them on the worker).
        self._iterators = weakref.WeakSet()

    def _build_on(self, indices, num_workers):
        """{index: the dataset of worker index, or None if it does not
        answer}. The first trace is made alone; when it did not depend on
        the worker, the other workers run it at once (each call waits on its
        own worker), else each worker's trace follows."""
        def make(index):
            return self._unless_unreachable(index, self._build, index,
                                            num_workers)

        built = {}
        pending = list(indices)
        while pending and not self._has_shared_trace(num_workers):
            index = pending.pop(0)
            built[index] = make(index)
        built.update(_at_once(pending, make))
        return built

    def _has_shared_trace(self, num_workers):
        return (self._shared_trace is not None and
                self._shared_trace[1] == num_workers)

    def _build(self, index, num_workers):
        shared = (self._shared_trace[0] if self._has_shared_trace(num_workers)
                  else None)
        with tf.device(worker_device(index)), \
                dispatch_scope(index, num_workers), \
                tf.variable_creator_scope(_no_variables), \
                IndexWatch() as watch:
            if shared is not None:
                function = shared
            elif self._with_context:
                context = self._strategy.input_context()
                function = _tf_adapter.traced_once_each(
                    tf.function(lambda: self._fn(context)))
            else:
                function = _tf_adapter.traced_once_each(tf.function(self._fn))
            drawn_before = None if shared is not None else _python_random_state()
            try:
                with _exit_guard.tf_section():  # see keras_ps._exit_guard
                    dataset = function()
            except Exception as error:
                name = getattr(self._fn, "__name__", self._fn)
                error.add_note(
                    f"keras_ps: dataset_fn {name!r} raised this while "
                    f"creating the dataset on worker {index}. "
                    "Fix the error in dataset_fn: it is traced for the first "
                    "worker, and for each worker when it reads the worker's "
                    "index (and again when a worker rejoins).")
                raise
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(
                f"dataset_fn must return a tf.data.Dataset. Received: "
                f"{type(dataset).__name__} from {self._fn!r}.")
        if (shared is None and not watch.read and
                _python_random_state() == drawn_before):
            # dataset_fn did not read which worker it runs for, nor draw from
            # Python's or numpy's random generator (a seed per worker): its
            # graph is the same on every worker, so the next ones run this
            # trace (tracing is most of a dataset's making: ~50 ms for a dataset
            # with a map, against ~20 ms to run it on a worker).
            self._shared_trace = (function, num_workers)
        return dataset

    def build(self):
        """Makes the dataset on every member worker that does not have it yet
        (it is made at creation already; this is for code written for TF's
        per-worker datasets, which are made lazily)."""
        with self._gate.shared():
            members = self._members_now()
            missing = [index for index, member in enumerate(members)
                       if member and (index >= len(self._datasets) or
                                      self._datasets[index] is None)]
            for index, dataset in self._build_on(missing, len(members)).items():
                while len(self._datasets) <= index:
                    self._datasets.append(None)
                self._datasets[index] = dataset

    @property
    def element_spec(self):
        """The structure of the dataset's elements (same on every worker).

        When no worker holds the dataset yet (every one failed its first
        call: right after a coordinator restarts, the workers may still be
        dropping the old coordinator's state), waits up to
        KERAS_PS_CONNECT_TIMEOUT seconds for one to be re-admitted, which
        makes its dataset."""
        timeout = _constants.env_float(_constants.CONNECT_TIMEOUT_ENV_VAR,
                                       _constants.DEFAULT_CONNECT_TIMEOUT,
                                       minimum=0)
        deadline = time.monotonic() + timeout
        while True:
            for dataset in list(self._datasets):
                if dataset is not None:
                    return dataset.element_spec
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"No worker could build the dataset within {timeout:g} s "
                    f"(KERAS_PS_CONNECT_TIMEOUT): none of the "
                    f"{len(self._datasets)} workers answered. Check that the "
                    "worker tasks are running and reachable from this "
                    "process, or raise KERAS_PS_CONNECT_TIMEOUT.")
            time.sleep(0.1)

    def _unless_unreachable(self, index, make, *args):
        """`make(*args)`, or None when worker `index` does not answer."""
        try:
            return make(*args)
        except Exception as error:
            if not failure_handling.is_connectivity_error(error):
                raise
            logger.info("[worker:%d] unreachable (%s); its dataset is made "
                        "when it is re-admitted", index, type(error).__name__)
            self._on_unreachable(index)
            return None

    def _iter_on(self, index):
        if index >= len(self._datasets) or self._datasets[index] is None:
            return None
        with tf.device(worker_device(index)):
            return iter(self._datasets[index])

    def __iter__(self):
        with self._gate.shared():
            made = _at_once(range(len(self._datasets)), lambda index:
                            self._unless_unreachable(index, self._iter_on, index))
            iterators = PerWorkerValues(
                [made[i] for i in range(len(self._datasets))], source=self)
            self._iterators.add(iterators)
        if self._on_iterators_dropped is not None:
            iterators.on_dropped(self._on_iterators_dropped)
        return iterators

    def rebuild(self, index, num_workers):
        """(Re)creates worker `index`'s dataset and every iterator on it
        (called with the gate held exclusively).

        Returns:
            The iterators replaced (those of a worker that kept its process
            are alive there: see `ClusterCoordinator` on releasing them).
        """
        while len(self._datasets) <= index:
            self._datasets.append(None)
        self._datasets[index] = self._build(index, num_workers)
        replaced = []
        for iterators in list(self._iterators):
            old = iterators.replace(index, self._iter_on(index))
            if old is not None:
                replaced.append(old)
        logger.info("[worker:%d] per-worker dataset rebuilt", index)
        return replaced
