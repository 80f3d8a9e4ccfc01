"""Names every layer shares: the CDK app (stacks/), the fab tasks (clusterops/, fabfile/) and the
watchdog on the nodes (the image copies this file to /workspace). One definition each; a test checks
that the stack's outputs are the ones the inventory reads."""

CLUSTER_TAG = "gpu-cluster:name"  # on every resource of a cluster; the node role may stop only these
RANK_TAG = "gpu-cluster:rank"  # on each instance
RETAIN_TAG = "gpu-cluster:retain"  # on an EFS kept by retain_data=true (fab audit keeps it)
CONTAINER_SSH_PORT = 4444  # the training container's sshd (assets/docker/sshd_config)
METRIC_NAMESPACE = "GpuCluster/Autostop"  # the watchdog's heartbeat and GPU metrics
BUSY_METRIC = "Busy"  # the heartbeat: 1 busy, 0 idle; each node's idle alarm watches it
# Its one unit: CloudWatch keeps each unit's points apart, and an alarm over a metric published in two
# units "behaves unpredictably" (PutMetricAlarm, Unit). node-bootstrap.sh's busy beat spells it too.
BUSY_UNIT = "Count"
# fab's commands leave their connection's SSH_CONNECTION here (clusterops/nodes/remote.py), in the container:
# the watchdog counts no fab connection as use (a forgotten `fab monitor` would keep the cluster up).
FAB_SSH_MARKS = "/run/gpu-cluster/fab-ssh"


def parameter_prefix(cluster_name: str) -> str:
    """Where the stack's SSM parameters live; `fab audit` lists what is left under it."""
    return f"/gpu-cluster/{cluster_name}/"


def host_key_parameter(cluster_name: str) -> str:
    return parameter_prefix(cluster_name) + "ssh-host-key"


def image_context_parameter(cluster_name: str) -> str:
    return parameter_prefix(cluster_name) + "image-context"


def idle_minutes_parameter(cluster_name: str) -> str:
    """The watchdog's idle_minutes, outside user data (a change there would replace every node);
    the bootstrap reads it when it starts the container."""
    return parameter_prefix(cluster_name) + "idle-minutes"


def node_config_parameter(cluster_name: str) -> str:
    """The node bootstrap's config (script URL, base image, Spot, EFA cards), outside user data: a
    change there replaces no node; the user-data stub reads it at each run."""
    return parameter_prefix(cluster_name) + "node-config"


def dashboard_name(cluster_name: str, region: str) -> str:
    """CloudWatch dashboard names are global to the account: one per cluster and region
    (at most 255 of A-Z a-z 0-9 - _; a region name fits)."""
    return f"{cluster_name}-{region}"


# The stack's outputs (stacks/cluster_stack.py) that the inventory (clusterops/inventory.py) reads, and
# NodeUserData and the config's values, which `fab preflight` compares (clusterops/aws/redeploy.py).
OUTPUT_KEYS = (
    "ClusterName",
    "Access",
    "HeadPublicIp",
    "PrivateIps",
    "PublicIps",
    "InstanceIds",
    "FileSystemId",
    "KeyParameterName",
    "KeyName",
    "HostKeyParameterName",
    "Region",
    "GpusPerNode",
    "InstanceType",
    "DashboardUrl",
    "EfaCards",
    "Spot",
    "NodeUserData",
    "SpotMaxPrice",  # Spot stacks only
    # the config values `fab preflight` compares with the next deploy's (stacks/cluster_stack.config_outputs)
    "RootVolumeGb",
    "PlacementGroup",
    "RetainData",
    "BaseImage",
    "IdleMinutes",
    "DataBucket",
)
REQUIRED_OUTPUTS = ("PrivateIps", "PublicIps", "InstanceIds", "GpusPerNode", "HostKeyParameterName", "KeyParameterName")
