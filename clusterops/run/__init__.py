"""One run, from the laptop: the use cases of fab train, check, data, plan and cost; a run's launch, lifecycle,
resume and budget; the log stream, `fab check`'s links, TensorBoard, its report, and the failure drills."""
