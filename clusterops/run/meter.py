"""What the cluster costs now, as the laptop sees it (its boto3 session: clusterops.aws.session): the node price
(the one `fab inventory` kept, else the offline table's; a budget's Spot ceiling), the nodes that bill, the EFS
I/O rate, and a running job's projection. Read by fab train's budget (trainlaunch), fab cost, runs and plan."""

from __future__ import annotations

from typing import Callable, Optional

from cluster_node.protocol import rundir
from clusterops import cost as costs
from clusterops.aws.instances import spot_interrupted
from clusterops.aws.session import aws_session, nodes_zone, pricing_client
from clusterops.inventory import Inventory, describe
from clusterops.nodes import remote
from clusterops.run import lifecycle

Say = Callable[[str], None]


def kept_price(inv: Optional[Inventory], instance_type: str) -> Optional[costs.Price]:
    """The price `fab inventory` kept, if it is for this type."""
    if inv is None or inv.usd_per_hour is None or inv.instance_type != instance_type:
        return None
    return costs.Price(inv.usd_per_hour, inv.price_source)


def node_price(inv: Inventory) -> costs.Price:
    """The inventory's node price: the one `fab inventory` kept, else the offline table's."""
    return kept_price(inv, inv.instance_type) or costs.offline_price(inv.instance_type, inv.region or "us-east-1")


def budget_price(inv: Inventory, session=None) -> costs.Price:
    """The node price a --budget-usd meters at: node_price, but on a Spot cluster on AWS the most a Spot
    node-hour can cost (its max price, else On-Demand), not the Spot price `fab inventory` saw."""
    from botocore.exceptions import BotoCoreError, ClientError

    if inv.source != "aws" or not inv.spot:
        return node_price(inv)
    region, ids = inv.region or "us-east-1", [n.instance_id for n in inv.nodes if n.instance_id]
    try:
        session = session or aws_session(inv.region)
        ec2, pricing = session.client("ec2"), pricing_client(session)
    except (BotoCoreError, ClientError):
        ec2 = pricing = None
    return costs.spot_ceiling(ec2, pricing, inv.instance_type, region, ids)


def billed_nodes(inv: Inventory, session=None) -> int:
    """The cluster's nodes that bill: all but a Spot node EC2 interrupted and still holds stopped (only EC2
    starts it again; a stopped instance bills no usage); all when EC2 cannot say: the safe side of a budget."""
    from botocore.exceptions import BotoCoreError, ClientError

    ids = [n.instance_id for n in inv.nodes if n.instance_id]
    if inv.source != "aws" or not ids:
        return len(inv.nodes)
    try:
        return len(inv.nodes) - len(spot_interrupted(describe((session or aws_session(inv.region)).client("ec2"), ids)))
    except (BotoCoreError, ClientError):
        return len(inv.nodes)


def efs_io_rate(inv: Inventory, session=None) -> Optional[float]:
    """EFS Elastic-throughput dollars per hour at the last hour's rate; None when unknown."""
    from botocore.exceptions import BotoCoreError, ClientError

    if inv.source != "aws" or not inv.file_system_id:
        return None
    try:
        cloudwatch = (session or aws_session(inv.region)).client("cloudwatch")
        return costs.efs_io_usd_per_hour(cloudwatch, inv.file_system_id)
    except (BotoCoreError, ClientError):
        return None


def projector(inv: Inventory, say: Callable[[str], None] = lambda line: print(line, flush=True)):
    """On AWS: say once what the run will cost (nodes and EFS I/O), as soon as its step time is
    known; "unknown" where no price is known, never an exception after the run has started."""
    if inv.source != "aws":
        return None
    price = node_price(inv)
    hourly = None if price.usd_per_hour is None else price.usd_per_hour * len(inv.nodes)
    printed: list[str] = []

    def on_progress(progress: Optional[rundir.Progress]) -> None:
        if printed or not costs.projection(progress, hourly):
            return
        line = costs.projection(progress, hourly, efs_io_rate(inv)) or ""
        say(f"cost: {line} [{price.source}]")
        printed.append(line)

    return on_progress


def cost_report(
    inv: Optional[Inventory], config, spot: bool, size: Optional[float], passes: Optional[float], say: Say = print
) -> None:
    """`fab cost`'s use case: the cluster's $/hour (`config`, a stacks.config.ClusterConfig: cdk.json and the
    task's overrides), storage and EFS I/O; on AWS what the running nodes spent; the running job's projection."""
    on_aws = inv if inv is not None and inv.source == "aws" else None  # the inventory of AWS nodes
    aws = on_aws is not None
    session = aws_session(on_aws.region if on_aws else None)
    region = session.region_name or "us-east-1"
    price, saving = costs.node_price(
        session.client("ec2") if session.region_name else None,
        pricing_client(session),
        config.instance_type,
        region,
        spot,
        (nodes_zone(session, inv) if spot else None) or config.availability_zone,
        kept=kept_price(inv if aws else None, config.instance_type),
    )
    if saving:
        say(saving)
    efs_gb = 0.0
    if on_aws and on_aws.file_system_id:
        fs = session.client("efs").describe_file_systems(FileSystemId=on_aws.file_system_id)["FileSystems"][0]
        efs_gb = fs["SizeInBytes"]["Value"] / 1e9
    layout = deployed_layout(session, on_aws, config) if on_aws else planned_layout(config)
    estimate = costs.Estimate(config.nodes, price, efs_gb=efs_gb, dataset_gb=size, epochs=passes, **layout)
    say("\n".join(estimate.lines()))
    if on_aws:
        _spent(session, on_aws, price, say)
    say(costs.table_line())
    if inv is not None and inv.source == "local":
        say(
            f"the emulated cluster {inv.cluster!r} costs nothing: the estimate above is for "
            f"{config.nodes} x {config.instance_type} on AWS (cdk.json, or --nodes/--instance-type); "
            "a CPU step time says nothing about a GPU's, so no run projection"
        )
    elif inv is not None:
        with remote.connect(inv, inv.head) as conn:
            run = lifecycle.active_run(conn, inv)
            line = run and costs.projection(
                lifecycle.run_state(conn, inv, run).progress, estimate.usd_per_hour, efs_io_rate(inv, session)
            )
        say(line or "no run going")


def planned_layout(config) -> dict:
    """What a deploy of `config` would bill beside its nodes: its root volumes, subnet layout, public addresses and
    the flow-log key (only the stack's own VPC logs its rejected flows: stacks/network.py)."""
    # access=ssh asks each node for one; with access=ssm the subnet decides: the stack's own public ones assign one
    public = not config.private_subnet and (config.access == "ssh" or not config.vpc_id)
    return dict(
        root_gb=config.root_volume_gb,
        private_subnet=config.private_subnet,
        public_ips=config.nodes * public,
        flow_log_key=config.flow_logs and not config.vpc_id,
    )


def deployed_layout(session, inv: Inventory, config) -> dict:
    """planned_layout as the deployed cluster has it: cdk.json need not hold the `-c` values it was deployed with
    (context is not kept between deploys). Its own VPC's NAT gateway (the stack's resources), its nodes' EBS
    volumes, public addresses and KMS key; what cannot be read comes from `config`."""
    from clusterops.aws import destroy, redeploy

    ec2 = session.client("ec2")
    found = redeploy.deployed(session.client("cloudformation"), ec2, destroy.stack_of(inv))
    types = found.resource_types if found else None
    planned = planned_layout(config)
    private = planned["private_subnet"] if types is None else "AWS::EC2::NatGateway" in types
    ids = [node.instance_id for node in inv.nodes if node.instance_id]
    attached = [{"Name": "attachment.instance-id", "Values": ids}]
    volumes = ec2.describe_volumes(Filters=attached)["Volumes"] if ids else []
    return dict(
        root_gb=round(sum(v["Size"] for v in volumes) / len(ids)) if volumes else planned["root_gb"],
        private_subnet=private,
        public_ips=_public_ips(ec2, found.nodes, found.outputs.get("Access")) if found else 0,
        flow_log_key=planned["flow_log_key"] if types is None else "AWS::KMS::Key" in types,
    )


def _public_ips(ec2, nodes, access: Optional[str]) -> int:
    """The nodes' public IPv4 addresses, from EC2 (Node.public_ip is an address to reach, not one: an instance
    id with access=ssm, the private IP without a public one). A stop releases a node's; it gets one again at its
    start with access=ssh (its interface asks), else where its subnet maps public IPs on launch."""
    live = [n for n in nodes if n["State"]["Name"] not in ("shutting-down", "terminated")]
    waiting = [n for n in live if not n.get("PublicIpAddress") and n["State"]["Name"] in ("stopping", "stopped")]
    subnets = sorted({n["SubnetId"] for n in waiting if n.get("SubnetId")}) if access != "ssh" else []
    maps = {s["SubnetId"]: s.get("MapPublicIpOnLaunch", False) for s in _subnets(ec2, subnets)}
    at_start = [n for n in waiting if access == "ssh" or maps.get(n.get("SubnetId", ""))]
    return sum(1 for n in live if n.get("PublicIpAddress")) + len(at_start)


def _subnets(ec2, ids: list[str]) -> list[dict]:
    return ec2.describe_subnets(SubnetIds=ids)["Subnets"] if ids else []


def _spent(session, inv: Inventory, price: costs.Price, say: Say = print) -> None:
    from datetime import datetime, timedelta, timezone

    ids = [n.instance_id for n in inv.nodes if n.instance_id]
    reservations = session.client("ec2").describe_instances(InstanceIds=ids)["Reservations"]
    launched = [i["LaunchTime"] for r in reservations for i in r["Instances"] if i["State"]["Name"] == "running"]
    say(f"spent since the running nodes started: {costs.usd(costs.spent(launched, price.usd_per_hour))}")
    if inv.file_system_id:
        now = datetime.now(timezone.utc)
        read, written = costs.efs_io_gb(session.client("cloudwatch"), inv.file_system_id, now - timedelta(days=1), now)
        say(
            f"EFS I/O in the last 24 h: {read:.1f} GB read, {written:.1f} GB written = "
            f"${costs.efs_io_usd(read, written):.2f}"
        )
