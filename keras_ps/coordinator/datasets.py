"""Per-worker datasets and iterators, rebuilt when a worker comes back."""

import inspect
import logging

import tensorflow as tf

from keras_ps import strategy as strategy_lib
from keras_ps.coordinator.values import PerWorkerValues

logger = logging.getLogger(__name__)


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


class PerWorkerDataset:
    """A dataset created on every worker by `coordinator.create_per_worker_dataset`.

    `iter()` gives a `PerWorkerValues` of iterators to pass to `schedule`.
    """

    def __init__(self, coordinator, dataset_or_fn):
        self._coordinator = coordinator
        if isinstance(dataset_or_fn, tf.data.Dataset):
            # A dataset made on the coordinator travels as its serialized
            # graph and is rebuilt on each worker (its variant can't be copied).
            dataset = dataset_or_fn
            graph = tf.raw_ops.DatasetToGraphV2(
                input_dataset=tf.data.experimental.to_variant(dataset))
            spec = dataset.element_spec
            self._fn = lambda: tf.data.experimental.from_variant(
                tf.raw_ops.DatasetFromGraph(graph_def=graph), spec)
            self._with_context = False
        elif callable(dataset_or_fn):
            self._fn = dataset_or_fn
            self._with_context = _takes_context(dataset_or_fn)
        else:
            raise TypeError(
                "create_per_worker_dataset needs a dataset_fn or a "
                f"tf.data.Dataset. Received: {dataset_or_fn!r}.")
        # Built now on the workers in the cluster; a worker that is down or
        # joins later gets its dataset when it is admitted (_rebuild).
        self._datasets = [self._build(i) if member else None
                          for i, member in enumerate(coordinator.members())]
        self._iterators = []  # PerWorkerValues handed out, rebuilt on recovery

    def _build(self, index):
        strategy = self._coordinator.strategy
        num = self._coordinator.num_workers
        with tf.device(strategy_lib.worker_device(index)), \
                strategy_lib._DispatchScope(index, num), \
                tf.variable_creator_scope(_no_variables):
            if self._with_context:
                context = strategy.input_context()
                fn = lambda: self._fn(context)
            else:
                fn = self._fn
            try:
                dataset = tf.function(fn)()
            except Exception as error:
                name = getattr(self._fn, "__name__", self._fn)
                error.add_note(
                    f"keras_ps: dataset_fn {name!r} raised this while "
                    f"creating the dataset on worker {index}. "
                    "Fix the error in dataset_fn: it runs once on every worker "
                    "(and again when a worker rejoins).")
                raise
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(
                f"dataset_fn must return a tf.data.Dataset. Received: "
                f"{type(dataset).__name__} from {self._fn!r}.")
        return dataset

    @property
    def element_spec(self):
        """The structure of the dataset's elements (same on every worker)."""
        for dataset in self._datasets:
            if dataset is not None:
                return dataset.element_spec
        raise RuntimeError("No worker is in the cluster to build the dataset on.")

    def _iter_on(self, index):
        if index >= len(self._datasets) or self._datasets[index] is None:
            return None
        with tf.device(strategy_lib.worker_device(index)):
            return iter(self._datasets[index])

    def __iter__(self):
        with self._coordinator._gate.shared():
            iterators = PerWorkerValues(
                [self._iter_on(i) for i in range(len(self._datasets))],
                source=self)
            self._iterators.append(iterators)
        return iterators

    def _rebuild(self, index):
        """(Re)creates worker `index`'s dataset and every iterator on it."""
        while len(self._datasets) <= index:
            self._datasets.append(None)
        self._datasets[index] = self._build(index)
        for iterators in self._iterators:
            iterators._replace(index, self._iter_on(index))
        logger.info("[worker:%d] per-worker dataset rebuilt", index)
