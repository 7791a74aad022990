"""The coordinator's settings, validated once, from arguments or the environment."""

import dataclasses
from typing import Optional

from keras_ps import _constants


@dataclasses.dataclass(frozen=True)
class CoordinatorConfig:
    """How the coordinator packs calls and handles worker failures.

    Every field has an environment variable and a default in
    keras_ps/_constants.py; `from_env` reads them, an explicit argument wins.

    Attributes:
        max_pack: most closures of one function per remote call (1: no packing).
        probe_timeout: seconds a connectivity probe of a task may take.
        recovery_interval: seconds between probes of a failed or joining worker.
        rebuild_retry_delay: seconds before retrying a failed re-admission.
        readmit_workers: whether a failed worker that answers again is re-admitted.
        no_worker_timeout: seconds `join` tolerates no healthy worker (0: forever).
        cut_off_timeout: seconds every worker may stay cut off from a ps the
            coordinator reaches before the job fails (0: forever).
        hang_timeout: seconds a call may run before its worker is probed and,
            if it does not answer, set aside as hung (0: no hang watchdog,
            and no call given up as stuck either).
        stuck_timeout: seconds a call may run on a worker that answers before
            it is given up as stuck; None ("auto") compares it with finished
            calls of its function (see keras_ps/_constants.py); 0: never.
            Seconds must be at least `hang_timeout` (and it positive).
        ps_recovery_timeout: seconds a recovery waits for a lost ps to answer.
    """

    max_pack: int = _constants.DEFAULT_MAX_PACK
    probe_timeout: float = _constants.DEFAULT_PROBE_TIMEOUT
    recovery_interval: float = _constants.DEFAULT_RECOVERY_INTERVAL
    rebuild_retry_delay: float = _constants.REBUILD_RETRY_DELAY
    readmit_workers: bool = bool(_constants.DEFAULT_READMIT_WORKERS)
    no_worker_timeout: float = _constants.DEFAULT_NO_WORKER_TIMEOUT
    cut_off_timeout: float = _constants.DEFAULT_CUT_OFF_TIMEOUT
    hang_timeout: float = _constants.DEFAULT_HANG_TIMEOUT
    stuck_timeout: Optional[float] = None
    ps_recovery_timeout: float = _constants.DEFAULT_PS_RECOVERY_TIMEOUT
    # Where max_pack came from, for error messages.
    max_pack_source: str = dataclasses.field(default="max_pack", compare=False)

    def __post_init__(self):
        if isinstance(self.max_pack, bool) or not isinstance(self.max_pack, int) \
                or self.max_pack < 1:
            raise ValueError(
                f"max_pack must be an integer of at least 1. Received: "
                f"{self.max_pack_source}={self.max_pack!r}. Use 1 to turn "
                "packing off, or leave it unset for the default "
                f"{_constants.DEFAULT_MAX_PACK}.")
        if not self.recovery_interval > 0:
            raise ValueError(
                "recovery_interval must be a positive number of seconds. "
                f"Received: recovery_interval={self.recovery_interval!r}.")
        if not self.probe_timeout >= _constants.MIN_PROBE_TIMEOUT:
            raise ValueError(
                f"probe_timeout must be at least "
                f"{_constants.MIN_PROBE_TIMEOUT} s: a shorter probe fails "
                "against a healthy worker, which is then set aside as hung "
                f"and never re-admitted. Received: probe_timeout="
                f"{self.probe_timeout!r}. Leave it unset for the default "
                f"{_constants.DEFAULT_PROBE_TIMEOUT:g} s.")
        for name in ("rebuild_retry_delay", "no_worker_timeout", "hang_timeout",
                     "ps_recovery_timeout", "cut_off_timeout"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(
                    f"{name} must be 0 or a positive number of seconds. "
                    f"Received: {name}={value!r}.")
        if self.stuck_timeout is not None and not self.stuck_timeout >= 0:
            raise ValueError(
                "stuck_timeout must be None (auto), 0 (never) or a positive "
                f"number of seconds. Received: stuck_timeout="
                f"{self.stuck_timeout!r}.")
        if self.stuck_timeout and not (
                self.hang_timeout and self.stuck_timeout >= self.hang_timeout):
            # The watchdog looks only at calls older than the hang timeout,
            # and not at all when it is 0.
            stuck, hang = (_constants.STUCK_TIMEOUT_ENV_VAR,
                           _constants.HANG_TIMEOUT_ENV_VAR)
            raise ValueError(
                f"stuck_timeout={self.stuck_timeout!r} cannot act with "
                f"hang_timeout={self.hang_timeout!r}: " + (
                    "the watchdog that gives calls up is off. Fix: set "
                    f"hang_timeout ({hang}) to a positive number of seconds "
                    f"(default {_constants.DEFAULT_HANG_TIMEOUT:g}), or unset "
                    f"{stuck}." if not self.hang_timeout else
                    "the watchdog looks at a call only once it has run the "
                    f"hang timeout. Fix: set stuck_timeout ({stuck}) to at "
                    f"least hang_timeout ({hang}), or lower that, or unset "
                    f"{stuck}."))

    @classmethod
    def from_env(cls, max_pack=None):
        """The settings from the environment; `max_pack` overrides its variable."""
        source = "max_pack"
        if max_pack is None:
            source = _constants.MAX_PACK_ENV_VAR
            max_pack = _constants.env_int(
                _constants.MAX_PACK_ENV_VAR, _constants.DEFAULT_MAX_PACK)
        return cls(
            max_pack=max_pack,
            max_pack_source=source,
            probe_timeout=_constants.env_float(
                _constants.PROBE_TIMEOUT_ENV_VAR,
                _constants.DEFAULT_PROBE_TIMEOUT,
                minimum=_constants.MIN_PROBE_TIMEOUT),
            recovery_interval=_constants.env_float(
                _constants.RECOVERY_INTERVAL_ENV_VAR,
                _constants.DEFAULT_RECOVERY_INTERVAL, above=0),
            readmit_workers=_constants.env_switch(
                _constants.READMIT_WORKERS_ENV_VAR,
                _constants.DEFAULT_READMIT_WORKERS),
            no_worker_timeout=_constants.env_float(
                _constants.NO_WORKER_TIMEOUT_ENV_VAR,
                _constants.DEFAULT_NO_WORKER_TIMEOUT, minimum=0),
            cut_off_timeout=_constants.env_float(
                _constants.CUT_OFF_TIMEOUT_ENV_VAR,
                _constants.DEFAULT_CUT_OFF_TIMEOUT, minimum=0),
            hang_timeout=_constants.env_float(
                _constants.HANG_TIMEOUT_ENV_VAR,
                _constants.DEFAULT_HANG_TIMEOUT, minimum=0),
            stuck_timeout=_constants.env_seconds_or_auto(
                _constants.STUCK_TIMEOUT_ENV_VAR),
            ps_recovery_timeout=_constants.env_float(
                _constants.PS_RECOVERY_TIMEOUT_ENV_VAR,
                _constants.DEFAULT_PS_RECOVERY_TIMEOUT, minimum=0),
        )
