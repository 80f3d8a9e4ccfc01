"""What is left of a cluster after `cdk destroy` (or before): everything tagged gpu-cluster:name=NAME
(NAT gateways, VPC endpoints and KMS keys of a private subnet too), the untagged network interfaces
of its instances and security groups, the public IPv4 addresses of its running instances, its SSM
parameters and dashboard, a stack whose delete failed, and the CDK bootstrap bucket's objects; each with a
monthly cost ("unknown" when no price is known). Deletion (`teardown`) goes in dependency order, and not
while the cluster's stack is alive (one in DELETE_FAILED is not: it is deleted again last). Functions take
boto3 clients."""

from __future__ import annotations

from botocore.exceptions import ClientError

from cluster_node.protocol.contract import CLUSTER_TAG, RETAIN_TAG, parameter_prefix
from clusterops.aws.leftover import KEPT, Leftover
from clusterops.aws.teardown import Pace, delete
from clusterops.cost import HOURS_PER_MONTH, TABLE, offline_price

__all__ = ["KEPT", "Leftover", "Pace", "delete", "failed_stacks", "find", "live_stacks", "monthly_total", "survey"]

CDK_QUALIFIER = "hnb659fds"  # the default `cdk bootstrap` qualifier


class AuditError(RuntimeError):
    """A delete refused (the cluster's stack still holds what it would delete)."""


def _tag_filter(cluster: str) -> list[dict]:
    return [{"Name": f"tag:{CLUSTER_TAG}", "Values": [cluster]}]


def _tags(items: list[dict]) -> dict:
    return {t["Key"]: t["Value"] for t in items or []}


def _instances(ec2, filters: list[dict]) -> list[Leftover]:
    found = []
    pages = ec2.get_paginator("describe_instances").paginate(Filters=filters)
    for i in (i for page in pages for r in page["Reservations"] for i in r["Instances"]):
        state = i["State"]["Name"]
        if state in ("terminated", "shutting-down"):
            continue
        price = offline_price(i["InstanceType"], ec2.meta.region_name).usd_per_hour
        running = state in ("running", "pending")
        monthly = (None if price is None else price * HOURS_PER_MONTH) if running else 0.0
        found.append(Leftover("instance", i["InstanceId"], f"{i['InstanceType']} {state}", monthly))
        if running and i.get("PublicIpAddress"):
            found.append(
                Leftover(
                    "public-ipv4",
                    i["PublicIpAddress"],
                    f"on {i['InstanceId']}",
                    TABLE["public_ipv4_usd_per_hour"] * HOURS_PER_MONTH,
                )
            )
    return found


def spot_requests(ec2, cluster: str, known: set[str]) -> list[Leftover]:
    """Spot nodes' persistent requests (tagged by their launch templates), and an instance one of
    them launched that is not tagged: terminating a node of a persistent request reopens it and
    EC2 launches another, so `cdk destroy` alone can leave nodes running. Cancel them first."""
    found = []
    pages = ec2.get_paginator("describe_spot_instance_requests").paginate(
        Filters=_tag_filter(cluster) + [{"Name": "state", "Values": ["open", "active", "disabled"]}]
    )
    for request in (r for page in pages for r in page["SpotInstanceRequests"]):
        instance = request.get("InstanceId")
        found.append(
            Leftover(
                "spot-request",
                request["SpotInstanceRequestId"],
                f"{request['Type']} {request['State']}, instance {instance or 'none yet'}: "
                "launches a node whenever its instance is gone",
                0.0,
            )
        )
        if instance and instance not in known:
            found += _instances(ec2, [{"Name": "instance-id", "Values": [instance]}])
    return found


def _volumes(ec2, cluster: str, instance_ids: list[str]) -> list[Leftover]:
    """By tag, and by the instances they are attached to: a node a reopened Spot request launched is not
    tagged, nor its root volume, which bills while the node is stopped (priced at $0: its volume is this row)."""
    filters = [_tag_filter(cluster)] + (
        [[{"Name": "attachment.instance-id", "Values": instance_ids}]] * bool(instance_ids)
    )
    volumes = {v["VolumeId"]: v for f in filters for v in ec2.describe_volumes(Filters=f)["Volumes"]}
    return [
        Leftover("volume", vid, f"{v['Size']} GB {v['State']}", v["Size"] * TABLE["gp3_usd_per_gb_month"])
        for vid, v in sorted(volumes.items())
    ]


def _network_interfaces(ec2, cluster: str, instance_ids: list[str]) -> list[Leftover]:
    """ENIs carry no tags: found by the instances they are attached to and by the cluster's
    security groups (the EFS mount targets' too), and by tag for any created by hand."""
    groups = [g["GroupId"] for g in ec2.describe_security_groups(Filters=_tag_filter(cluster))["SecurityGroups"]]
    filters = [_tag_filter(cluster)]
    if instance_ids:
        filters.append([{"Name": "attachment.instance-id", "Values": instance_ids}])
    if groups:
        filters.append([{"Name": "group-id", "Values": groups}])
    enis = {
        e["NetworkInterfaceId"]: e
        for f in filters
        for e in ec2.describe_network_interfaces(Filters=f)["NetworkInterfaces"]
    }
    return [
        Leftover("network-interface", eni_id, f"{e['Status']} {e.get('Description', '')}".strip(), 0.0)
        for eni_id, e in sorted(enis.items())
    ]


def _file_systems(efs, cluster: str) -> list[Leftover]:
    found = []
    pages = efs.get_paginator("describe_file_systems").paginate()  # 100 per page at most
    for fs in (fs for page in pages for fs in page["FileSystems"]):
        tags = _tags(fs.get("Tags"))
        if tags.get(CLUSTER_TAG) == cluster:
            gb = fs["SizeInBytes"]["Value"] / 1e9
            retained = tags.get(RETAIN_TAG) == "true"
            found.append(
                Leftover(
                    "file-system",
                    fs["FileSystemId"],
                    f"EFS {gb:.1f} GB" + (" (kept: retain_data=true)" if retained else ""),
                    gb * TABLE["efs_standard_usd_per_gb_month"],
                    retained,
                )
            )
    return found


def _tagged_elsewhere(ssm, logs, cloudwatch, cluster: str) -> list[Leftover]:
    found = []
    pages = ssm.get_paginator("describe_parameters").paginate(
        ParameterFilters=[{"Key": "Name", "Option": "BeginsWith", "Values": [parameter_prefix(cluster)]}]
    )
    found += [Leftover("parameter", p["Name"], p["Type"], 0.0) for page in pages for p in page["Parameters"]]
    for page in logs.get_paginator("describe_log_groups").paginate():
        for group in page["logGroups"]:
            tags = logs.list_tags_for_resource(resourceArn=group["arn"].removesuffix(":*")).get("tags", {})
            if tags.get(CLUSTER_TAG) == cluster:
                stored = group.get("storedBytes", 0) / 1e9
                found.append(Leftover("log-group", group["logGroupName"], f"{stored:.2f} GB", stored * 0.03))
    for page in cloudwatch.get_paginator("describe_alarms").paginate():
        for alarm in page["MetricAlarms"]:
            tags = _tags(cloudwatch.list_tags_for_resource(ResourceARN=alarm["AlarmArn"])["Tags"])
            if tags.get(CLUSTER_TAG) == cluster:
                found.append(Leftover("alarm", alarm["AlarmName"], alarm["StateValue"], TABLE["alarm_usd_per_month"]))
    return found


def _network(ec2, cluster: str) -> list[Leftover]:
    """A private subnet's NAT gateway and Session Manager endpoints: billed by the hour."""
    nats = ec2.get_paginator("describe_nat_gateways").paginate(Filters=_tag_filter(cluster))
    found = [
        Leftover("nat-gateway", n["NatGatewayId"], n["State"], TABLE["nat_gateway_usd_per_hour"] * HOURS_PER_MONTH)
        for page in nats
        for n in page["NatGateways"]
        # the tag again here: a server that ignores the filter (moto does) would list every cluster's
        if n["State"] not in ("deleting", "deleted", "failed") and _tags(n.get("Tags", [])).get(CLUSTER_TAG) == cluster
    ]
    endpoints = ec2.get_paginator("describe_vpc_endpoints").paginate(Filters=_tag_filter(cluster))
    for e in (e for page in endpoints for e in page["VpcEndpoints"]):
        if e["State"].lower() in ("deleting", "deleted"):
            continue
        zones = max(1, len(e.get("SubnetIds", []))) if e["VpcEndpointType"] == "Interface" else 0
        monthly = zones * TABLE["interface_endpoint_usd_per_hour"] * HOURS_PER_MONTH
        found.append(
            Leftover("vpc-endpoint", e["VpcEndpointId"], f"{e['VpcEndpointType']} {e['ServiceName']}", monthly)
        )
    return found


def _kms_keys(kms, cluster: str) -> list[Leftover]:
    """Customer-managed keys tagged with the cluster; a key pending deletion is gone (KMS pricing:
    no charge while scheduled for deletion)."""
    found = []
    for key in (k for page in kms.get_paginator("list_keys").paginate() for k in page["Keys"]):
        try:
            tags = kms.list_resource_tags(KeyId=key["KeyId"]).get("Tags", [])
            state = kms.describe_key(KeyId=key["KeyId"])["KeyMetadata"]["KeyState"]
        except ClientError:  # another account's key policy may refuse us: not ours
            continue
        if {t["TagKey"]: t["TagValue"] for t in tags}.get(CLUSTER_TAG) == cluster and state not in (
            "PendingDeletion",
            "PendingReplicaDeletion",
        ):
            found.append(Leftover("kms-key", key["KeyId"], state, TABLE["kms_key_usd_per_month"]))
    return found


def dashboard_names(cluster: str, region: str) -> set[str]:
    """The names the stack gives its dashboard (account-global: per region since issue 19 §18)."""
    return {cluster, f"{cluster}-{region}"}


def _dashboards(cloudwatch, cluster: str, region: str) -> list[Leftover]:
    names = dashboard_names(cluster, region)
    pages = cloudwatch.get_paginator("list_dashboards").paginate(DashboardNamePrefix=cluster)
    return [
        Leftover("dashboard", d["DashboardName"], "CloudWatch dashboard", TABLE["dashboard_usd_per_month"])
        for page in pages
        for d in page["DashboardEntries"]
        if d["DashboardName"] in names
    ]


# A stack in DELETE_FAILED holds nothing any more: `cdk destroy` gave up on some of its resources, which bill
# on; they are this audit's to delete, then the stack's delete is asked again.
DELETE_FAILED = "DELETE_FAILED"


def _cluster_stacks(cloudformation, cluster: str) -> list[dict]:
    """The stacks of the cluster: tagged with it (CDK passes the stack's tags to CloudFormation; -c
    stack_name may rename it) or named as app.py names it; none DELETE_COMPLETE."""
    stacks = (s for page in cloudformation.get_paginator("describe_stacks").paginate() for s in page["Stacks"])
    return [
        s
        for s in stacks
        if (_tags(s.get("Tags")).get(CLUSTER_TAG) == cluster or s["StackName"] == f"GpuCluster-{cluster}")
        and s["StackStatus"] != "DELETE_COMPLETE"
    ]


def live_stacks(cloudformation, cluster: str) -> list[tuple[str, str]]:
    """(name, status) of the stacks that hold the cluster (not one whose delete failed: failed_stacks)."""
    stacks = _cluster_stacks(cloudformation, cluster)
    return [(s["StackName"], s["StackStatus"]) for s in stacks if s["StackStatus"] != DELETE_FAILED]


def failed_stacks(cloudformation, cluster: str, ec2=None) -> list[Leftover]:
    """The cluster's stacks in DELETE_FAILED: deleted again (teardown) once what they left is gone; with `ec2`,
    each names what in its VPC it never made (foreign_endpoints)."""
    return [
        Leftover(
            "stack",
            s["StackName"],
            f"{DELETE_FAILED} ({s.get('StackStatusReason') or 'no reason given'}): what it could not delete bills "
            f"on, listed here{foreign_endpoints(cloudformation, ec2, s['StackName'], cluster) if ec2 else ''}; "
            "--delete deletes it, then the stack",
            0.0,
        )
        for s in _cluster_stacks(cloudformation, cluster)
        if s["StackStatus"] == DELETE_FAILED
    ]


def foreign_endpoints(cloudformation, ec2, stack: str, cluster: str) -> str:
    """ ", and its VPC holds endpoints it did not make: ..." when the stack's own VPC holds endpoints not the
    cluster's, which keep the VPC from being deleted: GuardDuty Runtime Monitoring's automated agent makes a
    guardduty-data endpoint in every VPC with instances and "doesn't delete the VPC endpoint" (GuardDuty User
    Guide). Not deleted here: they are not the cluster's."""
    from clusterops.aws.redeploy import stack_resources

    try:
        resources = stack_resources(cloudformation, stack)
    except ClientError:
        return ""
    vpcs = [
        r["PhysicalResourceId"]
        for r in resources
        if r["ResourceType"] == "AWS::EC2::VPC" and r.get("PhysicalResourceId")
    ]
    if not vpcs:
        return ""
    in_vpc = [{"Name": "vpc-id", "Values": vpcs}]
    endpoints = [
        f"{e['VpcEndpointId']} ({e['ServiceName']})"
        for e in ec2.describe_vpc_endpoints(Filters=in_vpc)["VpcEndpoints"]
        if _tags(e.get("Tags")).get(CLUSTER_TAG) != cluster and e["State"].lower() not in ("deleting", "deleted")
    ]
    # GuardDuty makes "a VPC endpoint and a security group associated with this VPC endpoint" (its User Guide)
    groups = [
        f"{g['GroupId']} ({g['GroupName']})"
        for g in ec2.describe_security_groups(Filters=in_vpc)["SecurityGroups"]
        if g["GroupName"] != "default" and _tags(g.get("Tags")).get(CLUSTER_TAG) != cluster
    ]
    if not endpoints and not groups:
        return ""
    found = "; ".join(
        [f"endpoints {', '.join(endpoints)}"] * bool(endpoints)
        + [f"security groups {', '.join(groups)}"] * bool(groups)
    )
    return (
        f", and its VPC {', '.join(vpcs)} holds what it did not make: {found} (GuardDuty's Runtime Monitoring leaves "
        "a guardduty-data endpoint and its group): `aws ec2 delete-vpc-endpoints --vpc-endpoint-ids ID`, then, once "
        "the endpoint is gone (its interfaces go a minute later), `aws ec2 delete-security-group --group-id ID`"
    )


def cdk_assets(sts, s3, region: str) -> list[Leftover]:
    """The CDK bootstrap bucket: every deploy uploads assets (this app's image context zip) that
    `cdk destroy` leaves behind. Which objects are this app's cannot be told from outside."""
    bucket = f"cdk-{CDK_QUALIFIER}-assets-{sts.get_caller_identity()['Account']}-{region}"
    try:
        objects = [
            o for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket) for o in page.get("Contents", [])
        ]
    except ClientError:  # no bootstrap in this region, or no access
        return []
    gb = sum(o["Size"] for o in objects) / 1e9
    return [
        Leftover(
            "cdk-assets", bucket, f"{len(objects)} objects, {gb:.2f} GB", gb * TABLE["s3_standard_usd_per_gb_month"]
        )
    ]


def find(clients: dict, cluster: str) -> list[Leftover]:
    ec2 = clients["ec2"]
    found = _instances(ec2, _tag_filter(cluster))
    found += spot_requests(ec2, cluster, {x.id for x in found if x.kind == "instance"})
    found += _volumes(ec2, cluster, [x.id for x in found if x.kind == "instance"])
    found += _file_systems(clients["efs"], cluster)
    found += _network_interfaces(ec2, cluster, [x.id for x in found if x.kind == "instance"])
    found += [
        Leftover("address", a["AllocationId"], a["PublicIp"], TABLE["public_ipv4_usd_per_hour"] * HOURS_PER_MONTH)
        for a in ec2.describe_addresses(Filters=_tag_filter(cluster))["Addresses"]
    ]
    found += [
        Leftover("key-pair", k["KeyName"], k.get("KeyPairId", ""), 0.0)
        for k in ec2.describe_key_pairs(Filters=_tag_filter(cluster))["KeyPairs"]
    ]
    found += _network(ec2, cluster)
    found += _tagged_elsewhere(clients["ssm"], clients["logs"], clients["cloudwatch"], cluster)
    found += _dashboards(clients["cloudwatch"], cluster, ec2.meta.region_name)
    if "kms" in clients:
        found += _kms_keys(clients["kms"], cluster)
    if "cloudformation" in clients:
        found += failed_stacks(clients["cloudformation"], cluster, ec2)
    if "sts" in clients and "s3" in clients:
        found += cdk_assets(clients["sts"], clients["s3"], ec2.meta.region_name)
    return found


def survey(clients: dict, cluster: str, refuse_live: bool = False) -> tuple[list[Leftover], list[Leftover]]:
    """`fab audit`'s use case: what find() finds, as (the shared CDK bootstrap bucket, the cluster's leftovers);
    with `refuse_live` (before a delete) refused while the cluster's stack is alive."""
    if refuse_live:
        refuse_live_stack(clients["cloudformation"], cluster)
    found = find(clients, cluster)
    return [x for x in found if x.kind == "cdk-assets"], [x for x in found if x.kind != "cdk-assets"]


def refuse_live_stack(cloudformation, cluster: str) -> None:
    """A live stack's resources are CloudFormation's: deleting them under it loses a running
    cluster's /data and leaves the stack failing its own delete."""
    for stack, status in live_stacks(cloudformation, cluster):
        raise AuditError(
            f"stack {stack} ({status}) still holds cluster {cluster}: `npx cdk destroy` it first "
            "(fab audit --delete --force deletes under a live stack)"
        )


def monthly_total(leftovers: list[Leftover]) -> str:
    known = sum(x.usd_per_month for x in leftovers if x.usd_per_month is not None)
    unknown = [x for x in leftovers if x.usd_per_month is None]
    return f"${known:.2f}/month" + (f" + unknown for {len(unknown)} resource(s) without a price" if unknown else "")
