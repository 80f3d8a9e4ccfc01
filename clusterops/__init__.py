"""Cluster operations behind the fab tasks: inventory, launch building, remote operations, local cluster."""
