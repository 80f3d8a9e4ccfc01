"""User data: the real bootstrap script (assets/bootstrap/node-bootstrap.sh) behind an env header.

The header values may be CDK tokens (file system id, region, ...); they resolve at deploy time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

BOOTSTRAP_SCRIPT = Path(__file__).resolve().parent.parent / "assets" / "bootstrap" / "node-bootstrap.sh"
ENV_FILE = "/etc/gpu-cluster/bootstrap.env"
USER_DATA_LIMIT = 16 * 1024  # EC2: user data is at most 16 KB before base64
TOKEN_ALLOWANCE = 256  # bytes counted for each value CloudFormation fills in at deploy time
SCRIPT_PATH = "/usr/local/sbin/gpu-cluster-bootstrap"


def without_comments(script: str) -> str:
    """The script with its header (what it does, how to run it) but not the comment lines below it (the
    repository keeps them): user data holds 16 KB at most."""
    lines = script.splitlines()
    header = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    return "\n".join(lines[:header] + [line for line in lines[header:] if not line.lstrip().startswith("#")])


def render_user_data(env: Mapping[str, str]) -> str:
    """User-data commands (after the shebang) that install the bootstrap with its env file and run it."""
    script = without_comments(BOOTSTRAP_SCRIPT.read_text())
    env_lines = "\n".join(f"{key}={value}" for key, value in env.items())
    return "\n".join(
        [
            "set -euo pipefail",
            "install -d -m 0755 /etc/gpu-cluster",
            f"cat > {ENV_FILE}.new <<'GPU_CLUSTER_ENV'",
            env_lines,
            "GPU_CLUSTER_ENV",
            f"cat > {SCRIPT_PATH}.new <<'GPU_CLUSTER_SCRIPT'",
            script.rstrip("\n"),
            "GPU_CLUSTER_SCRIPT",
            f"chmod 0755 {SCRIPT_PATH}.new",
            # Replace only what changed, so a re-run leaves the machine as it was.
            f"for f in {ENV_FILE} {SCRIPT_PATH}; do",
            '  if cmp -s "$f.new" "$f"; then rm "$f.new"; else mv "$f.new" "$f"; fi',
            "done",
            f"exec {SCRIPT_PATH} {ENV_FILE}",
            "",
        ]
    )


def user_data_bytes(resolved) -> int:
    """Size of user data as CloudFormation will render it, from its resolved template value
    (a string, or Fn::Join of strings and tokens; each token counted at TOKEN_ALLOWANCE bytes)."""
    if isinstance(resolved, dict) and "Fn::Base64" in resolved:
        resolved = resolved["Fn::Base64"]
    if isinstance(resolved, str):
        return len(resolved.encode())
    parts = resolved["Fn::Join"][1]
    return sum(len(part.encode()) if isinstance(part, str) else TOKEN_ALLOWANCE for part in parts)


def check_user_data_size(resolved, what: str) -> int:
    size = user_data_bytes(resolved)
    if size > USER_DATA_LIMIT:
        raise ValueError(
            f"{what}: user data would be {size} bytes, over EC2's {USER_DATA_LIMIT}; "
            "shorten the bootstrap script or the values it carries"
        )
    return size
