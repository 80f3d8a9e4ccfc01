"""A node's user data: the stub (assets/bootstrap/user-data-stub.sh) after the node's fixed values, which it
fetches the bootstrap with. Plain Python, no CDK: `fab preflight` imports it to tell whether a deploy of this
checkout changes every node's user data (user_data_version), which CDK's user-data hash turns into a
replacement of every node."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Mapping

ENV_FILE = "/etc/gpu-cluster/bootstrap.env"
SCRIPT_PATH = "/usr/local/sbin/gpu-cluster-bootstrap"
STUB_BODY = Path(__file__).resolve().parent.parent / "assets" / "bootstrap" / "user-data-stub.sh"
# Each node's fixed values, in this order (stacks/nodes.py fills them in): only what a node keeps for its life.
USER_DATA_KEYS = (
    "CLUSTER_NAME",
    "NODE_RANK",
    "FILE_SYSTEM_ID",
    "AWS_REGION",
    "STACK_NAME",
    "SIGNAL_RESOURCE",
    "NODE_CONFIG_PARAMETER",
    "IMAGE_CONTEXT_PARAMETER",
    "HOST_KEY_PARAMETER",
    "IDLE_MINUTES_PARAMETER",
    "IDLE_ALARM",
    "HEARTBEAT_NAMESPACE",
    "INSTANCE_TYPE",
)


def render_user_data(env: Mapping[str, str]) -> str:
    """User-data commands (after the shebang): write the node's fixed values, add the node config,
    fetch the bootstrap and run it (it signals CloudFormation itself)."""
    if tuple(env) != USER_DATA_KEYS:
        raise ValueError(f"user data keys {tuple(env)} are not USER_DATA_KEYS {USER_DATA_KEYS}")
    env_lines = "\n".join(f"{key}={value}" for key, value in env.items())
    return "\n".join(
        [
            "set -euo pipefail",
            f"ENV_FILE={ENV_FILE} SCRIPT={SCRIPT_PATH}",
            "install -d -m 0755 /etc/gpu-cluster",
            "cat > \"$ENV_FILE.new\" <<'GPU_CLUSTER_ENV'",
            env_lines,
            "GPU_CLUSTER_ENV",
            stub_body(),
        ]
    )


def stub_body() -> str:
    """The stub's script without its header (shebang and the comment lines above the first command)."""
    lines = STUB_BODY.read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    return "\n".join(lines[first:]) + "\n"


def user_data_version() -> str:
    """What every node's user data holds besides its values: the stub's text and the keys. Another version
    (an upgrade of this app) changes every node's user data, so the deploy replaces every node; the stack
    outputs it (NodeUserData) for `fab preflight` to compare with this checkout's."""
    text = render_user_data({key: "" for key in USER_DATA_KEYS})
    return hashlib.sha256(text.encode()).hexdigest()[:16]
