"""One-shot programs the laptop runs on a node (each a `python -m` module printing JSON): the health probe and
its verdicts, `fab status`'s row, `fab monitor`'s sample, the run overview, the link test, a run's start."""
