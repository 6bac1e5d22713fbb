"""The memory tier: snapshots in node RAM with a replica on a peer."""
