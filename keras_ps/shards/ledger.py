"""The shard ledger: where every shard of an epoch is. Pure Python, no TF.

One ledger per epoch. Each shard is in one `ShardState`; `transition` is the
only place a state changes, checks the move against `ALLOWED`, and logs it.

    PENDING ──hand_out──> HANDED_OUT ──finish──> DONE
                              │   ^
                         lose │   │ hand_out
                              v   │
                             LOST ┘        HANDED_OUT ──fail──> FAILED

A LOST shard is back in the queue (its worker failed, hung, or left); its
retry resumes after the records whose steps its earlier attempts applied.
Records trained twice (steps of a lost attempt that its retry runs again)
follow from the ps' count of the records of every step begun, set here with
`set_begun`.
"""

import enum
import logging
import threading

logger = logging.getLogger(__name__)


class ShardState(enum.Enum):
    PENDING = "pending"  # not handed out yet this epoch
    HANDED_OUT = "handed_out"  # a worker is running it
    LOST = "lost"  # its worker failed, hung or left: queued again
    DONE = "done"  # every record trained by a completed step
    FAILED = "failed"  # could not be read, after the allowed attempts


ALLOWED = {
    ShardState.PENDING: {ShardState.HANDED_OUT},
    ShardState.HANDED_OUT: {ShardState.DONE, ShardState.LOST,
                            ShardState.FAILED},
    ShardState.LOST: {ShardState.HANDED_OUT},
    ShardState.DONE: set(),
    ShardState.FAILED: set(),
}


class ShardTransitionError(RuntimeError):
    """A move the state machine does not allow (a bug, never user input)."""


class _Shard:
    __slots__ = ("index", "description", "records", "state", "worker",
                 "attempts", "workers_tried", "trained", "losses")

    def __init__(self, index, description, records):
        self.index = index
        self.description = description
        self.records = records  # known size, or None (a file before reading)
        self.state = ShardState.PENDING
        self.worker = None
        self.attempts = 0
        self.workers_tried = []
        self.trained = 0  # records trained by completed steps
        self.losses = 0  # attempts lost with their worker


class ShardLedger:
    """Every shard of one epoch: handed out, done or lost. Thread-safe.

    Args:
        descriptions: one text per shard, naming what it reads (logs, errors).
        records: per shard, its number of records, or None when unknown.
        epoch: the epoch this ledger tracks.
        order: the order shards are handed out in (a permutation of their
            indices); default: index order.
    """

    def __init__(self, descriptions, records=None, epoch=0, order=None):
        records = records if records is not None else [None] * len(descriptions)
        if len(records) != len(descriptions):
            raise ValueError(
                "One record count per shard is needed. Received: "
                f"{len(descriptions)} descriptions and {len(records)} counts.")
        self.epoch = epoch
        self._shards = [_Shard(i, d, r) for i, (d, r)
                        in enumerate(zip(descriptions, records))]
        self.order = list(range(len(self._shards))) if order is None \
            else [int(i) for i in order]
        if sorted(self.order) != list(range(len(self._shards))):
            raise ValueError(
                "order must list every shard index once. Received: "
                f"order={self.order!r} for {len(self._shards)} shards.")
        self._retrained = [0] * len(self._shards)  # per shard, from the ps
        self._retrained_before = 0  # by earlier runs (a restored backup)
        self.losses = 0
        self._cv = threading.Condition()
        self._changes = 0

    # -- the state machine -----------------------------------------------------
    def transition(self, index, new_state, reason, worker=None):
        """Moves shard `index` to `new_state`; the one place states change.

        Raises:
            ShardTransitionError: the move is not in ALLOWED.
        """
        with self._cv:
            shard = self._shards[index]
            old = shard.state
            if new_state not in ALLOWED[old]:
                raise ShardTransitionError(
                    f"Shard {index} ({shard.description}) cannot go from "
                    f"{old.value} to {new_state.value} ({reason}).")
            shard.state = new_state
            if worker is not None:
                shard.worker = worker
            self._changes += 1
            self._cv.notify_all()
        prefix = f"[worker:{worker}]" if worker is not None else "[chief]"
        logger.info("%s epoch %d shard %d (%s): %s -> %s (%s)", prefix,
                    self.epoch, index, shard.description, old.value,
                    new_state.value, reason)

    def hand_out(self, index, worker):
        with self._cv:
            shard = self._shards[index]
            shard.attempts += 1
            shard.workers_tried.append(worker)
            attempt = shard.attempts
        self.transition(index, ShardState.HANDED_OUT, f"attempt {attempt}",
                        worker)

    def finish(self, index, worker, trained_before, trained_now):
        """The shard's last step completed: it started `trained_before`
        records in (skipped, applied by earlier attempts) and trained
        `trained_now` more."""
        with self._cv:
            shard = self._shards[index]
            shard.trained = trained_before + trained_now
            shard.records = shard.trained
        self.transition(index, ShardState.DONE,
                        f"{trained_now} records trained, {trained_before} by "
                        f"earlier attempts", worker)

    def set_retrained(self, per_shard):
        """The records of each shard trained twice so far this epoch."""
        per_shard = [int(n) for n in per_shard]
        if len(per_shard) != len(self._shards):
            raise ValueError(
                "One count per shard is needed. Received: "
                f"{len(per_shard)} counts for {len(self._shards)} shards.")
        with self._cv:
            self._retrained = per_shard

    def set_begun(self, begun, applied):
        """Sets the records trained twice from the ps' counts of this epoch.

        `begun[i]` holds the records of every step of shard i that began (on
        any attempt; a step that begins is applied), `applied[i]` its owner's
        progress. The attempts of a shard cover its records from the start,
        each at least once: all of them once it is done, its applied
        progress before. The records begun beyond those were trained twice
        (while a step is in flight, it counts here until it is marked).
        """
        begun, applied = list(begun), list(applied)
        if not len(begun) == len(applied) == len(self._shards):
            raise ValueError(
                "One count per shard is needed. Received: "
                f"{len(begun)} begun and {len(applied)} applied counts for "
                f"{len(self._shards)} shards.")
        with self._cv:
            covered = [s.trained if s.state is ShardState.DONE else int(a)
                       for s, a in zip(self._shards, applied)]
            retrained = [max(0, int(b) - c) for b, c in zip(begun, covered)]
        self.set_retrained(retrained)

    def records_retrained(self):
        with self._cv:
            return self._retrained_before + sum(self._retrained)

    def lose(self, index, reason):
        """The shard's worker failed, hung or left: queue it again."""
        with self._cv:
            shard = self._shards[index]
            worker = shard.worker
            self.losses += 1
            shard.losses += 1
        self.transition(index, ShardState.LOST, reason, worker)

    def fail(self, index, reason):
        self.transition(index, ShardState.FAILED, reason,
                        self._shards[index].worker)

    # -- queries ----------------------------------------------------------------
    def state(self, index):
        with self._cv:
            return self._shards[index].state

    def description(self, index):
        return self._shards[index].description

    def attempts(self, index):
        with self._cv:
            return self._shards[index].attempts

    def workers_tried(self, index):
        with self._cv:
            return list(self._shards[index].workers_tried)

    def records(self, index):
        with self._cv:
            return self._shards[index].records

    def __len__(self):
        return len(self._shards)

    def count(self, state):
        with self._cv:
            return sum(s.state is state for s in self._shards)

    def todo(self):
        """Shard indices still PENDING, in hand-out order."""
        with self._cv:
            return [i for i in self.order
                    if self._shards[i].state is ShardState.PENDING]

    def complete(self):
        with self._cv:
            return all(s.state is ShardState.DONE for s in self._shards)

    def records_done(self):
        with self._cv:
            return sum(s.trained for s in self._shards
                       if s.state is ShardState.DONE)

    def total_records(self):
        """Records in the epoch, or None while a shard's size is unknown."""
        with self._cv:
            sizes = [s.records for s in self._shards]
        return None if any(r is None for r in sizes) else sum(sizes)

    def lost_shards(self):
        """Shards with an attempt lost this epoch (their worker failed)."""
        with self._cv:
            return [s.index for s in self._shards if s.losses]

    def empty_shards(self):
        with self._cv:
            return [s.index for s in self._shards
                    if s.state is ShardState.DONE and s.trained == 0]

    def changes(self):
        with self._cv:
            return self._changes

    def wait_for_change(self, seen, timeout):
        """Waits until the change counter passes `seen` (or `timeout`)."""
        with self._cv:
            self._cv.wait_for(lambda: self._changes != seen, timeout)
            return self._changes

    def summary(self):
        """The epoch's shard figures, for the epoch logs."""
        with self._cv:
            done = [s for s in self._shards if s.state is ShardState.DONE]
            return {
                "shards_done": len(done),
                "shards": len(self._shards),
                "records_trained": sum(s.trained for s in done),
                "shards_lost": self.losses,
                "records_retrained": self._retrained_before +
                sum(self._retrained),
            }

    # -- backups ------------------------------------------------------------------
    def snapshot(self):
        """A JSON-able record of the epoch: which shards are done (a shard
        still running counts as not done)."""
        with self._cv:
            return {
                "epoch": self.epoch,
                "order": list(self.order),
                "done": [s.index for s in self._shards
                         if s.state is ShardState.DONE],
                "records": [s.records for s in self._shards],
                "records_retrained": self._retrained_before +
                sum(self._retrained),
                "losses": self.losses,
            }

    @classmethod
    def restore(cls, snapshot, descriptions):
        """A ledger from `snapshot`: its done shards stay done (not trained
        again); every other shard is PENDING.

        Raises:
            ValueError: the snapshot has another number of shards.
        """
        records = snapshot.get("records") or [None] * len(descriptions)
        if len(records) != len(descriptions):
            raise ValueError(
                "The backup's shard ledger has a different number of shards "
                f"than the data. Received: {len(records)} shards in the backup, "
                f"{len(descriptions)} in the ShardedInput. Fix: resume with the "
                "same data and shard size, or delete the backup directory.")
        ledger = cls(descriptions, records, snapshot["epoch"],
                     snapshot.get("order"))
        for index in snapshot["done"]:
            shard = ledger._shards[index]
            shard.state = ShardState.DONE
            shard.trained = records[index] or 0
        ledger._retrained_before = snapshot.get("records_retrained", 0)
        ledger.losses = snapshot.get("losses", 0)
        logger.info("[chief] epoch %d shard ledger restored: %d of %d shards "
                    "already done", ledger.epoch, len(snapshot["done"]),
                    len(descriptions))
        return ledger
