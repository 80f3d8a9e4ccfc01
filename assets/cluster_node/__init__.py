"""Everything that runs on a cluster node, in one package: shipped in the image (/workspace/cluster_node),
refreshed by `fab sync` (/data/code/cluster_node), run from the laptop as `python -m cluster_node.MODULE`.
Stdlib only, except the idle watchdog (boto3). docs/architecture.md shows what runs where."""

# fab train refuses a node whose package speaks another version of the run protocol ("run fab sync").
PROTOCOL_VERSION = 1
