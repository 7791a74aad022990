"""Which files of an incremental backup the ps write past the page cache: by
default none (a restore on the same machine reads them from memory); with
KERAS_PS_DIRECT_IO=deltas on the ps, a delta's (merged ones too), written
every few hundred steps, go straight to the disk, so the kernel's copying
and writing back does not slow the steps, and a full backup's, which a
restore reads most of, stay in the cache."""

import os
import sys

import pytest

from _page_cache import skip_unless_written_direct
from _page_cache_job import backups_cached_pages
from _paths import TESTS
from _results import reports, run_child

pytestmark = pytest.mark.timeout(300)

ALL = ("full", "delta", "merged", "sealing")


def _check(seen, past_the_cache):
    assert all(seen[what] for what in ALL), seen  # each has row files
    for what in ALL:
        if what in past_the_cache:
            # About 1,000 rows of 64 floats and 2 slots: over 100 pages.
            assert sum(pages for _, pages in seen[what]) > 100, seen
            assert all(resident == 0 for resident, _ in seen[what]), \
                (what, seen)
        else:
            assert all(resident >= pages // 2
                       for resident, pages in seen[what]), (what, seen)


@pytest.mark.parametrize("background_deltas", [False, True],
                         ids=["delta", "background_delta"])
def test_by_default_every_backup_file_goes_through_the_page_cache(
        cluster, tmp_path, background_deltas):
    # The shared cluster's ps run with this process' environment.
    if os.environ.get("KERAS_PS_DIRECT_IO") is not None:
        pytest.skip("KERAS_PS_DIRECT_IO is set: the ps do as it says")
    skip_unless_written_direct(tmp_path)
    _check(backups_cached_pages(cluster.resolver, str(tmp_path / "backup"),
                                background_deltas), past_the_cache=())


def test_with_direct_io_deltas_only_a_deltas_files_skip_the_page_cache(
        tmp_path):
    skip_unless_written_direct(tmp_path)
    code, output = run_child(
        [sys.executable, os.path.join(TESTS, "_page_cache_job.py"),
         str(tmp_path)], timeout=240,
        env=dict(os.environ, KERAS_PS_DIRECT_IO="deltas"))
    found = reports(output)
    assert code == 0 and len(found) == 2, (code, output[-12000:])
    for report in found:
        _check(report["seen"], past_the_cache=("delta", "merged", "sealing"))
