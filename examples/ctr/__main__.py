"""`python -m examples.ctr [--backend jax|torch|tensorflow] ...`.

`--help` without a chosen backend uses a lighter installed one than Keras's
default TensorFlow (`examples.backend_for_help`): no TensorFlow import, no
TensorFlow log lines.
"""

import sys

from examples import backend_for_help, select_backend, wants_help

if __name__ == "__main__":
    select_backend(sys.argv[1:])
    if wants_help(sys.argv[1:]):
        backend_for_help()
    from examples.ctr.train import main

    main(sys.argv[1:])
