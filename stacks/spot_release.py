"""Cancels a Spot node's persistent request when the node is terminated.

EC2 (User Guide, "Spot Instance requests" and "Cancel a Spot Instance request"): a persistent request
opens again when its instance is interrupted or terminated and launches a new one; cancel the request
before terminating the instance. CloudFormation terminates an AWS::EC2::Instance and cancels nothing,
so every `cdk destroy`, every replacement and every rollback of a failed node left a node outside the
stack (whose network interface then blocks the subnet's deletion). One-time requests would end with
their instance, but cannot be stopped (autostop, `fab stop-cluster` need stop): persistent stays.

An EventBridge rule on EC2's state-change events (shutting-down, terminated) runs a small function that
cancels the request of the terminated instance if the request carries this cluster's tag. A custom
resource could only cancel on its own deletion, so not after a failed creation's rollback, and a
deploy into moto cannot run one. The rule, function and role are deleted after the nodes (each node
depends on them). `fab release-spot` / `fab audit` stay the manual way and the check afterwards.
"""

from __future__ import annotations

from pathlib import Path

from aws_cdk import Acknowledgment, Aws, Duration, RemovalPolicy, Validations
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from constructs import Construct

from cluster_node.protocol.contract import CLUSTER_TAG, RANK_TAG

HANDLER = Path(__file__).resolve().parent / "spot_release_handler.py"
INLINE_LIMIT = 4096  # CloudFormation: Code.ZipFile holds at most 4 KB
TERMINATING = ["shutting-down", "terminated"]  # a stopped node that is terminated may skip shutting-down


class SpotRequestRelease(Construct):
    def __init__(self, scope: Construct, construct_id: str, *, cluster_name: str) -> None:
        super().__init__(scope, construct_id)
        source = HANDLER.read_text()
        if len(source.encode()) > INLINE_LIMIT:
            raise ValueError(f"{HANDLER.name} is over the {INLINE_LIMIT} bytes an inline function may have")
        log_group = logs.LogGroup(
            self, "Logs", retention=logs.RetentionDays.ONE_MONTH, removal_policy=RemovalPolicy.DESTROY
        )
        role = iam.Role(
            self,
            "Role",
            assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
            description="Cancel the persistent Spot request of a terminated node of this cluster",
        )
        log_group.grant_write(role)
        # The Describe calls have no resource-level permissions; CancelSpotInstanceRequests is
        # limited to the requests tagged with this cluster (the nodes' launch templates tag them).
        role.add_to_policy(
            iam.PolicyStatement(actions=["ec2:DescribeSpotInstanceRequests", "ec2:DescribeInstances"], resources=["*"])
        )
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["ec2:CancelSpotInstanceRequests"],
                resources=[f"arn:{Aws.PARTITION}:ec2:{Aws.REGION}:{Aws.ACCOUNT_ID}:spot-instances-request/*"],
                conditions={"StringEquals": {f"aws:ResourceTag/{CLUSTER_TAG}": cluster_name}},
            )
        )
        function = lambda_.Function(
            self,
            "Function",
            runtime=lambda_.Runtime.PYTHON_3_14,
            handler="index.handler",
            code=lambda_.Code.from_inline(source),
            timeout=Duration.seconds(30),
            role=role,
            log_group=log_group,
            environment={"CLUSTER_NAME": cluster_name, "CLUSTER_TAG": CLUSTER_TAG, "RANK_TAG": RANK_TAG},
            description=f"{cluster_name}: cancel a terminated Spot node's persistent request",
        )
        # Its Role property (GetAtt) orders it after the role, and it first runs when a node goes, which
        # depends on the role's policy: CDK's DependsOn on both fails cfn-lint (W3005, the role's twice).
        resource = function.node.default_child
        assert isinstance(resource, lambda_.CfnFunction)
        resource.add_deletion_override("DependsOn")
        events.Rule(
            self,
            "NodeTerminated",
            description=f"{cluster_name}: an instance is terminated; the function acts on this cluster's only",
            event_pattern=events.EventPattern(
                source=["aws.ec2"],
                detail_type=["EC2 Instance State-change Notification"],
                detail={"state": TERMINATING},
            ),
            targets=[targets.LambdaFunction(function, retry_attempts=4)],
        )
        self._acknowledge_findings()

    def _acknowledge_findings(self) -> None:
        """cdk-nag findings this small function accepts, each with its reason."""
        calls_ec2 = "It calls the EC2 API only, on events EventBridge retries (and `fab audit` checks afterwards)"
        Validations.of(self).acknowledge(
            Acknowledgment(
                id="AwsSolutions::AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:ec2:<AWS::Region>:"
                "<AWS::AccountId>:spot-instances-request/*]",
                reason="EC2 creates the requests from the nodes' launch templates, ids unknown at synth: the "
                "statement is limited to requests tagged with this cluster.",
            ),
            Acknowledgment(
                id="AwsSolutions::AwsSolutions-IAM5[Resource::*]",
                reason="ec2:DescribeSpotInstanceRequests has no resource-level permissions.",
            ),
            Acknowledgment(
                id="NIST.800.53.R5::NIST.800.53.R5-CloudWatchLogGroupEncrypted",
                reason="Its log holds instance and Spot request ids only; a KMS key would bill more than the "
                "cluster's alarms.",
            ),
            Acknowledgment(
                id="NIST.800.53.R5::NIST.800.53.R5-LambdaConcurrency",
                reason="Reserved concurrency takes from the account's unreserved pool, which a new account "
                "(10 in all) cannot spare.",
            ),
            Acknowledgment(id="NIST.800.53.R5::NIST.800.53.R5-LambdaDLQ", reason=calls_ec2 + "."),
            Acknowledgment(
                id="NIST.800.53.R5::NIST.800.53.R5-LambdaInsideVPC",
                reason=calls_ec2 + "; in the VPC it would need a NAT gateway or an EC2 endpoint.",
            ),
        )
