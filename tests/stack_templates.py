"""The cluster stack's template as the construct tests build it: cdk.json's context (its feature flags),
a documentation CIDR and what `fab preflight` pins, given explicitly as offline synth needs."""

from aws_cdk.assertions import Template
from conftest import cdk_app

from stacks.cluster_stack import GpuClusterStack
from stacks.pins import synth_config

SSH_CIDR = "203.0.113.0/24"
AMI = "ami-0123456789abcdef0"
# What `fab preflight` pins (or -c gives): offline synth passes both explicitly.
PINS = {"availability_zone": "us-east-1a", "ami_id": AMI}


def cluster_template(region=None, **context) -> Template:
    config = synth_config({"ssh_cidr": SSH_CIDR, **PINS, **context}, region=region)
    return Template.from_stack(GpuClusterStack(cdk_app(), "Cluster", config=config))


def launch_templates(template: Template) -> list[dict]:
    """Each node's launch template data."""
    return [r["Properties"]["LaunchTemplateData"] for r in template.find_resources("AWS::EC2::LaunchTemplate").values()]
