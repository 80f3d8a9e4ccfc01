"""How the cluster gets stopped: `--then-stop`'s --stop-now and the idle watchdog call StopInstances once per node
(one call for all fails all when one node refuses), retry a `pending` one, and stop their own node last (its stop
shuts down the container they run in); the watchdog's own instance id, asked again until IMDS answers. A real EC2
client under botocore's Stubber (response shapes from its models)."""

import boto3
import pytest

from cluster_node.daemons.autostop import cloud
from cluster_node.daemons.autostop import watchdog as autostop


def _stop_stub(states: list[tuple[str, str]]):
    """A real EC2 client answering as EC2 does right after `fab start`: one node still `pending`."""
    from botocore.stub import ANY, Stubber

    ec2 = boto3.client("ec2", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    stubber = Stubber(ec2)
    instances = [{"InstanceId": i, "State": {"Name": s, "Code": 0}} for i, s in states]
    stubber.add_response("describe_instances", {"Reservations": [{"Instances": instances}]}, {"Filters": ANY})
    return ec2, stubber


def _refused(stubber, instance: str) -> None:
    stubber.add_client_error(
        "stop_instances",
        service_error_code="IncorrectInstanceState",
        service_message=f"The instance '{instance}' is not in a state from which it can be stopped.",
        expected_params={"InstanceIds": [instance]},
    )


def test_then_stop_stops_each_node_on_its_own_and_retries_a_pending_one(monkeypatch, capsys):
    """EC2 refuses to stop a `pending` instance (IncorrectInstanceState) and one StopInstances for all nodes
    fails for all of them. Before: one call for both, the running node left billing too."""
    ec2, stubber = _stop_stub([("i-0aaaaaaaaaaaaaaa1", "running"), ("i-0aaaaaaaaaaaaaaa2", "pending")])
    stubber.add_response("stop_instances", {"StoppingInstances": []}, {"InstanceIds": ["i-0aaaaaaaaaaaaaaa1"]})
    _refused(stubber, "i-0aaaaaaaaaaaaaaa2")
    stubber.add_response("stop_instances", {"StoppingInstances": []}, {"InstanceIds": ["i-0aaaaaaaaaaaaaaa2"]})
    monkeypatch.setattr(cloud, "STOP_DELAY_S", 0.0)
    with stubber:
        assert autostop.stop_now(ec2, "c") == 0
        stubber.assert_no_pending_responses()
    assert capsys.readouterr().out.splitlines() == [
        "autostop: i-0aaaaaaaaaaaaaaa1: stopping",
        "autostop: i-0aaaaaaaaaaaaaaa2: stopping",
        "autostop: run ended; stopping ['i-0aaaaaaaaaaaaaaa1', 'i-0aaaaaaaaaaaaaaa2']",
    ]


def test_the_node_that_stops_the_cluster_stops_itself_last(monkeypatch, capsys):
    """A fresh read (session 30): StopInstances on its own node shuts that node's OS down, and the container with
    `--stop-now` (or the watchdog) goes with it; stopped in id order, the head's stop came before the others'
    and they billed until their own watchdogs stopped them (--then-stop's run end + idle_minutes)."""
    ids = [("i-0aaaaaaaaaaaaaaa1", "running"), ("i-0aaaaaaaaaaaaaaa2", "running"), ("i-0aaaaaaaaaaaaaaa3", "running")]
    ec2, stubber = _stop_stub(ids)
    for instance in ("i-0aaaaaaaaaaaaaaa2", "i-0aaaaaaaaaaaaaaa3", "i-0aaaaaaaaaaaaaaa1"):
        stubber.add_response("stop_instances", {"StoppingInstances": []}, {"InstanceIds": [instance]})
    with stubber:
        assert autostop.stop_now(ec2, "c", own="i-0aaaaaaaaaaaaaaa1") == 0
        stubber.assert_no_pending_responses()  # in this order: the caller's own node last
    assert capsys.readouterr().out.splitlines()[-1].startswith("autostop: run ended; stopping ['i-0aaaaaaaaaaaaaaa1',")


def test_the_watchdog_leaves_its_own_node_up_while_another_refuses_and_stops_it_once_they_all_stop():
    """The review: a watchdog that stopped its own node with another refused would go down with it, and the refused
    node would bill on; its own node waits for the next round's retry."""
    ids = [("i-0aaaaaaaaaaaaaaa1", "running"), ("i-0aaaaaaaaaaaaaaa2", "pending")]
    ec2, stubber = _stop_stub(ids)
    _refused(stubber, "i-0aaaaaaaaaaaaaaa2")
    with stubber, pytest.raises(RuntimeError, match="i-0aaaaaaaaaaaaaaa1: not yet: stopped last"):
        cloud.stop_cluster(ec2, "c", own="i-0aaaaaaaaaaaaaaa1")
    ec2, stubber = _stop_stub(ids)
    for instance in ("i-0aaaaaaaaaaaaaaa2", "i-0aaaaaaaaaaaaaaa1"):
        stubber.add_response("stop_instances", {"StoppingInstances": []}, {"InstanceIds": [instance]})
    with stubber:
        assert cloud.stop_cluster(ec2, "c", own="i-0aaaaaaaaaaaaaaa1") == [i for i, _ in ids]
        stubber.assert_no_pending_responses()
    # A lasting refusal (a Spot node after `fab release-spot`): no reason to keep this node up, billed
    ec2, stubber = _stop_stub(ids)
    stubber.add_client_error("stop_instances", "UnsupportedOperation", "released", expected_params=None)
    stubber.add_response("stop_instances", {"StoppingInstances": []}, {"InstanceIds": ["i-0aaaaaaaaaaaaaaa1"]})
    with stubber, pytest.raises(RuntimeError, match="i-0aaaaaaaaaaaaaaa2: An error occurred \\(UnsupportedOperation"):
        cloud.stop_cluster(ec2, "c", own="i-0aaaaaaaaaaaaaaa1")
    stubber.assert_no_pending_responses()


def test_a_watchdog_without_its_instance_id_asks_again_and_beats_once_it_answers(tmp_path):
    """A fresh read (session 30): the container had no INSTANCE_ID and IMDS did not answer its one question at
    start: no heartbeat for the whole boot, and the alarm (missing data is idle) stopped the node, busy or not."""
    beats = []

    class Cloudwatch:
        def put_metric_data(self, Namespace, MetricData):
            beats.append(MetricData[0]["Dimensions"][0]["Value"])

    answers = iter([None, "i-0123456789abcdef0"])
    dog = autostop.Watchdog(60.0, 60.0, tmp_path / "state.json", "boot-1")
    sources = autostop.Sources(tmp_path / "no-terminals", 4444, tmp_path / "no-marks")
    loop = autostop.Loop(tmp_path, "0", dog, None, Cloudwatch(), None, "c", sources)
    loop.identify = lambda: next(answers, "i-0123456789abcdef0")
    loop.round(1000.0)
    assert beats == []
    loop.round(1060.0)
    assert beats == ["i-0123456789abcdef0"] and loop.instance_id == "i-0123456789abcdef0"


def test_a_node_that_refuses_every_try_is_named_and_the_others_still_stop(monkeypatch, capsys):
    ec2, stubber = _stop_stub([("i-0aaaaaaaaaaaaaaa1", "pending"), ("i-0aaaaaaaaaaaaaaa2", "running")])
    _refused(stubber, "i-0aaaaaaaaaaaaaaa1")
    stubber.add_response("stop_instances", {"StoppingInstances": []}, {"InstanceIds": ["i-0aaaaaaaaaaaaaaa2"]})
    for _ in range(cloud.STOP_TRIES - 1):
        _refused(stubber, "i-0aaaaaaaaaaaaaaa1")
    slept: list[float] = []
    monkeypatch.setattr(cloud.time, "sleep", slept.append)
    with stubber:
        assert autostop.stop_now(ec2, "c") == 1
        stubber.assert_no_pending_responses()
    assert slept == [2.0, 4.0, 8.0]  # backoff
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("autostop: i-0aaaaaaaaaaaaaaa1: An error occurred (IncorrectInstanceState)")
    assert out[1:] == [
        "autostop: i-0aaaaaaaaaaaaaaa2: stopping",
        "autostop: run ended; stopping ['i-0aaaaaaaaaaaaaaa2']",
    ]
