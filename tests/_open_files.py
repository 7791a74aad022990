"""Seeing a dataset iterator alive on a worker process: a TFRecord reader
keeps its file open while its iterator lives (/proc/<pid>/fd)."""

import os

import tensorflow as tf

RECORDS = 2000  # 2 MB: more than a reader buffers, so the file stays open


def write_records(path):
    with tf.io.TFRecordWriter(path) as writer:
        for i in range(RECORDS):
            writer.write(bytes([i % 256]) * 1000)
    return path


def open_on(pids, path):
    """How many descriptors each process in `pids` holds open on `path`."""
    counts = []
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        count = 0
        for fd in os.listdir(fd_dir):
            try:
                count += os.readlink(os.path.join(fd_dir, fd)) == path
            except OSError:  # closed while listing
                pass
        counts.append(count)
    return counts


@tf.function
def _read(iterator):
    return tf.strings.length(next(iterator))


def reading_iterator(coordinator, path, steps=40):
    """Iterators of a per-worker dataset reading `path`, after rounds of
    `steps` scheduled reads (each must see a 1000-byte record) until every
    worker that takes calls has run at least one of them."""
    from keras_ps.coordinator.worker import RUNNABLE

    dataset = coordinator.create_per_worker_dataset(
        lambda: tf.data.TFRecordDataset(path).repeat().prefetch(2))
    iterator = iter(dataset)
    before = [w.closures_run for w in coordinator.workers]
    for _ in range(20):
        results = [coordinator.schedule(_read, args=(iterator,))
                   for _ in range(steps)]
        coordinator.join()
        lengths = [int(r.fetch()) for r in results]
        assert lengths == [1000] * steps, lengths
        if all(w.closures_run > b
               for w, b in zip(coordinator.workers, before)
               if w.state in RUNNABLE):
            return iterator
    raise AssertionError("a worker ran none of 20 rounds of reads")
