"""Network: a VPC with one public subnet and no NAT (or an existing subnet), and the node security group."""
from __future__ import annotations

from typing import Optional

from aws_cdk import Duration, RemovalPolicy, Stack, aws_ec2 as ec2, aws_iam as iam, aws_kms as kms, aws_logs as logs
from constructs import Construct

# The container's sshd (assets/docker/sshd_config); fab and mpirun use it.
CONTAINER_SSH_PORT = 4444


class ClusterNetwork(Construct):
    """Exposes `vpc`, `subnet` (where every node and the EFS mount target go) and `security_group`."""

    def __init__(self, scope: Construct, construct_id: str, *, ssh_cidr: Optional[str],
                 vpc_id: Optional[str] = None, subnet_id: Optional[str] = None,
                 availability_zone: Optional[str] = None, flow_logs: bool = True) -> None:
        super().__init__(scope, construct_id)
        if vpc_id and subnet_id and availability_zone:
            self.subnet: ec2.ISubnet = ec2.Subnet.from_subnet_attributes(
                self, "Subnet", subnet_id=subnet_id, availability_zone=availability_zone)
            self.vpc: ec2.IVpc = ec2.Vpc.from_vpc_attributes(
                self, "Vpc", vpc_id=vpc_id, availability_zones=[availability_zone],
                public_subnet_ids=[subnet_id])
        else:
            # One AZ: the one that offers the instance type (chosen by config), else the first.
            zones = {"availability_zones": [availability_zone]} if availability_zone else {"max_azs": 1}
            vpc = ec2.Vpc(
                self, "Vpc", nat_gateways=0, **zones,
                ip_addresses=ec2.IpAddresses.cidr("10.42.0.0/16"),
                subnet_configuration=[ec2.SubnetConfiguration(
                    name="nodes", subnet_type=ec2.SubnetType.PUBLIC, cidr_mask=20)],
            )
            if flow_logs:
                self._log_rejected_flows(vpc)
            self.vpc = vpc
            self.subnet = vpc.public_subnets[0]

        self.security_group = ec2.SecurityGroup(
            self, "NodeSecurityGroup", vpc=self.vpc, allow_all_outbound=True,
            description="GPU cluster nodes: all traffic between members, SSH from ssh_cidr only")
        # MPI, NCCL, the container sshd and TensorBoard stay inside the cluster.
        self.security_group.add_ingress_rule(
            self.security_group, ec2.Port.all_traffic(), "all traffic between cluster members")
        if ssh_cidr:
            for port, what in ((22, "host SSH"), (CONTAINER_SSH_PORT, "training container SSH")):
                self.security_group.add_ingress_rule(
                    ec2.Peer.ipv4(ssh_cidr), ec2.Port.tcp(port), f"{what} from ssh_cidr")

    def _log_rejected_flows(self, vpc: ec2.Vpc) -> None:
        """Rejected flows only: a security record at negligible cost (accepted MPI traffic is huge),
        encrypted with the stack's own key ($1/month; scheduled for deletion by `cdk destroy`)."""
        self.log_key = kms.Key(
            self, "FlowLogKey", enable_key_rotation=True, pending_window=Duration.days(7),
            removal_policy=RemovalPolicy.DESTROY, description="Encrypts the cluster's VPC flow log")
        self.log_key.add_to_resource_policy(iam.PolicyStatement(
            actions=["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"],
            principals=[iam.ServicePrincipal(f"logs.{Stack.of(self).region}.amazonaws.com")],
            resources=["*"]))
        flow_log_group = logs.LogGroup(
            self, "RejectedFlows", retention=logs.RetentionDays.TWO_WEEKS, encryption_key=self.log_key,
            removal_policy=RemovalPolicy.DESTROY)
        vpc.add_flow_log("RejectedFlowLog", destination=ec2.FlowLogDestination.to_cloud_watch_logs(flow_log_group),
                         traffic_type=ec2.FlowLogTrafficType.REJECT)
