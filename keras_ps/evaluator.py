"""`python -m keras_ps.evaluator`: the sidecar evaluator task.

The command keeps this short name; the code is in keras_ps/sidecar/cli.py.
"""

import sys

from keras_ps.sidecar.cli import main

if __name__ == "__main__":
    sys.exit(main())
