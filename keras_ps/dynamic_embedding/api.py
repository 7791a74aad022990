"""What a dynamic table is configured with, and what it raises."""

import dataclasses

from keras_ps.errors import KerasPSError

KEY_DTYPES = ("int64", "string")
DEFAULT_ROWS = ("zeros", "trainable")


class DynamicTableError(KerasPSError, ValueError):
    """A dynamic embedding table was configured or called wrongly."""


class KeyDtypeError(KerasPSError, TypeError):
    """Keys of a dtype the table was not made for."""


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """How a `DynamicEmbedding` table admits and evicts keys.

    Attributes:
        capacity: rows in total, split evenly over the shards (one per ps).
        key_dtype: "int64" or "string".
        min_count: a key gets its own row once it has been seen this many
            times in training (1: at once).
        max_age: a row not seen for this many training steps is evicted at
            the start of the next one (None: never by age).
        evict_lru: when a shard is full, evict its least recently seen rows
            for new keys (False: a full shard raises instead).
        filter_size: counters of the admission filter per shard.
        filter_hashes: counters per key (a count-min sketch).
    """

    capacity: int
    key_dtype: str = "int64"
    min_count: int = 1
    max_age: int = None
    evict_lru: bool = True
    filter_size: int = 1 << 20
    filter_hashes: int = 3

    def __post_init__(self):
        if self.key_dtype not in KEY_DTYPES:
            raise DynamicTableError(
                f"DynamicEmbedding keys are int64 or strings. Received: "
                f"key_dtype={self.key_dtype!r}. Pass key_dtype='int64' (any "
                "integer id, negative included) or key_dtype='string'.")
        for name in ("capacity", "min_count", "filter_size", "filter_hashes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise DynamicTableError(
                    f"DynamicEmbedding's {name} must be a positive integer. "
                    f"Received: {name}={value!r}.")
        if self.max_age is not None and (
                not isinstance(self.max_age, int) or self.max_age < 1):
            raise DynamicTableError(
                "DynamicEmbedding's max_age is a number of training steps "
                f"(>= 1) or None. Received: max_age={self.max_age!r}.")

    def shard_rows(self, num_shards):
        """Rows of each of `num_shards` shards (the first ones one more)."""
        if self.capacity < num_shards:
            raise DynamicTableError(
                "A DynamicEmbedding needs at least one row per parameter "
                f"server. Received: capacity={self.capacity} with "
                f"{num_shards} ps. Pass capacity >= {num_shards} (in "
                "practice, the number of live ids you expect, with room).")
        base, extra = divmod(self.capacity, num_shards)
        return [base + (1 if i < extra else 0) for i in range(num_shards)]
