"""One run, from the laptop: its launch, lifecycle, resume and budget, the log stream, `fab check`'s links,
TensorBoard, its report, and the failure drills."""
