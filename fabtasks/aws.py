"""Tasks that talk to the AWS account: before deploying, what it costs, what is left, restarting."""
from __future__ import annotations

from pathlib import Path

from fabric import task
from invoke.exceptions import Exit

from clusterops import audit as audits
from clusterops import cost as costs
from clusterops import preflight as checks
from clusterops import remote, report
from clusterops.inventory import (DEFAULT_OUTPUTS, Inventory, InventoryError, from_outputs,
                                  stack_outputs_from_aws, stack_outputs_from_file, start_and_refresh)

from .common import ERRORS, aws_session, cluster_config, fail, head, inventory_path, load_inventory


@task(help={"nodes": "node count (default: cdk.json)", "instance_type": "instance type (default: cdk.json)",
            "request_quota": "file the vCPU quota increase through Service Quotas when short",
            "spot": "check the Spot quota bucket instead of On-Demand"})
def preflight(c, nodes=None, instance_type=None, request_quota=False, spot=False):
    """Before `cdk deploy`: credentials, region, offering, vCPU quota, a RunInstances dry run, the AMI."""
    config = cluster_config(nodes=nodes, instance_type=instance_type)
    session = aws_session()
    clients = {name: session.client(name) for name in ("sts", "ec2", "ssm", "service-quotas")} \
        if session.region_name else {"sts": session.client("sts", region_name="us-east-1")}
    found, notes = checks.run_preflight(clients, session.region_name, config.instance_type, config.nodes,
                                        config.ami_parameter, request_quota=request_quota, spot=spot)
    for check in found:
        print(f"{'ok  ' if check.ok else 'FAIL'}  {check.name}: {check.detail}")
    for note in notes:
        print(note)
    if not all(check.ok for check in found):
        raise Exit("error: preflight failed; fix the FAIL lines before `cdk deploy`", code=1)


@task(help={"nodes": "node count (default: the inventory, else cdk.json)",
            "instance_type": "instance type (default: the inventory, else cdk.json)"})
def cost(c, nodes=None, instance_type=None):
    """$/hour of the cluster, storage per month, the running job's projection and what was spent."""
    inv = Inventory.load(inventory_path(c)) if inventory_path(c).exists() else None
    aws = inv is not None and inv.source == "aws"
    config = cluster_config(nodes=nodes or (len(inv.nodes) if aws else None),
                             instance_type=instance_type or (inv.instance_type if aws else None))
    session = aws_session(inv.region if aws else None)
    region = session.region_name or "us-east-1"
    try:
        from botocore.config import Config
        pricing = session.client("pricing", region_name="us-east-1",
                                 config=Config(connect_timeout=5, read_timeout=10, retries={"max_attempts": 1}))
        price = costs.instance_price(pricing, config.instance_type, region)
    except KeyError as error:
        raise Exit(f"error: {error.args[0]}", code=1) from None
    efs_gb = 0.0
    if aws and DEFAULT_OUTPUTS.exists():
        _, outputs = stack_outputs_from_file(DEFAULT_OUTPUTS)
        fs = session.client("efs").describe_file_systems(FileSystemId=outputs["FileSystemId"])["FileSystems"][0]
        efs_gb = fs["SizeInBytes"]["Value"] / 1e9
    estimate = costs.Estimate(config.nodes, price, config.root_volume_gb, efs_gb)
    print("\n".join(estimate.lines()))
    if aws:
        ids = [n.instance_id for n in inv.nodes if n.instance_id]
        reservations = session.client("ec2").describe_instances(InstanceIds=ids)["Reservations"]
        launched = [i["LaunchTime"] for r in reservations for i in r["Instances"] if i["State"]["Name"] == "running"]
        print(f"spent since the running nodes started: ${costs.spent(launched, price.usd_per_hour):.2f}")
    if inv is not None:
        with head(inv) as conn:
            run = remote.active_run(conn, inv)
            line = run and costs.projection(remote.run_state(conn, run)["progress"], estimate.usd_per_hour)
        print(line or "no run going")


@task
def start(c):
    """Start the cluster's stopped nodes (after autostop or --then-stop) and refresh the inventory."""
    inv = load_inventory(c)
    try:
        fresh = start_and_refresh(inv, aws_session(inv.region).client("ec2"))
    except ERRORS as error:
        raise fail(error) from None
    fresh.save(inventory_path(c))
    print(f"{len(fresh.nodes)} node(s) running; head {fresh.head.public_ip}; run `fab status` once they are ready")


@task(help={"cluster": "cluster name (default: the inventory's, else cdk.json's)",
            "delete": "delete what is found, after confirmation", "yes": "do not ask (scripts)"})
def audit(c, cluster=None, delete=False, yes=False):
    """Anything still tagged with the cluster, with its monthly cost; --delete removes it."""
    inv = Inventory.load(inventory_path(c)) if inventory_path(c).exists() else None
    name = cluster or (inv.cluster if inv and inv.source == "aws" else cluster_config().cluster_name)
    session = aws_session(inv.region if inv and inv.region else None)
    if not session.region_name:
        raise Exit("error: no AWS region: set AWS_REGION or `aws configure`", code=1)
    clients = {k: session.client(k) for k in ("ec2", "efs", "ssm", "logs", "cloudwatch")}
    leftovers = audits.find(clients, name)
    if not leftovers:
        print(f"nothing tagged gpu-cluster:name={name} in {session.region_name}")
        return
    rows = [{"kind": x.kind, "id": x.id, "detail": x.detail, "usd_per_month": f"{x.usd_per_month:.2f}"}
            for x in leftovers]
    print(report.table(rows, ["kind", "id", "detail", "usd_per_month"]))
    print(f"total: ${sum(x.usd_per_month for x in leftovers):.2f}/month in {session.region_name}")
    if not delete:
        return
    if not yes and input(f"delete these {len(leftovers)} resources? type {name} to confirm: ").strip() != name:
        raise Exit("nothing deleted", code=1)
    failed = audits.delete(clients, leftovers)
    if failed:
        raise Exit(f"error: {len(failed)} resource(s) could not be deleted; run `fab audit` again", code=1)


@task(help={"stack": "stack name (default: the one cluster stack in the outputs file)",
            "outputs": f"cdk outputs file (default {DEFAULT_OUTPUTS})",
            "from_aws": "describe the stack with boto3 instead of reading the outputs file "
                        "(also the fallback when the outputs file is missing and --stack is given)",
            "key_file": "private key of your own key pair (when deployed with -c key_name=...)"})
def inventory(c, stack=None, outputs=str(DEFAULT_OUTPUTS), from_aws=False, key_file=None):
    """Build .cluster/inventory.json from the deploy outputs; fetch the SSH key and host key once."""
    try:
        if not from_aws and not Path(outputs).exists() and stack:
            print(f"no {outputs}: describing stack {stack} instead")
            from_aws = True
        if from_aws:
            if not stack:
                raise InventoryError("--from-aws needs --stack NAME")
            session = aws_session()
            name, outs = stack, stack_outputs_from_aws(stack, session)
        else:
            name, outs = stack_outputs_from_file(Path(outputs))
            if stack and stack != name:
                raise InventoryError(f"{outputs} holds stack {name}, not {stack}")
            session = aws_session(outs.get("Region"))
        target = inventory_path(c)
        inv = from_outputs(name, outs, session, target.parent / "keys", key_file=key_file)
    except ERRORS as error:
        raise fail(error) from None
    inv.save(target)
    print(f"{target}: {len(inv.nodes)} node(s) of {inv.instance_type}, head {inv.head.public_ip}")
