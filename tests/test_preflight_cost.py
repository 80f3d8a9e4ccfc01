"""Preflight and cost: EC2, STS and SSM from a moto server; Service Quotas, Pricing and CloudWatch
statistics (which moto lacks or fakes) through botocore's Stubber with real response shapes."""

import dataclasses
import json
import subprocess
from datetime import datetime, timedelta, timezone

import boto3
import pytest
from aws_stubs import aws_inventory, offline, quotas_client, table_price
from botocore.stub import ANY, Stubber
from conftest import REPO, moto_instances, tool_env
from test_preflight_network import default_vpc_way_out

from cluster_node.protocol.rundir import Progress
from clusterops import cost
from clusterops.aws import preflight, quotas
from clusterops.inventory import Inventory, Node, SshSettings, describe
from clusterops.run import meter
from stacks.config import ClusterConfig, offerings_context_key
from stacks.instance_types import INSTANCE_TYPES

# ---------------------------------------------------------------- issue item 5: the preflight


@pytest.mark.parametrize(
    "code, words",
    [
        ("UnauthorizedOperation", "ec2:RunInstances"),
        ("InsufficientInstanceCapacity", "no capacity"),
        ("VcpuLimitExceeded", "vCPU quota"),
        ("SomethingNew", "the message from AWS"),
    ],
)
def test_dry_run_errors_are_explained(code, words):
    ec2 = offline("ec2")
    with Stubber(ec2) as stubber:
        stubber.add_client_error("run_instances", service_error_code=code, service_message="the message from AWS")
        check = preflight.dry_run(ec2, "ami-12345678", "g4dn.2xlarge", 2, availability_zone="us-east-1b")
    assert not check.ok and check.detail.startswith(f"{code}: ") and words in check.detail


def test_the_dry_run_is_a_permission_check_in_the_chosen_az_or_subnet():
    ec2 = offline("ec2")
    base = {"ImageId": "ami-1", "InstanceType": "p5.48xlarge", "MinCount": 2, "MaxCount": 2, "DryRun": True}
    with Stubber(ec2) as stubber:
        stubber.add_client_error(
            "run_instances", "DryRunOperation", expected_params=dict(base, Placement={"AvailabilityZone": "us-east-1b"})
        )
        stubber.add_client_error(
            "run_instances", "DryRunOperation", expected_params=dict(base, SubnetId="subnet-0abc1234")
        )
        stubber.add_client_error(
            "run_instances",
            "VPCIdNotSpecified",
            "No default VPC for this user",
            expected_params=dict(base, Placement={"AvailabilityZone": "us-east-1b"}),
        )
        in_az = preflight.dry_run(ec2, "ami-1", "p5.48xlarge", 2, availability_zone="us-east-1b")
        in_subnet = preflight.dry_run(
            ec2, "ami-1", "p5.48xlarge", 2, subnet_id="subnet-0abc1234", availability_zone="x"
        )
        no_default_vpc = preflight.dry_run(ec2, "ami-1", "p5.48xlarge", 2, availability_zone="us-east-1b")
    for check in (in_az, in_subnet):
        assert check.ok and "permission check" in check.detail and "would launch" not in check.detail
    assert check.name == "launch permission (RunInstances dry run)"
    assert no_default_vpc.ok and no_default_vpc.skipped and no_default_vpc.label == "--  "
    assert no_default_vpc.detail == "not checked: no default VPC; the stack creates its own subnet"


def test_offerings_are_cached_where_synth_reads_them(tmp_path):
    context = tmp_path / "cdk.context.json"
    context.write_text(json.dumps({"availability-zones:account=1:region=us-east-1": ["us-east-1a"]}))
    preflight.cache_offerings(context, "us-east-1", "p5.48xlarge", ["us-east-1f", "us-east-1c"])
    saved = json.loads(context.read_text())
    key = offerings_context_key("us-east-1", "p5.48xlarge")
    assert saved[key] == ["us-east-1c", "us-east-1f"] and "availability-zones:account=1:region=us-east-1" in saved
    assert [p.name for p in tmp_path.iterdir()] == ["cdk.context.json"]  # no temp file left
    config = ClusterConfig.from_context({**saved, "instance_type": "p5.48xlarge"}, region="us-east-1")
    assert config.availability_zone == "us-east-1c"


def test_full_preflight_against_the_emulator(aws_env, tmp_path):
    clients = {name: boto3.client(name) for name in ("sts", "ec2", "ssm", "cloudformation")}
    clients["ssm"].put_parameter(Name="/test/preflight/ami", Value="ami-03cf127a", Type="String", Overwrite=True)
    running = quotas.running_vcpus(clients["ec2"], "g4dn.2xlarge")
    clients["service-quotas"], stubber = quotas_client(16 + running, vpcs=1000)
    config = ClusterConfig.from_context({"ami_ssm_parameter": "/test/preflight/ami"})
    context = tmp_path / "cdk.context.json"
    found, notes = preflight.run_preflight(clients, "us-east-1", config, context)
    assert [c.name for c in found] == [
        "credentials",
        "region",
        "CDK bootstrap",
        "deployed cluster",
        "AZ and subnet",
        "vCPU quota (On-Demand)",
        "VPC quota",
        "AMI",
        "launch permission (RunInstances dry run)",
    ]
    # us-east-1 is bootstrapped only once test_moto's `cdk bootstrap` has run (test_preflight_context checks it)
    assert all(c.ok for c in found if c.name != "CDK bootstrap"), found
    zones = json.loads(context.read_text())[offerings_context_key("us-east-1", "g4dn.2xlarge")]
    assert found[4].detail.startswith(f"a new VPC with one public subnet in {zones[0]}")
    assert notes[0] == f"checking 2 x g4dn.2xlarge (On-Demand) in us-east-1, AZ {zones[0]}"
    assert "cfn-exec-role-123456789012-us-east-1" in notes[1] and "YOUR permissions" in notes[1]
    subnet = clients["ec2"].describe_subnets(Filters=[{"Name": "availability-zone", "Values": [zones[0]]}])["Subnets"][
        0
    ]
    default_vpc_way_out(clients["ec2"], subnet["VpcId"])
    existing = ClusterConfig.from_context(
        {
            "ami_ssm_parameter": "/test/preflight/ami",
            "vpc_id": subnet["VpcId"],
            "subnet_id": subnet["SubnetId"],
            "availability_zone": zones[0],
        }
    )
    clients["service-quotas"], _ = quotas_client(8)
    found, notes = preflight.run_preflight(clients, "us-east-1", existing)
    assert found[4].detail.startswith(f"existing subnet {subnet['SubnetId']} in {zones[0]}")
    assert {c.name for c in found if not c.ok} - {"CDK bootstrap"} == {"vCPU quota (On-Demand)"}
    assert "--request-quota" in notes[2]


# ---------------------------------------------------------------- issue item 4: prices


def test_every_accepted_type_has_a_dated_offline_price():
    for name in INSTANCE_TYPES:
        price = cost.offline_price(name, "us-east-1")
        assert price.usd_per_hour and price.usd_per_hour > 0, name
        assert price.source == f"offline table of {cost.TABLE['date']}"


def test_the_table_has_the_mid_2025_p4_p5_cuts():
    prices = cost.TABLE["instances_usd_per_hour"]
    assert (
        prices["p5.48xlarge"] == 55.04 and prices["p4d.24xlarge"] == 21.957642 and prices["p4de.24xlarge"] == 27.44705
    )
    assert "2025-06-05" in cost.TABLE["note"] and cost.TABLE["source"] and cost.TABLE["date"] >= "2025-06"


PRICE_ITEM = {
    "product": {
        "productFamily": "Compute Instance",
        "attributes": {"instanceType": "g6e.xlarge", "regionCode": "ap-south-1"},
    },
    "serviceCode": "AmazonEC2",
    "terms": {
        "OnDemand": {
            "ABC.JRTCKXETXF": {
                "priceDimensions": {
                    "ABC.JRTCKXETXF.6YS6EN2CT7": {
                        "unit": "Hrs",
                        "pricePerUnit": {"USD": "2.1234000000"},
                        "description": "$2.1234 per On Demand Linux g6e.xlarge Instance Hour",
                    }
                }
            }
        }
    },
}


def test_the_pricing_api_price_is_used_for_any_region():
    pricing = offline("pricing")
    with Stubber(pricing) as stubber:
        stubber.add_response(
            "get_products",
            {"PriceList": [json.dumps(PRICE_ITEM)], "FormatVersion": "aws_v1"},
            {"ServiceCode": "AmazonEC2", "MaxResults": 10, "Filters": ANY},
        )
        price = cost.instance_price(pricing, "g6e.xlarge", "ap-south-1")
        stubber.assert_no_pending_responses()
    assert price == cost.Price(2.1234, "Pricing API, ap-south-1") and price.from_api


def test_the_region_filter_is_regioncode():
    pricing = offline("pricing")
    seen = {}
    pricing.meta.events.register(
        "provide-client-params.pricing.GetProducts",
        lambda params, **kwargs: seen.update({f["Field"]: f["Value"] for f in params["Filters"]}),
    )
    with Stubber(pricing) as stubber:
        stubber.add_response("get_products", {"PriceList": [], "FormatVersion": "aws_v1"})
        cost.instance_price(pricing, "g6e.xlarge", "ap-south-1")
    assert seen["regionCode"] == "ap-south-1" and seen["instanceType"] == "g6e.xlarge" and "location" not in seen


def test_without_the_api_another_region_is_priced_from_the_table_and_says_so():
    failing = offline("pricing")
    with Stubber(failing) as broken:
        broken.add_client_error("get_products", service_error_code="AccessDeniedException")
        price = cost.instance_price(failing, "p4de.24xlarge", "eu-west-1")
    assert price.usd_per_hour == 27.44705
    assert price.source == f"offline table of {cost.TABLE['date']}: us-east-1 prices, eu-west-1 may differ"
    kept = cost.Price(28.0, "Pricing API, eu-west-1")
    assert cost.instance_price(None, "p4de.24xlarge", "eu-west-1", kept=kept) == kept


def test_a_missing_price_is_unknown_everywhere_never_zero_or_an_exception():
    price = cost.instance_price(None, "g9.huge", "us-east-1")
    assert price.usd_per_hour is None and price.source.startswith("unknown")
    estimate = cost.Estimate(2, price, 200, 1.0)
    assert estimate.usd_per_hour is None and "= unknown/hour (unknown/day)" in estimate.lines()[0]
    line = cost.projection(Progress.from_json({"step": 10, "max_steps": 110, "avg_step_time_s": 36.0}), None)
    assert "1.0 h and unknown more for the nodes" in line
    assert cost.spent([datetime.now(timezone.utc)], None) is None


def test_fab_train_follow_projection_never_raises_for_any_type(capsys):
    from clusterops.run import meter

    for instance_type in ("g6.xlarge", "p4de.24xlarge", "x9.unknown"):
        inv = Inventory(
            cluster="c",
            source="aws",
            gpus_per_node=1,
            instance_type=instance_type,
            region="us-east-1",
            nodes=[Node(0, "node0", "1.2.3.4", "10.0.0.5", "i-1")],
            ssh=SshSettings("root", 4444, "/k", "/kh"),
        )
        on_progress = meter.projector(inv)
        on_progress(Progress.from_json({"step": 5}))  # step time not known yet: nothing
        on_progress(Progress.from_json({"step": 10, "max_steps": 3610, "avg_step_time_s": 1.0}))
        on_progress(Progress.from_json({"step": 20, "max_steps": 3610, "avg_step_time_s": 1.0}))  # printed once
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    hour_of = {t: table_price(t) for t in ("g6.xlarge", "p4de.24xlarge")}  # 3600 steps left at 1 s/step
    assert lines[0].startswith(
        f"cost: run: step 10/3610 at 1.00 s/step -> 1.0 h and ${hour_of['g6.xlarge']:.2f} more for the nodes"
    )
    assert f"${hour_of['p4de.24xlarge']:.2f} more" in lines[1] and "unknown more for the nodes" in lines[2]


def test_estimate_with_efs_io_projection_and_spend():
    estimate = cost.Estimate(4, cost.Price(0.752, "Pricing API, us-east-1"), 200, 13.0, dataset_gb=150, epochs=90)
    assert estimate.usd_per_hour == pytest.approx(3.008)
    assert estimate.ebs_usd_per_month == pytest.approx(4 * 200 * 0.08)
    # /data will hold the 150 GB data set, not the 13 GB there now; it is written once (before: $0 for both)
    assert estimate.efs_usd_per_month == pytest.approx(150 * 0.30)
    assert estimate.lines()[2] == "EFS /data: 150.0 GB (the data set) = $45.00/month until deleted"
    assert estimate.lines()[3].startswith(
        "EFS Elastic I/O: up to 13,500 GB read (150 GB x 90 epochs) and 150 GB written once = $414.00; "
        "staged to local NVMe, 4 x 150 GB read once = $27.00 "
    )
    larger = cost.Estimate(4, cost.Price(0.752, "Pricing API, us-east-1"), 200, 400.0, dataset_gb=150, epochs=90)
    assert larger.lines()[2] == "EFS /data: 400.0 GB = $120.00/month until deleted"
    line = cost.projection(
        Progress.from_json({"step": 1000, "max_steps": 50_000, "avg_step_time_s": 1.71}), estimate.usd_per_hour, 0.5
    )
    hours = 49_000 * 1.71 / 3600
    assert f"{hours:.1f} h" in line and f"${hours * 3.008:.2f}" in line and f"${hours * 0.5:.2f} EFS I/O" in line
    assert cost.projection(Progress.from_json({"step": 5, "max_steps": 10}), 3.0) is None
    now = datetime(2026, 11, 22, 12, tzinfo=timezone.utc)
    assert cost.spent([now - timedelta(hours=2), now - timedelta(hours=1)], 0.752, now) == pytest.approx(3 * 0.752)


def test_efs_io_comes_from_the_efs_cloudwatch_metrics():
    cloudwatch = offline("cloudwatch")
    # A recent hour: GetMetricStatistics' period depends on the start's age (efsio.period_s), a fixed date ages.
    now = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    with Stubber(cloudwatch) as stubber:
        # efsio's order: data read and write, then metadata read and write (reads and writes at their prices).
        metrics = (("DataReadIOBytes", [30, 20]), ("DataWriteIOBytes", [5]), ("MetadataReadIOBytes", [1]))
        for metric, gigabytes in (*metrics, ("MetadataWriteIOBytes", [2])):
            stubber.add_response(
                "get_metric_statistics",
                {
                    "Label": metric,
                    "Datapoints": [{"Timestamp": now, "Sum": g * 1e9, "Unit": "Bytes"} for g in gigabytes],
                },
                {
                    "Namespace": "AWS/EFS",
                    "MetricName": metric,
                    "StartTime": now - timedelta(hours=1),
                    "EndTime": now,
                    "Period": 60,
                    "Dimensions": [{"Name": "FileSystemId", "Value": "fs-0abc"}],
                    "Statistics": ["Sum"],
                },
            )
        assert cost.efs_io_usd_per_hour(cloudwatch, "fs-0abc", now) == pytest.approx(51 * 0.03 + 7 * 0.06)


def test_fab_cost_shows_the_offline_tables_date_and_source(tmp_path):
    result = subprocess.run(
        ["fab", "cost", "--nodes", "4", "--instance-type", "g6.xlarge", "--dataset-gb", "150", "--epochs", "90"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=tool_env(
            GPU_CLUSTER_INVENTORY=str(tmp_path / "none.json"),
            AWS_ACCESS_KEY_ID="",
            AWS_SECRET_ACCESS_KEY="",
            AWS_CONFIG_FILE=str(tmp_path / "no-config"),
            AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-credentials"),
        ),
    )
    assert result.returncode == 0, result.stderr
    g6 = table_price("g6.xlarge")
    assert f"cluster: 4 x ${g6:.3f}/h = ${4 * g6:.2f}/hour" in result.stdout
    assert f"[offline table of {cost.TABLE['date']}]" in result.stdout
    assert "EBS root volumes: 4 x 200 GB gp3 = $64.00/month" in result.stdout
    assert "EFS Elastic I/O: up to 13,500 GB read" in result.stdout
    assert (
        f"offline price table: prices of {cost.TABLE['date']} in us-east-1, checked {cost.TABLE['checked']}; "
        f"source: {cost.TABLE['source']}"
    ) in result.stdout
    bad = subprocess.run(
        ["fab", "cost", "--instance-type", "m5.large"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=tool_env(GPU_CLUSTER_INVENTORY=str(tmp_path / "none.json")),
    )
    assert bad.returncode == 1 and "invalid config instance_type='m5.large'" in bad.stderr
    epochs = subprocess.run(
        ["fab", "cost", "--dataset-gb", "10", "--epochs", "-3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=tool_env(GPU_CLUSTER_INVENTORY=str(tmp_path / "none.json")),
    )
    assert epochs.returncode == 1 and epochs.stderr.strip() == "error: invalid --epochs '-3': a positive number"


def test_a_broken_aws_profile_is_one_line(tmp_path):
    result = subprocess.run(
        ["fab", "preflight"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=tool_env(AWS_PROFILE="no-such-profile", AWS_CONFIG_FILE=str(tmp_path / "none")),
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: AWS configuration: The config profile (no-such-profile) could not be found "
        "(check AWS_PROFILE / `aws configure`)"
    ]


def test_an_unreadable_quota_is_a_fail_line_and_the_other_checks_still_run(tmp_path, aws_env):
    """Service Quotas is not emulated: the quota call fails the way a denied or unreachable one does."""
    result = subprocess.run(
        ["fab", "preflight"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        # one attempt: botocore's retries of the failing call (with back-off) took 10 s of the test
        env=tool_env(GPU_CLUSTER_CDK_CONTEXT=str(tmp_path / "cdk.context.json"), AWS_MAX_ATTEMPTS="1", **aws_env),
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    quota = [line for line in result.stdout.splitlines() if "vCPU quota" in line]
    assert len(quota) == 1 and quota[0].startswith("FAIL  vCPU quota (On-Demand): could not read it: ")
    assert "AZ and subnet: a new VPC with one public subnet in us-east-1" in result.stdout
    assert json.loads((tmp_path / "cdk.context.json").read_text())[offerings_context_key("us-east-1", "g4dn.2xlarge")]
    assert result.stderr.strip() == "error: preflight failed; fix the FAIL lines before `cdk deploy`"


def test_spend_and_efs_io_of_a_running_cluster(aws_env, capsys):
    from clusterops.run.meter import _spent

    ids = moto_instances(2, "spend")
    fs = boto3.client("efs").create_file_system(CreationToken="spend")["FileSystemId"]
    inv = aws_inventory("spend", ids, file_system_id=fs)
    _spent(boto3.session.Session(), inv, cost.offline_price("g4dn.xlarge", "us-east-1"))
    _spent(boto3.session.Session(), inv, cost.Price(None, "unknown"))
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("spent since the running nodes started: $") and out[2].endswith(": unknown")
    assert out[1] == "EFS I/O in the last 24 h: 0.0 GB read, 0.0 GB written = $0.00"


def test_an_aws_error_inside_a_task_is_one_line(tmp_path, aws_env):
    inv = Inventory(
        cluster="gone",
        source="aws",
        gpus_per_node=1,
        instance_type="g4dn.xlarge",
        region="us-east-1",
        nodes=[Node(0, "node0", "1.2.3.4", "10.0.0.5", "i-0123456789abcdef0")],
        ssh=SshSettings("root", 4444, "/k", "/kh"),
        file_system_id="fs-0123456789abcdef0",
    )
    inv.save(tmp_path / "inventory.json")
    result = subprocess.run(
        ["fab", "cost"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=tool_env(GPU_CLUSTER_INVENTORY=str(tmp_path / "inventory.json"), **aws_env),
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: fab cost: FileSystemNotFound: File system 'fs-0123456789abcdef0' does not exist."
    ], result.stderr


def test_a_private_subnet_shows_its_nat_and_endpoints_monthly_cost():
    price = cost.Price(0.752, "Pricing API, us-east-1")
    public = cost.Estimate(2, price, 200, 1.0)
    private = cost.Estimate(2, price, 200, 1.0, private_subnet=True)
    hourly = (
        cost.TABLE["nat_gateway_usd_per_hour"]
        + cost.TABLE["public_ipv4_usd_per_hour"]
        + 3 * cost.TABLE["interface_endpoint_usd_per_hour"]
    )
    assert public.network_usd_per_month == 0 and not [line for line in public.lines() if "NAT" in line]
    assert private.network_usd_per_month == pytest.approx(hourly * 730)
    assert any(f"${hourly * 730:.2f}/month" in line for line in private.lines())


def test_fab_cost_on_the_emulated_cluster_says_it_costs_nothing(tmp_path):
    from clusterops.inventory import Inventory, Node, SshSettings

    local = Inventory(
        cluster="local",
        source="local",
        nodes=[Node(0, "node0", "10.213.0.10", "10.213.0.10")],
        gpus_per_node=1,
        ssh=SshSettings("root", 4444, "key", "known_hosts"),
        instance_type="local",
    )
    local.save(tmp_path / "inventory.json")
    result = subprocess.run(
        ["fab", "cost"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=tool_env(
            GPU_CLUSTER_INVENTORY=str(tmp_path / "inventory.json"),
            AWS_ACCESS_KEY_ID="",
            AWS_SECRET_ACCESS_KEY="",
            AWS_CONFIG_FILE=str(tmp_path / "no-config"),
            AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-credentials"),
        ),
    )
    assert result.returncode == 0, result.stderr
    assert "the emulated cluster 'local' costs nothing" in result.stdout
    assert "no run going" not in result.stdout  # it did not try to project a CPU run as GPU dollars


def test_fab_cost_prices_the_deployed_clusters_nat_gateway_volumes_and_addresses_not_cdk_jsons(aws_env):
    """Deployed with `-c access=ssm -c private_subnet=true -c root_volume_gb=1000`: context is not kept between
    deploys (CDK Developer Guide, *Context values*), so cdk.json says neither; fab cost reads the stack's NAT
    gateway and the nodes' own volumes and addresses."""
    network = {
        "Vpc": {"Type": "AWS::EC2::VPC", "Properties": {"CidrBlock": "10.42.0.0/16"}},
        "Subnet": {"Type": "AWS::EC2::Subnet", "Properties": {"VpcId": {"Ref": "Vpc"}, "CidrBlock": "10.42.0.0/24"}},
        "Ip": {"Type": "AWS::EC2::EIP", "Properties": {"Domain": "vpc"}},
        "Nat": {
            "Type": "AWS::EC2::NatGateway",
            "Properties": {"AllocationId": {"Fn::GetAtt": ["Ip", "AllocationId"]}, "SubnetId": {"Ref": "Subnet"}},
        },
    }
    cfn = boto3.client("cloudformation")
    cfn.create_stack(StackName="GpuCluster-priv", TemplateBody=json.dumps({"Resources": network}))
    subnet = cfn.describe_stack_resource(StackName="GpuCluster-priv", LogicalResourceId="Subnet")
    ec2 = boto3.client("ec2")
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    disk = [{"DeviceName": "/dev/sda1", "Ebs": {"VolumeSize": 1000}}]
    launched = ec2.run_instances(
        ImageId=image,
        MinCount=2,
        MaxCount=2,
        BlockDeviceMappings=disk,
        NetworkInterfaces=[
            {
                "DeviceIndex": 0,
                "SubnetId": subnet["StackResourceDetail"]["PhysicalResourceId"],
                "AssociatePublicIpAddress": False,  # the private subnet's nodes (stacks/node_launch.py)
            }
        ],
    )["Instances"]
    # as `fab inventory` writes an access=ssm cluster's nodes: addressed by instance id, not by a public IP
    nodes = [Node(r, f"node{r}", i["InstanceId"], f"10.42.0.{5 + r}", i["InstanceId"]) for r, i in enumerate(launched)]
    inv = dataclasses.replace(aws_inventory("priv", []), nodes=nodes, stack_name="GpuCluster-priv")
    planned = ClusterConfig.from_context({**json.loads((REPO / "cdk.json").read_text())["context"], "nodes": "2"})
    expected = {"root_gb": 200, "private_subnet": False, "public_ips": 2, "flow_log_key": True}
    assert meter.planned_layout(planned) == expected
    layout = meter.deployed_layout(boto3.session.Session(), inv, planned)
    # this stack holds no KMS key (as deployed with -c flow_logs=false): no flow-log key to bill
    assert layout == {"root_gb": 1000, "private_subnet": True, "public_ips": 0, "flow_log_key": False}
    lines = cost.Estimate(2, cost.Price(0.752, "x"), efs_gb=1.0, **layout).lines()
    assert "EBS root volumes: 2 x 1000 GB gp3 = $160.00/month" in lines[1] and "NAT gateway" in lines[3]
    assert lines[-1].startswith("cost guards (idle alarms, dashboard, watchdog metrics): $3.20/month")
    public = cost.Estimate(2, cost.Price(0.752, "x"), efs_gb=1.0, **meter.planned_layout(planned)).lines()
    assert "public IPv4: 2 x $0.005/h = $0.010/hour more while they run" in public
    assert public[-1].startswith("cost guards (idle alarms, dashboard, flow-log key, watchdog metrics): $")


def test_a_stopped_nodes_public_ipv4_counts_where_its_start_will_give_it_one(aws_env):
    """A stop releases a node's public address (EC2 User Guide); access=ssh's interfaces ask for one at each start,
    with access=ssm the subnet's MapPublicIpOnLaunch decides."""
    ec2 = boto3.client("ec2")
    vpc = ec2.create_vpc(CidrBlock="10.43.0.0/16")["Vpc"]["VpcId"]
    mapping, plain = (ec2.create_subnet(VpcId=vpc, CidrBlock=f"10.43.{i}.0/24")["Subnet"]["SubnetId"] for i in (1, 2))
    ec2.modify_subnet_attribute(SubnetId=mapping, MapPublicIpOnLaunch={"Value": True})
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    ids = [
        ec2.run_instances(
            ImageId=image,
            MinCount=1,
            MaxCount=1,
            NetworkInterfaces=[{"DeviceIndex": 0, "SubnetId": subnet, "AssociatePublicIpAddress": False}],
        )["Instances"][0]["InstanceId"]
        for subnet in (mapping, plain)
    ]
    ec2.stop_instances(InstanceIds=ids)
    stopped = describe(ec2, ids).values()
    assert all(not n.get("PublicIpAddress") for n in stopped)
    assert meter._public_ips(ec2, stopped, "ssm") == 1  # the mapping subnet's node
    assert meter._public_ips(ec2, stopped, "ssh") == 2
    ec2.terminate_instances(InstanceIds=ids)
    assert meter._public_ips(ec2, describe(ec2, ids).values(), "ssh") == 0
