"""Where each ps serves, as the ps themselves announce it.

A ps started with `python -m keras_ps.server --rdzv_endpoint HOST:PORT`
announces its address to the rendezvous and renews it while it runs. The
coordinator's `ElasticClusterResolver` reads the addresses, so a ps replaced
on another address (a pod rescheduled under a new IP, a new VM) is found
there. An announcement lapses when it is not renewed within the lease (the
server's `keepalive_timeout`): a ps gone for good is not named for ever. A
newer ps process announcing the same index replaces the older one, whose
renewals are refused from then on, so an old ps cut off by the network and
still renewing cannot take its index back.
"""

import collections
import threading
import time
from typing import Callable, Dict, List, Tuple

from keras_ps.elastic import api

#: Highest ps index (exclusive) the rendezvous records.
MAX_PS = 1024
#: Replaced incarnations remembered per index (their renewals are refused).
_REPLACED_KEPT = 16


class PsRegistry:
    """{ps index: (address, incarnation, lapses at)}, under one lock.

    Args:
        lease: Seconds an announcement holds without a renewal.
        clock: Monotonic time source in seconds.
    """

    def __init__(self, lease: float,
                 clock: Callable[[], float] = time.monotonic):
        self.lease = lease
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: Dict[int, Tuple[str, str, float]] = {}
        self._replaced: Dict[int, collections.deque] = {}

    def announce(self, index: int, address: str, incarnation: str) -> float:
        """Records that ps `index` serves at `address`; returns the lease.

        Raises:
            RendezvousStateError: A newer process announced this index since
                `incarnation` did.
        """
        with self._lock:
            replaced = self._replaced.setdefault(
                index, collections.deque(maxlen=_REPLACED_KEPT))
            if incarnation in replaced:
                now_at = self._entries.get(index, ("", "", 0.0))[0]
                raise api.RendezvousStateError(
                    f"ps {index} at {address} was replaced by a newer ps "
                    f"process announcing index {index}"
                    + (f" (at {now_at})" if now_at else "")
                    + "; its address is no longer announced. Stop this "
                    "process: the job uses the newer one")
            current = self._entries.get(index)
            if current is not None and current[1] != incarnation:
                replaced.append(current[1])
            self._entries[index] = (address, incarnation,
                                    self._clock() + self.lease)
            return self.lease

    def addresses(self) -> List[str]:
        """Addresses by index; "" where none is announced or it lapsed."""
        now = self._clock()
        with self._lock:
            live = {i: entry[0] for i, entry in self._entries.items()
                    if entry[2] > now}
        size = max(live, default=-1) + 1
        return [live.get(i, "") for i in range(size)]
