"""What an incremental backup holds: every variable, by a key that does not
depend on how it is sharded, grouped by the rows that change together.

Variables are the model's weights and the optimizer's variables, in the
order Keras saves them, each sharded weight (or slot of one) counted once,
whole (keras_ps.tables._sharded_weights.collapse): key `"model/3"` is the 4th
weight of the model however many shards hold it, so a backup restores into
any partitioning. Each `tf.Variable` that holds rows of one is a `Part`.

A layer that saves its own state (a DynamicEmbedding) comes after, shard
by shard, as its ps holds it: each shard's rows and their optimizer slots
(a table, like any other), then the rest of the shard's state, the
variables its `backup_variables()` names (per-slot keys, counters); after
a restore each shard rebuilds its key map from them (`restore_key_maps`).
Such a backup restores into as many shards only (`check_matches`).

Parts are written in `Group`s, each written by the device holding it:

- `"table"`: a weight shard whose optimizer updates it row by row, with its
  slots (keras_ps._keras.row_tracking), of at least `min_table_bytes`: a
  delta writes only the rows marked dirty, in row files;
- `"rows"`: any other part larger than BUNDLE_MAX_BYTES (e.g. a table under
  dense Adam), alone, written whole in row files by every backup;
- `"bundle"`: the smaller ones of a device (dense layers, optimizer
  scalars), and the owned state below whatever its size (a row file would
  add an 8-byte id to each of its 4- or 8-byte entries), written whole into
  one file by every backup.
"""

import dataclasses

import keras
import tensorflow as tf

from keras_ps.tables import _sharded_weights
from keras_ps._keras import row_tracking
from keras_ps.tables.sharded_variable import ShardedVariable

# Parts up to this size that are not tables go into their device's bundle.
BUNDLE_MAX_BYTES = 2**20
# A bundle is closed once it holds this much.
BUNDLE_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True, eq=False)
class Part:
    """Rows `[offset, offset + rows)` of the logical variable `key`."""

    key: str
    variable: tf.Variable
    offset: int

    @property
    def rows(self):
        return int(self.variable.shape[0]) if self.variable.shape.rank else 1

    @property
    def nbytes(self):
        return self.variable.shape.num_elements() * self.variable.dtype.size


@dataclasses.dataclass(eq=False)
class Group:
    """Parts on one device with the same rows, written to the same files."""

    name: str
    parts: list
    kind: str  # "table", "rows" or "bundle"
    strategy: object = None  # a table's: the strategy that placed it

    @property
    def table(self):
        return self.kind == "table"

    @property
    def device(self):
        return self.parts[0].variable.device

    @property
    def keys(self):
        return [p.key for p in self.parts]

    @property
    def variables(self):
        return [p.variable for p in self.parts]

    @property
    def nbytes(self):
        return sum(p.nbytes for p in self.parts)


def normalize(objects):
    """`objects` as {name: Keras layer or optimizer}.

    Raises:
        TypeError: `objects` is not a Keras model or such a dict.
    """
    if isinstance(objects, keras.Model):
        named = {"model": objects}
        if getattr(objects, "optimizer", None) is not None:
            named["optimizer"] = objects.optimizer
        return named
    if isinstance(objects, dict) and objects and all(
            isinstance(k, str) and "/" not in k
            and isinstance(v, (keras.layers.Layer, keras.optimizers.Optimizer))
            for k, v in objects.items()):
        return dict(objects)
    raise TypeError(
        "An incremental backup needs a Keras model (its optimizer is included) "
        "or a dict of names (without '/') to Keras models, layers and "
        f"optimizers. Received: {objects!r:.200}. Pass e.g. model, or "
        "{'model': model, 'optimizer': optimizer}.")


def _listed_variables(obj):
    """[(element, path, whether it is owned state)] of `obj`, each sharded
    weight once, whole; then the variables a layer saves itself (a
    DynamicEmbedding's rows and their optimizer slots, each shard apart),
    each shard's state after its rows (`_owned_state`)."""
    if isinstance(obj, keras.optimizers.Optimizer):
        if not obj.built:
            raise ValueError(
                f"The optimizer {obj.name!r} is not built yet, so its slots do "
                "not exist to be backed up or restored. Fix: save or restore "
                "after the first training step, or build the optimizer first: "
                "optimizer.build(model.trainable_variables).")
        listed = obj.variables
    else:
        listed = obj.weights
    out = [(element, _path(element), False)
           for element in _sharded_weights.collapse(listed)]
    states = set()
    for variable in listed:
        if getattr(variable, _sharded_weights.SAVED_BY_OWNER_ATTR, False):
            out.append((variable, _path(variable), False))
            state = _owned_state(variable)
            if not isinstance(obj, keras.optimizers.Optimizer) \
                    and id(state) not in states:
                states.add(id(state))
                owner = _path(variable).rsplit("/", 1)[0]
                out.extend((v, f"{owner}/{name}", True) for name, v
                           in sorted(state.backup_variables().items()))
    return out


def _path(element):
    return getattr(element, "path", None) or element.name


def _owned_state(variable):
    """The state beside `variable`, which a layer saves itself (a
    DynamicEmbedding shard's key map and counters, see
    keras_ps.tables._sharded_weights.OWNED_STATE_ATTR).

    Raises:
        ValueError: its layer gives incremental backups no such state.
    """
    state = getattr(variable, _sharded_weights.OWNED_STATE_ATTR, None)
    if state is None:
        raise ValueError(
            f"Weight {_path(variable)!r} belongs to a layer that saves its own "
            "state, and that layer does not say how to back it up "
            "incrementally. Fix: full backups, "
            "BackupAndRestore(..., incremental=False).")
    return state


def _tf_variables(element):
    """[(tf.Variable, first row)] holding `element`."""
    if isinstance(element, ShardedVariable):
        out, offset = [], 0
        for variable in element.variables:
            out.append((variable, offset))
            offset += int(variable.shape[0])
        return out
    return [(row_tracking.tf_variable(element), 0)]


class Catalog:
    """The variables of `objects` and how they are written.

    Args:
        objects: {name: Keras layer/model or optimizer} (see `normalize`).
        min_table_bytes: smaller tables (with their slots) are not tracked.

    Attributes:
        variables: {key: (path, shape, dtype name)} of every logical variable.
        parts: {key: [Part]} in row order.
        groups: every Group.
        owned: [(owner path, state, device)] of each shard of a layer that
            saves its own state (a DynamicEmbedding's SlotShard), in order.
        state_keys: keys of those shards' `backup_variables()`.
    """

    def __init__(self, objects, min_table_bytes=0):
        objects = normalize(objects)
        self.variables, self.parts = {}, {}
        self.owned, self.state_keys = [], set()
        by_id = {}
        for name, obj in objects.items():
            for index, (element, path, state) in enumerate(
                    _listed_variables(obj)):
                pieces = _tf_variables(element)
                if any(id(v) in by_id for v, _ in pieces):
                    continue  # listed by an earlier object (a shared layer)
                key = f"{name}/{index}"
                owned = getattr(element, _sharded_weights.OWNED_STATE_ATTR,
                                None)
                if state:
                    self.state_keys.add(key)
                elif (owned is not None and isinstance(obj, keras.layers.Layer)
                        and all(o is not owned for _, o, _ in self.owned)):
                    self.owned.append((path.rsplit("/", 1)[0], owned,
                                       pieces[0][0].device))
                shape = tuple(int(d) for d in element.shape)
                self.variables[key] = (path, shape,
                                       tf.as_dtype(element.dtype).name)
                self.parts[key] = [Part(key, v, first) for v, first in pieces]
                for part in self.parts[key]:
                    by_id[id(part.variable)] = part
        self.groups = [g for g in self._table_groups(objects, by_id)
                       if g.nbytes >= min_table_bytes]
        grouped = {id(p) for g in self.groups for p in g.parts}
        bundles = {}  # device -> the open bundle
        for key, parts in self.parts.items():
            for i, part in enumerate(parts):
                if id(part) in grouped:
                    continue
                if (part.nbytes > BUNDLE_MAX_BYTES
                        and key not in self.state_keys):
                    self.groups.append(Group(_file_name(key, i), [part], "rows"))
                    continue
                device = part.variable.device
                bundle = bundles.get(device)
                if bundle is None or bundle.nbytes >= BUNDLE_BYTES:
                    bundle = bundles[device] = Group(
                        f"bundle-{len(self.groups)}", [], "bundle")
                    self.groups.append(bundle)
                bundle.parts.append(part)

    def _table_groups(self, objects, by_id):
        optimizers = [o for o in objects.values()
                      if isinstance(o, keras.optimizers.Optimizer)]
        layers = [o for o in objects.values()
                  if isinstance(o, keras.layers.Layer)]
        groups, claimed = [], set()
        for optimizer in optimizers:
            for layer in layers:
                for weight in layer.trainable_weights:
                    slots = row_tracking.row_slots(optimizer, weight)
                    if slots is None:
                        continue
                    table = by_id.get(id(row_tracking.tf_variable(weight)))
                    members = [table] + [by_id.get(id(s)) for s in slots]
                    if (any(m is None or id(m) in claimed for m in members)
                            or any(m.rows != table.rows
                                   or m.variable.device != table.variable.device
                                   for m in members)):
                        continue
                    claimed.update(id(m) for m in members)
                    index = self.parts[table.key].index(table)
                    groups.append(Group(
                        _file_name(table.key, index), members, "table",
                        row_tracking.strategy_of(optimizer)))
        return groups

    def describe(self):
        """What a full backup's manifest entry records of the catalog: every
        variable's path, shape and dtype, and the shards of each layer that
        saves its own state."""
        described = {"variables": {k: [p, list(s), d] for k, (p, s, d)
                                   in self.variables.items()}}
        if self.owned:
            described["owned"] = self.owned_layout()
        return described

    def owned_layout(self):
        """{owner path: its shards} of the layers that save their own
        state (recorded with a full backup)."""
        layout = {}
        for owner, _, _ in self.owned:
            layout[owner] = layout.get(owner, 0) + 1
        return layout

    def restore_key_maps(self, devices=None):
        """After a restore: each owned shard (on `devices`, None: all)
        rebuilds its key map from its restored variables."""
        for _, state, device in self.owned:
            if devices is None or device in devices:
                state.restore_key_map()

    def _check_layout(self, saved, where):
        """Raises ValueError unless the layers that save their own state have
        as many shards as when the backup was written (`saved`: {owner:
        shards}): their rows and key maps are restored shard by shard."""
        mine = self.owned_layout()
        differ = sorted(o for o in set(mine) & set(saved)
                        if mine[o] != saved[o])
        if not differ:
            return  # the same, or another model (said next)
        details = ", ".join(f"{o!r} has {saved[o]} shards in the backup and "
                            f"{mine[o]} here" for o in differ)
        raise ValueError(
            f"The incremental backup in {where!r} holds a DynamicEmbedding "
            "shard by shard (its rows, key map and counters per ps), so it "
            f"restores only into as many ps as wrote it. Received: {details}. "
            "Fix: restore it with that number of ps (then write a "
            "tf.train.Checkpoint or model.save_weights, which load into any "
            "number), or train with BackupAndRestore(..., incremental=False), "
            "whose backups restore into any number of ps.")

    @property
    def tables(self):
        """The table groups (rows tracked)."""
        return [g for g in self.groups if g.table]

    def check_matches(self, full, where):
        """Raises ValueError unless `full` (a full backup's manifest entry)
        holds exactly this catalog's variables, with a layer that saves its
        own state in as many shards."""
        self._check_layout(full.get("owned", {}), where)
        saved = full["variables"]
        mine = {k: [p, list(s), d] for k, (p, s, d) in self.variables.items()}
        if mine == saved:
            return
        missing = sorted(set(mine) - set(saved))
        extra = sorted(set(saved) - set(mine))
        differ = sorted(k for k in set(mine) & set(saved)
                        if mine[k][1:] != saved[k][1:])
        details = []
        for label, keys, source in (("not in the backup", missing, mine),
                                    ("only in the backup", extra, saved)):
            if keys:
                details.append(f"{label}: "
                               f"{[source[k][0] for k in keys[:5]]}")
        for key in differ[:5]:
            here, there = mine[key], saved[key]
            details.append(
                f"{here[0]!r} is {tuple(here[1])} {here[2]} here and "
                f"{tuple(there[1])} {there[2]} in the backup")
        if not details:
            return  # only paths differ (layer names): the values still fit
        raise ValueError(
            f"The backup in {where!r} was written by a different model: "
            f"{'; '.join(details)}. Fix: give a changed model its own backup "
            "directory, or delete the directory to train from scratch.")


def _file_name(key, shard):
    return f"{key.replace('/', '.')}.s{shard}"
