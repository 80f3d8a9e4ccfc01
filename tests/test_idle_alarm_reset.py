"""The idle alarm's reset at every boot, as the template grants it: a fixed name per node that the
node can compute, and SetAlarmState on exactly those alarms (least privilege). The node side (the
boot unit and its commands) is tested in tests/test_bootstrap_every_boot.py."""

import re

import aws_cdk as cdk
from aws_cdk.assertions import Template
from conftest import REPO
from test_autostop import alarm_fires_at

from cluster_node.daemons.autostop import cloud
from cluster_node.protocol.contract import BUSY_METRIC, BUSY_UNIT, METRIC_NAMESPACE
from stacks.cluster_stack import GpuClusterStack
from stacks.config import ClusterConfig, alarm_minutes


def _template(**context) -> Template:
    config = ClusterConfig.from_context(
        {"ssh_cidr": "203.0.113.0/24", "cluster_name": "tc", "ami_id": "ami-0123456789abcdef0", **context}
    )
    return Template.from_stack(GpuClusterStack(cdk.App(), "Cluster", config=config))


def _text(value) -> str:
    """A resolved Fn::Join or Ref as text, pseudo parameters as <Name>."""
    if isinstance(value, str):
        return value
    if "Ref" in value:
        return f"<{value['Ref'].split('::')[-1]}>"
    if "Fn::Join" in value:
        separator, parts = value["Fn::Join"]
        return separator.join(_text(p) for p in parts)
    return "<token>"


def _statements(template: Template, action: str) -> list[dict]:
    return [
        s
        for policy in template.find_resources("AWS::IAM::Policy").values()
        for s in policy["Properties"]["PolicyDocument"]["Statement"]
        if action in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])
    ]


def test_each_node_may_set_exactly_its_clusters_idle_alarms_which_it_can_name():
    """SetAlarmState supports alarm ARNs (Service Authorization Reference, CloudWatch); alarm names are
    unique per account and region: `CLUSTER-nodeR-idle`, in the node's user data as IDLE_ALARM."""
    template = _template(nodes="2", idle_minutes="60")
    names = sorted(a["Properties"]["AlarmName"] for a in template.find_resources("AWS::CloudWatch::Alarm").values())
    assert names == ["tc-node0-idle", "tc-node1-idle"]
    (statement,) = _statements(template, "cloudwatch:SetAlarmState")
    assert sorted(_text(r) for r in statement["Resource"]) == [
        f"arn:<Partition>:cloudwatch:<Region>:<AccountId>:alarm:{name}" for name in names
    ]
    assert statement["Action"] == "cloudwatch:SetAlarmState" and "Condition" not in statement
    for rank, instance in enumerate(template.find_resources("AWS::EC2::Instance").values()):
        user_data = _text(instance["Properties"]["UserData"]["Fn::Base64"])
        assert f"IDLE_ALARM={names[rank]}\n" in user_data and "HEARTBEAT_NAMESPACE=GpuCluster/Autostop\n" in user_data


def test_the_alarm_name_in_user_data_does_not_follow_idle_minutes():
    """With idle_minutes=0 there is no alarm, but the same IDLE_ALARM line: changing it replaces no node."""
    with_alarm, without = _template(idle_minutes="60"), _template(idle_minutes="0")
    assert not without.find_resources("AWS::CloudWatch::Alarm")
    for template in (with_alarm, without):
        instance = next(iter(template.find_resources("AWS::EC2::Instance").values()))
        assert "IDLE_ALARM=tc-node0-idle\n" in _text(instance["Properties"]["UserData"]["Fn::Base64"])


def test_a_reset_alarm_stops_the_node_at_once_unless_a_busy_beat_is_in_its_window():
    """Why the boot unit publishes a busy beat before SetAlarmState OK: evaluated as CloudWatch does
    (tests/test_autostop.alarm_fires_at), a window of missing data (the node was stopped) is ALARM
    at the first evaluation after the reset, i.e. a stop right after boot; one beat at boot holds it
    off for the alarm's whole window, then a container that never came back is stopped."""
    alarm = _template(idle_minutes="60").find_resources("AWS::CloudWatch::Alarm")
    props = next(iter(alarm.values()))["Properties"]
    window = alarm_minutes(60)
    stopped = [None] * (window - 1)  # the last minutes of the stop, in the window at boot: no data
    boot = len(stopped)  # the boot minute
    assert alarm_fires_at(props, {"Busy": stopped + [None] * 5}) == boot + 1  # the first evaluation
    beat = alarm_fires_at(props, {"Busy": stopped + [1.0] + [None] * (window + 5)})
    assert beat == boot + 1 + window  # a full window after the boot beat


class _RecordingCloudWatch:
    def __init__(self):
        self.calls: list[dict] = []

    def put_metric_data(self, **call):
        self.calls.append(call)


def test_every_busy_beat_is_published_in_the_unit_the_idle_alarm_reads():
    """PutMetricAlarm, Unit: points that specify a unit "are aggregated separately", and "if the metric
    is published with multiple types of units and you don't specify a unit, the alarm's behavior is not
    defined". The host's boot beat had no unit (None) and the watchdog's said Count: two series, and an
    alarm over the boot beat alone would stop a busy node. The alarm names no unit (AWS recommends
    omitting it; it reads every unit published), so every publisher uses one, BUSY_UNIT: the watchdog
    here, the host's beat in tests/test_bootstrap_every_boot.py (its recorded put-metric-data and
    read-back); no other code publishes to the namespace."""
    alarms = _template(nodes="2", idle_minutes="60").find_resources("AWS::CloudWatch::Alarm").values()
    assert len(alarms) == 2 and not [a for a in alarms if "Unit" in a["Properties"]]
    recording = _RecordingCloudWatch()
    cloud.publish(recording, "i-0abc", busy=True)
    (call,) = recording.calls
    assert call["Namespace"] == METRIC_NAMESPACE
    assert [d["Unit"] for d in call["MetricData"] if d["MetricName"] == BUSY_METRIC] == [BUSY_UNIT]
    publishers = sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "assets").rglob("*")
        if path.suffix in (".py", ".sh") and re.search(r"put[-_]metric[-_]data", path.read_text())
    )
    assert publishers == ["assets/bootstrap/node-bootstrap.sh", "assets/cluster_node/daemons/autostop/cloud.py"]
