"""What runs on every node for as long as the container: the idle watchdog (autostop/) and the Spot watcher, over
IMDSv2."""
