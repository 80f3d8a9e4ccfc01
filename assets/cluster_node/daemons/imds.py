"""The instance metadata service through IMDSv2, for the watchdog (region, instance id) and the Spot
watcher (spot/instance-action). IMDSv2: PUT /latest/api/token with the header
X-aws-ec2-metadata-token-ttl-seconds, then GET the path with X-aws-ec2-metadata-token (EC2 User Guide,
"Use the Instance Metadata Service to access instance metadata"). AUTOSTOP_IMDS_URL points the tests
at a stand-in."""

from __future__ import annotations

import json
import os
import urllib.request

IMDS_URL = os.environ.get("AUTOSTOP_IMDS_URL", "http://169.254.169.254")
IDENTITY_PATH = "/latest/dynamic/instance-identity/document"


def imds_get(path: str, base: str = IMDS_URL, timeout: float = 2.0) -> bytes:
    """GET an instance-metadata path through IMDSv2 (a session token first, then the path with it).
    Raises OSError (urllib.error.HTTPError for a status such as 404) when there is no answer."""
    token_request = urllib.request.Request(
        f"{base}/latest/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"}
    )
    with urllib.request.urlopen(token_request, timeout=timeout) as response:
        token = response.read().decode()
    request = urllib.request.Request(f"{base}{path}", headers={"X-aws-ec2-metadata-token": token})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def instance_identity(base: str = IMDS_URL, timeout: float = 2.0) -> dict:
    """The instance identity document through IMDSv2 (region, instanceId, privateIp), {} off EC2."""
    try:
        return json.loads(imds_get(IDENTITY_PATH, base, timeout))
    except (OSError, ValueError):
        return {}
