"""Before `cdk deploy`: credentials, region, the AZs offering the type (cached in cdk.context.json,
where the app reads them to place its subnet), the AZ and subnet the stack will use, the vCPU quota
bucket of the family and purchase option, with Spot the Spot price and the saving, a RunInstances dry
run (a permission check, no more), the AMI; and a quota increase request when asked (quotas.py: the
vCPU and VPC quotas). Functions take boto3 clients."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from botocore.exceptions import BotoCoreError, ClientError

from clusterops import cost as costs
from clusterops.aws import cdkcontext
from clusterops.aws.cdkcontext import cache_offerings
from clusterops.aws.check import Check
from clusterops.aws.quotas import NETWORK, QuotaCheck, check_quota, network_quota, request_increase
from clusterops.aws.redeploy import Deployed, nodes_added, pin_zone, redeploy_check
from clusterops.terminal import aws_error
from stacks.config import (
    SPOT_INTERRUPTION,
    SPOT_REQUEST,
    ClusterConfig,
    choose_availability_zone,
    unmovable_zone,
)

NO_DEFAULT_VPC = ("VPCIdNotSpecified", "DefaultVpcDoesNotExist")
DRY_RUN_ERRORS = {
    "UnauthorizedOperation": "your credentials may not launch instances (ec2:RunInstances)",
    "InsufficientInstanceCapacity": "AWS has no capacity for this type here now: try another AZ or later",
    "VcpuLimitExceeded": "the vCPU quota is too low (see the quota line)",
    "InstanceLimitExceeded": "the instance quota is too low",
    "Unsupported": "this instance type is not supported in this AZ",
    "InvalidAMIID.NotFound": "the AMI does not exist in this region",
    "OptInRequired": "the account must opt in to this region or product",
    "MissingInput": "the default VPC has no subnet in this AZ",
}
DRY_RUN = "launch permission (RunInstances dry run)"


def offered_zones(ec2, instance_type: str) -> list[str]:
    offers = ec2.get_paginator("describe_instance_type_offerings").paginate(
        LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": [instance_type]}]
    )
    return sorted({o["Location"] for page in offers for o in page["InstanceTypeOfferings"]})


def placement(config: ClusterConfig, zones: list[str], deployed: Optional[str] = None) -> tuple[Check, Optional[str]]:
    """Where the stack will put the nodes (a deployed cluster's: where they are), and whether the type is
    offered there; returns the AZ."""
    if not zones:
        return Check("AZ and subnet", False, f"{config.instance_type} is not offered in any AZ of this region"), None
    if config.subnet_id:
        az = config.availability_zone
        where = f"existing subnet {config.subnet_id} in {az} (vpc {config.vpc_id})"
        if az not in zones:
            return Check(
                "AZ and subnet",
                False,
                f"{where}: {config.instance_type} is not offered there (offered in {', '.join(zones)})",
            ), az
        return Check("AZ and subnet", True, where), az
    refusal = None if config.availability_zone else unmovable_zone(deployed, zones)
    if refusal:
        return Check("AZ and subnet", False, f"{config.instance_type} is {refusal}"), deployed
    az = choose_availability_zone(config.availability_zone, zones, deployed)
    if deployed and az != deployed:
        return Check(
            "AZ and subnet",
            False,
            f"availability_zone={az}, but the deployed cluster's subnet is in {deployed}; an update cannot move "
            "a subnet to another AZ: leave availability_zone out, or `fab destroy` first",
        ), az
    if az not in zones:
        return Check(
            "AZ and subnet",
            False,
            f"availability_zone={az} does not offer {config.instance_type} (offered in {', '.join(zones)})",
        ), az
    vpc = "the deployed stack's VPC" if deployed else "a new VPC"
    offered = f"{config.instance_type} offered in {', '.join(zones)}"
    return Check("AZ and subnet", True, f"{vpc} with one public subnet in {az} ({offered})"), az


# attribute: (its key in DescribeVpcAttribute's answer, the AWS CLI flag that turns it on)
DNS_ATTRIBUTES = {
    "enableDnsSupport": ("EnableDnsSupport", "enable-dns-support"),
    "enableDnsHostnames": ("EnableDnsHostnames", "enable-dns-hostnames"),
}


def vpc_dns(ec2, vpc_id: str) -> Check:
    """A given VPC resolves the EFS file system's DNS name, which the nodes mount /data by: EFS needs the
    VPC's DNS resolution and DNS hostnames on (AWS EFS User Guide, "Mounting on Amazon EC2 with a DNS name")."""
    off = []
    for attribute, (key, _) in DNS_ATTRIBUTES.items():
        try:
            value = ec2.describe_vpc_attribute(VpcId=vpc_id, Attribute=attribute)[key]["Value"]
        except ClientError as error:
            return Check("VPC DNS", False, f"could not read {vpc_id}'s {attribute}: {aws_error(error)}")
        if not value:
            off.append(attribute)
    if not off:
        return Check("VPC DNS", True, f"{vpc_id} resolves and names hosts (EFS is mounted by its DNS name)")
    # One attribute a call (EC2 API reference, ModifyVpcAttribute).
    turn_on = " && ".join(f"aws ec2 modify-vpc-attribute --vpc-id {vpc_id} --{DNS_ATTRIBUTES[a][1]}" for a in off)
    return Check("VPC DNS", False, f"{vpc_id} has {' and '.join(off)} off: /data (EFS) would not mount; {turn_on}")


ROUTE_OUT = "subnet route out"


def subnet_route_out(ec2, subnet_id: str, public_ip: Optional[bool]) -> Check:
    """A given subnet's way out, which every boot needs (SSM, S3, CloudFormation, apt, nvcr.io): its route
    table's default route (the subnet's own table, else its VPC's main one, VPC User Guide "Route tables"),
    followed through a firewall's endpoint. `public_ip`: True, the node asks for one (access=ssh, and fab
    reaches it there); False, it can have none (several EFA cards); None, the subnet's auto-assign decides.
    Fails only what cannot work; a shared VPC's route tables, which its owner keeps, are not checked."""
    try:
        found = _way_out(ec2, subnet_id)
    except ClientError as error:
        return Check(ROUTE_OUT, False, f"could not read {subnet_id}'s routes: {aws_error(error)}")
    if found is None:
        return Check(
            ROUTE_OUT, True, f"not checked: no route table of {subnet_id} is visible (a shared VPC?)", skipped=True
        )
    subnet, table, hops = found
    public = bool(subnet.get("MapPublicIpOnLaunch")) if public_ip is None else public_ip
    return _route_verdict(f"{subnet_id} (route table {table})", hops, public, asks=public_ip is True)


def _route_verdict(where: str, hops: list[str], public: bool, asks: bool) -> Check:
    """The verdict on the default route's last hop (igw-, nat-, tgw-, pcx-, vgw-, eni-, ...)."""
    if not hops or hops[-1] == "none":
        return Check(ROUTE_OUT, False, f"{where} has no working default route (0.0.0.0/0): a node could not boot")
    path, last = " then ".join(hops), hops[-1]
    if last.startswith("pcx-"):
        return Check(ROUTE_OUT, False, f"{where} goes out through {path}: a peering connection carries no internet")
    if last.startswith("igw-") and not public:
        return Check(
            ROUTE_OUT,
            False,
            f"{where} goes out through {path} but its nodes get no public IP: a node could not boot; pass a "
            "subnet with a NAT gateway route (or turn on its public IP auto-assign, not with several EFA cards)",
        )
    if asks and not last.startswith("igw-"):
        return Check(
            ROUTE_OUT,
            False,
            f"{where} goes out through {path}, not an internet gateway: fab could not reach the nodes' "
            "public IPs (access=ssh; replies leave that way); pass a public subnet, or use access=ssm",
        )
    return Check(ROUTE_OUT, True, f"{where} goes out through {path}")


def _way_out(ec2, subnet_id: str) -> Optional[tuple[dict, str, list[str]]]:
    """(the subnet, its route table's id, the default route's hops: one, or a firewall endpoint's then its
    subnet's); None when no route table is visible."""
    subnet = ec2.describe_subnets(SubnetIds=[subnet_id])["Subnets"][0]
    table = _route_table(ec2, subnet_id, subnet["VpcId"])
    if table is None:
        return None
    hops = [_default_target(table)]
    if hops[0].startswith("vpce-"):  # a Network Firewall or Gateway Load Balancer endpoint: where it goes next
        endpoint = ec2.describe_vpc_endpoints(VpcEndpointIds=[hops[0]])["VpcEndpoints"][0]
        beyond = _route_table(ec2, endpoint["SubnetIds"][0], subnet["VpcId"]) if endpoint.get("SubnetIds") else None
        hops.append(_default_target(beyond) if beyond else "none")
    return subnet, table["RouteTableId"], hops


def _route_table(ec2, subnet_id: str, vpc_id: str) -> Optional[dict]:
    explicit = ec2.describe_route_tables(Filters=[{"Name": "association.subnet-id", "Values": [subnet_id]}])
    main = [{"Name": "vpc-id", "Values": [vpc_id]}, {"Name": "association.main", "Values": ["true"]}]
    tables = explicit["RouteTables"] or ec2.describe_route_tables(Filters=main)["RouteTables"]
    return tables[0] if tables else None


def _default_target(table: dict) -> str:
    """The 0.0.0.0/0 route's target (EC2 API reference, Route), "none" without a working one (a blackhole:
    its NAT gateway or instance is gone)."""
    for route in table["Routes"]:
        if route.get("DestinationCidrBlock") == "0.0.0.0/0" and route.get("State") != "blackhole":
            ids = [v for k, v in route.items() if k.endswith("Id") and k != "InstanceOwnerId" and isinstance(v, str)]
            return ids[0] if ids else route.get("CoreNetworkArn", "another target")
    return "none"


def dry_run(
    ec2,
    image_id: str,
    instance_type: str,
    nodes: int,
    subnet_id: Optional[str] = None,
    availability_zone: Optional[str] = None,
    spot: bool = False,
) -> Check:
    """RunInstances with DryRun: it checks YOUR permission to launch there (as Spot: with the nodes'
    market options), not capacity or quota."""
    params = dict(ImageId=image_id, InstanceType=instance_type, MinCount=nodes, MaxCount=nodes, DryRun=True)
    if spot:
        params["InstanceMarketOptions"] = {
            "MarketType": "spot",
            "SpotOptions": {"SpotInstanceType": SPOT_REQUEST, "InstanceInterruptionBehavior": SPOT_INTERRUPTION},
        }
    if subnet_id:
        params["SubnetId"] = subnet_id
    elif availability_zone:
        params["Placement"] = {"AvailabilityZone": availability_zone}
    try:
        ec2.run_instances(**params)
    except ClientError as error:
        code = error.response["Error"]["Code"]
        if code == "DryRunOperation":
            return Check(
                DRY_RUN,
                True,
                f"you may launch {nodes} x {instance_type} there "
                "(a permission check: capacity and quota are not tested)",
            )
        if code in NO_DEFAULT_VPC and not subnet_id:
            return Check(DRY_RUN, True, "not checked: no default VPC; the stack creates its own subnet", skipped=True)
        return Check(DRY_RUN, False, f"{code}: {DRY_RUN_ERRORS.get(code, error.response['Error'].get('Message', ''))}")
    return Check(DRY_RUN, False, "the dry run launched nothing and raised nothing")


def spot_check(ec2, pricing, config: ClusterConfig, region: str, zone: Optional[str]) -> Check:
    """The Spot price in the AZ the stack will use, the saving against On-Demand, and whether
    spot_max_price is below it (EC2 would not launch the nodes at that price)."""
    try:
        spot = costs.spot_price(ec2, config.instance_type, zone)
    except ClientError as error:
        return Check("Spot price", True, f"not checked: {aws_error(error)}", skipped=True)
    line = costs.spot_saving(spot, costs.instance_price(pricing, config.instance_type, region))
    cap = config.spot_max_price
    if cap is not None and spot.usd_per_hour is not None and spot.usd_per_hour > cap:
        return Check("Spot price", False, f"{line}; spot_max_price {cap:g} is below it: no node would launch")
    return Check("Spot price", True, line, skipped=spot.usd_per_hour is None)


SPOT_ROLE = "aws-service-role/spot.amazonaws.com/AWSServiceRoleForEC2Spot"
# What the EC2 User Guide's grant for the Spot service-linked role lists ("Service-linked role for Spot
# Instance requests", customer managed keys).
SPOT_KEY_OPERATIONS = (
    "Decrypt Encrypt GenerateDataKey GenerateDataKeyWithoutPlaintext CreateGrant DescribeKey ReEncryptFrom ReEncryptTo"
)


def spot_volume_key(ec2, kms, account: str, region: str) -> Check:
    """The nodes' encrypted root volumes use the account's default EBS key. EC2 starts a stopped Spot node
    again through the AWSServiceRoleForEC2Spot service-linked role, which may use AWS managed keys but a
    customer managed one only with a grant: without it the first restart after an interruption fails."""
    role = f"arn:aws:iam::{account}:role/{SPOT_ROLE}"
    try:
        key = ec2.get_ebs_default_kms_key_id()["KmsKeyId"]
        # CreateGrant takes a key's ARN, not an alias
        metadata = None if key.endswith("alias/aws/ebs") else kms.describe_key(KeyId=key)["KeyMetadata"]
        if metadata is None or metadata["KeyManager"] == "AWS":
            return Check("Spot volume key", True, f"the default EBS key is AWS managed ({key})")
        grants = kms.get_paginator("list_grants").paginate(KeyId=metadata["Arn"])
        granted = any(g.get("GranteePrincipal") == role for page in grants for g in page["Grants"])
    except ClientError as error:
        return Check("Spot volume key", True, f"not checked: {aws_error(error)}", skipped=True)
    if granted:
        return Check("Spot volume key", True, f"the default EBS key {metadata['Arn']} is granted to the Spot role")
    grant = (
        f"aws kms create-grant --region {region} --key-id {metadata['Arn']} --grantee-principal {role} "
        f"--operations {SPOT_KEY_OPERATIONS}"
    )
    return Check(
        "Spot volume key",
        False,
        f"the default EBS key {metadata['Arn']} is customer managed and not granted to the Spot service role: "
        f"EC2 could not restart an interrupted node (unless the key's policy allows that role); {grant}",
    )


def identity(sts) -> tuple[Check, Optional[str]]:
    try:
        who = sts.get_caller_identity()
    except (ClientError, BotoCoreError) as error:
        return Check("credentials", False, f"{error}; configure AWS credentials (aws configure / SSO)"), None
    return Check("credentials", True, f"account {who['Account']} as {who['Arn']}"), who["Account"]


BOOTSTRAP_PARAMETER = "/cdk-bootstrap/hnb659fds/version"  # the default qualifier's
# The oldest bootstrap stack this app's template accepts: its CheckBootstrapVersion rule refuses 1-5.
MIN_BOOTSTRAP_VERSION = 6


def bootstrap_check(ssm, account: str, region: str) -> Check:
    """`cdk deploy` needs the account/region bootstrapped (CDK Developer Guide, "Bootstrapping");
    the bootstrap stack publishes its version in an SSM parameter."""
    fix = f"npx cdk bootstrap aws://{account}/{region}"
    try:
        value = ssm.get_parameter(Name=BOOTSTRAP_PARAMETER)["Parameter"]["Value"]
    except ClientError as error:
        if error.response["Error"]["Code"] == "ParameterNotFound":
            return Check(
                "CDK bootstrap",
                False,
                f"{BOOTSTRAP_PARAMETER} not found: run `{fix}` once for this account and region",
            )
        return Check("CDK bootstrap", False, f"could not read {BOOTSTRAP_PARAMETER}: {aws_error(error)}")
    if not value.isdigit() or int(value) < MIN_BOOTSTRAP_VERSION:
        return Check(
            "CDK bootstrap",
            False,
            f"version {value} is older than the {MIN_BOOTSTRAP_VERSION} this app's template requires: run `{fix}`",
        )
    return Check("CDK bootstrap", True, f"version {value} ({BOOTSTRAP_PARAMETER})")


def ami(
    ssm, parameter: str, region: str, context: dict, context_file: Optional[Path], refresh: bool = False
) -> tuple[Check, Optional[str]]:
    """The AMI the stack will boot: the id pinned in cdk.context.json, else the parameter's value,
    pinned now. A pin is replaced only with refresh (a new AMI replaces every node at the next deploy)."""
    pinned = cdkcontext.pinned_ami(context, region, parameter)
    try:
        latest = ssm.get_parameter(Name=parameter)["Parameter"]["Value"]
    except ClientError as error:
        if pinned and not refresh:  # the pin is what deploys; the parameter only tells of a newer one
            return Check("AMI", True, f"{pinned}, pinned in cdk.context.json ({parameter}: {aws_error(error)})"), pinned
        return Check("AMI", False, f"{parameter}: {error.response['Error']['Code']}"), None
    if pinned and (not refresh or pinned == latest):
        newer = f"; {latest} is newer: `fab preflight --refresh-ami` pins it" if latest != pinned else ""
        return Check("AMI", True, f"{pinned}, pinned in cdk.context.json (from {parameter}){newer}"), pinned
    if context_file is not None:
        cdkcontext.pin_ami(context_file, region, parameter, latest)
    if pinned:
        return Check("AMI", True, f"{pinned} -> {latest}: the next `cdk deploy` replaces every node"), latest
    return Check("AMI", True, f"pinned {latest} ({parameter}) in cdk.context.json"), latest


def cloudformation_role_note(account: str, region: str) -> str:
    return (
        f"note: `cdk deploy` launches the nodes through CloudFormation, which uses the CDK bootstrap's "
        f"execution role (cdk-hnb659fds-cfn-exec-role-{account}-{region}) when it exists; the dry run "
        "above checks YOUR permissions, not that role's"
    )


def run_preflight(
    clients: dict,
    region: Optional[str],
    config: ClusterConfig,
    context_file: Optional[Path] = None,
    request_quota: bool = False,
    spot: bool = False,
    context: Optional[dict] = None,
    refresh_ami: bool = False,
    stack_name: str = "GpuCluster-gpu-cluster",
) -> tuple[list[Check], list[str]]:
    """All checks in order; stops early without credentials or region. Returns (checks, notes);
    the first note says what was checked (count, type, purchase option, region and AZ)."""
    who, account = identity(clients["sts"])
    checks = [who]
    if not who.ok:
        return checks, []
    checks.append(
        Check("region", bool(region), region or "none: set AWS_REGION (the CDK CLI reads it first) or `aws configure`")
    )
    if not region:
        return checks, []
    ec2 = clients["ec2"]
    checks.append(bootstrap_check(clients["ssm"], account or "ACCOUNT", region))
    ami_check, image_id = ami(
        clients["ssm"], config.ami_parameter, region, context or {}, context_file, refresh=refresh_ami
    )
    image = config.ami_id or image_id  # what synth boots: -c ami_id wins over the pin
    az, found = _deployed_and_placement(clients, config, region, context_file, stack_name, image, checks)
    if config.vpc_id:
        checks.append(vpc_dns(ec2, config.vpc_id))
    if config.subnet_id:
        public_ip = True if config.public_ip_request else (False if config.efa_cards > 1 else None)
        checks.append(subnet_route_out(ec2, config.subnet_id, public_ip))
    quota = _quota(clients, config, spot, nodes_added(config, found, image), checks)
    network = _network(clients, config, account or "", found)
    if network is not None:
        checks.append(network)
    if spot:
        checks.append(spot_check(ec2, clients.get("pricing"), config, region, az))
        checks.append(spot_volume_key(ec2, clients["kms"], account or "ACCOUNT", region))
    checks.append(ami_check)
    if image and az:
        checks.append(dry_run(ec2, image, config.instance_type, config.nodes, config.subnet_id, az, spot))
    notes = [
        f"checking {config.nodes} x {config.instance_type} ({'Spot' if spot else 'On-Demand'}) in {region}, "
        f"AZ {az or 'none'}",
        cloudformation_role_note(account or "ACCOUNT", region),
    ]
    if quota is not None and not quota.ok:
        notes.append(
            request_increase(clients["service-quotas"], quota)
            if request_quota
            else f"run `fab preflight --request-quota` to ask for {quota.needed} vCPUs"
        )
    return checks, notes


def _deployed_and_placement(
    clients: dict,
    config: ClusterConfig,
    region: str,
    context_file: Optional[Path],
    stack_name: str,
    image: Optional[str],
    checks: list[Check],
) -> tuple[Optional[str], Optional[Deployed]]:
    """The deployed cluster of that name (redeploy.py), the type's AZs cached and a deployed cluster's pinned,
    and where the stack will put the nodes; returns that AZ, and the deployed cluster (None: a new one)."""
    ec2 = clients["ec2"]
    known, found = redeploy_check(clients["cloudformation"], ec2, config, stack_name, image)
    checks.append(known)
    zones = offered_zones(ec2, config.instance_type)
    deployed_zone = found.zone if found else None
    if context_file is not None and zones:
        cache_offerings(context_file, region, config.instance_type, zones)
    if context_file is not None and not config.vpc_id:
        pin_zone(context_file, region, config.cluster_name, deployed_zone, found is not None)
    where, az = placement(config, zones, deployed_zone)
    checks.append(where)
    return az, found


def _quota(clients: dict, config: ClusterConfig, spot: bool, added: int, checks: list[Check]) -> Optional[QuotaCheck]:
    """The vCPU quota against what runs and the `added` nodes this deploy launches."""
    quota_name = f"vCPU quota ({'Spot' if spot else 'On-Demand'})"
    try:
        quota = check_quota(clients["ec2"], clients["service-quotas"], config.instance_type, added, spot)
    except ClientError as error:  # e.g. no servicequotas:GetServiceQuota: say so, check the rest
        checks.append(Check(quota_name, False, f"could not read it: {aws_error(error)}"))
        return None
    checks.append(Check(quota_name, quota.ok, quota.line()))
    return quota


def _network(clients: dict, config: ClusterConfig, account: str, found: Optional[Deployed]) -> Optional[Check]:
    """The VPC quota line where this deploy adds what a quota caps: its own VPC and internet gateway where
    the stack has none yet (a first deploy, a change set never run), and in a private subnet the NAT
    gateway's Elastic IP; None where it adds none. (A deployed cluster cannot change private_subnet: the
    deployed-cluster line says why.)"""
    if config.vpc_id:
        return None
    made = frozenset() if found is None else found.resource_types
    if made is None:
        return Check(NETWORK, False, "could not list the stack's resources (cloudformation:ListStackResources)")
    try:
        # A stack with its own VPC has its Elastic IP, or a private_subnet change the deployed-cluster line refuses.
        vpc = "AWS::EC2::VPC" not in made
        elastic_ip = vpc and config.private_subnet
        if not (vpc or elastic_ip):
            return None
        return network_quota(clients["ec2"], clients["service-quotas"], account, vpc, elastic_ip)
    except ClientError as error:  # as the vCPU quota's: say so, check the rest
        return Check(NETWORK, False, f"could not read it: {aws_error(error)}")
