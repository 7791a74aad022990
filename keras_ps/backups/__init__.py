"""Backups of large tables that write only the rows that changed.

This package owns `IncrementalBackup` (public as `keras_ps.IncrementalBackup`):
what a backup holds, keyed independently of sharding (`_catalog`), the
directory's manifest of full backups and deltas and its atomic publication
(`_chain`), each ps writing and reading its own rows (`_io`, `_row_files`),
and restore in order into any number of shards; what is checked before
training starts (`_checks`: the environment, the shared directory); the
lock that keeps two jobs out of one backup directory (`_job_lock`). It
reads which rows changed from `keras_ps.tables` and which slots an optimizer
updates row by row from `keras_ps._keras`;
`keras_ps.callbacks.BackupAndRestore` drives it from fit.
"""

from keras_ps.backups.incremental_backup import IncrementalBackup

__all__ = ["IncrementalBackup"]
