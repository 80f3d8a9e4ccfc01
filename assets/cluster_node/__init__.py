"""Everything that runs on a cluster node, in one package: shipped in the image (/workspace/cluster_node),
refreshed by `fab sync` (/data/code/cluster_node), run from the laptop as `python -m cluster_node.MODULE`.
Stdlib only, except the idle watchdog (boto3). docs/architecture.md shows what runs where."""
