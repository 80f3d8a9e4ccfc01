"""One-shot programs the laptop runs on a node (`python -m cluster_node.programs.X`, JSON on stdout): the health
probe and its verdicts, `fab status`'s row, `fab monitor`'s sample, the run overview, the link test, a run's
start."""
