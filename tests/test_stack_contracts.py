"""Template contracts of issue 19 (a third read of the AWS path), each against the owner's documentation:
the node role's Session Manager permissions, a pinned AMI, idle settings outside user data, one IMDS hop,
the flow log's key policy and role trust, a per-region dashboard name."""

import json

import pytest
from aws_cdk.assertions import Template
from conftest import cdk_app

from stacks.cluster_stack import GpuClusterStack
from stacks.config import ami_context_key
from stacks.instance_types import AMI_PARAMETERS
from stacks.pins import synth_config

SSH_CIDR = "203.0.113.0/24"
AMI = "ami-0123456789abcdef0"
PINS = {"availability_zone": "us-east-1a", "ami_id": AMI}


def _template(region=None, **context) -> dict:
    config = synth_config({"ssh_cidr": SSH_CIDR, **PINS, **context}, region=region)
    return Template.from_stack(GpuClusterStack(cdk_app(), "Cluster", config=config)).to_json()


def _of_type(template: dict, kind: str) -> dict:
    return {k: r for k, r in template["Resources"].items() if r["Type"] == kind}


def _actions(statement: dict) -> list[str]:
    return [statement["Action"]] if isinstance(statement["Action"], str) else statement["Action"]


def _resources(statement: dict) -> list:
    return statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]


# ---------------------------------------------------------------- §11: the node role

# AWS Systems Manager User Guide, "Create a custom IAM role for Session Manager" (and AWS's own
# AWSCloud9SSMInstanceProfile): what SSM Agent needs on the instance for sessions. S3/CloudWatch session
# logging and KMS session encryption would add s3:GetEncryptionConfiguration / kms:Decrypt: not used here.
SESSION_ACTIONS = {
    "ssm:UpdateInstanceInformation",
    "ssmmessages:CreateControlChannel",
    "ssmmessages:CreateDataChannel",
    "ssmmessages:OpenControlChannel",
    "ssmmessages:OpenDataChannel",
}


def _node_role_statements(template: dict) -> list[dict]:
    roles = {
        k for k, r in _of_type(template, "AWS::IAM::Role").items() if "GpuNodesNodeRole" in k and "Policy" not in k
    }
    assert len(roles) == 1, roles
    return [
        s
        for p in _of_type(template, "AWS::IAM::Policy").values()
        if {"Ref": next(iter(roles))} in p["Properties"]["Roles"]
        for s in p["Properties"]["PolicyDocument"]["Statement"]
    ]


@pytest.mark.parametrize("access", ["ssh", "ssm"])
def test_the_node_role_has_session_manager_actions_and_no_managed_policy(access):
    """AmazonSSMManagedInstanceCore allows ssm:GetParameter(s) on every parameter of the region
    (`/ec2/keypair/*` private keys included): the role gets the Session Manager actions instead."""
    context = {"access": "ssm", "ssh_cidr": None} if access == "ssm" else {}
    template = _template(**context)
    for role in _of_type(template, "AWS::IAM::Role").values():
        assert "ManagedPolicyArns" not in role["Properties"], role["Properties"]["ManagedPolicyArns"]
    actions = {a for s in _node_role_statements(template) for a in _actions(s)}
    assert SESSION_ACTIONS <= actions, SESSION_ACTIONS - actions


def test_the_nodes_read_and_write_only_their_own_parameters():
    """Every SSM parameter action of the node role names a parameter under /gpu-cluster/NAME/ (the
    nodes read the EC2 key pair's public key from IMDS, never /ec2/keypair/*)."""
    template = _template(cluster_name="alpha")
    names = {k: r["Properties"]["Name"] for k, r in _of_type(template, "AWS::SSM::Parameter").items()}
    ssm = [s for s in _node_role_statements(template) if any(a.startswith("ssm:") for a in _actions(s))]
    parameter_statements = [
        s for s in ssm if any(a.startswith(("ssm:GetParameter", "ssm:PutParameter")) for a in _actions(s))
    ]
    assert parameter_statements
    for statement in parameter_statements:
        for resource in _resources(statement):
            text = json.dumps(resource)
            for logical_id, name in names.items():  # a Ref to the stack's parameter is its name
                text = text.replace(f'":parameter", {{"Ref": "{logical_id}"}}', f'":parameter{name}"')
            assert resource != "*" and ":parameter/gpu-cluster/alpha/" in text, text
    others = [s for s in ssm if s not in parameter_statements]
    assert {a for s in others for a in _actions(s) if a.startswith("ssm:")} <= SESSION_ACTIONS


# ---------------------------------------------------------------- §13: a pinned AMI, idle settings outside user data


def _deployed_image_ids(template: dict, ssm_values: dict[str, str]) -> list[str]:
    """The ImageId each node gets when CloudFormation deploys the template, with the SSM parameters'
    values at deploy time (`AWS::SSM::Parameter::Value<...>` parameters resolve then)."""
    parameters = template.get("Parameters", {})
    ids = []
    for instance in _of_type(template, "AWS::EC2::Instance").values():
        image = instance["Properties"]["ImageId"]
        if isinstance(image, dict):
            parameter = parameters[image["Ref"]]
            assert parameter["Type"].startswith("AWS::SSM::Parameter::Value")
            image = ssm_values[parameter["Default"]]
        ids.append(image)
    return ids


def test_a_new_dlami_release_replaces_no_node():
    """`MachineImage.from_ssm_parameter(.../latest/ami-id)` resolves at every deploy: a DLAMI release
    would replace every node (ImageId: update requires replacement, CloudFormation AWS::EC2::Instance).
    The template holds the pinned id; the DLAMI's `latest` no longer matters."""
    template = _template()
    latest = AMI_PARAMETERS["oss"]
    before = _deployed_image_ids(template, {latest: "ami-00000000000000001"})
    after = _deployed_image_ids(template, {latest: "ami-00000000000000002"})
    assert before == after == [AMI, AMI]
    ssm_typed = [p["Default"] for p in template.get("Parameters", {}).values() if "SSM::Parameter" in p["Type"]]
    assert ssm_typed == ["/cdk-bootstrap/hnb659fds/version"]  # CDK's own bootstrap check, nothing else


def _user_data(template: dict) -> dict[str, str]:
    return {k: json.dumps(r["Properties"]["UserData"]) for k, r in _of_type(template, "AWS::EC2::Instance").items()}


def test_changing_idle_minutes_changes_no_node():
    """User data changes replace the node (`user_data_causes_replacement`): idle_minutes lives in the
    cluster's own SSM parameter, which the bootstrap reads when it starts the container."""
    short, long = _template(idle_minutes="30"), _template(idle_minutes="90")
    assert _user_data(short) == _user_data(long)
    assert all("IDLE_MINUTES_PARAMETER=/gpu-cluster/gpu-cluster/idle-minutes" in u for u in _user_data(short).values())

    def value(template):
        return [
            r["Properties"]["Value"]
            for r in _of_type(template, "AWS::SSM::Parameter").values()
            if r["Properties"]["Name"] == "/gpu-cluster/gpu-cluster/idle-minutes"
        ]

    assert value(short) == ["30"] and value(long) == ["90"]


# ---------------------------------------------------------------- §18: the dashboard


def test_the_dashboard_is_named_per_region():
    """CloudWatch dashboards are global to the account (CloudFormation AWS::CloudWatch::Dashboard):
    the same cluster_name in two regions must not collide. PutDashboard: at most 255 characters of
    A-Z a-z 0-9 - _; the region's name fits that alphabet."""
    template = _template(cluster_name="c" * 31)
    dashboard = next(iter(_of_type(template, "AWS::CloudWatch::Dashboard").values()))
    name = dashboard["Properties"]["DashboardName"]
    assert name == {"Fn::Join": ["", ["c" * 31 + "-", {"Ref": "AWS::Region"}]]}
    assert len("c" * 31 + "-" + "ap-southeast-7") <= 255
    url = json.dumps(template["Outputs"]["DashboardUrl"]["Value"])
    assert "#dashboards:name=" + "c" * 31 + '-", {"Ref": "AWS::Region"}' in url


# ---------------------------------------------------------------- §20: IMDS, flow log key and role


@pytest.mark.parametrize(
    "context",
    [
        {},
        {"spot": "true"},
        {"instance_type": "g5.12xlarge"},
        {"instance_type": "p4d.24xlarge", "access": "ssm", "ssh_cidr": None, "private_subnet": "true", "spot": "true"},
    ],
    ids=["on-demand", "spot", "efa", "efa-spot"],
)
def test_every_node_answers_imds_tokens_within_one_hop(context):
    """EC2 User Guide, "Configure the Instance Metadata Service options": an AMI registered with
    ImdsSupport v2.0 launches with a hop limit of 2, which lets a bridged container take the node's
    credentials. The containers here use the host's network (--net=host), so 1 hop is enough."""
    template = _template(**context)
    instances = _of_type(template, "AWS::EC2::Instance")
    templates = _of_type(template, "AWS::EC2::LaunchTemplate")
    assert len(templates) == len(instances) == 2
    for instance in instances.values():  # each node launches from its own template's latest version
        assert instance["Properties"]["LaunchTemplate"]["Version"]["Fn::GetAtt"][0] in templates
    for launch in templates.values():
        options = launch["Properties"]["LaunchTemplateData"]["MetadataOptions"]
        assert options == {"HttpTokens": "required", "HttpPutResponseHopLimit": 1}, options


def test_the_flow_log_key_serves_only_this_stacks_log_group():
    """CloudWatch Logs User Guide, "Encrypt log data in CloudWatch Logs using AWS KMS": the key policy
    limits the logs service principal with kms:EncryptionContext:aws:logs:arn."""
    template = _template()
    key = next(iter(_of_type(template, "AWS::KMS::Key").values()))
    statements = [
        s
        for s in key["Properties"]["KeyPolicy"]["Statement"]
        if "logs." in json.dumps(s.get("Principal", {}).get("Service", ""))
    ]
    assert len(statements) == 1
    condition = statements[0].get("Condition", {})
    arn = condition.get("ArnEquals", condition.get("ArnLike", {})).get("kms:EncryptionContext:aws:logs:arn")
    assert arn is not None, condition
    group = next(iter(_of_type(template, "AWS::Logs::LogGroup").values()))
    name = group["Properties"]["LogGroupName"]
    assert ":log-group:" in json.dumps(arn) and json.dumps(name).strip('"') in json.dumps(arn), (arn, name)


def test_the_flow_log_role_trusts_the_service_for_this_account_only():
    """Amazon VPC User Guide, "IAM role for publishing flow logs to CloudWatch Logs": aws:SourceAccount
    (and aws:SourceArn) against the confused deputy."""
    template = _template()
    trusts = [
        s
        for r in _of_type(template, "AWS::IAM::Role").values()
        for s in r["Properties"]["AssumeRolePolicyDocument"]["Statement"]
        if s["Principal"].get("Service") == "vpc-flow-logs.amazonaws.com"
    ]
    assert len(trusts) == 1
    condition = trusts[0].get("Condition", {})
    assert condition.get("StringEquals", {}).get("aws:SourceAccount") == {"Ref": "AWS::AccountId"}, condition
    assert ":vpc-flow-log/" in json.dumps(condition.get("ArnLike", {}).get("aws:SourceArn")), condition


def test_the_pinned_ami_is_the_one_preflight_cached_for_the_familys_dlami():
    """The cache key names the region and the DLAMI parameter: a V100 type gets the proprietary one."""
    context = {
        "ssh_cidr": SSH_CIDR,
        "availability_zone": "us-east-1a",
        ami_context_key("us-east-1", AMI_PARAMETERS["oss"]): "ami-0aaaaaaaaaaaaaaaa",
        ami_context_key("us-east-1", AMI_PARAMETERS["proprietary"]): "ami-0bbbbbbbbbbbbbbbb",
    }
    assert synth_config({**context, "instance_type": "g5.xlarge"}, "us-east-1").ami_id == "ami-0aaaaaaaaaaaaaaaa"
    assert synth_config({**context, "instance_type": "p3.2xlarge"}, "us-east-1").ami_id == "ami-0bbbbbbbbbbbbbbbb"
    assert synth_config({**context, "ami_id": "ami-0cccccccccccccccc"}, "us-east-1").ami_id == "ami-0cccccccccccccccc"


def test_session_managers_heartbeat_is_allowed_on_instances_without_a_tag_condition():
    """ssm:UpdateInstanceInformation (the SSM Agent's heartbeat) takes the EC2 `instance` resource type; the
    Service Authorization Reference ("Actions defined by AWS Systems Manager") lists only ec2:SourceInstanceARN and
    ssm:SourceInstanceARN as its own condition keys, aws:ResourceTag only under the resource type. A fresh read
    (session 30): the tag condition issue 28 §7 added is not a key this action is documented to carry, and if SSM
    leaves it out of the request every heartbeat is denied and no access=ssm node ever connects. So: this account's
    and region's instances, no condition (AWS's own minimal policy grants it on "*"). The ssmmessages channel
    actions have no resource type."""
    template = _template(cluster_name="alpha", access="ssm", ssh_cidr=None)
    statements = _node_role_statements(template)
    (heartbeat,) = [s for s in statements if "ssm:UpdateInstanceInformation" in _actions(s)]
    assert _actions(heartbeat) == ["ssm:UpdateInstanceInformation"] and "Condition" not in heartbeat
    (resource,) = _resources(heartbeat)
    assert resource != "*" and json.dumps(resource).endswith(':instance/*"]]}'), resource
    channels = [s for s in statements if any(a.startswith("ssmmessages:") for a in _actions(s))]
    assert channels and all(_resources(s) == ["*"] for s in channels)


@pytest.mark.parametrize("context", [{}, {"access": "ssm", "private_subnet": "true", "ssh_cidr": None}])
def test_no_node_boots_before_its_subnets_route_and_the_session_manager_endpoints(context):
    """The user-data stub calls SSM and S3 first thing: a private subnet's NAT route, the public subnet's
    internet route and the interface endpoints exist before any node is created."""
    template = _template(**context)
    routes = {k for k, r in _of_type(template, "AWS::EC2::Route").items() if "nodes" in k}
    endpoints = set(_of_type(template, "AWS::EC2::VPCEndpoint")) - {
        k
        for k, r in _of_type(template, "AWS::EC2::VPCEndpoint").items()
        if r["Properties"].get("VpcEndpointType") != "Interface"
    }
    assert routes and (endpoints or not context)
    for logical_id, node in _of_type(template, "AWS::EC2::Instance").items():
        assert routes | endpoints <= set(node["DependsOn"]), logical_id
