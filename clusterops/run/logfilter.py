"""What `--follow` leaves out of train.log: Open MPI's help text (between lines of dashes), its
`[host:pid]` and "mpirun noticed" lines, the ranks' tracebacks (`[rankN]:` lines, `Traceback ...` and
their indented frames) and ssh's "Connection ... closed". A failed attempt prints ~80 such lines whose
advice is usually wrong for the case (a lost node reads as "check PATH and LD_LIBRARY_PATH"); the
supervisor's own line names the cause. train.log keeps every line: `fab logs` (without --follow) prints
it whole, and each hidden stretch is replaced by one line that says so."""

from __future__ import annotations

import re

# Open MPI's show_help frame: 74 dashes before and after (open-mpi/ompi opal/util/show_help.c, dash_line)
_DASHES = re.compile(r"^-{20,}\s*$")
_NOISE = re.compile(
    r"^(\[rank\d+\]:|\[[\w.-]+:\d+\]|Traceback \(most recent call last\)|Connection to \S+ closed"
    r"|mpirun noticed|Primary job\s+terminated|prterun |\s*$)"
)
# Open MPI's plm_rsh calls setpgid() on each ssh child in the parent too (Stevens' race, ompi PR #2957); once
# the child has exec'd, the parent's call fails (EACCES) and says so on stderr: harmless, not even counted.
_HARMLESS = re.compile(r"plm:rsh: Warning: setpgid\(\d+,\d+\) failed in parent")
_SUPERVISOR = re.compile(r"^\d{4}-\d\d-\d\dT[\d:]+Z ")  # the supervisor's own lines: always shown
_FRAME = re.compile(r"^(\s+|\w*(Error|Exception)\b.*$)")  # a traceback's frames and its last line


class FollowFilter:
    """Feed it train.log's chunks as they arrive; it returns what to print (whole lines only)."""

    def __init__(self, hint: str):
        self.hint = hint  # how to see everything, e.g. `fab logs --run NAME`
        self.partial, self.hidden = "", 0
        self.in_help = self.in_traceback = False

    def feed(self, chunk: str) -> str:
        lines = (self.partial + chunk).split("\n")
        self.partial = lines.pop()
        return "".join(self._line(line) for line in lines)

    def flush(self) -> str:
        """At the end of the follow: the last, unterminated line, and the note for a hidden stretch."""
        out = self._line(self.partial) if self.partial else ""
        self.partial = ""
        return out + self._note()

    def _line(self, line: str) -> str:
        if _HARMLESS.search(line):
            return ""
        if self._noise(line):
            self.hidden += 1
            return ""
        return self._note() + line + "\n"

    def _noise(self, line: str) -> bool:
        if _SUPERVISOR.match(line):  # also ends a help frame whose closing dashes never came
            self.in_help = self.in_traceback = False
            return False
        if _DASHES.match(line):
            self.in_help = not self.in_help
            return True
        if self.in_help:
            return True
        if self.in_traceback and _FRAME.match(line):
            return True
        self.in_traceback = line.lstrip().startswith("Traceback (most recent call last)")
        return bool(_NOISE.match(line)) and (self.hidden > 0 or line.strip() != "")

    def _note(self) -> str:
        if not self.hidden:
            return ""
        count, self.hidden = self.hidden, 0
        lines = "1 line" if count == 1 else f"{count} lines"
        return f"  ({lines} of Open MPI and rank error output not shown here: {self.hint} prints them)\n"
