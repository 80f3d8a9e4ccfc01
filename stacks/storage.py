"""Shared storage: an encrypted EFS file system mounted at /data on every node.

Access: the nodes mount it as plain NFS clients (no IAM identity: amazon-efs-utils, which IAM
authorisation needs, is not packaged for the Ubuntu DLAMI). With the CDK flag
`@aws-cdk/aws-efs:denyAnonymousAccess` the default policy grants such clients write and root but not
`ClientMount`, and EFS refuses the mount (aws-cdk #33669). So the policy grants all three, to clients
that come through a mount target; the mount target's security group admits NFS from cluster nodes
only, and that is the access control. Data is encrypted at rest."""

from __future__ import annotations

from aws_cdk import RemovalPolicy, Tags
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_efs as efs
from aws_cdk import aws_iam as iam
from constructs import Construct

from cluster_node.protocol.contract import RETAIN_TAG

# What the bootstrap's root NFS client needs: mount, write, and act as root (no root squash).
NFS_CLIENT_ACTIONS = ("ClientMount", "ClientWrite", "ClientRootAccess")
# Set on a file system kept with retain_data=true: `fab audit --delete` leaves it alone unless told.


class SharedStorage(Construct):
    """Exposes `file_system`. NFS is reachable only from `client_security_group`."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        vpc: ec2.IVpc,
        subnet: ec2.ISubnet,
        client_security_group: ec2.ISecurityGroup,
        retain_data: bool,
    ) -> None:
        super().__init__(scope, construct_id)
        security_group = ec2.SecurityGroup(
            self,
            "EfsSecurityGroup",
            vpc=vpc,
            allow_all_outbound=False,
            description="EFS mount target: NFS from cluster nodes only",
        )
        security_group.add_ingress_rule(client_security_group, ec2.Port.tcp(2049), "NFS from cluster nodes")
        self.file_system = efs.FileSystem(
            self,
            "FileSystem",
            vpc=vpc,
            vpc_subnets=ec2.SubnetSelection(subnets=[subnet]),
            security_group=security_group,
            encrypted=True,
            allow_anonymous_access=True,  # the flag's partial grant is replaced by the policy below
            throughput_mode=efs.ThroughputMode.ELASTIC,
            performance_mode=efs.PerformanceMode.GENERAL_PURPOSE,
            enable_automatic_backups=False,
            removal_policy=RemovalPolicy.RETAIN if retain_data else RemovalPolicy.DESTROY,
        )
        if retain_data:
            Tags.of(self.file_system).add(RETAIN_TAG, "true")
        self.file_system.add_to_resource_policy(
            iam.PolicyStatement(
                sid="NodesMountThroughTheMountTarget",
                actions=[f"elasticfilesystem:{action}" for action in NFS_CLIENT_ACTIONS],
                principals=[iam.AnyPrincipal()],
                conditions={"Bool": {"elasticfilesystem:AccessedViaMountTarget": "true"}},
            )
        )
