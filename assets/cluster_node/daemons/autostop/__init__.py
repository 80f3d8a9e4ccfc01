"""The idle watchdog, one per node: `python -m cluster_node.daemons.autostop.watchdog` (entrypoint.sh)."""
