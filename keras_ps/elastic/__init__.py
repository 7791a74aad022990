"""Elastic membership for keras_ps: the rendezvous server and its client.

See keras_ps/elastic/README.md. Importing this package does not import
TensorFlow: `ElasticClusterResolver` (which subclasses TF's ClusterResolver)
is loaded on first access, through the module `__getattr__` below.
"""

from keras_ps.elastic.agent import AgentConfig
from keras_ps.elastic.agent import ElasticAgent
from keras_ps.elastic.api import MembershipChange
from keras_ps.elastic.api import MembershipView
from keras_ps.elastic.api import NodeState
from keras_ps.elastic.api import RendezvousAuthError
from keras_ps.elastic.client import RendezvousClient
from keras_ps.elastic.api import RendezvousClosedError
from keras_ps.elastic.api import RendezvousConfig
from keras_ps.elastic.api import RendezvousError
from keras_ps.elastic.api import RendezvousInvalidArgumentError
from keras_ps.elastic.api import RendezvousResourceExhaustedError
from keras_ps.elastic.rendezvous_server import RendezvousServer
from keras_ps.elastic.api import RendezvousStateError
from keras_ps.elastic.api import RendezvousTimeoutError
from keras_ps.elastic.api import RendezvousUnknownNodeError
from keras_ps.elastic.agent import TaskStatus
from keras_ps.elastic.api import WaitingNodes

__all__ = [
    "AgentConfig",
    "ElasticAgent",
    "ElasticClusterResolver",
    "MembershipChange",
    "MembershipView",
    "NodeState",
    "RendezvousAuthError",
    "RendezvousClient",
    "RendezvousClosedError",
    "RendezvousConfig",
    "RendezvousError",
    "RendezvousInvalidArgumentError",
    "RendezvousResourceExhaustedError",
    "RendezvousServer",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "RendezvousUnknownNodeError",
    "TaskStatus",
    "WaitingNodes",
]


def __getattr__(name):
    if name == "ElasticClusterResolver":
        from keras_ps.elastic.resolver import ElasticClusterResolver
        return ElasticClusterResolver
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
