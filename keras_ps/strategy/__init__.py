"""The strategy: which variables go to which parameter server, and steps on
workers.

This package owns `ParameterServerStrategy` (`strategy`; public as
`keras_ps.ParameterServerStrategy`), what lives on each ps and whether it
still does (`_ps_state`: incarnation markers, variables given back to a
restarted ps), and which worker a value or a call belongs to (`_per_worker`:
`PerWorkerValues`, the dispatch context). Importing it installs keras_ps'
Keras hooks (`keras_ps._keras`) that place weights on the ps; the coordinator
that runs steps on the workers is `keras_ps.coordinator`, one layer up.
"""

from keras_ps.strategy.strategy import ParameterServerStrategy

__all__ = ["ParameterServerStrategy"]
