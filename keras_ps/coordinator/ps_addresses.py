"""Where a lost parameter server answers again.

A restart policy, or a replacement machine given the same address, brings a
ps back on its address. A replacement with another address (a pod
rescheduled and addressed by its IP, a new VM) is found through the
strategy's cluster resolver, asked again while the coordinator waits:
resolvers that ask the platform at each call (TF's KubernetesClusterResolver
and GCEClusterResolver, or one of your own) name the ps' new address.
`keras_ps.elastic.ElasticClusterResolver` is asked for the address the ps
announced to its rendezvous (`ps_address`), never for its `cluster_spec()`,
which waits for workers.
"""

import logging
import time

from keras_ps import cluster as cluster_lib
from keras_ps.cluster import _network

logger = logging.getLogger(__name__)

# Seconds between two rounds of probes, and between two questions to the
# resolver (a platform's resolver calls the platform's API).
_POLL_S = 0.2
_ASK_EVERY_S = 1.0


def resolved_address(resolver, index):
    """The address `resolver` names for ps `index` now; None when it names
    none (an error, fewer ps: logged). A membership watcher is asked its
    `ps_address`, not its `cluster_spec()` (which may wait for workers)."""
    try:
        if isinstance(resolver, cluster_lib.MembershipWatcher):
            return resolver.ps_address(index)
        return cluster_lib.training_cluster(resolver.cluster_spec())["ps"][index]
    except Exception as error:  # a resolver's own failure is not the job's
        logger.info("[chief] the cluster resolver named no address for ps "
                    "%d (%s: %s); waiting on its address", index,
                    type(error).__name__, str(error).splitlines()[0]
                    if str(error) else "")
        return None


def wait_for_ps(resolver, index, address, deadline):
    """The address on which ps `index`, lost at `address`, answers again:
    `address`, or the one `resolver` names for it now, whichever answers
    first; None when neither has by `deadline` (time.monotonic())."""
    named, asked_at = None, None
    while True:
        if asked_at is None or time.monotonic() - asked_at >= _ASK_EVERY_S:
            asked_at = time.monotonic()
            now_at = resolved_address(resolver, index)
            if now_at not in (None, address, named):
                logger.info("[chief] the cluster resolver names %s for ps "
                            "%d (lost at %s)", now_at, index, address)
            named = now_at
        for candidate in dict.fromkeys([named or address, address]):
            left = deadline - time.monotonic()
            if _network.probe(candidate, min(1.0, max(0.05, left))):
                return candidate
        if time.monotonic() >= deadline:
            return None
        time.sleep(_POLL_S)


def follow(strategy, readmission, found):
    """Points the cluster at the addresses the lost ps answer on again
    (`found`: {index: address}), for those that moved. Under the
    coordinator's exclusive gate, before the cluster is pushed again."""
    for index, address in sorted(found.items()):
        was = strategy.cluster_spec["ps"][index]
        if address != was:
            logger.warning(
                "[chief] ps %d answers at %s now, not at %s (where the "
                "cluster resolver names it): the cluster follows it there",
                index, address, was)
            strategy.move_ps(index, address)
            readmission.move_ps(index, address)
