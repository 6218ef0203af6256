"""`python -m examples.sasrec [--backend jax|torch|tensorflow] ...`."""

import sys

from examples import select_backend

if __name__ == "__main__":
    select_backend(sys.argv[1:])
    from examples.sasrec.train import main

    main(sys.argv[1:])
