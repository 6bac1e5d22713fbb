"""The `torchrevive` command line: a torchrun-compatible launcher and snapshot tools."""
