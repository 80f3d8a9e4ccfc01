"""Shared storage: an encrypted EFS file system mounted at /data on every node."""
from __future__ import annotations

from aws_cdk import RemovalPolicy, aws_ec2 as ec2, aws_efs as efs
from constructs import Construct


class SharedStorage(Construct):
    """Exposes `file_system`. NFS is reachable only from `client_security_group`."""

    def __init__(self, scope: Construct, construct_id: str, *, vpc: ec2.IVpc, subnet: ec2.ISubnet,
                 client_security_group: ec2.ISecurityGroup, retain_data: bool) -> None:
        super().__init__(scope, construct_id)
        security_group = ec2.SecurityGroup(
            self, "EfsSecurityGroup", vpc=vpc, allow_all_outbound=False,
            description="EFS mount target: NFS from cluster nodes only")
        security_group.add_ingress_rule(client_security_group, ec2.Port.tcp(2049),
                                        "NFS from cluster nodes")
        self.file_system = efs.FileSystem(
            self, "FileSystem", vpc=vpc,
            vpc_subnets=ec2.SubnetSelection(subnets=[subnet]),
            security_group=security_group,
            encrypted=True,
            throughput_mode=efs.ThroughputMode.ELASTIC,
            performance_mode=efs.PerformanceMode.GENERAL_PURPOSE,
            enable_automatic_backups=False,
            removal_policy=RemovalPolicy.RETAIN if retain_data else RemovalPolicy.DESTROY,
        )
