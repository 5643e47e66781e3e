"""`python -m mamba3lite` is the `mamba3lite` console script."""

import sys

from mamba3lite.cli import main

if __name__ == "__main__":
    sys.exit(main())
