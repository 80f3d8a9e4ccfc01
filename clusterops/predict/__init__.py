"""Predictions and plots, from measurements and the step model: is the network the bottleneck, the weak-scaling
table, `fab plan`, `fab report --verify`."""
