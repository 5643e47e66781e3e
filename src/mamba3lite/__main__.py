"""`python -m mamba3lite` is the `mamba3lite` console script."""

import signal
import sys

from mamba3lite.cli import main

if __name__ == "__main__":
    code = main()
    # The command is over (a training run has saved everything): a SIGTERM during interpreter shutdown,
    # which takes a while after torch, must not turn a finished run into exit -15.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(code)
