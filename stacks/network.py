"""Network: a VPC with one subnet for the nodes (or an existing subnet), and the node security group.

Public (default): the nodes' subnet is public, no NAT; access=ssh admits ssh_cidr on 4444 (the
training container's sshd, all that fab, mpirun and `fab ssh` use; the host's 22 stays closed),
access=ssm admits nothing from outside the group. Private (access=ssm only): the nodes have no public
IP; a NAT gateway in a small public subnet lets them pull the image, Session Manager is reached
through interface endpoints, S3 through a (free) gateway endpoint.
"""

from __future__ import annotations

from typing import Optional

from aws_cdk import Aws, Duration, RemovalPolicy, Stack
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from constructs import Construct

from cluster_node.protocol.contract import CONTAINER_SSH_PORT

# The container's sshd (assets/docker/sshd_config); fab and mpirun use it.
# Session Manager's endpoints (the SSH proxy of access=ssm goes through ssm and ssmmessages).
SSM_ENDPOINTS = (
    ("Ssm", ec2.InterfaceVpcEndpointAwsService.SSM),
    ("SsmMessages", ec2.InterfaceVpcEndpointAwsService.SSM_MESSAGES),
    ("Ec2Messages", ec2.InterfaceVpcEndpointAwsService.EC2_MESSAGES),
)


class ClusterNetwork(Construct):
    """Exposes `vpc`, `subnet` (where every node and the EFS mount target go) and `security_group`."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        ssh_cidr: Optional[str],
        vpc_id: Optional[str] = None,
        subnet_id: Optional[str] = None,
        availability_zone: Optional[str] = None,
        flow_logs: bool = True,
        private_subnet: bool = False,
    ) -> None:
        super().__init__(scope, construct_id)
        self.endpoints: list[ec2.InterfaceVpcEndpoint] = []
        if vpc_id and subnet_id and availability_zone:
            self.subnet: ec2.ISubnet = ec2.Subnet.from_subnet_attributes(
                self, "Subnet", subnet_id=subnet_id, availability_zone=availability_zone
            )
            self.vpc: ec2.IVpc = ec2.Vpc.from_vpc_attributes(
                self, "Vpc", vpc_id=vpc_id, availability_zones=[availability_zone], public_subnet_ids=[subnet_id]
            )
        else:
            vpc = self._create_vpc(availability_zone, private_subnet)
            if flow_logs:
                self._log_rejected_flows(vpc)
            self.vpc = vpc
            self.subnet = (vpc.private_subnets if private_subnet else vpc.public_subnets)[0]

        self.security_group = ec2.SecurityGroup(
            self,
            "NodeSecurityGroup",
            vpc=self.vpc,
            allow_all_outbound=True,
            description="GPU cluster nodes: all traffic between members, SSH from ssh_cidr only",
        )
        # MPI, NCCL, the container sshd and TensorBoard stay inside the cluster. EFA needs the group
        # to admit all traffic from AND to itself (its traffic is not IP: 0.0.0.0/0 does not cover it).
        self.security_group.add_ingress_rule(
            self.security_group, ec2.Port.all_traffic(), "all traffic between cluster members"
        )
        # (allow_all_outbound makes CDK drop egress rules added its way: this one goes in as L1)
        ec2.CfnSecurityGroupEgress(
            self,
            "EgressToMembers",
            group_id=self.security_group.security_group_id,
            ip_protocol="-1",
            destination_security_group_id=self.security_group.security_group_id,
            description="all traffic between cluster members (EFA)",
        )
        if ssh_cidr:  # the container's sshd only: a host shell goes through Session Manager
            self.security_group.add_ingress_rule(
                ec2.Peer.ipv4(ssh_cidr), ec2.Port.tcp(CONTAINER_SSH_PORT), "training container SSH from ssh_cidr"
            )
        if private_subnet:
            self._add_endpoints()

    def _create_vpc(self, availability_zone: Optional[str], private_subnet: bool) -> ec2.Vpc:
        # One AZ: the one that offers the instance type (chosen by config), else the first.
        zones = {"availability_zones": [availability_zone]} if availability_zone else {"max_azs": 1}
        if not private_subnet:
            return ec2.Vpc(
                self,
                "Vpc",
                nat_gateways=0,
                **zones,
                ip_addresses=ec2.IpAddresses.cidr("10.42.0.0/16"),
                subnet_configuration=[
                    ec2.SubnetConfiguration(name="nodes", subnet_type=ec2.SubnetType.PUBLIC, cidr_mask=20)
                ],
            )
        return ec2.Vpc(
            self,
            "Vpc",
            nat_gateways=1,
            **zones,
            ip_addresses=ec2.IpAddresses.cidr("10.42.0.0/16"),
            subnet_configuration=[
                ec2.SubnetConfiguration(name="nat", subnet_type=ec2.SubnetType.PUBLIC, cidr_mask=28),
                ec2.SubnetConfiguration(name="nodes", subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS, cidr_mask=20),
            ],
            gateway_endpoints={"S3": ec2.GatewayVpcEndpointOptions(service=ec2.GatewayVpcEndpointAwsService.S3)},
        )

    def _add_endpoints(self) -> None:
        """Interface endpoints for Session Manager in the nodes' subnet, HTTPS from the nodes only."""
        endpoint_group = ec2.SecurityGroup(
            self,
            "EndpointSecurityGroup",
            vpc=self.vpc,
            allow_all_outbound=False,
            description="Session Manager endpoints: HTTPS from cluster nodes",
        )
        endpoint_group.add_ingress_rule(self.security_group, ec2.Port.tcp(443), "HTTPS from cluster nodes")
        for name, service in SSM_ENDPOINTS:
            self.endpoints.append(
                self.vpc.add_interface_endpoint(
                    name,
                    service=service,
                    subnets=ec2.SubnetSelection(subnets=[self.subnet]),
                    security_groups=[endpoint_group],
                    private_dns_enabled=True,
                    open=False,
                )
            )

    def _log_rejected_flows(self, vpc: ec2.Vpc) -> None:
        """Rejected flows only: a security record at negligible cost (accepted MPI traffic is huge),
        encrypted with the stack's own key ($1/month; scheduled for deletion by `cdk destroy`)."""
        stack = Stack.of(self)
        group_name = f"/gpu-cluster/{stack.stack_name}/rejected-flows"
        self.log_key = kms.Key(
            self,
            "FlowLogKey",
            enable_key_rotation=True,
            pending_window=Duration.days(7),
            removal_policy=RemovalPolicy.DESTROY,
            description="Encrypts the cluster's VPC flow log",
        )
        # CloudWatch Logs User Guide, "Encrypt log data in CloudWatch Logs using AWS KMS": the service
        # may use the key only for this log group (the encryption context names it).
        self.log_key.add_to_resource_policy(
            iam.PolicyStatement(
                actions=["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"],
                principals=[iam.ServicePrincipal(f"logs.{stack.region}.amazonaws.com")],
                resources=["*"],
                conditions={
                    "ArnEquals": {
                        "kms:EncryptionContext:aws:logs:arn": (
                            f"arn:{Aws.PARTITION}:logs:{Aws.REGION}:{Aws.ACCOUNT_ID}:log-group:{group_name}"
                        )
                    }
                },
            )
        )
        flow_log_group = logs.LogGroup(
            self,
            "RejectedFlows",
            log_group_name=group_name,
            retention=logs.RetentionDays.TWO_WEEKS,
            encryption_key=self.log_key,
            removal_policy=RemovalPolicy.DESTROY,
        )
        vpc.add_flow_log(
            "RejectedFlowLog",
            destination=ec2.FlowLogDestination.to_cloud_watch_logs(flow_log_group, self._flow_log_role()),
            traffic_type=ec2.FlowLogTrafficType.REJECT,
        )

    def _flow_log_role(self) -> iam.Role:
        """Amazon VPC User Guide, "IAM role for publishing flow logs to CloudWatch Logs": aws:SourceAccount
        and aws:SourceArn keep another account's flow log from using this role (confused deputy)."""
        flow_logs = f"arn:{Aws.PARTITION}:ec2:{Aws.REGION}:{Aws.ACCOUNT_ID}:vpc-flow-log/*"
        return iam.Role(
            self,
            "FlowLogRole",
            assumed_by=iam.ServicePrincipal(
                "vpc-flow-logs.amazonaws.com",
                conditions={
                    "StringEquals": {"aws:SourceAccount": Aws.ACCOUNT_ID},
                    "ArnLike": {"aws:SourceArn": flow_logs},
                },
            ),
            description="VPC flow log delivery to the cluster's rejected-flows log group",
        )
