"""The node's bootstrap beside its user data (stacks/userdata.py renders that stub): the node-config SSM
parameter (KEY=VALUE lines the stub reads at each run: the bootstrap script's S3 URL, the base image, Spot,
EFA cards) and the user-data size check. Only what a node keeps for its life (cluster, rank, instance type,
file system, stack, its own logical ID, parameter and alarm names) is in user data, so no config change and
no edit of the script alters it, which with `user_data_causes_replacement` would replace every node.

The values may be CDK tokens (file system id, region, ...); they resolve at deploy time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from aws_cdk import Tags
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3_assets as s3_assets
from aws_cdk import aws_ssm as ssm
from constructs import Construct

from cluster_node.protocol.contract import CLUSTER_TAG, node_config_parameter

from .config import ClusterConfig

BOOTSTRAP_SCRIPT = Path(__file__).resolve().parent.parent / "assets" / "bootstrap" / "node-bootstrap.sh"
USER_DATA_LIMIT = 16 * 1024  # EC2: user data is at most 16 KB before base64
TOKEN_ALLOWANCE = 256  # bytes counted for each value CloudFormation fills in at deploy time


def node_config(values: Mapping[str, str]) -> str:
    """The node-config parameter's value: KEY=VALUE lines (a value may be a CDK token)."""
    return "\n".join(f"{key}={value}" for key, value in values.items())


def make_node_config(scope: Construct, config: ClusterConfig, role: iam.IRole) -> ssm.StringParameter:
    """The node-config parameter, which the role may read: the bootstrap script's own asset (editing it
    changes neither user data nor the image context's tag), the base image, Spot, EFA cards."""
    script = s3_assets.Asset(scope, "BootstrapScript", path=str(BOOTSTRAP_SCRIPT))
    # That one object (Asset.grant_read would allow the whole CDK assets bucket).
    role.add_to_principal_policy(
        iam.PolicyStatement(actions=["s3:GetObject"], resources=[script.bucket.arn_for_objects(script.s3_object_key)])
    )
    values = {
        "BOOTSTRAP_URL": script.s3_object_url,
        "BASE_IMAGE": config.image,
        "EFA_CARDS": str(config.efa_cards),
        "SPOT": "true" if config.spot else "false",
    }
    parameter = ssm.StringParameter(
        scope,
        "NodeConfig",
        parameter_name=node_config_parameter(config.cluster_name),
        string_value=node_config(values),
        description="The node bootstrap's config (KEY=VALUE lines): script URL, base image, Spot, EFA",
    )
    parameter.grant_read(role)
    # Found by its /gpu-cluster/NAME/ path, so untagged (moto crashes on SSM parameter tags in CloudFormation).
    Tags.of(parameter).remove(CLUSTER_TAG, priority=200)
    return parameter


def user_data_bytes(resolved) -> int:
    """Size of user data as CloudFormation will render it, from its resolved template value
    (a string, or Fn::Join of strings and tokens; each token counted at TOKEN_ALLOWANCE bytes)."""
    if isinstance(resolved, dict) and "Fn::Base64" in resolved:
        resolved = resolved["Fn::Base64"]
    if isinstance(resolved, str):
        return len(resolved.encode())
    parts = resolved["Fn::Join"][1]
    return sum(len(part.encode()) if isinstance(part, str) else TOKEN_ALLOWANCE for part in parts)


def check_user_data_size(resolved, what: str) -> int:
    size = user_data_bytes(resolved)
    if size > USER_DATA_LIMIT:
        raise ValueError(
            f"{what}: user data would be {size} bytes, over EC2's {USER_DATA_LIMIT}; shorten the values it carries"
        )
    return size
