"""Which rows of a table the optimizer changed: dirty-row tracking.

An incremental backup writes only the rows of a large table (and of its
optimizer slots) that changed since the previous backup. The row-wise
updates (keras_ps.tables._rowwise) know exactly which rows they touch, so when a
table is tracked each such update also writes, with one scatter on the
table's ps, the current *generation* into the table's dirty vector (one
int32 per row, colocated with the table). A backup then:

1. advances the generation on every ps (`Generations.advance`): the rows
   marked so far carry a generation at most the old one, `g`;
2. writes the rows whose mark is above the generation of the previous
   backup it builds on (`since`), on each ps (nothing is cleared: a row
   updated during or after the backup carries `g + 1` and goes into the
   next one, and a backup that fails to publish leaves every mark in place,
   so the next one still includes its rows);
3. once published, is the base of the next: `since = g`.

Tracking is decided when a function is traced: an untracked table's updates
have no extra op at all. Pure TensorFlow; the strategy-aware creation of the
dirty vectors lives in keras_ps.backups.incremental_backup.
"""

import threading
import weakref

import tensorflow as tf

_lock = threading.Lock()
# id(tf.Variable) -> (weak reference to it, its RowTracker). Keyed by id: a
# tf.Variable is not hashable.
_trackers = {}


class RowTracker:
    """The dirty vector of one table (or one shard of a sharded table).

    Args:
        dirty: an int32 `tf.Variable` of shape `[rows]` on the table's ps:
            the generation of each row's last update (0: none since tracking
            began).
        generation: the int32 scalar `tf.Variable` of that ps holding the
            current generation (shared by every table on the ps).
    """

    def __init__(self, dirty, generation):
        self.dirty = dirty
        self.generation = generation

    @property
    def device(self):
        return self.dirty.device


def track(variable, tracker):
    """From now on, functions traced with `variable` (a `tf.Variable`) mark
    the rows their row-wise updates touch in `tracker`."""
    with _lock:
        for key in [k for k, (ref, _) in _trackers.items() if ref() is None]:
            del _trackers[key]  # a table that is gone: free its tracker
        _trackers[id(variable)] = (weakref.ref(variable), tracker)


def untrack(variable):
    with _lock:
        _trackers.pop(id(variable), None)


def tracker_of(variable):
    """The RowTracker of `variable`, or None when it is not tracked."""
    with _lock:
        entry = _trackers.get(id(variable))
    if entry is None or entry[0]() is not variable:
        return None
    return entry[1]


def mark_rows(variable, indices, after=()):
    """Marks rows `indices` (any shape, int32 or int64) of `variable` dirty,
    if it is tracked; nothing at all otherwise.

    Args:
        variable: the `tf.Variable` whose rows were updated.
        indices: the rows (repeats allowed).
        after: ops the mark runs after (the row updates), so a backup that
            reads the rows before they are written finds them marked with
            a later generation and writes them next time.
    """
    tracker = tracker_of(variable)
    if tracker is None:
        return
    with tf.control_dependencies([op for op in after if op is not None]), \
            tf.device(tracker.device):
        indices = tf.reshape(indices, [-1])
        generation = tf.raw_ops.ReadVariableOp(
            resource=tracker.generation.handle, dtype=tf.int32)
        tf.raw_ops.ResourceScatterUpdate(
            resource=tracker.dirty.handle, indices=indices,
            updates=tf.fill(tf.shape(indices), generation))


def mark_all(variable):
    """Marks every row of `variable` dirty if it is tracked (an update that
    was not row-wise: a dense gradient, a dense first step)."""
    tracker = tracker_of(variable)
    if tracker is None:
        return
    with tf.device(tracker.device):
        generation = tf.raw_ops.ReadVariableOp(
            resource=tracker.generation.handle, dtype=tf.int32)
        tf.raw_ops.AssignVariableOp(
            resource=tracker.dirty.handle,
            value=tf.fill(tf.shape(tracker.dirty), generation))


def count_marked(trackers, since):
    """How many rows each of `trackers` has marked after generation `since`
    (counted on their ps; a few small calls each)."""
    counts = []
    for tracker in trackers:
        with tf.device(tracker.device):
            marks = tf.raw_ops.ReadVariableOp(resource=tracker.dirty.handle,
                                              dtype=tf.int32)
            counts.append(tf.math.count_nonzero(marks > since,
                                                dtype=tf.int64))
    return [int(count) for count in counts]


class Generations:
    """The current generation of every ps that holds a tracked table.

    The number lives in one int32 scalar variable per ps and strategy (which
    the marks read) and, as `current`, here. A ps that lost its state and
    was given zeros back no longer agrees (`agree()` is False) until the
    next `advance`.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._variables = {}  # key -> (tf.Variable, alive)
        self.current = 1

    def variable_for(self, key, create, alive=lambda: True):
        """The generation variable registered under `key` (a ps and the
        strategy that placed it); `create(current)` makes it the first time.
        `alive()` is False once its cluster connection is gone (it is then
        forgotten)."""
        with self._lock:
            if key not in self._variables:
                self._variables[key] = (create(self.current), alive)
            return self._variables[key][0]

    def _live(self):
        for key, (_, alive) in list(self._variables.items()):
            if not alive():
                del self._variables[key]
        return [variable for variable, _ in self._variables.values()]

    def advance(self):
        """Starts a new generation on every ps; returns the previous one
        (every mark made so far is at most that)."""
        with self._lock:
            previous = self.current
            self.current += 1
            for variable in self._live():
                with tf.device(variable.device):
                    variable.assign(self.current)
            return previous

    def agree(self):
        """Whether every ps holds the current generation (False when a ps
        was given its variables back, as zeros, since the last advance)."""
        # Read under the lock: an `advance` between reading `current` and
        # the variables (a compaction starting while a delta's thread
        # checks) would look like a lost ps, and drop that delta.
        with self._lock:
            try:
                return all(int(v.numpy()) == self.current
                           for v in self._live())
            except tf.errors.OpError:
                return False


GENERATIONS = Generations()
