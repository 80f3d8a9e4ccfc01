"""The cluster stack: composes network, shared storage and GPU nodes; declares the outputs fab reads."""
from __future__ import annotations

from aws_cdk import Acknowledgment, CfnOutput, Fn, Stack, Tags, Validations
from constructs import Construct

from .config import ClusterConfig
from .network import ClusterNetwork
from .nodes import CLUSTER_TAG, GpuNodes
from .storage import SharedStorage


class GpuClusterStack(Stack):

    def __init__(self, scope: Construct, construct_id: str, *, config: ClusterConfig, **kwargs) -> None:
        super().__init__(scope, construct_id, **kwargs)
        Tags.of(self).add(CLUSTER_TAG, config.cluster_name)

        self.network = ClusterNetwork(self, "Network", ssh_cidr=config.ssh_cidr,
                                      vpc_id=config.vpc_id, subnet_id=config.subnet_id,
                                      availability_zone=config.availability_zone)
        self.storage = SharedStorage(self, "SharedStorage", vpc=self.network.vpc,
                                     subnet=self.network.subnet,
                                     client_security_group=self.network.security_group,
                                     retain_data=config.retain_data)
        self.nodes = GpuNodes(self, "GpuNodes", config=config, vpc=self.network.vpc,
                              subnet=self.network.subnet,
                              security_group=self.network.security_group,
                              file_system=self.storage.file_system)
        self._acknowledge_findings()

        instances = self.nodes.instances
        outputs = {
            "ClusterName": config.cluster_name,
            "HeadPublicIp": instances[0].instance_public_ip,
            "PrivateIps": Fn.join(",", [i.instance_private_ip for i in instances]),
            "PublicIps": Fn.join(",", [i.instance_public_ip for i in instances]),
            "InstanceIds": Fn.join(",", [i.instance_id for i in instances]),
            "FileSystemId": self.storage.file_system.file_system_id,
            "KeyParameterName": self.nodes.key_parameter_name or "none",
            "KeyName": self.nodes.key_pair.key_pair_name,
            "HostKeyParameterName": self.nodes.host_key_parameter_name,
            "Region": self.region,
            "GpusPerNode": str(config.gpus),
            "InstanceType": config.instance_type,
        }
        for name, value in outputs.items():
            CfnOutput(self, name, value=value)

    def _acknowledge_findings(self) -> None:
        """cdk-nag AwsSolutions findings this design accepts, each with its reason."""
        Validations.of(self).acknowledge(
            Acknowledgment(id="AwsSolutions::AwsSolutions-EC29", reason=(
                "Training nodes are disposable by design: `cdk destroy` must remove them and "
                "leave nothing billing; state lives on EFS and in checkpoints.")),
            Acknowledgment(
                id="AwsSolutions::AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/"
                   "AmazonSSMManagedInstanceCore]",
                reason="AWS's minimal, maintained policy for Session Manager access to the nodes."),
            Acknowledgment(
                id="AwsSolutions::AwsSolutions-IAM5[Resource::*]",
                reason="ec2:DescribeInstances and cloudwatch:PutMetricData have no resource-level "
                       "permissions: the autostop watchdog finds this cluster's instances by tag, and "
                       "may publish its heartbeat only to its own namespace (cloudwatch:namespace)."),
            Acknowledgment(id="AwsSolutions::AwsSolutions-EC28", reason=(
                "The idle alarm uses the autostop watchdog's own 1-minute heartbeat, not EC2 metrics; "
                "detailed monitoring would add about $2.10 per node-month for nothing.")),
            Acknowledgment(
                id="AwsSolutions::AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:ec2:<AWS::Region>:"
                   "<AWS::AccountId>:instance/*]",
                reason="ec2:StopInstances is limited by a condition to instances tagged with this "
                       "cluster's name (aws:ResourceTag/gpu-cluster:name)."),
        )
