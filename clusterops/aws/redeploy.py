"""fab preflight against what is deployed: a second `cdk deploy` of a cluster that exists. CDK does not
remember context between deploys (a `-c` key left out takes its default: CDK Developer Guide, "Context
values"), so a deploy without the first one's `-c cluster_name=x` makes a second cluster, and one without its
`-c instance_type` changes the type. And CloudFormation replaces a subnet whose AZ changes (AWS::EC2::Subnet
AvailabilityZone: "Update requires: Replacement"), which fails on its CIDR, still the old subnet's. So
preflight reads the stack of this name: what the deploy would change, key by key; the AZ its nodes are in,
pinned in cdk.context.json for synth (a new type must be offered there); and, for a new cluster, the clusters
already deployed in the region. Functions take boto3 clients."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from botocore.exceptions import ClientError

from clusterops.aws import cdkcontext
from clusterops.aws.check import Check
from clusterops.inventory import describe
from stacks.config import ClusterConfig, cluster_az_context_key
from stacks.userdata import user_data_version

CHECK = "deployed cluster"
REPLACES = "replaces every node: a running run ends, `fab stop` it first"
# Set at launch, and not all updatable in place: CloudFormation decides (`npx cdk diff` says "requires replacement").
MAY_REPLACE = "may replace every node (`npx cdk diff` says): a running run ends, `fab stop` it first"


@dataclass(frozen=True)
class Deployed:
    stack: str
    status: str
    outputs: dict
    zone: Optional[str]  # where its subnet (else its nodes) is; None when neither shows
    images: frozenset[str] = frozenset()  # its nodes' AMIs
    resource_types: Optional[frozenset[str]] = None  # what the stack holds; None when it could not be listed
    running: frozenset[str] = frozenset()  # its nodes that are pending or running (they count against quotas)
    nodes: tuple[dict, ...] = field(default=(), compare=False)  # its nodes as EC2 describes them

    @property
    def instance_ids(self) -> list[str]:
        return [i for i in self.outputs.get("InstanceIds", "").split(",") if i]

    @property
    def private_subnet(self) -> Optional[bool]:
        """Whether its own VPC has the private layout (a NAT gateway); None in a given VPC or not known."""
        if self.resource_types is None or "AWS::EC2::VPC" not in self.resource_types:
            return None
        return "AWS::EC2::NatGateway" in self.resource_types


def deployed(cfn, ec2, stack_name: str) -> Optional[Deployed]:
    """The stack of that name with its outputs, resources and its nodes' AZ, or None when there is none."""
    try:
        stack = cfn.describe_stacks(StackName=stack_name)["Stacks"][0]
    except ClientError as error:
        if "does not exist" in str(error):
            return None
        raise
    outputs = {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}
    found = Deployed(stack_name, stack["StackStatus"], outputs, None)
    try:
        resources: Optional[list[dict]] = stack_resources(cfn, stack_name)
    except ClientError:  # e.g. a user policy older than this check: the nodes may still say where they are
        resources = None
    nodes = _nodes(ec2, found.instance_ids)
    zone = _subnet_zone(ec2, resources or []) or min((n["Placement"]["AvailabilityZone"] for n in nodes), default=None)
    types = None if resources is None else frozenset(r["ResourceType"] for r in resources)
    running = frozenset(n["InstanceId"] for n in nodes if n["State"]["Name"] in ("pending", "running"))
    images = frozenset(n["ImageId"] for n in nodes)
    return Deployed(stack_name, found.status, outputs, zone, images, types, running, tuple(nodes))


def stack_resources(cfn, stack_name: str) -> list[dict]:
    """The stack's resource summaries (DescribeStackResources stops at 100: the paginated list)."""
    pages = cfn.get_paginator("list_stack_resources").paginate(StackName=stack_name)
    return [r for page in pages for r in page["StackResourceSummaries"]]


def _subnet_zone(ec2, resources: list[dict]) -> Optional[str]:
    """The AZ of the stack's own subnets (one AZ); None with a given VPC's subnet or none left."""
    ids = [
        r["PhysicalResourceId"]
        for r in resources
        if r.get("ResourceType") == "AWS::EC2::Subnet" and r.get("PhysicalResourceId")
    ]
    if not ids:
        return None
    try:
        subnets = ec2.describe_subnets(SubnetIds=ids)["Subnets"]
    except ClientError:  # deleted outside the stack: the nodes may still say
        return None
    return min((s["AvailabilityZone"] for s in subnets), default=None)


def _nodes(ec2, ids: list[str]) -> list[dict]:
    """The stack's instances EC2 still describes (one gone is no error: inventory.describe)."""
    return list(describe(ec2, ids).values())


def other_clusters(cfn, stack_name: str) -> list[str]:
    """The region's other stacks of this app (those with a ClusterName output), by name."""
    pages = cfn.get_paginator("describe_stacks").paginate()
    return sorted(
        s["StackName"]
        for page in pages
        for s in page["Stacks"]
        if s["StackName"] != stack_name
        and not s["StackStatus"].startswith("DELETE_COMPLETE")
        and any(o["OutputKey"] == "ClusterName" for o in s.get("Outputs", []))
    )


# key, output, its value in a config (None: the key does not apply), what the change does. A node's launch template
# is create-only (AWS::EC2::Instance LaunchTemplate: "Update requires: Replacement"), and each deploy points it at
# the template's latest version: Spot's maximum price too replaces every node.
_KEYS: tuple[tuple[str, str, Callable[[ClusterConfig], Optional[str]], str], ...] = (
    ("instance_type", "InstanceType", lambda c: c.instance_type, REPLACES),
    ("spot", "Spot", lambda c: str(c.spot).lower(), REPLACES),
    ("spot_max_price", "SpotMaxPrice", lambda c: c.spot_max_price_output, REPLACES),
    ("efa cards", "EfaCards", lambda c: str(c.efa_cards), REPLACES),
    ("access", "Access", lambda c: c.access, "the way fab reaches the nodes"),
    # BlockDeviceMapping: "Modifying any other parameter [than DeleteOnTermination] results in instance replacement"
    ("root_volume_gb", "RootVolumeGb", lambda c: str(c.root_volume_gb), REPLACES),
    ("placement_group", "PlacementGroup", lambda c: str(c.in_placement_group).lower(), MAY_REPLACE),
    ("retain_data", "RetainData", lambda c: str(c.retain_data).lower(), "whether `cdk destroy` deletes /data"),
    ("image", "BaseImage", lambda c: c.image, "each node boots the image node-config names when it boots"),
    ("idle_minutes", "IdleMinutes", lambda c: str(c.idle_minutes), "when the idle watchdog stops the cluster"),
    ("data_bucket", "DataBucket", lambda c: c.data_bucket or "none", "the bucket the nodes may read"),
)


def changes(config: ClusterConfig, found: Deployed, image: Optional[str] = None) -> list[str]:
    """What this config (booting `image`) changes in the deployed cluster, one phrase a key."""
    said = _replacing(found, image) + [
        f"{key} {found.outputs[output]} -> {value(config)} ({effect})"
        for key, output, value, effect in _KEYS
        if output in found.outputs and value(config) not in (None, found.outputs[output])
    ]
    key = config.key_name or f"{config.cluster_name}-{found.stack}"  # stacks/nodes.py's generated pair otherwise
    if found.outputs.get("KeyName", key) != key:  # the node's KeyName
        said.append(f"key_name {found.outputs['KeyName']} -> {key} ({MAY_REPLACE})")
    before = len(found.instance_ids)
    if before and config.nodes < before:
        gone = ", ".join(f"node{rank}" for rank in range(config.nodes, before))
        said.append(f"nodes {before} -> {config.nodes} ({gone} terminated, their disks with them)")
    elif before and config.nodes > before:
        said.append(f"nodes {before} -> {config.nodes} (adds {config.nodes - before}, replaces none)")
    return said


def nodes_added(config: ClusterConfig, found: Optional[Deployed], image: Optional[str] = None) -> int:
    """The nodes this deploy launches: all of them for a new cluster or one whose nodes it replaces
    (CloudFormation creates each replacement before it terminates the old node: both run for a while), else
    the ranks the deployed cluster lacks and those of its kept nodes that are stopped (a stopped node counts
    nowhere, and `fab start` will start it: only a running one is already counted)."""
    if found is None or any(REPLACES in c or MAY_REPLACE in c for c in changes(config, found, image)):
        return config.nodes
    return config.nodes - len(set(found.instance_ids[: config.nodes]) & found.running)


# Stack states `cdk deploy` cannot update, and what to do (CloudFormation User Guide, stack status codes).
STUCK = {
    "UPDATE_ROLLBACK_FAILED": "`aws cloudformation continue-update-rollback --stack-name {stack}`, then deploy",
    "DELETE_FAILED": "`fab destroy` again (`fab audit` names what held it), then deploy",
}
# A first deploy that failed: `cdk deploy` deletes the stack and creates it anew (the CLI's creation failure).
NOTHING_LEFT = ("ROLLBACK_COMPLETE", "ROLLBACK_FAILED")


def stuck(found: Deployed) -> Optional[str]:
    """Why `cdk deploy` cannot update the stack now, else None (REVIEW_IN_PROGRESS, a change set never
    executed, is one the CLI deploys over)."""
    if found.status.endswith("_IN_PROGRESS") and found.status != "REVIEW_IN_PROGRESS":
        return f"{found.stack} is {found.status}: wait until it ends (`aws cloudformation describe-stacks`)"
    if found.status in STUCK:
        return f"{found.stack} is {found.status}: " + STUCK[found.status].format(stack=found.stack)
    return None


def _replacing(found: Deployed, image: Optional[str]) -> list[str]:
    """What replaces every node besides the config: this checkout's node user data (an upgrade of this app:
    the old nodes' idle watchdog would stop the new ones while they bootstrap), a new AMI."""
    deployed, mine = found.outputs.get("NodeUserData"), user_data_version()
    said = []
    if deployed != mine:
        what = "not known (an older version deployed it)" if deployed is None else f"{deployed} -> {mine}"
        said.append(f"node user data {what} ({REPLACES}; and `fab stop-cluster` before the deploy)")
    if image and found.images and image not in found.images:
        said.append(f"AMI {', '.join(sorted(found.images))} -> {image} ({REPLACES})")
    if found.outputs.get("Spot") == "true" and "SpotMaxPrice" not in found.outputs:
        said.append(
            "spot_max_price not known (an older version deployed it): a price other than its first deploy's "
            "replaces every node"
        )
    return said


def subnet_layout_change(config: ClusterConfig, found: Deployed) -> Optional[str]:
    """Why this deploy cannot update the deployed cluster's network, else None. The public and the private
    layouts share 10.42.0.0/16 (stacks/network.py), and CloudFormation creates a replacement before it deletes
    the old resource, so the new subnets overlap the old ones (CreateSubnet: "the subnets' CIDR blocks must not
    overlap") and the new mount target meets the old one in its AZ (EFS: "only one mount target per
    Availability Zone"): the deploy fails and rolls back."""
    if found.resource_types is None:
        return None
    anew = "`fab fetch` the runs you need, `fab destroy`, then deploy anew (or -c cluster_name=NEW: a second cluster)"
    own_vpc = "AWS::EC2::VPC" in found.resource_types
    given_vpc = not own_vpc and "AWS::EFS::MountTarget" in found.resource_types  # none yet: a change set not run
    if (own_vpc and config.vpc_id) or (given_vpc and not config.vpc_id):  # EFS: mount targets "in one VPC at a time"
        where = "its own VPC -> -c vpc_id" if own_vpc else "a given VPC -> its own"
        return f"{found.stack}: {where} cannot change on a deployed cluster (its file system's mount target): {anew}"
    if found.private_subnet is None or found.private_subnet == config.private_subnet:
        return None
    before, after = str(found.private_subnet).lower(), str(config.private_subnet).lower()
    keep = "-c access=ssm -c private_subnet=true" if found.private_subnet else "-c private_subnet=false"
    return (
        f"{found.stack}: private_subnet {before} -> {after} cannot change on a deployed cluster (its new subnets "
        f"would overlap the old ones and the deploy rolls back): deploy with {keep}, or {anew}"
    )


def redeploy_check(
    cfn, ec2, config: ClusterConfig, stack_name: str, image: Optional[str] = None
) -> tuple[Check, Optional[Deployed]]:
    """The `deployed cluster` line, and the deployed cluster (None for a new one, or a failed first deploy that
    `cdk deploy` deletes): its AZ pin is kept, and its resources are what the deploy need not add."""
    found = deployed(cfn, ec2, stack_name)
    if found is not None and found.status in NOTHING_LEFT:
        detail = f"{stack_name} is {found.status} (a first deploy that failed): `cdk deploy` deletes it and starts anew"
        return Check(CHECK, True, detail), None
    if found is not None and (stuck(found) or subnet_layout_change(config, found)):
        return Check(CHECK, False, stuck(found) or subnet_layout_change(config, found) or ""), found
    if found is None:
        others = other_clusters(cfn, stack_name)
        detail = f"none named {stack_name}: this deploy makes a new cluster"
        if others:
            detail += f"; this region has {', '.join(others)} (-c cluster_name=NAME deploys to one of those)"
        return Check(CHECK, True, detail), None
    said = changes(config, found, image)
    detail = (
        f"{stack_name} ({found.status}, nodes in {found.zone or 'no AZ'}): "
        + (
            "this deploy changes " + "; ".join(said) + " (-c values are not remembered: a key left out is its default)"
            if said
            else "this deploy changes none of its nodes by type, Spot, EFA, count, AMI or node user data"
        )
        + "; `npx cdk diff` lists every resource it replaces"
    )
    return Check(CHECK, True, detail), found


def pin_zone(context_file: Path, region: str, cluster_name: str, zone: Optional[str], exists: bool) -> None:
    """Synth keeps a deployed cluster's subnet in its AZ; a cluster not deployed has no pin, and a deployed one
    whose AZ does not show keeps the pin it has."""
    key = cluster_az_context_key(region, cluster_name)
    if zone:
        cdkcontext.write(context_file, {key: zone})
    elif not exists:
        cdkcontext.forget(context_file, key)
