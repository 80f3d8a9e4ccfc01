"""A node's public IP, across every network the stack can be deployed into: CloudFormation fails the whole
stack on `Fn::GetAtt Instance.PublicIp` of an instance that has none ("Attribute: PublicIp was not found
for resource", aws/aws-parallelcluster#1129, aws/aws-cdk#17516), after every node has bootstrapped, and
then rolls the nodes back. So each configuration's template is read for what it guarantees:

- an output reads a node's PublicIp only where the template guarantees that node one: its launch
  template's primary interface asks for one, or it sits in a subnet of this stack that maps public IPs
  (a given subnet's MapPublicIpOnLaunch is not the stack's to know);
- with access=ssh every node has one (fab reaches it there); a node reached through Session Manager never
  asks for one, and in a private subnet (this stack's) or a given one the outputs read none (a given public
  subnet may still give one: it keeps that subnet's way out)."""

import json

import pytest
from stack_templates import cluster_template

EXISTING = {"vpc_id": "vpc-0123456789abcdef0", "subnet_id": "subnet-0123456789abcdef0"}
SSM = {"ssh_cidr": None, "access": "ssm"}
CONFIGURATIONS = {
    "ssh, this stack's VPC": {},
    "ssh, a given subnet": EXISTING,
    "ssh, a given subnet, one EFA card": {**EXISTING, "instance_type": "g5.12xlarge", "efa": "on"},
    "ssh, p4d in a given subnet (EFA off)": {**EXISTING, "instance_type": "p4d.24xlarge"},
    "ssm, this stack's public subnet": SSM,
    "ssm, this stack's private subnet": {**SSM, "private_subnet": "true"},
    "ssm, a given subnet": {**SSM, **EXISTING},
    "ssm, a given subnet, one EFA card": {**SSM, **EXISTING, "instance_type": "g5.12xlarge", "efa": "on"},
    "ssm, p4d with EFA in a given subnet": {**SSM, **EXISTING, "instance_type": "p4d.24xlarge"},
    "ssm, p4d with EFA in this stack's private subnet": {
        **SSM,
        "private_subnet": "true",
        "instance_type": "p4d.24xlarge",
    },
}


def _primary_interface(template, instance: dict) -> dict | None:
    """The node's primary interface in its launch template, if the template states one."""
    spec = instance["Properties"].get("LaunchTemplate", {})
    logical = spec.get("LaunchTemplateId", {}).get("Ref")
    if logical is None:
        return None
    data = template.find_resources("AWS::EC2::LaunchTemplate")[logical]["Properties"]["LaunchTemplateData"]
    return next(
        (
            i
            for i in data.get("NetworkInterfaces", [])
            if i.get("DeviceIndex") == 0 and i.get("NetworkCardIndex", 0) == 0
        ),
        None,
    )


def public_ip(template, instance: dict) -> bool | None:
    """True: the template guarantees the node a public IP; False: it has none; None: the given subnet
    decides (unknown here)."""
    primary = _primary_interface(template, instance)
    if primary is not None and "AssociatePublicIpAddress" in primary:
        return bool(primary["AssociatePublicIpAddress"])
    subnet = (primary or instance["Properties"]).get("SubnetId")
    if isinstance(subnet, dict) and "Ref" in subnet:
        return bool(template.find_resources("AWS::EC2::Subnet")[subnet["Ref"]]["Properties"].get("MapPublicIpOnLaunch"))
    return None


def _public_ip_readers(outputs: dict) -> set[str]:
    """The instances whose PublicIp any output reads."""
    found: set[str] = set()

    def walk(value) -> None:
        if isinstance(value, dict):
            attribute = value.get("Fn::GetAtt")
            if isinstance(attribute, list) and attribute[1] == "PublicIp":
                found.add(attribute[0])
            for inner in value.values():
                walk(inner)
        elif isinstance(value, list):
            for inner in value:
                walk(inner)

    walk(outputs)
    return found


@pytest.mark.parametrize("name", CONFIGURATIONS)
def test_an_output_reads_only_public_ips_the_template_guarantees(name):
    template = cluster_template(**CONFIGURATIONS[name])
    context = {"ssh_cidr": "203.0.113.0/24", **CONFIGURATIONS[name]}
    instances = template.find_resources("AWS::EC2::Instance")
    has = {logical: public_ip(template, instance) for logical, instance in instances.items()}
    outputs = template.to_json()["Outputs"]
    for logical in _public_ip_readers(outputs):
        assert has[logical] is True, f"{name}: an output reads {logical}'s PublicIp, which it may not have"
    if context.get("access", "ssh") == "ssh":
        assert set(has.values()) == {True}, f"{name}: fab reaches ssh nodes at their public IPs: {has}"
    elif "private_subnet" in context or "vpc_id" in context:
        assert True not in has.values(), f"{name}: a node reached through Session Manager asks for a public IP"
        assert json.dumps(outputs["PublicIps"]) == '{"Value": "none"}'
