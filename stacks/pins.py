"""What synth refuses to guess (app.py calls `synth_config`; the fab tasks read the plain config).

  * a way in: access=ssh without ssh_cidr deploys a cluster nothing can reach;
  * the AZ: an AZ name maps to a different zone per account and big GPU types are offered in few AZs,
    so the subnet goes to an explicit AZ, an existing subnet's, or one `fab preflight` found offering
    the type (cdk.context.json, `offerings_context_key`);
  * the AMI: a DLAMI's `.../latest/ami-id` resolved at deploy would replace every node after each
    release, so the template holds the id `fab preflight` pinned (`ami_context_key`) or `-c ami_id`.
Each refusal is one line that says what to run. It is an `UnpinnedError`: app.py turns it into an
error annotation, which fails `cdk synth`/`diff`/`deploy` but not `cdk destroy` (the CLI runs the app
for destroy too, and tearing a cluster down must never need the deploy's `-c` values again, but a
non-default `cluster_name` or `stack_name`, which names the stack).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Mapping, Optional

from .config import (
    AMI_ID_RE,
    ClusterConfig,
    ConfigError,
    ami_context_key,
    cached_offerings,
    cluster_az_context_key,
    unmovable_zone,
)


class UnpinnedError(ConfigError):
    """Something a deploy would have to guess (the AZ, the AMI, a way in)."""

    def __init__(self, key: str, value: Any, accepted: str):
        super().__init__(key, value, accepted)
        self.args = (f"{key} not set: {accepted}" if value is None else self.args[0],)


PLACEHOLDER_AMI = "ami-00000000000000000"  # only in a template that an UnpinnedError keeps from deploying


def unpinned_config(context: Mapping[str, Any] | Callable[[str], Any], region: Optional[str]) -> ClusterConfig:
    """The config as far as the context gives it, for a stack that `cdk destroy` can still name."""
    config = ClusterConfig.from_context(context, region=region)
    return replace(config, ami_id=config.ami_id or PLACEHOLDER_AMI)


def synth_config(context: Mapping[str, Any] | Callable[[str], Any], region: Optional[str]) -> ClusterConfig:
    """The validated config with its AZ and AMI pinned, or a ConfigError naming what is missing."""
    get = context if callable(context) else context.get
    config = ClusterConfig.from_context(get, region=region)
    check_reachable(config)
    check_zone_unmoved(config, get, region)
    preflight = f"run `fab preflight --instance-type {config.instance_type}`"
    if not (config.availability_zone or config.vpc_id or config.subnet_id):
        raise UnpinnedError(
            "availability_zone",
            None,
            f"no AZ checked for {config.instance_type} in {region or 'this region'}: "
            f"{preflight} first, or pass -c availability_zone=...",
        )
    return replace(config, ami_id=config.ami_id or _cached_ami(config, get, region, preflight))


def check_zone_unmoved(config: ClusterConfig, get: Callable[[str], Any], region: Optional[str]) -> None:
    """A deployed cluster's subnet stays in its AZ (fab preflight's pin): a type not offered there is refused
    here, not in from_context, so `cdk destroy` (unpinned_config) still names the stack."""
    if config.vpc_id or not region or get("availability_zone"):
        return
    offered = cached_offerings(get, region, config.instance_type)
    refusal = unmovable_zone(get(cluster_az_context_key(region, config.cluster_name)), offered)
    if refusal:
        raise UnpinnedError("instance_type", config.instance_type, refusal)


def check_reachable(config: ClusterConfig) -> None:
    """access=ssh admits only ssh_cidr: without it no inbound rule exists and no task reaches a node."""
    if config.access == "ssh" and not config.ssh_cidr:
        raise UnpinnedError(
            "ssh_cidr",
            None,
            "access=ssh needs -c ssh_cidr=YOUR.IP/32 (curl -s https://checkip.amazonaws.com), "
            "or use -c access=ssm (Session Manager, no inbound port)",
        )


def _cached_ami(config: ClusterConfig, get: Callable[[str], Any], region: Optional[str], preflight: str) -> str:
    pinned = get(ami_context_key(region, config.ami_parameter)) if region else None
    if pinned is None:
        raise UnpinnedError(
            "ami_id",
            None,
            f"no AMI pinned for {config.ami_parameter} in {region or 'this region'}: "
            f"{preflight} first, or pass -c ami_id=...",
        )
    if not isinstance(pinned, str) or not AMI_ID_RE.match(pinned):
        raise ConfigError("ami_id", pinned, f"the cached AMI is not an AMI id: {preflight} again")
    return pinned
