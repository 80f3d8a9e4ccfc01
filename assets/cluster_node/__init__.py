"""Everything that runs on a cluster node, in one package: shipped in the image (/workspace/cluster_node),
refreshed by `fab sync` (/data/code/cluster_node), run from the laptop as `python -m cluster_node.PACKAGE.MODULE`.
Stdlib only, except the idle watchdog (boto3). By noun: protocol/ (the shared files' names and records),
programs/ (one-shot, from the laptop), supervisor/ (one run's), daemons/ (every node's); tools.py at the
base. docs/architecture.md shows what runs where."""
