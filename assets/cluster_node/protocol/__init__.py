"""The files every process shares, written down once: the run directory's and /data/.cluster's names and records,
the run spec, phases, and the names the stack, the laptop and the nodes share."""
