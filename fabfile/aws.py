"""Tasks that talk to the AWS account: before deploying, what it costs, what is left, stopping and
restarting. AWS errors are one line (aws_errors)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from invoke.exceptions import Exit

from clusterops import cost as costs
from clusterops import terminal
from clusterops.aws import audit as audits
from clusterops.aws import deployed
from clusterops.aws import destroy as teardown_plan
from clusterops.aws import preflight as checks
from clusterops.aws.instances import release_spot as release_spot_requests
from clusterops.aws.instances import start_cluster, stop_nodes
from clusterops.aws.session import aws_session, pricing_client
from clusterops.inventory import (
    DEFAULT_OUTPUTS,
    Inventory,
    InventoryError,
)
from clusterops.nodes import records, remote
from clusterops.run import meter

from .common import (
    aws_errors,
    cluster_config,
    inventory_path,
    load_inventory,
    task,
)

if TYPE_CHECKING:
    from stacks.config import ClusterConfig

AUDIT_CLIENTS = ("ec2", "efs", "ssm", "logs", "cloudwatch", "sts", "s3", "kms", "cloudformation")


def context_file() -> Path:
    """cdk.context.json, where `fab preflight` caches the AZs offering the type and pins the AMI for
    `cdk synth`."""
    return Path(os.environ.get("GPU_CLUSTER_CDK_CONTEXT", "cdk.context.json"))


def deploy_config(cli: list[str], **overrides) -> tuple[dict, "ClusterConfig"]:
    """The context `cdk deploy` would see (cdk.json, cdk.context.json, -c KEY=VALUE) and the
    ClusterConfig it parses to, validated the same way; bad values are one line."""
    from clusterops.aws import cdkcontext
    from stacks.config import ClusterConfig, ConfigError
    from stacks.contextkeys import UnknownContextKeyError, check_context_keys, settings_keys

    try:
        given = cdkcontext.parse_cli(cli) | {k: str(v) for k, v in overrides.items() if v is not None}
        check_context_keys(given, settings_keys(Path("cdk.json"), Path.home() / ".cdk.json"))  # as synth does
        context = cdkcontext.merged(Path("cdk.json"), context_file(), given)
        return context, ClusterConfig.from_context(context)
    except (cdkcontext.ContextError, ConfigError, UnknownContextKeyError) as error:
        raise Exit(f"error: {error}", code=1) from None


@task(
    iterable=["context"],
    help={
        "context": "KEY=VALUE, repeatable: the -c values you give `cdk deploy` (over cdk.json, cdk.context.json)",
        "nodes": "node count (same as -c nodes=N)",
        "instance_type": "instance type (same as -c instance_type=T)",
        "request_quota": "file the vCPU quota increase through Service Quotas when short",
        "spot": "Spot nodes (default: the context's spot): the Spot quota bucket, the Spot price and the saving",
        "refresh_ami": "re-resolve the DLAMI parameter and pin its current AMI (the next deploy replaces the nodes)",
    },
)
def preflight(c, context=None, nodes=None, instance_type=None, request_quota=False, spot=False, refresh_ami=False):
    """Check credentials, CDK bootstrap, quota, AZ and AMI before `cdk deploy`.

    Before `cdk deploy`: credentials, region, CDK bootstrap, AZ and subnet, vCPU quota, AMI (pinned),
    launch permission."""
    from stacks.config import stack_name

    values, config = deploy_config(context or [], nodes=nodes, instance_type=instance_type)
    session = aws_session()
    clients = (
        {name: session.client(name) for name in ("sts", "ec2", "ssm", "service-quotas", "kms", "cloudformation")}
        if session.region_name
        else {"sts": session.client("sts", region_name="us-east-1")}
    )
    clients["pricing"] = pricing_client(session)
    with aws_errors("preflight"):
        found, notes = checks.run_preflight(
            clients,
            session.region_name,
            config,
            context_file(),
            request_quota=request_quota,
            spot=spot or config.spot,
            context=values,
            refresh_ami=refresh_ami,
            stack_name=stack_name(values.get("stack_name"), config.cluster_name),
        )
    summary, notes = (notes[0], notes[1:]) if notes else (None, notes)
    if summary:
        print(summary)
    for check in found:
        print(f"{check.label}  {check.name}: {check.detail}")
    for note in notes:
        print(note)
    if not all(check.ok for check in found):
        raise Exit("error: preflight failed; fix the FAIL lines before `cdk deploy`", code=1)


def _positive(name: str, value) -> Optional[float]:
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        number = 0.0
    if number <= 0:
        raise Exit(f"error: invalid --{name.replace('_', '-')} {value!r}: a positive number", code=1)
    return number


@task(
    help={
        "nodes": "node count (default: the inventory, else cdk.json)",
        "instance_type": "instance type (default: the inventory, else cdk.json)",
        "dataset_gb": "the data set's GB on /data, read each epoch: its storage and the EFS Elastic I/O estimate",
        "epochs": "epochs over that data set (with --dataset-gb)",
        "spot": "price Spot nodes (default: what the inventory says, else cdk.json's spot)",
    }
)
def cost(c, nodes=None, instance_type=None, dataset_gb=None, epochs=None, spot=False):
    """The cluster's $/hour, the running job's projection and what was spent.

    $/hour of the cluster, storage and EFS I/O, the running job's projection, what was spent."""
    size, passes = _positive("dataset_gb", dataset_gb), _positive("epochs", epochs)
    inv = Inventory.load(inventory_path(c)) if inventory_path(c).exists() else None
    aws = inv is not None and inv.source == "aws"
    config = cluster_config(
        nodes=nodes or (len(inv.nodes) if aws else None),
        instance_type=instance_type or (inv.instance_type if aws else None),
    )
    spot = spot or (inv.spot if aws else config.spot)
    with aws_errors("fab cost"):
        meter.cost_report(inv, config, spot, size, passes, say=print)


def _on_instances(c, what: str, action):
    """action(inventory, ec2) with the inventory's region; AWS errors as one line."""
    inv = load_inventory(c)
    with aws_errors(f"fab {what}"):
        return action(inv, aws_session(inv.region).client("ec2"))


@task(help={"skip_interrupted": "start the others when EC2 stopped a Spot node (only EC2 starts that one again)"})
def start(c, skip_interrupted=False):
    """Start the cluster's stopped nodes and refresh the inventory.

    Start the cluster's stopped nodes (after autostop or --then-stop) and refresh the inventory."""
    fresh, line = _on_instances(
        c,
        "start",
        lambda inv, ec2: start_cluster(inv, ec2, skip_interrupted, aws_session(inv.region).client("cloudwatch")),
    )
    fresh.save(inventory_path(c))
    print(line)


@task
def stop_cluster(c):
    """Stop every node now; `fab start` brings them back.

    Stop every node now (EBS and EFS keep billing, instance-store NVMe is erased); `fab start` restarts."""
    stopped = _on_instances(c, "stop-cluster", stop_nodes)
    print(f"stopping {', '.join(stopped) or 'nothing (no node was running)'}; `fab start` brings them back")


def _cluster_and_session(c, cluster: Optional[str]):
    """The cluster's name (given, else the inventory's, else cdk.json's) and a session in its region."""
    inv = Inventory.load(inventory_path(c)) if inventory_path(c).exists() else None
    name = cluster or (inv.cluster if inv and inv.source == "aws" else cluster_config().cluster_name)
    session = aws_session(inv.region if inv and inv.region else None)
    if not session.region_name:
        raise Exit("error: no AWS region: set AWS_REGION or `aws configure`", code=1)
    return name, session


@task(help={"yes": "destroy even when /data holds a run going or runs not fetched (they go with the file system)"})
def destroy(c, yes=False):
    """Tear the cluster down once /data would lose nothing (`npx cdk destroy`).

    `npx cdk destroy` of the inventory's stack, refused in one line while a run goes or /data holds runs
    never fetched or changed since (unless retain_data=true kept the file system), or while the head node
    cannot be reached (a stopped cluster: `fab start` first, unless it keeps its file system); --yes destroys
    anyway. Then `fab audit`."""
    inv = load_inventory(c)
    if inv.source != "aws":
        raise Exit("error: the inventory is the emulated cluster's: `fab local.down` tears it down", code=1)
    # cdk.json's directory, the app `cdk destroy` runs: this checkout (GPU_CLUSTER_CDK_APP: a copy of it)
    project = Path(os.environ.get("GPU_CLUSTER_CDK_APP") or Path(__file__).resolve().parent.parent)
    session = aws_session(inv.region)
    clients = {name: session.client(name) for name in ("cloudformation", "efs", "ec2")}
    with aws_errors("fab destroy"):
        try:
            print(teardown_plan.destroy(inv, clients, lambda: _at_risk(inv), project, yes))
        except teardown_plan.DestroyError as error:
            raise Exit(f"error: {error}", code=1) from None


def _at_risk(inv):
    """What /data holds, from the first node that answers (each mounts it; the head first, whose launcher
    is the run's). A node whose program fails (RemoteError) is the answer: the others run the same image."""
    unreachable: Exception = RuntimeError("no node in the inventory")
    for node in sorted(inv.nodes, key=lambda n: n.name != inv.head.name):
        try:
            with remote.connect(inv, node) as connection:
                return records.at_risk(connection, inv)
        except remote.RemoteError as error:
            raise teardown_plan.UnansweredError(str(error)) from None
        except Exception as error:  # noqa: BLE001 - this node is down or unreachable: try the next
            unreachable = error
    raise unreachable


@task(help={"cluster": "cluster name (default: the inventory's, else cdk.json's)"})
def release_spot(c, cluster=None):
    """Cancel a Spot cluster's persistent requests before `cdk destroy`.

    Before `cdk destroy` of a Spot cluster: cancel its persistent Spot requests (else EC2 launches a
    new node for each one CloudFormation terminates). Refused while their nodes run: `fab stop-cluster`
    first (EC2 cannot stop a Spot node whose request is cancelled)."""
    name, session = _cluster_and_session(c, cluster)
    with aws_errors("fab release-spot"):
        try:
            print(release_spot_requests(session.client("ec2"), name))
        except InventoryError as error:
            raise Exit(f"error: {error}", code=1) from None


@task(
    help={
        "cluster": "cluster name (default: the inventory's, else cdk.json's)",
        "delete": "delete what is found, after confirmation",
        "yes": "do not ask (scripts)",
        "include_retained": "also delete a file system kept with retain_data=true (its data is lost)",
        "force": "delete even while the cluster's CloudFormation stack exists (its /data included)",
    }
)
def audit(c, cluster=None, delete=False, yes=False, include_retained=False, force=False):
    """Anything left of the cluster and its monthly cost; --delete removes it.

    Anything left of the cluster, with its monthly cost; --delete removes it in dependency order
    (not while its stack exists: `cdk destroy` first)."""
    name, session = _cluster_and_session(c, cluster)
    clients = {k: session.client(k) for k in AUDIT_CLIENTS}
    with aws_errors("fab audit"):
        shared, leftovers = audits.survey(clients, name, refuse_live=delete and not force)
    for x in shared:
        print(
            f"CDK bootstrap bucket {x.id}: {x.detail}, {costs.usd(x.usd_per_month)}/month ({audits.KEPT['cdk-assets']})"
        )
    if not leftovers:
        print(f"nothing tagged gpu-cluster:name={name} in {session.region_name}")
        return
    rows = [
        {
            "kind": x.kind,
            "id": x.id,
            "detail": x.detail,
            "usd_per_month": "unknown" if x.usd_per_month is None else f"{x.usd_per_month:.2f}",
        }
        for x in leftovers
    ]
    print(terminal.table(rows, ["kind", "id", "detail", "usd_per_month"]))
    print(
        f"total: {audits.monthly_total(leftovers)} in {session.region_name} "
        f"(instance prices: {costs.TABLE['region']} offline table of {costs.TABLE['date']})"
    )
    if not delete:
        return
    if not yes and input(f"delete these {len(leftovers)} resources? type {name} to confirm: ").strip() != name:
        raise Exit("nothing deleted", code=1)
    failed = audits.delete(clients, leftovers, include_retained=include_retained)
    if failed:
        raise Exit(f"error: {len(failed)} resource(s) could not be deleted; run `fab audit` again", code=1)


@task(
    help={
        "stack": "stack name (default: the one cluster stack in the outputs file)",
        "outputs": f"cdk outputs file (default {DEFAULT_OUTPUTS})",
        "from_aws": "describe the stack with boto3 instead of reading the outputs file "
        "(also the fallback when the outputs file is missing and --stack is given)",
        "key_file": "private key of your own key pair (when deployed with -c key_name=...)",
    }
)
def inventory(c, stack=None, outputs=str(DEFAULT_OUTPUTS), from_aws=False, key_file=None):
    """Build .cluster/inventory.json from the deploy's outputs and EC2.

    Build .cluster/inventory.json (deploy outputs, EC2's addresses, keys, node price)."""
    with aws_errors("fab inventory"):
        inv, price = deployed.inventory(stack, Path(outputs), from_aws, key_file, inventory_path(c), say=print)
    print(
        f"{inventory_path(c)}: {len(inv.nodes)} node(s) of {inv.instance_type}, head {inv.head.public_ip}, "
        f"{costs.usd(price.usd_per_hour)}/node-hour [{price.source}]"
    )
