"""One run's supervisor on the head node (`python -m cluster_node.supervisor.loop RUN_DIR`): the loop, one poll,
hangs, restarts, the nodes over ssh, the budget meter and its AWS readings, goodput."""
