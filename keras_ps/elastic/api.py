"""Interface of the keras_ps rendezvous: configuration, errors and specs.

The rendezvous (orchestrator) server lets elastic training nodes find each
other: nodes register with `GetClusterSpec`, keep their lease with
`GetWaitingNodes`, and meet at barriers. This module holds what both sides of
the wire share and what users handle: `RendezvousConfig`, the frozen result
types, the state enums and the error hierarchy rooted in `RendezvousError`.

It imports neither gRPC nor TensorFlow, so the server starts fast.
"""

import dataclasses
import enum
import math
import os
from typing import ClassVar, Mapping, Optional, Tuple

from keras_ps._base_errors import KerasPSError

#: gRPC metadata key that carries the shared secret.
TOKEN_METADATA_KEY = "x-keras-ps-token"
#: Trailing metadata key listing the nodes a failed meeting waited for.
MISSING_METADATA_KEY = "x-keras-ps-missing"
#: Trailing metadata key with the number of missing nodes (the list above may
#: be cut short to fit the metadata size limit).
MISSING_COUNT_METADATA_KEY = "x-keras-ps-missing-count"
#: Largest blob one node may bring to `Synchronize`.
MAX_DATA_BYTES = 1 << 20
#: Longest barrier/synchronize tag.
MAX_TAG_LENGTH = 1024
#: Longest HOST:PORT address.
MAX_ADDRESS_LENGTH = 1024

ENV_PREFIX = "KERAS_PS_RDZV_"


# --------------------------------------------------------------------------
# Errors. Each maps to one gRPC status code (by name, so this module does not
# need grpc); the server sends that code and the client maps it back.
# --------------------------------------------------------------------------


class RendezvousError(KerasPSError):
    """Base class of every error the rendezvous raises on purpose."""

    #: Name of the `grpc.StatusCode` this error travels as.
    status_code: ClassVar[str] = "UNKNOWN"

    def __init__(self, message: str = ""):
        super().__init__(message)
        self.message = message

    def __str__(self):
        return self.message

    def __reduce__(self):
        return (type(self), (self.message,))


class RendezvousTimeoutError(RendezvousError, TimeoutError):
    """A rendezvous, barrier or synchronize did not complete in time.

    Attributes:
        missing: Addresses of the nodes that did not arrive (may be cut short
            for very large clusters; see `missing_count`).
        missing_count: How many nodes did not arrive.
    """

    status_code = "DEADLINE_EXCEEDED"

    def __init__(self, message: str = "", missing=(), missing_count=None):
        super().__init__(message)
        self.missing = tuple(missing)
        self.missing_count = (len(self.missing) if missing_count is None
                              else int(missing_count))

    def __reduce__(self):
        return (type(self), (self.message, self.missing, self.missing_count))


class RendezvousAuthError(RendezvousError):
    """The server requires a token and the call had none or a wrong one."""

    status_code = "UNAUTHENTICATED"


class RendezvousClosedError(RendezvousError):
    """The server is unreachable, shutting down, or the client was closed."""

    status_code = "UNAVAILABLE"


class RendezvousInvalidArgumentError(RendezvousError, ValueError):
    """A request field is malformed; the message names field and value."""

    status_code = "INVALID_ARGUMENT"


class RendezvousResourceExhaustedError(RendezvousError):
    """Too many nodes are already waiting; the join was refused."""

    status_code = "RESOURCE_EXHAUSTED"


class RendezvousUnknownNodeError(RendezvousError):
    """The server does not know this address (it left, its lease lapsed, or
    the server restarted). Call `get_cluster_spec` again to re-register."""

    status_code = "NOT_FOUND"


class RendezvousStateError(RendezvousError):
    """The call does not fit the node's state (e.g. a barrier from a node that
    is not admitted, or min/max nodes differing from the job's)."""

    status_code = "FAILED_PRECONDITION"


ERRORS_BY_STATUS_CODE: Mapping[str, type] = {
    cls.status_code: cls
    for cls in (RendezvousTimeoutError, RendezvousAuthError,
                RendezvousClosedError, RendezvousInvalidArgumentError,
                RendezvousResourceExhaustedError, RendezvousUnknownNodeError,
                RendezvousStateError)
}


# --------------------------------------------------------------------------
# State enums and result types.
# --------------------------------------------------------------------------


class NodeState(enum.Enum):
    """Where a registered node stands."""

    #: Registered; not in the cluster spec (fewer than min_nodes joined yet,
    #: the gather window is open, or max_nodes places are taken).
    WAITING = "waiting"
    #: Holds a place (an index) in the cluster spec.
    ADMITTED = "admitted"


class RendezvousPhase(enum.Enum):
    """Life cycle of the rendezvous as a whole."""

    #: Fewer than min_nodes registered.
    AWAITING_MIN = "awaiting_min"
    #: min_nodes registered; more may join until the gather window closes.
    GATHERING = "gathering"
    #: The cluster spec is published; joins fill free places at once.
    ESTABLISHED = "established"
    #: The server is shutting down.
    CLOSED = "closed"


class MeetingState(enum.Enum):
    """Life cycle of one generation of a barrier/synchronize tag."""

    OPEN = "open"
    COMPLETE = "complete"
    FAILED = "failed"


class MeetingKind(enum.Enum):
    """Barriers and synchronizes use separate tag namespaces."""

    BARRIER = "barrier"
    SYNCHRONIZE = "synchronize"


class RemovalReason(enum.Enum):
    """Why a node left the membership."""

    LEFT = "left"
    EXPIRED = "expired"


@dataclasses.dataclass(frozen=True)
class MembershipView:
    """The admitted workers as one node sees them.

    Attributes:
        workers: Worker addresses by index. A node keeps its index while it
            stays; the place of a node that left holds None until a waiting
            node takes it (trailing free places are dropped).
        index: This node's index in `workers`.
        version: Membership version; grows with every membership change.
        ps: Where each ps announced it serves, by index (None: no ps
            announced it, or its announcement lapsed); filled by
            `RendezvousClient.list_members` only. A ps announcing itself
            does not change `version`.
    """

    workers: Tuple[Optional[str], ...]
    index: int
    version: int
    ps: Tuple[Optional[str], ...] = ()

    @property
    def addresses(self) -> Tuple[str, ...]:
        """The admitted addresses in index order, without free places."""
        return tuple(a for a in self.workers if a is not None)

    @property
    def size(self) -> int:
        """Number of admitted nodes."""
        return len(self.addresses)

    def as_dict(self) -> dict:
        """{index: address} for the admitted nodes (TF's sparse job form)."""
        return {i: a for i, a in enumerate(self.workers) if a is not None}


@dataclasses.dataclass(frozen=True)
class WaitingNodes:
    """Answer to a keep-alive.

    Attributes:
        count: Net membership change since the node's previous keep-alive (or
            its admission): joined - lost.
        joined: Nodes admitted since then.
        lost: Nodes that left or whose lease lapsed since then.
        version: Current membership version.
        state: The calling node's state.
    """

    count: int
    joined: int
    lost: int
    version: int
    state: NodeState


@dataclasses.dataclass(frozen=True)
class MembershipChange:
    """One applied change of the admitted set (one version step)."""

    version: int
    admitted: Tuple[str, ...] = ()
    removed: Tuple[str, ...] = ()
    reason: Optional[RemovalReason] = None


# --------------------------------------------------------------------------
# Configuration.
# --------------------------------------------------------------------------


def _parse_float(text):
    return float(text)


def _parse_int(text):
    return int(text)


def _parse_token(text):
    return text or None


@dataclasses.dataclass(frozen=True)
class RendezvousConfig:
    """Server-side knobs. Each is also read by `from_env` from
    ``KERAS_PS_RDZV_<FIELD NAME IN UPPER CASE>``.

    Attributes:
        gather_timeout: Seconds after min_nodes joined during which more
            nodes (up to max_nodes) may still join the first cluster spec.
        keepalive_timeout: Lease: a node that neither calls nor waits in a
            call for this many seconds is removed.
        barrier_timeout: Default barrier/synchronize timeout in seconds.
        max_pending_nodes: How many nodes may wait beyond max_nodes; further
            joins are refused with RESOURCE_EXHAUSTED.
        max_workers: Server threads. A quarter (at least 2) is kept free of
            blocking waits so keep-alives are always served.
        max_concurrent_rpcs: gRPC's cap on RPCs in progress at once.
        long_poll_timeout: Longest time one blocking call is held on the
            server before it answers "still waiting" and the client calls
            again.
        token: Shared secret clients must send in the `x-keras-ps-token`
            metadata; None disables the check.
    """

    gather_timeout: float = 5.0
    keepalive_timeout: float = 10.0
    barrier_timeout: float = 60.0
    max_pending_nodes: int = 1024
    max_workers: int = 64
    max_concurrent_rpcs: int = 4096
    long_poll_timeout: float = 5.0
    token: Optional[str] = dataclasses.field(default=None, repr=False)

    _PARSERS: ClassVar[dict] = {
        "gather_timeout": _parse_float,
        "keepalive_timeout": _parse_float,
        "barrier_timeout": _parse_float,
        "max_pending_nodes": _parse_int,
        "max_workers": _parse_int,
        "max_concurrent_rpcs": _parse_int,
        "long_poll_timeout": _parse_float,
        "token": _parse_token,
    }

    def __post_init__(self):
        self._check_seconds("gather_timeout", allow_zero=True)
        self._check_seconds("keepalive_timeout")
        self._check_seconds("barrier_timeout")
        self._check_seconds("long_poll_timeout")
        self._check_int("max_pending_nodes", minimum=0)
        self._check_int("max_workers", minimum=4)
        self._check_int("max_concurrent_rpcs", minimum=1)
        if self.max_concurrent_rpcs < self.max_workers:
            raise ValueError(
                "RendezvousConfig.max_concurrent_rpcs must be at least "
                f"max_workers, got max_concurrent_rpcs="
                f"{self.max_concurrent_rpcs!r} with max_workers="
                f"{self.max_workers!r}. Lower max_workers (--max_workers, "
                f"{self.env_var('max_workers')}) or raise max_concurrent_rpcs "
                f"({self.env_var('max_concurrent_rpcs')})")
        token = self.token
        if token is not None:
            if (not isinstance(token, str) or not token
                    or not all(0x21 <= ord(c) <= 0x7e for c in token)):
                raise ValueError(
                    "RendezvousConfig.token must be None or a non-empty "
                    "string of printable ASCII without spaces")

    def _check_seconds(self, name, allow_zero=False):
        value = getattr(self, name)
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value)
              and (value >= 0 if allow_zero else value > 0))
        if not ok:
            bound = ">= 0" if allow_zero else "> 0"
            raise ValueError(
                f"RendezvousConfig.{name} must be a finite number of seconds "
                f"{bound}, got {value!r}")

    def _check_int(self, name, minimum):
        value = getattr(self, name)
        if (not isinstance(value, int) or isinstance(value, bool)
                or value < minimum):
            raise ValueError(
                f"RendezvousConfig.{name} must be an integer >= {minimum}, "
                f"got {value!r}")

    @property
    def blocking_slots(self) -> int:
        """Threads that may be held by blocking calls at once."""
        return self.max_workers - max(2, self.max_workers // 4)

    @classmethod
    def env_var(cls, name: str) -> str:
        """The environment variable that sets field `name`."""
        return ENV_PREFIX + name.upper()

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None,
                 **overrides) -> "RendezvousConfig":
        """Builds a config from ``KERAS_PS_RDZV_*`` variables.

        Args:
            environ: Mapping to read; defaults to `os.environ`.
            **overrides: Field values that win over the environment; None
                values are ignored.

        Returns:
            The validated config.

        Raises:
            ValueError: A variable does not parse or a value is out of range;
                the message names the variable (or field) and the value.
        """
        environ = os.environ if environ is None else environ
        values = {}
        for name, parse in cls._PARSERS.items():
            var = cls.env_var(name)
            if var not in environ:
                continue
            text = environ[var]
            try:
                values[name] = parse(text.strip() if name != "token" else text)
            except ValueError:
                kind = ("a number of seconds" if name.endswith("timeout")
                        else "an integer")
                raise ValueError(
                    f"environment variable {var}={text!r} is not a valid "
                    f"{name} ({kind}). Unset it for the default") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**values)
        except ValueError as error:
            # The variables of the fields the error names (an override of
            # None leaves its variable's value in force).
            message = str(error)
            sources = [cls.env_var(k) for k in values
                       if overrides.get(k) is None
                       and cls.env_var(k) in environ
                       and (f"RendezvousConfig.{k} " in message
                            or f" {k}=" in message)]
            if sources:
                raise ValueError(
                    f"{error} (set from {', '.join(sources)})") from None
            raise


def parse_address(address: str, field: str = "address",
                  allow_port_zero: bool = False) -> Tuple[str, int]:
    """Splits and checks a HOST:PORT address (IPv6 hosts in brackets).

    Args:
        address: The text to check.
        field: Name used in the error message.
        allow_port_zero: Accept port 0 (pick a free port when binding).

    Returns:
        (host, port); an IPv6 host keeps its brackets.

    Raises:
        ValueError: Naming `field` and the value.
    """
    def bad(why):
        return ValueError(f"{field} {address!r} is not HOST:PORT ({why})")

    if not isinstance(address, str) or not address:
        raise ValueError(f"{field} must be a non-empty HOST:PORT, "
                         f"got {address!r}")
    if len(address) > MAX_ADDRESS_LENGTH:
        raise bad(f"longer than {MAX_ADDRESS_LENGTH} characters")
    if any(c.isspace() or not c.isprintable() or c == ","
           for c in address) or not address.isascii():
        raise bad("contains spaces, commas or non-ASCII characters")
    host, sep, port_text = address.rpartition(":")
    if not sep or not host:
        raise bad("missing host or port")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise bad("unbalanced brackets around the IPv6 host")
    elif ":" in host or "[" in host or "]" in host:
        raise bad("IPv6 hosts need brackets, e.g. [::1]:1234")
    if not port_text.isdigit():
        raise bad("port is not a number")
    port = int(port_text)
    low = 0 if allow_port_zero else 1
    if not low <= port <= 65535:
        raise bad(f"port must be in {low}..65535")
    return host, port
