"""What of a file the page cache holds, and dropping it from there (the
row-file writer's O_DIRECT and the reader's read-ahead are checked so)."""

import os

import pytest


def cached_pages(path):
    """Pages of the file at `path` in the page cache (mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                             ctypes.c_char_p]
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size,
                                          access=mmap.ACCESS_COPY) as m:
        address = ctypes.addressof(ctypes.c_char.from_buffer(m))
        vector = ctypes.create_string_buffer(pages)
        assert libc.mincore(address, size, vector) == 0, ctypes.get_errno()
        resident = sum(byte & 1 for byte in vector.raw)
    return resident, pages


def filesystem(path):
    """The type of the filesystem holding `path` (/proc/self/mounts)."""
    path, best = os.path.realpath(path), ("", "")
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            _, point, kind = line.split()[:3]
            if (path == point or path.startswith(point.rstrip("/") + "/")) \
                    and len(point) > len(best[0]):
                best = (point, kind)
    return best[1]


def skip_unless_written_direct(path):
    """Skips the test unless `path` is on a filesystem the row-file writer
    writes with O_DIRECT (a local disk's: ext4, XFS, Btrfs)."""
    kind = filesystem(path)
    if kind not in ("ext4", "xfs", "btrfs"):
        pytest.skip(f"{path} is on {kind}, which is written buffered")


def drop_from_cache(path):
    """Asks the kernel to drop the file's pages from the page cache; whether
    it did is for `cached_pages` to say (tmpfs keeps them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
