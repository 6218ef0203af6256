"""`python -m examples.sasrec [--backend jax|torch|tensorflow] ...`.

The arguments are parsed before any backend is imported: `--help` and usage
errors come at once.
"""

import sys

from examples import select_backend

if __name__ == "__main__":
    from examples.sasrec.cli import parse_args

    parse_args(sys.argv[1:])  # prints the help or a usage error and exits, without Keras
    select_backend(sys.argv[1:])
    from examples.sasrec.train import main

    main(sys.argv[1:])
