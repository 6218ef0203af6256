"""`python -m examples.ctr [--backend jax|torch|tensorflow] ...`.

The arguments are parsed before any backend is imported: `--help` and usage
errors come at once.
"""

import sys

from examples import select_backend

if __name__ == "__main__":
    from examples.ctr.cli import build_parser

    build_parser().parse_args(sys.argv[1:])  # prints the help or a usage error and exits, without Keras
    select_backend(sys.argv[1:])
    from examples.ctr.train import main

    main(sys.argv[1:])
