"""Subcommands of the `mamba3lite` CLI; see `mamba3lite.cli`."""
