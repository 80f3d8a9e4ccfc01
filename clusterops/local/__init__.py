"""The emulated cluster on this machine: its nodes (network namespaces running the image's entrypoint), network,
repair, /data, the one-at-a-time lock, and an IMDS stand-in."""
