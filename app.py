#!/usr/bin/env python3
"""CDK entry point: reads context once, validates it, composes the cluster stack.

fab preflight --instance-type g4dn.2xlarge   # pins the AZ and the AMI in cdk.context.json
npx cdk deploy -c ssh_cidr=$(curl -s https://checkip.amazonaws.com)/32
npx cdk synth -c nodes=3 -c ssh_cidr=203.0.113.7/32 -c availability_zone=us-east-1a -c ami_id=ami-0123456789abcdef0
"""

import os
import sys
from pathlib import Path

import aws_cdk as cdk
from cdk_nag import AwsSolutionsChecks, NIST80053R5Checks

from stacks.config import stack_name
from stacks.contextkeys import check_context_keys, settings_keys
from stacks.pins import UnpinnedError, synth_config, unpinned_config

app = cdk.App()
region = os.environ.get("CDK_DEFAULT_REGION")
unpinned = None
try:
    # the CLI runs the app in the project directory: its cdk.json, and the user's ~/.cdk.json
    check_context_keys(app.node.get_all_context(), settings_keys(Path("cdk.json"), Path.home() / ".cdk.json"))
    try:
        config = synth_config(app.node.try_get_context, region=region)  # refuses to guess the AZ or the AMI
    except UnpinnedError as error:  # fails synth/diff/deploy as an error annotation, not `cdk destroy`
        config, unpinned = unpinned_config(app.node.try_get_context, region=region), f"error: {error}"
    name = stack_name(app.node.try_get_context("stack_name"), config.cluster_name)
    from stacks.cluster_stack import GpuClusterStack  # after the checks: bad context fails in a second, not three

    stack = GpuClusterStack(
        app,
        name,
        config=config,
        env=cdk.Environment(account=os.environ.get("CDK_DEFAULT_ACCOUNT"), region=region),
        description=f"GPU training cluster {config.cluster_name}: {config.nodes} x {config.instance_type}",
    )
except ValueError as error:  # ConfigError, an unknown context key, or a service limit a value would exceed
    sys.exit(f"error: {error}")
if unpinned:
    cdk.Annotations.of(stack).add_error(unpinned)
else:  # an unpinned template never deploys: its findings would only bury the one line
    cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app), NIST80053R5Checks(app))
app.synth()
