"""A ps' announcement of its address to the rendezvous, renewed while it
runs (`python -m keras_ps.server --rdzv_endpoint HOST:PORT`).

The coordinator's `ElasticClusterResolver` reads the announced addresses:
a lost ps that comes back on another address is followed there. The
thread keeps trying while the rendezvous is unreachable (it may start
after the ps, or restart: it keeps nothing), and stops renewing once a
newer ps process announced the same index.
"""

import os
import socket
import threading
import time
import uuid
from typing import Callable, Optional

from keras_ps.elastic import api
from keras_ps.elastic.client import RendezvousClient
from keras_ps.elastic.rendezvous_server import PemSource

# Seconds between two attempts while the rendezvous does not answer, at most.
_RETRY_MAX_S = 5.0


class PsAnnouncer:
    """Announces ps `index` at `address` to the rendezvous at `endpoint`
    from a daemon thread, every third of the lease the server grants, for
    as long as the process runs.

    Args:
        say: Called with each line worth an operator's eye (the first
            announcement, the rendezvous unreachable, a newer ps).

    Raises:
        ValueError: `endpoint` is not HOST:PORT, or `tls_root_cert` is no
            readable certificate.
    """

    def __init__(self, endpoint: str, index: int, address: str,
                 say: Callable[[str], None], token: Optional[str] = None,
                 tls_root_cert: Optional[PemSource] = None):
        self._client = RendezvousClient(endpoint, token=token, timeout=5.0,
                                        tls_root_cert=tls_root_cert)
        self._index, self._address, self._say = index, address, say
        self.incarnation = (f"{socket.gethostname()}:{os.getpid()}:"
                            f"{uuid.uuid4().hex[:12]}")
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="keras_ps-announce-ps")

    def start(self) -> "PsAnnouncer":
        self._thread.start()
        return self

    def _run(self):
        endpoint = self._client.endpoint
        announced, failing, pause = False, False, 0.5
        while True:
            try:
                lease = self._client.announce_ps(self._index, self._address,
                                                 self.incarnation)
            except api.RendezvousStateError as error:
                self._say(f"stops announcing its address: {error}")
                return
            except api.RendezvousError as error:
                if not failing:
                    self._say(f"cannot announce its address to the "
                              f"rendezvous {endpoint} yet ({error}); trying "
                              "again until it answers")
                failing, pause = True, min(pause * 2, _RETRY_MAX_S)
                time.sleep(pause)
                continue
            if not announced or failing:
                self._say(f"announced {self._address} to the rendezvous "
                          f"{endpoint} (renewed every {lease / 3:.3g} s)")
            announced, failing, pause = True, False, 0.5
            time.sleep(lease / 3)
