"""The laptop side behind the fab tasks. At the base: the inventory (the nodes and how to reach them), cost,
and the terminal's tables; above it, by noun: aws/, local/ (the emulated cluster), nodes/, predict/ and
run/. A base module imports no subpackage (tests/test_imports.py)."""
