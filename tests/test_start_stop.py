"""fab start / fab stop-cluster / fab inventory on AWS (issue item 6): a start right after an autostop
waits for `stopped`, a capacity failure stops the partial start, addresses come from EC2 as it is now.
moto's instances stop at once and never lack capacity, so those two are driven through botocore's
Stubber with EC2's real response shapes; the rest runs against a moto server."""

import json
import subprocess
from pathlib import Path

import boto3
import pytest
from botocore.stub import ANY, Stubber
from conftest import REPO, moto_instances, tool_env
from iampolicy import Request, evaluate

from clusterops.aws.instances import start_and_refresh
from clusterops.inventory import (
    Inventory,
    InventoryError,
    Node,
    SshSettings,
    from_outputs,
    write_known_hosts,
)

HOST_KEY = "ssh-ed25519 AAAAHOSTKEY"


def inventory(tmp_path: Path, ids: list[str]) -> Inventory:
    known = tmp_path / "known_hosts"
    write_known_hosts(known, [f"198.51.100.{r + 1}" for r in range(len(ids))], HOST_KEY, 4444)
    return Inventory(
        cluster="c",
        source="aws",
        gpus_per_node=1,
        region="us-east-1",
        instance_type="g4dn.xlarge",
        nodes=[Node(r, f"node{r}", f"198.51.100.{r + 1}", f"10.0.0.{r + 9}", i) for r, i in enumerate(ids)],
        ssh=SshSettings("root", 4444, str(tmp_path / "k"), str(known)),
    )


def described(*states, reason=None) -> dict:
    """A describe_instances response: (id, state[, public ip]) per instance."""
    instances = []
    for instance_id, state, *ip in states:
        item = {"InstanceId": instance_id, "State": {"Name": state, "Code": 0}, "PrivateIpAddress": "10.0.0.9"}
        if ip:
            item["PublicIpAddress"] = ip[0]
        if reason:
            item["StateReason"] = {"Code": "Server.InsufficientInstanceCapacity", "Message": reason}
        instances.append(item)
    return {"Reservations": [{"ReservationId": "r-1", "Instances": instances}]}


def ec2_stub():
    client = boto3.client(
        "ec2",
        region_name="us-east-1",
        aws_access_key_id="x",
        aws_secret_access_key="x",
        endpoint_url="https://ec2.invalid",
    )
    return client, Stubber(client)


def test_start_right_after_an_autostop_waits_for_stopped_first(tmp_path):
    ec2, stubber = ec2_stub()
    ids = ["i-0aaaaaaaaaaaaaaa1", "i-0aaaaaaaaaaaaaaa2"]
    stubber.add_response("describe_instances", described((ids[0], "stopping"), (ids[1], "stopped")))
    stubber.add_response("describe_instances", described((ids[0], "stopped")), {"InstanceIds": [ids[0]]})  # waiter
    stubber.add_response("start_instances", {"StartingInstances": []}, {"InstanceIds": ids})
    stubber.add_response(
        "describe_instances", described((ids[0], "running"), (ids[1], "running")), {"InstanceIds": ids}
    )  # waiter
    stubber.add_response(
        "describe_instances",
        described((ids[0], "running", "203.0.113.10"), (ids[1], "running", "203.0.113.11")),
        {"Filters": ANY},
    )
    with stubber:
        fresh = start_and_refresh(inventory(tmp_path, ids), ec2)
        stubber.assert_no_pending_responses()
    assert [n.public_ip for n in fresh.nodes] == ["203.0.113.10", "203.0.113.11"]
    assert (tmp_path / "known_hosts").read_text().splitlines() == [
        f"[203.0.113.{10 + r}]:4444 {HOST_KEY}" for r in range(2)
    ]


def _a_start_of_two_stopped_nodes(stubber, ids: list[str]) -> None:
    """EC2's answers to start_and_refresh(wait=False) of two stopped nodes: described, started, addressed."""
    stubber.add_response("describe_instances", described((ids[0], "stopped"), (ids[1], "stopped")))
    stubber.add_response("start_instances", {"StartingInstances": []}, {"InstanceIds": ids})
    stubber.add_response(
        "describe_instances",
        described((ids[0], "running", "203.0.113.10"), (ids[1], "running", "203.0.113.11")),
        {"Filters": ANY},
    )


def test_start_sends_each_node_a_busy_beat_before_it_starts_them(tmp_path):
    """The eighth read: a node's idle alarm stops it when it changes to ALARM; a start as its window of missing
    beats runs out was stopped before the node's own first beat. The beat is the watchdog's (namespace, name,
    InstanceId, unit: the alarm's metric), sent before StartInstances; the rehearsal holds it to the
    documented user policy."""
    ec2, stubber = ec2_stub()
    cloudwatch = boto3.client("cloudwatch", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    beats = Stubber(cloudwatch)
    ids = ["i-0aaaaaaaaaaaaaaa1", "i-0aaaaaaaaaaaaaaa2"]
    metric = {"MetricName": "Busy", "Value": 1.0, "Unit": "Count"}
    beats.add_response(
        "put_metric_data",
        {},
        {
            "Namespace": "GpuCluster/Autostop",
            "MetricData": [{**metric, "Dimensions": [{"Name": "InstanceId", "Value": i}]} for i in ids],
        },
    )
    order: list[str] = []
    cloudwatch.meta.events.register("before-parameter-build.cloudwatch.PutMetricData", lambda **_: order.append("beat"))
    ec2.meta.events.register("before-parameter-build.ec2.StartInstances", lambda **_: order.append("start"))
    _a_start_of_two_stopped_nodes(stubber, ids)
    with stubber, beats:
        start_and_refresh(inventory(tmp_path, ids), ec2, wait=False, cloudwatch=cloudwatch)
        beats.assert_no_pending_responses()
    assert order == ["beat", "start"]
    # A policy without the grant (one applied before it): the nodes start all the same, with a warning.
    beats.add_client_error("put_metric_data", "AccessDenied", "not authorized to perform: cloudwatch:PutMetricData")
    _a_start_of_two_stopped_nodes(stubber, ids)
    notes: list[str] = []
    with stubber, beats:
        start_and_refresh(inventory(tmp_path, ids), ec2, wait=False, cloudwatch=cloudwatch, notes=notes)
        stubber.assert_no_pending_responses()
    assert order[2:] == ["beat", "start"] and len(notes) == 1
    assert notes[0].startswith("warning: no busy heartbeat before the start (") and "AccessDenied" in notes[0]


def test_a_capacity_failure_stops_what_did_start_and_says_so_in_one_line(tmp_path):
    ec2, stubber = ec2_stub()
    ids = ["i-0aaaaaaaaaaaaaaa1", "i-0aaaaaaaaaaaaaaa2"]
    stubber.add_response("describe_instances", described((ids[0], "stopped"), (ids[1], "stopped")))
    stubber.add_client_error(
        "start_instances",
        service_error_code="InsufficientInstanceCapacity",
        service_message="We currently do not have sufficient p5.48xlarge capacity",
        expected_params={"InstanceIds": ids},
    )
    stubber.add_response("describe_instances", described((ids[0], "pending"), (ids[1], "stopped")))
    stubber.add_response("stop_instances", {"StoppingInstances": []}, {"InstanceIds": [ids[0]]})
    with stubber, pytest.raises(InventoryError) as raised:
        start_and_refresh(inventory(tmp_path, ids), ec2)
    stubber.assert_no_pending_responses()
    message = str(raised.value)
    assert "\n" not in message and "InsufficientInstanceCapacity" in message
    assert "stopped the 1 that did" in message and "try `fab start` later" in message


def test_a_node_that_fails_to_start_later_is_reported_and_the_others_stopped(tmp_path):
    ec2, stubber = ec2_stub()
    ids = ["i-0aaaaaaaaaaaaaaa1", "i-0aaaaaaaaaaaaaaa2"]
    stubber.add_response("describe_instances", described((ids[0], "stopped"), (ids[1], "stopped")))
    stubber.add_response("start_instances", {"StartingInstances": []}, {"InstanceIds": ids})
    stubber.add_response("describe_instances", described((ids[0], "running"), (ids[1], "stopping")))  # waiter fails
    stubber.add_response(
        "describe_instances",
        described((ids[0], "running"), (ids[1], "stopped"), reason="Server.InsufficientInstanceCapacity"),
    )
    stubber.add_response("describe_instances", described((ids[0], "running"), (ids[1], "stopped")))
    stubber.add_response("stop_instances", {"StoppingInstances": []}, {"InstanceIds": [ids[0]]})
    with (
        stubber,
        pytest.raises(
            InventoryError,
            match=r"i-0aaaaaaaaaaaaaaa2 stopped: Server.InsufficientInstanceCapacity"
            r".*stopped the 1 that did",
        ),
    ):
        start_and_refresh(inventory(tmp_path, ids), ec2)
    stubber.assert_no_pending_responses()


def _spot_interrupted(response: dict, instance_id: str) -> dict:
    for instance in response["Reservations"][0]["Instances"]:
        if instance["InstanceId"] == instance_id:
            instance["StateReason"] = {"Code": "Server.SpotInstanceShutdown", "Message": "Server.SpotInstanceShutdown"}
    return response


def test_a_spot_node_ec2_interrupted_is_not_started_and_nothing_else_is(tmp_path):
    """Only EC2 starts a Spot instance it stopped (interruption-behavior.html): StartInstances on it fails.
    A stub: moto does not emulate Spot interruptions. Before: every stopped node went to StartInstances."""
    ec2, stubber = ec2_stub()
    ids = ["i-0aaaaaaaaaaaaaaa1", "i-0aaaaaaaaaaaaaaa2"]
    stubber.add_response(
        "describe_instances", _spot_interrupted(described((ids[0], "stopped"), (ids[1], "stopped")), ids[1])
    )
    with stubber, pytest.raises(InventoryError, match=r"^i-0aaaaaaaaaaaaaaa2 stopped by a Spot interruption: only EC2"):
        start_and_refresh(inventory(tmp_path, ids), ec2)
    stubber.assert_no_pending_responses()  # no StartInstances at all


def test_skip_interrupted_starts_the_others(tmp_path):
    ec2, stubber = ec2_stub()
    ids = ["i-0aaaaaaaaaaaaaaa1", "i-0aaaaaaaaaaaaaaa2"]
    stubber.add_response(
        "describe_instances", _spot_interrupted(described((ids[0], "stopped"), (ids[1], "stopped")), ids[1])
    )
    stubber.add_response("start_instances", {"StartingInstances": []}, {"InstanceIds": [ids[0]]})
    stubber.add_response("describe_instances", described((ids[0], "running")), {"InstanceIds": [ids[0]]})  # waiter
    stubber.add_response(
        "describe_instances", described((ids[0], "running", "203.0.113.10"), (ids[1], "stopped")), {"Filters": ANY}
    )
    with stubber:
        fresh = start_and_refresh(inventory(tmp_path, ids), ec2, skip_interrupted=True)
        stubber.assert_no_pending_responses()
    assert fresh.nodes[0].public_ip == "203.0.113.10"


def test_skip_interrupted_refuses_when_the_head_node_is_the_interrupted_one(tmp_path):
    """Every task reaches the cluster through node0: starting the others would bill for nothing."""
    ec2, stubber = ec2_stub()
    ids = ["i-0aaaaaaaaaaaaaaa1", "i-0aaaaaaaaaaaaaaa2"]
    response = _spot_interrupted(described((ids[0], "stopped"), (ids[1], "stopped")), ids[0])
    stubber.add_response("describe_instances", response)
    with stubber, pytest.raises(InventoryError, match=r"it is the head node"):
        start_and_refresh(inventory(tmp_path, ids), ec2, skip_interrupted=True)
    stubber.assert_no_pending_responses()  # nothing started


def test_a_start_refused_while_the_spot_request_is_not_yet_disabled_is_retried(tmp_path):
    """Right after a stop a persistent Spot request is still active/marked-for-stop and StartInstances
    answers IncorrectSpotRequestState (hashicorp/terraform-provider-aws#33399). Before: a traceback."""
    ec2, stubber = ec2_stub()
    ids = ["i-0aaaaaaaaaaaaaaa1"]
    stubber.add_response("describe_instances", described((ids[0], "stopped")))
    stubber.add_client_error("start_instances", service_error_code="IncorrectSpotRequestState")
    stubber.add_response("start_instances", {"StartingInstances": []}, {"InstanceIds": ids})
    stubber.add_response("describe_instances", described((ids[0], "running")), {"InstanceIds": ids})  # waiter
    stubber.add_response("describe_instances", described((ids[0], "running", "203.0.113.10")), {"Filters": ANY})
    with stubber:
        fresh = start_and_refresh(inventory(tmp_path, ids), ec2, delay=0)
        stubber.assert_no_pending_responses()
    assert fresh.nodes[0].public_ip == "203.0.113.10"


def test_a_budget_meters_the_nodes_that_bill_not_a_spot_node_ec2_holds_stopped(tmp_path):
    """After `fab start --skip-interrupted`, `fab train --budget-usd --exclude node2` must not meter node2:
    a stopped instance bills no usage. Before: len(inventory.nodes), 3/2 of the real rate."""
    from dataclasses import replace

    from clusterops.run.meter import billed_nodes

    ec2, stubber = ec2_stub()
    ids = ["i-0aaaaaaaaaaaaaaa1", "i-0aaaaaaaaaaaaaaa2", "i-0aaaaaaaaaaaaaaa3"]
    response = described((ids[0], "running"), (ids[1], "running"), (ids[2], "stopped"))
    stubber.add_response("describe_instances", _spot_interrupted(response, ids[2]))
    session = type("Session", (), {"client": lambda self, name: ec2})()
    with stubber:
        assert billed_nodes(replace(inventory(tmp_path, ids), source="aws"), session) == 2
    stubber.add_response("describe_instances", described((ids[0], "running"), (ids[1], "running"), (ids[2], "stopped")))
    with stubber:  # stopped by the user or autostop: fab train needs it started, it is counted
        assert billed_nodes(replace(inventory(tmp_path, ids), source="aws"), session) == 3


def test_fab_start_and_stop_cluster_against_the_emulator(aws_env, tmp_path):
    ec2 = boto3.client("ec2")
    ids = moto_instances(2, "startstop")
    path = tmp_path / "inventory.json"
    inventory(tmp_path, ids).save(path)
    env = tool_env(GPU_CLUSTER_INVENTORY=str(path), **aws_env)
    stopped = subprocess.run(["fab", "stop-cluster"], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert stopped.returncode == 0 and f"stopping {', '.join(sorted(ids))}" in stopped.stdout, stopped.stderr
    started = subprocess.run(["fab", "start"], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert started.returncode == 0, started.stderr
    states = {
        i["InstanceId"]: i for r in ec2.describe_instances(InstanceIds=ids)["Reservations"] for i in r["Instances"]
    }
    assert {i["State"]["Name"] for i in states.values()} == {"running"}
    fresh = Inventory.load(path)
    assert [(n.private_ip, n.public_ip) for n in fresh.nodes] == [
        (states[i]["PrivateIpAddress"], states[i].get("PublicIpAddress") or states[i]["PrivateIpAddress"]) for i in ids
    ]
    assert (tmp_path / "known_hosts").read_text().splitlines() == [
        f"[{n.public_ip}]:4444 {HOST_KEY}" for n in fresh.nodes
    ]
    ec2.terminate_instances(InstanceIds=[ids[1]])
    gone = subprocess.run(["fab", "start"], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert gone.returncode == 1 and gone.stderr.strip().splitlines() == [
        f"error: {ids[1]} no longer exist(s) (terminated): redeploy with `npx cdk deploy`, then `fab inventory`"
    ]


def test_fab_inventory_takes_addresses_from_ec2_and_keeps_the_price(aws_env, tmp_path):
    """A stop/start changes public IPs: the deploy outputs are stale, describe_instances is not."""
    ids = moto_instances(2, "addrs")
    ec2 = boto3.client("ec2")
    live = {i["InstanceId"]: i for r in ec2.describe_instances(InstanceIds=ids)["Reservations"] for i in r["Instances"]}
    boto3.client("ssm").put_parameter(
        Name="/gpu-cluster/addrs/ssh-host-key", Value=HOST_KEY, Type="String", Overwrite=True
    )
    outputs = {
        "ClusterName": "addrs",
        "PrivateIps": ",".join(live[i]["PrivateIpAddress"] for i in ids),
        "PublicIps": "192.0.2.1,192.0.2.2",
        "InstanceIds": ",".join(ids),
        "GpusPerNode": "1",
        "HostKeyParameterName": "/gpu-cluster/addrs/ssh-host-key",
        "KeyParameterName": "none",
        "Region": "us-east-1",
        "InstanceType": "g6.xlarge",
        "FileSystemId": "fs-0123",
    }
    built = from_outputs("GpuCluster-addrs", outputs, boto3.session.Session(), tmp_path / "keys", key_file="/k")
    assert [n.public_ip for n in built.nodes] == [live[i]["PublicIpAddress"] for i in ids]
    (tmp_path / "cdk-outputs.json").write_text(json.dumps({"GpuCluster-addrs": outputs}))
    result = subprocess.run(
        ["fab", "inventory", "--outputs", str(tmp_path / "cdk-outputs.json"), "--key-file", "/k"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=tool_env(GPU_CLUSTER_INVENTORY=str(tmp_path / "inv.json"), **aws_env),
    )
    assert result.returncode == 0, result.stderr
    saved = Inventory.load(tmp_path / "inv.json")
    assert saved.usd_per_hour == 0.8048 and saved.price_source.startswith("offline table of")  # no Pricing API in moto
    assert saved.file_system_id == "fs-0123" and "$0.80/node-hour" in result.stdout


# ---------------------------------------------------------------- issue 19 §7: a node restarted by EC2


def test_an_unreachable_node_gets_its_new_public_ip_from_ec2(aws_env, tmp_path):
    """EC2 User Guide, "Public IPv4 addresses": a stopped instance releases its public IPv4 address
    and gets a new one when it starts again (a Spot node stopped by an interruption and restarted by
    EC2 included). The inventory's old address then reads "unreachable"; EC2 knows the new one."""
    from clusterops.nodes.readdress import readdress_unreachable

    ids = moto_instances(2, "moved")
    ec2 = boto3.client("ec2")
    live = {i["InstanceId"]: i for r in ec2.describe_instances(InstanceIds=ids)["Reservations"] for i in r["Instances"]}
    stale = inventory(tmp_path, ids)  # 198.51.100.1 and .2: the addresses before the restart
    fresh, lines = readdress_unreachable(stale, ec2, reachable=lambda host, port: host != "198.51.100.1")
    new_ip = live[ids[0]]["PublicIpAddress"]
    assert [n.public_ip for n in fresh.nodes] == [new_ip, "198.51.100.2"]  # node1 answers: untouched
    assert lines == [f"node0: 198.51.100.1 -> {new_ip} (EC2 gave it a new public IP when it started again)"]
    assert (tmp_path / "known_hosts").read_text().splitlines() == [
        f"[{new_ip}]:4444 {HOST_KEY}",
        f"[198.51.100.2]:4444 {HOST_KEY}",
    ]
    ec2.stop_instances(InstanceIds=[ids[1]])
    _, stopped = readdress_unreachable(fresh, ec2, reachable=lambda host, port: False)
    assert f"node1 ({ids[1]}) is stopped: `fab start`" in stopped


def test_fab_status_refreshes_the_addresses_of_unreachable_nodes(aws_env, tmp_path):
    ids = moto_instances(1, "moved2")
    ec2 = boto3.client("ec2")
    new_ip = ec2.describe_instances(InstanceIds=ids)["Reservations"][0]["Instances"][0]["PublicIpAddress"]
    path = tmp_path / "inventory.json"
    inventory(tmp_path, ids).save(path)  # 198.51.100.1 (TEST-NET-2): nothing answers there
    result = subprocess.run(
        ["fab", "status"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=tool_env(GPU_CLUSTER_INVENTORY=str(path), **aws_env),
    )
    assert f"node0: 198.51.100.1 -> {new_ip} (EC2 gave it a new public IP" in result.stdout, (
        result.stdout + result.stderr
    )
    assert Inventory.load(path).nodes[0].public_ip == new_ip


# ---------------------------------------------------------------- issue 28 §1: access=ssm on a public subnet


def test_access_ssm_keeps_the_instance_ids_session_manager_needs(aws_env, tmp_path):
    """access=ssm on the default public subnet: the nodes have public IPs, but Session Manager's target
    (`--target %h`) is the instance id. Before: `fab inventory` and `fab start` put the public IPs there,
    and no node was reachable."""
    from clusterops.aws.instances import start_cluster, stop_nodes

    ids = moto_instances(2, "ssmpub")
    ec2 = boto3.client("ec2")
    live = {i["InstanceId"]: i for r in ec2.describe_instances(InstanceIds=ids)["Reservations"] for i in r["Instances"]}
    assert all(live[i].get("PublicIpAddress") for i in ids)  # a public subnet
    boto3.client("ssm").put_parameter(
        Name="/gpu-cluster/ssmpub/ssh-host-key", Value=HOST_KEY, Type="String", Overwrite=True
    )
    outputs = {
        "ClusterName": "ssmpub",
        "PrivateIps": ",".join(live[i]["PrivateIpAddress"] for i in ids),
        "PublicIps": ",".join(live[i]["PublicIpAddress"] for i in ids),
        "InstanceIds": ",".join(ids),
        "GpusPerNode": "1",
        "HostKeyParameterName": "/gpu-cluster/ssmpub/ssh-host-key",
        "KeyParameterName": "none",
        "Region": "us-east-1",
        "Access": "ssm",
    }
    built = from_outputs("GpuCluster-ssmpub", outputs, boto3.session.Session(), tmp_path / "keys", key_file="/k")
    assert built.ssh.proxy_command and [n.public_ip for n in built.nodes] == ids
    assert Path(built.ssh.known_hosts).read_text().splitlines() == [f"[{i}]:4444 {HOST_KEY}" for i in ids]
    stop_nodes(built, ec2)
    fresh, line = start_cluster(built, ec2)
    assert [n.public_ip for n in fresh.nodes] == ids and f"head {ids[0]}" in line


def test_a_start_of_nodes_whose_root_volumes_use_a_customer_managed_key_is_allowed_by_the_user_policy():
    """A fresh read (session 30): the nodes' root volumes use the account's default EBS key; where that key is
    customer managed, whoever calls StartInstances needs kms:CreateGrant on it, else the node goes pending, then
    stopped, "Client.InternalError: Client error on launch" (AWS re:Post Knowledge Center, kms-iam-ec2-permission).
    The user policy grants it for grants EC2 makes on the caller's behalf only."""
    policy = json.loads((REPO / "docs" / "user-policy.json").read_text())
    key = "arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"
    through_ec2 = {"kms:GrantIsForAWSResource": "true", "kms:ViaService": "ec2.us-east-1.amazonaws.com"}
    assert evaluate([policy], Request("kms:CreateGrant", key, through_ec2)).allowed
    assert not evaluate(
        [policy], Request("kms:CreateGrant", key, {**through_ec2, "kms:GrantIsForAWSResource": "false"})
    ).allowed
    assert not evaluate(
        [policy], Request("kms:CreateGrant", key, {**through_ec2, "kms:ViaService": "s3.us-east-1.amazonaws.com"})
    ).allowed
