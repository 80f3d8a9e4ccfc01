"""The cluster stack: composes network, shared storage and GPU nodes; declares the outputs fab reads."""

from __future__ import annotations

from aws_cdk import Acknowledgment, Annotations, CfnOutput, Fn, Stack, Tags, Validations
from constructs import Construct

from .config import ClusterConfig
from .dashboard import ClusterDashboard
from .network import ClusterNetwork
from .nodes import CLUSTER_TAG, GpuNodes
from .storage import SharedStorage
from .userdata import user_data_version


class GpuClusterStack(Stack):
    def __init__(self, scope: Construct, construct_id: str, *, config: ClusterConfig, **kwargs) -> None:
        super().__init__(scope, construct_id, **kwargs)
        Tags.of(self).add(CLUSTER_TAG, config.cluster_name)

        self.network = ClusterNetwork(
            self,
            "Network",
            ssh_cidr=config.ssh_cidr,
            vpc_id=config.vpc_id,
            subnet_id=config.subnet_id,
            availability_zone=config.availability_zone,
            flow_logs=config.flow_logs,
            private_subnet=config.private_subnet,
        )
        self.storage = SharedStorage(
            self,
            "SharedStorage",
            vpc=self.network.vpc,
            subnet=self.network.subnet,
            client_security_group=self.network.security_group,
            retain_data=config.retain_data,
        )
        self.nodes = GpuNodes(
            self,
            "GpuNodes",
            config=config,
            vpc=self.network.vpc,
            subnet=self.network.subnet,
            security_group=self.network.security_group,
            file_system=self.storage.file_system,
        )
        self._nodes_after_their_network()
        self.dashboard = ClusterDashboard(
            self,
            "Dashboard",
            name=config.cluster_name,
            instances=self.nodes.instances,
            file_system=self.storage.file_system,
        )
        self._acknowledge_findings(config)
        Validations.of(self.nodes).acknowledge(
            Acknowledgment(
                id="CloudFormation-Validate::W9010",
                reason="The AMI id is pinned on purpose (fab preflight, or -c ami_id): an SSM parameter resolved "
                "at every deploy would replace every node after each Deep Learning AMI release.",
            )
        )
        self._acknowledge_nist_findings()
        if config.efa_note:
            Annotations.of(self).add_warning_v2("gpu-cluster:efa", config.efa_note)
        if not config.flow_logs and not config.vpc_id:
            reason = "Flow logs were turned off with -c flow_logs=false (the default logs rejected flows)."
            Validations.of(self.network).acknowledge(
                Acknowledgment(id="AwsSolutions::AwsSolutions-VPC7", reason=reason),
                Acknowledgment(id="NIST.800.53.R5::NIST.800.53.R5-VPCFlowLogsEnabled", reason=reason),
            )
        for name, value in self._outputs(config).items():
            CfnOutput(self, name, value=value)

    def _outputs(self, config: ClusterConfig) -> dict:
        """What `fab inventory` reads (assets/cluster_node OUTPUT_KEYS names them)."""
        instances = self.nodes.instances
        public = config.public_ips
        return {
            "ClusterName": config.cluster_name,
            "HeadPublicIp": instances[0].instance_public_ip if public else "none",
            "PrivateIps": Fn.join(",", [i.instance_private_ip for i in instances]),
            "PublicIps": Fn.join(",", [i.instance_public_ip for i in instances]) if public else "none",
            "InstanceIds": Fn.join(",", [i.instance_id for i in instances]),
            "FileSystemId": self.storage.file_system.file_system_id,
            "KeyParameterName": self.nodes.key_parameter_name or "none",
            "KeyName": self.nodes.key_pair.key_pair_name,
            "HostKeyParameterName": self.nodes.host_key_parameter_name,
            "Region": self.region,
            "DashboardUrl": self.dashboard.url,
            "NodeUserData": user_data_version(),  # fab preflight: does this checkout replace every node?
            **config_outputs(config),
        }

    def _nodes_after_their_network(self) -> None:
        """A node's user data calls SSM and S3 at once: not before its subnet's route (a private subnet's NAT
        route) and the Session Manager endpoints exist (the stub retries for minutes, not for their creation)."""
        for instance in self.nodes.instances:
            instance.node.add_dependency(self.network.subnet.internet_connectivity_established, *self.network.endpoints)

    def _acknowledge_findings(self, config: ClusterConfig) -> None:
        """cdk-nag AwsSolutions findings this design accepts, each with its reason."""
        if config.data_bucket:
            Validations.of(self).acknowledge(
                Acknowledgment(
                    id=f"AwsSolutions::AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:s3:::{config.data_bucket}/*]",
                    reason="-c data_bucket names a bucket whose every object the nodes may read (s3:GetObject "
                    'only): `fab data --dataset imagenet --extra "--from s3://BUCKET/PREFIX"` fetches a prefix '
                    "of it; nothing else of S3 is granted.",
                )
            )
        Validations.of(self).acknowledge(
            Acknowledgment(
                id="AwsSolutions::AwsSolutions-EC29",
                reason=(
                    "Training nodes are disposable by design: `cdk destroy` must remove them and "
                    "leave nothing billing; state lives on EFS and in checkpoints."
                ),
            ),
            Acknowledgment(
                id="AwsSolutions::AwsSolutions-IAM5[Resource::*]",
                reason="ec2:DescribeInstances, cloudwatch:PutMetricData, cloudwatch:GetMetricStatistics and "
                "Session Manager's channel actions (ssmmessages:*Channel) have no "
                "resource-level permissions: the autostop watchdog finds this cluster's instances by tag, may "
                "publish its heartbeat only to its own namespace (cloudwatch:namespace), at boot a node reads its "
                "own beat back before it resets its idle alarm (read only), and SSM Agent opens only its own "
                "node's channels.",
            ),
            Acknowledgment(
                id="AwsSolutions::AwsSolutions-EC28",
                reason=(
                    "The idle alarm uses the autostop watchdog's own 1-minute heartbeat, not EC2 metrics; "
                    "detailed monitoring would add about $2.10 per node-month for nothing."
                ),
            ),
            Acknowledgment(
                id="AwsSolutions::AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:ec2:<AWS::Region>:"
                "<AWS::AccountId>:instance/*]",
                reason="ec2:StopInstances is limited by a condition to instances tagged with this cluster's name "
                "(aws:ResourceTag/gpu-cluster:name); ssm:UpdateInstanceInformation, SSM Agent's heartbeat, to this "
                "account's and region's instances (its documented condition keys name no tag).",
            ),
        )

    def _acknowledge_nist_findings(self) -> None:
        """cdk-nag NIST 800-53 rev 5 findings this design accepts, each on the construct it is about."""
        nist = "NIST.800.53.R5::NIST.800.53.R5-"
        Validations.of(self.network).acknowledge(
            Acknowledgment(
                id=nist + "VPCDefaultSecurityGroupClosed",
                reason=(
                    "Nothing is attached to the VPC's default security group: nodes and the EFS mount target "
                    "use their own groups. Closing it takes a Lambda-backed custom resource in every stack."
                ),
            ),
            Acknowledgment(
                id=nist + "VPCSubnetAutoAssignPublicIpDisabled",
                reason=(
                    "A public subnet is the default (no NAT gateway to pay for); the security group admits only "
                    "ssh_cidr on 4444 (none with access=ssm) and the cluster itself. With private_subnet "
                    "it holds only the NAT gateway."
                ),
            ),
            Acknowledgment(
                id=nist + "VPCNoUnrestrictedRouteToIGW",
                reason=(
                    "Nodes pull the NGC image and packages from the internet at boot (no NAT gateway, to keep "
                    "the bill at zero when idle); inbound is limited by the security group."
                ),
            ),
            Acknowledgment(
                id=nist + "EC2RestrictedCommonPorts",
                reason=(
                    "The flagged rule is the self-referencing all-traffic rule: its source is this security "
                    "group (cluster members only), which MPI and NCCL need; nothing is open to a CIDR."
                ),
            ),
        )
        Validations.of(self.storage).acknowledge(
            Acknowledgment(
                id=nist + "EFSInBackupPlan",
                reason=(
                    "/data is scratch for data sets and checkpoints that are re-creatable or fetched with "
                    "`fab fetch`; backups would bill after `cdk destroy`. retain_data=true keeps the file system."
                ),
            )
        )
        Validations.of(self).acknowledge(
            Acknowledgment(
                id=nist + "IAMNoInlinePolicy",
                reason=(
                    "CDK's per-role default policies: each is scoped to one role of this stack (the node role, "
                    "the flow-log role) and deleted with it; a managed policy would narrow nothing."
                ),
            )
        )


def config_outputs(config: ClusterConfig) -> dict[str, str]:
    """The outputs that are the config's own values. `fab preflight` compares the next deploy's config with them:
    the CDK remembers no -c value, so a deploy that leaves one out changes the cluster (clusterops.aws.redeploy)."""
    outputs = {
        "Access": config.access,
        "GpusPerNode": str(config.gpus),
        "InstanceType": config.instance_type,
        "Spot": "true" if config.spot else "false",
        "EfaCards": str(config.efa_cards),
        "RootVolumeGb": str(config.root_volume_gb),
        "PlacementGroup": "true" if config.in_placement_group else "false",
        "RetainData": "true" if config.retain_data else "false",
        "BaseImage": config.image,
        "IdleMinutes": str(config.idle_minutes),
        "DataBucket": config.data_bucket or "none",
    }
    if config.spot_max_price_output:
        outputs["SpotMaxPrice"] = config.spot_max_price_output
    return outputs
