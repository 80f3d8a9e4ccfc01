"""Stands in for mpirun's `-x NAME=VALUE` where a test launches the ranks with torchrun: every `-x NAME=VALUE`
pair goes into the environment, the rest of the argv is executed."""

import os
import sys

argv, env = [], dict(os.environ)
args = iter(sys.argv[1:])
for arg in args:
    if arg == "-x":
        name, _, value = next(args).partition("=")
        env[name] = value
    else:
        argv.append(arg)
os.execvpe(argv[0], argv, env)
