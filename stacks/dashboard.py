"""A CloudWatch dashboard of the cluster: per node CPU, network in/out, GPU utilisation and memory
(published by each node's watchdog), the heartbeat the idle alarm watches, and EFS traffic.
Exposes `dashboard` and `url`."""

from __future__ import annotations

from typing import Sequence

from aws_cdk import Aws, Duration
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_efs as efs
from constructs import Construct

from cluster_node.protocol.contract import BUSY_METRIC as HEARTBEAT_METRIC
from cluster_node.protocol.contract import METRIC_NAMESPACE as NODE_NAMESPACE
from cluster_node.protocol.contract import dashboard_name

# What the watchdog (cluster_node/daemons/autostop/watchdog.py) publishes per node, dimension InstanceId.
GPU_METRICS = (("GPUUtilization", "GPU utilisation (%)"), ("GPUMemoryUsedPercent", "GPU memory used (%)"))
PERIOD = Duration.minutes(1)
# The nodes run without detailed monitoring (stacks/nodes.py): EC2 sends its AWS/EC2 metrics every 5 minutes,
# so a Sum over a 1-minute period would be 5 minutes of bytes under a per-minute label (EC2 User Guide).
EC2_PERIOD = Duration.minutes(5)


def _graph(title: str, metrics: Sequence[cw.IMetric], unit: str = "") -> cw.GraphWidget:
    return cw.GraphWidget(
        title=title, left=list(metrics), width=12, height=6, left_y_axis=cw.YAxisProps(label=unit, show_units=False)
    )


class ClusterDashboard(Construct):
    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        name: str,
        instances: Sequence[ec2.Instance],
        file_system: efs.IFileSystem,
    ) -> None:
        super().__init__(scope, construct_id)
        self.instances, self.file_system = list(instances), file_system
        # Dashboard names are global to the account: the same cluster name in two regions must not collide.
        self.name = dashboard_name(name, Aws.REGION)
        self.dashboard = cw.Dashboard(self, "Dashboard", dashboard_name=self.name, default_interval=Duration.hours(3))
        self.dashboard.add_widgets(
            *(_graph(title, self._per_node(NODE_NAMESPACE, metric), "%") for metric, title in GPU_METRICS)
        )
        self.dashboard.add_widgets(
            _graph("CPU utilisation (%)", self._per_node("AWS/EC2", "CPUUtilization"), "%"),
            _graph(
                "Busy heartbeat (1 busy, 0 idle; missing: watchdog down)",
                self._per_node(NODE_NAMESPACE, HEARTBEAT_METRIC, "Maximum"),
            ),
        )
        self.dashboard.add_widgets(
            _graph("Network in (bytes / 5 min)", self._per_node("AWS/EC2", "NetworkIn", "Sum"), "bytes"),
            _graph("Network out (bytes / 5 min)", self._per_node("AWS/EC2", "NetworkOut", "Sum"), "bytes"),
        )
        self.dashboard.add_widgets(
            _graph(
                "EFS /data bytes read and written (billed in Elastic mode)",
                [self._efs("DataReadIOBytes"), self._efs("DataWriteIOBytes"), self._efs("MetadataIOBytes")],
                "bytes",
            ),
            _graph(
                "EFS throughput used (%) and burst credits",
                [self._efs("PercentIOLimit", "Maximum"), self._efs("BurstCreditBalance", "Minimum")],
            ),
        )
        self.url = f"https://{Aws.REGION}.console.aws.amazon.com/cloudwatch/home?region={Aws.REGION}#dashboards:name={self.name}"

    def _per_node(self, namespace: str, metric: str, statistic: str = "Average") -> list[cw.Metric]:
        return [
            cw.Metric(
                namespace=namespace,
                metric_name=metric,
                statistic=statistic,
                period=EC2_PERIOD if namespace == "AWS/EC2" else PERIOD,
                dimensions_map={"InstanceId": instance.instance_id},
                label=f"node{rank}",
            )
            for rank, instance in enumerate(self.instances)
        ]

    def _efs(self, metric: str, statistic: str = "Sum") -> cw.Metric:
        return cw.Metric(
            namespace="AWS/EFS",
            metric_name=metric,
            statistic=statistic,
            period=PERIOD,
            dimensions_map={"FileSystemId": self.file_system.file_system_id},
            label=metric,
        )
