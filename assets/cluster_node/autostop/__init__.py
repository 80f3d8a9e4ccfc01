"""The idle watchdog, one per node: `python -m cluster_node.autostop.watchdog` (entrypoint.sh)."""
