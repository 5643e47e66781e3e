"""mamba3lite: pretrain small Mamba-3 language models end to end.

Importing this package does nothing: no I/O, no device, no logging set-up (docs/architecture.md §6 rule 1).
"""

__version__ = "0.1.0"
