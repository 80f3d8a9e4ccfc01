"""Reaching the nodes: SSH primitives, the one line that runs a `cluster_node` program, one node observed, the
health probe and its verdicts, a node found again at a new address."""
