#!/usr/bin/env bash
# Shared by the stand-ins: append "name args..." to $SANDBOX/calls.log.
record() { printf '%s\n' "$(basename "$0") $*" >> "$SANDBOX/calls.log"; }
