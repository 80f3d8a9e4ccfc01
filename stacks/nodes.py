"""GPU nodes: N instances in one subnet and cluster placement group, each bootstrapped to run
the sshd training container. Exposes `instances` (rank order), `key_parameter_name`, `role`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from aws_cdk import (
    Aws,
    CfnCreationPolicy,
    CfnResourceSignal,
    Duration,
    Stack,
    Tags,
)
from aws_cdk import (
    aws_cloudwatch as cloudwatch,
)
from aws_cdk import (
    aws_cloudwatch_actions as cloudwatch_actions,
)
from aws_cdk import (
    aws_ec2 as ec2,
)
from aws_cdk import (
    aws_efs as efs,
)
from aws_cdk import (
    aws_iam as iam,
)
from aws_cdk import (
    aws_s3_assets as s3_assets,
)
from aws_cdk import (
    aws_ssm as ssm,
)
from constructs import Construct

from cluster_node.protocol.contract import (
    BUSY_METRIC,
    CLUSTER_TAG,
    METRIC_NAMESPACE,
    RANK_TAG,
    host_key_parameter,
    idle_minutes_parameter,
    image_context_parameter,
    node_config_parameter,
)

from .bootstrap import check_user_data_size, make_node_config
from .config import ClusterConfig, alarm_minutes
from .images import image_tag
from .node_launch import PinnedImage, attach_launch_template
from .spot_release import SpotRequestRelease
from .userdata import render_user_data

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
BOOTSTRAP_TIMEOUT = Duration.minutes(45)  # pulling the NGC image (~10 GB) dominates
# The autostop watchdog's heartbeat (cluster_node/daemons/autostop/watchdog.py publishes it once a minute).
HEARTBEAT_NAMESPACE = METRIC_NAMESPACE
HEARTBEAT_METRIC = BUSY_METRIC
HEARTBEAT_PERIOD = Duration.minutes(1)


HOST_KEY_PENDING = "pending: written by node 0 at boot"


def _cfn(instance: ec2.Instance) -> ec2.CfnInstance:
    """The instance's CloudFormation resource (CDK's escape hatch)."""
    resource = instance.node.default_child
    assert isinstance(resource, ec2.CfnInstance)
    return resource


# AWS Systems Manager User Guide, "Create a custom IAM role for Session Manager": what SSM Agent needs for
# sessions (fab's access=ssm proxy; no session logging or KMS). ssmmessages has no resource-level permissions;
# ssm:UpdateInstanceInformation takes the EC2 instance, its own condition keys only ec2:/ssm:SourceInstanceARN
# (Service Authorization Reference).
SESSION_MANAGER_ACTIONS = (
    "ssm:UpdateInstanceInformation",
    "ssmmessages:CreateControlChannel",
    "ssmmessages:CreateDataChannel",
    "ssmmessages:OpenControlChannel",
    "ssmmessages:OpenDataChannel",
)


def idle_alarm_name(cluster_name: str, rank: int) -> str:
    """The node finds its alarm by it (unique per account and region; in user data even with idle_minutes=0,
    so changing idle_minutes replaces no node)."""
    return f"{cluster_name}-node{rank}-idle"


def host_key_parameter_name(cluster_name: str) -> str:
    return host_key_parameter(cluster_name)


def image_context_parameter_name(cluster_name: str) -> str:
    return image_context_parameter(cluster_name)


class GpuNodes(Construct):
    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ClusterConfig,
        vpc: ec2.IVpc,
        subnet: ec2.ISubnet,
        security_group: ec2.ISecurityGroup,
        file_system: efs.IFileSystem,
        assets_dir: Path = ASSETS_DIR,
    ) -> None:
        super().__init__(scope, construct_id)
        self.host_key_parameter_name = host_key_parameter_name(config.cluster_name)
        # Image build context: the Dockerfile and the training program, unpacked on each node.
        self.image_context = s3_assets.Asset(
            self, "ImageContextAsset", path=str(assets_dir), exclude=["bootstrap", "**/__pycache__", "**/*.pyc"]
        )
        self.role = self._node_role(config)
        self.host_key_parameter = self._host_key_parameter()
        self.image_context_parameter = self._image_context_parameter(config)
        self.idle_minutes_parameter = self._idle_minutes_parameter(config)
        self.node_config_parameter = make_node_config(self, config, self.role)
        self._grant_stop_and_heartbeat(config)
        self.key_pair, self.key_parameter_name = self._key_pair(config)
        # One group per instance type: a type change replaces every node (new before old), and the new nodes
        # then start a group of their own instead of joining the old nodes' hardware, where EC2 is likelier
        # to lack capacity ("Placement group rules and limitations": launch all of a group's nodes at once).
        group = "PlacementGroup" + "".join(part.capitalize() for part in re.split(r"\W", config.instance_type))
        placement_group = (
            ec2.PlacementGroup(self, group, strategy=ec2.PlacementGroupStrategy.CLUSTER)
            if config.in_placement_group
            else None
        )
        machine_image = PinnedImage(config.ami_id)
        # Created before the nodes and deleted after them, so it sees every node's termination.
        release = SpotRequestRelease(self, "SpotRelease", cluster_name=config.cluster_name) if config.spot else None
        self.instances: list[ec2.Instance] = []
        for rank in range(config.nodes):
            instance = self._instance(config, rank, vpc, subnet, security_group, machine_image, placement_group)
            if release:
                instance.node.add_dependency(release)
            self._bootstrap(config, rank, instance, file_system)
            self._launch_options(config, rank, instance, subnet, security_group)
            self.instances.append(instance)
        self._grant_alarm_reset(config)
        self.idle_alarms = [
            self._idle_alarm(config, rank, instance)
            for rank, instance in enumerate(self.instances)
            if config.idle_minutes
        ]

    def _node_role(self, config: ClusterConfig) -> iam.Role:
        role = iam.Role(
            self,
            "NodeRole",
            assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
            description="GPU cluster nodes: SSM sessions, bootstrap signal, image context",
        )
        # Not AmazonSSMManagedInstanceCore: it allows ssm:GetParameter(s) on every parameter of the
        # region (the generated /ec2/keypair/* private keys too), to any process on the node.
        channels = [a for a in SESSION_MANAGER_ACTIONS if a.startswith("ssmmessages:")]
        role.add_to_policy(iam.PolicyStatement(actions=channels, resources=["*"]))
        # The agent's heartbeat, on this account's and region's instances, with no tag condition: the Service
        # Authorization Reference lists aws:ResourceTag under the `instance` resource type, not on this action,
        # which names only ec2:/ssm:SourceInstanceARN; if SSM does not put the tag into the request, a tag
        # condition denies every heartbeat and no node ever connects (AWS's own minimal policy grants it on "*").
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["ssm:UpdateInstanceInformation"],
                resources=[f"arn:{Aws.PARTITION}:ec2:{Aws.REGION}:{Aws.ACCOUNT_ID}:instance/*"],
            )
        )
        role.add_to_policy(
            iam.PolicyStatement(actions=["cloudformation:SignalResource"], resources=[Stack.of(self).stack_id])
        )
        if config.data_bucket:  # read only, that bucket only: `fab data --dataset imagenet --extra "--from s3://..."`
            bucket = f"arn:{Aws.PARTITION}:s3:::{config.data_bucket}"
            role.add_to_policy(iam.PolicyStatement(actions=["s3:ListBucket"], resources=[bucket]))
            role.add_to_policy(iam.PolicyStatement(actions=["s3:GetObject"], resources=[f"{bucket}/*"]))
        return role

    def _host_key_parameter(self) -> ssm.StringParameter:
        """Owned by the stack (so `cdk destroy` deletes it); node 0 overwrites the placeholder."""
        parameter = ssm.StringParameter(
            self,
            "HostKey",
            parameter_name=self.host_key_parameter_name,
            string_value=HOST_KEY_PENDING,
            description="The cluster's SSH host public key, pinned by the fab tasks",
        )
        parameter.grant_write(self.role)
        # Found by its /gpu-cluster/NAME/ path, so untagged: moto 5.2 crashes on SSM parameter tags
        # in CloudFormation, and the deploy-into-moto test needs this stack.
        Tags.of(parameter).remove(CLUSTER_TAG, priority=200)
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=["s3:GetObject"],
                resources=[self.image_context.bucket.arn_for_objects(self.image_context.s3_object_key)],
            )
        )
        return parameter

    def _image_context_parameter(self, config: ClusterConfig) -> ssm.StringParameter:
        """Where the image context is, outside user data: a code edit updates this parameter and
        replaces no node (running nodes get code with `fab sync`; new ones build from it)."""
        parameter = ssm.StringParameter(
            self,
            "ImageContext",
            parameter_name=image_context_parameter_name(config.cluster_name),
            string_value=f"{self.image_context.s3_object_url} {image_tag(self.image_context.asset_hash, config.image)}",
            description="The training image's build context (S3 URL and tag) for the node bootstrap",
        )
        parameter.grant_read(self.role)
        Tags.of(parameter).remove(CLUSTER_TAG, priority=200)
        return parameter

    def _idle_minutes_parameter(self, config: ClusterConfig) -> ssm.StringParameter:
        """idle_minutes outside user data, so changing it replaces no node; the bootstrap passes it to
        the container it starts (new nodes, or a re-created container, get the new value)."""
        parameter = ssm.StringParameter(
            self,
            "IdleMinutes",
            parameter_name=idle_minutes_parameter(config.cluster_name),
            string_value=str(config.idle_minutes),
            description="Minutes the cluster may idle before its watchdog stops it (0: off)",
        )
        parameter.grant_read(self.role)
        Tags.of(parameter).remove(CLUSTER_TAG, priority=200)
        return parameter

    def _key_pair(self, config: ClusterConfig) -> tuple[ec2.IKeyPair, Optional[str]]:
        """The user's key pair by name, else a new one whose private key CDK keeps in SSM."""
        if config.key_name:
            return ec2.KeyPair.from_key_pair_name(self, "KeyPair", config.key_name), None
        key_pair = ec2.KeyPair(
            self,
            "KeyPair",
            key_pair_name=f"{config.cluster_name}-{Stack.of(self).stack_name}",
            type=ec2.KeyPairType.ED25519,
        )
        return key_pair, key_pair.private_key.parameter_name

    def _instance(
        self,
        config: ClusterConfig,
        rank: int,
        vpc: ec2.IVpc,
        subnet: ec2.ISubnet,
        security_group: ec2.ISecurityGroup,
        machine_image: ec2.IMachineImage,
        placement_group: Optional[ec2.PlacementGroup],
    ) -> ec2.Instance:
        instance = ec2.Instance(
            self,
            f"Node{rank}",
            instance_name=config.node_name(rank),
            vpc=vpc,
            vpc_subnets=ec2.SubnetSelection(subnets=[subnet]),
            security_group=security_group,
            instance_type=ec2.InstanceType(config.instance_type),
            machine_image=machine_image,
            role=self.role,
            key_pair=self.key_pair,
            placement_group=placement_group,
            require_imdsv2=False,  # its own launch template requires IMDSv2 (stacks/node_launch.py)
            # no detailed monitoring: the idle alarm uses the heartbeat
            user_data_causes_replacement=True,
            propagate_tags_to_volume_on_creation=True,
            block_devices=[
                ec2.BlockDevice(
                    device_name="/dev/sda1",
                    volume=ec2.BlockDeviceVolume.ebs(
                        config.root_volume_gb,
                        volume_type=ec2.EbsDeviceVolumeType.GP3,
                        encrypted=True,
                        delete_on_termination=True,
                    ),
                )
            ],
        )
        Tags.of(instance).add(RANK_TAG, str(rank))
        return instance

    def _bootstrap(
        self, config: ClusterConfig, rank: int, instance: ec2.Instance, file_system: efs.IFileSystem
    ) -> None:
        """User data (the stub with this node's life-long values), the signal it must send, and what
        must exist before it runs."""
        stack = Stack.of(self)
        env = {
            "CLUSTER_NAME": config.cluster_name,
            "NODE_RANK": str(rank),
            "FILE_SYSTEM_ID": file_system.file_system_id,
            "AWS_REGION": stack.region,
            "STACK_NAME": stack.stack_name,
            # The lazy logical ID: the one in the template, with the user-data hash CDK appends
            # (get_logical_id omits it: aws-cdk#11959); while CDK hashes the user data it renders unhashed.
            "SIGNAL_RESOURCE": _cfn(instance).logical_id,
            "NODE_CONFIG_PARAMETER": node_config_parameter(config.cluster_name),
            "IMAGE_CONTEXT_PARAMETER": image_context_parameter_name(config.cluster_name),
            "HOST_KEY_PARAMETER": self.host_key_parameter_name,
            "IDLE_MINUTES_PARAMETER": idle_minutes_parameter(config.cluster_name),
            "IDLE_ALARM": idle_alarm_name(config.cluster_name, rank),
            "HEARTBEAT_NAMESPACE": HEARTBEAT_NAMESPACE,
            # A node of another type is another node: in user data, a type change replaces each node (a
            # new one bootstraps, then the old one goes). In place, CloudFormation would stop and start
            # every node at once, and EC2 refuses a stopped Spot instance a new type.
            "INSTANCE_TYPE": config.instance_type,
        }
        instance.user_data.add_commands(render_user_data(env))
        check_user_data_size(stack.resolve(instance.user_data.render()), config.node_name(rank))
        _cfn(instance).cfn_options.creation_policy = CfnCreationPolicy(
            resource_signal=CfnResourceSignal(count=1, timeout=f"PT{int(BOOTSTRAP_TIMEOUT.to_minutes())}M")
        )
        # Mount targets must exist before the bootstrap mounts /data.
        instance.node.add_dependency(
            file_system.mount_targets_available,
            self.host_key_parameter,
            self.image_context_parameter,
            self.idle_minutes_parameter,
            self.node_config_parameter,
        )

    def _launch_options(
        self,
        config: ClusterConfig,
        rank: int,
        instance: ec2.Instance,
        subnet: ec2.ISubnet,
        security_group: ec2.ISecurityGroup,
    ) -> None:
        """IMDS options, EFA interfaces and Spot market options: the node's own launch template."""
        spot_tags = {CLUSTER_TAG: config.cluster_name, RANK_TAG: str(rank)}
        attach_launch_template(
            self,
            rank,
            instance,
            efa_cards=config.efa_cards,
            subnet=subnet,
            security_group=security_group,
            public=config.public_ip_request,
            existing_subnet=config.vpc_id is not None,
            spot=(config.spot_max_price, spot_tags) if config.spot else None,
        )

    def _grant_stop_and_heartbeat(self, config: ClusterConfig) -> None:
        """Always, even with idle_minutes=0 (`fab train --then-stop` stops the cluster from a node):
        find and stop this cluster's instances and no others; publish the autostop heartbeat."""
        self.role.add_to_policy(iam.PolicyStatement(actions=["ec2:DescribeInstances"], resources=["*"]))
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=["ec2:StopInstances"],
                # Pseudo-parameters, not format_arn: the same ARN text in every environment.
                resources=[f"arn:{Aws.PARTITION}:ec2:{Aws.REGION}:{Aws.ACCOUNT_ID}:instance/*"],
                conditions={"StringEquals": {f"aws:ResourceTag/{CLUSTER_TAG}": config.cluster_name}},
            )
        )
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=["cloudwatch:PutMetricData"],
                resources=["*"],
                conditions={"StringEquals": {"cloudwatch:namespace": HEARTBEAT_NAMESPACE}},
            )
        )

    def _grant_alarm_reset(self, config: ClusterConfig) -> None:
        """At every boot a node sets its alarm to OK once CloudWatch serves its busy beat (node-bootstrap.sh
        reset_alarm). ARNs by name: alarm_arn would make a cycle (policy -> alarm -> node -> policy)."""
        arn = f"arn:{Aws.PARTITION}:cloudwatch:{Aws.REGION}:{Aws.ACCOUNT_ID}:alarm:"
        names = [idle_alarm_name(config.cluster_name, rank) for rank in range(config.nodes)]
        self.role.add_to_policy(
            iam.PolicyStatement(actions=["cloudwatch:SetAlarmState"], resources=[arn + n for n in names])
        )
        self.role.add_to_policy(iam.PolicyStatement(actions=["cloudwatch:GetMetricStatistics"], resources=["*"]))

    def _idle_alarm(self, config: ClusterConfig, rank: int, instance: ec2.Instance) -> cloudwatch.Alarm:
        """Stops the node when its heartbeat has said idle, or nothing (a dead watchdog, a dead
        container), for idle_minutes + the grace: after the watchdog itself would have stopped it."""
        minutes = alarm_minutes(config.idle_minutes)
        alarm = cloudwatch.Alarm(
            self,
            f"IdleAlarm{rank}",
            alarm_name=idle_alarm_name(config.cluster_name, rank),
            alarm_description=f"{config.node_name(rank)}: no busy autostop heartbeat for {minutes} min "
            f"(idle, or the watchdog is dead); stops the node",
            metric=cloudwatch.Metric(
                namespace=HEARTBEAT_NAMESPACE,
                metric_name=HEARTBEAT_METRIC,
                statistic="Maximum",
                period=HEARTBEAT_PERIOD,
                dimensions_map={"InstanceId": instance.instance_id},
                # No unit: it reads every unit published, and every beat is BUSY_UNIT's (a unit here would
                # leave out the unitless boot beats of nodes bootstrapped before, until they are replaced).
            ),
            threshold=1,
            evaluation_periods=minutes,
            datapoints_to_alarm=minutes,
            comparison_operator=cloudwatch.ComparisonOperator.LESS_THAN_THRESHOLD,
            treat_missing_data=cloudwatch.TreatMissingData.BREACHING,
        )
        alarm.add_alarm_action(cloudwatch_actions.Ec2Action(cloudwatch_actions.Ec2InstanceAction.STOP))
        # Its Ref to the instance means CloudFormation creates it only once the node has signalled
        # (creation policy), i.e. its watchdog runs: no missing heartbeat during the bootstrap.
        return alarm
