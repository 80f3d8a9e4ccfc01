"""Issue 19 §14: the watchdog's idle clock survives a restart of the watchdog, and a stop call that EC2
refuses is retried with backoff while the heartbeat keeps saying idle (so the clock never resets).

Contract (EC2 User Guide, "Stop a Spot Instance", Limitations,
https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/using-spot-instances-request.html#stopping-a-spot-instance):
"You can't stop a Spot Instance if the associated Spot Instance request is cancelled. When the Spot
Instance request is cancelled, you can only terminate the Spot Instance" (and a one-time request's
instance cannot be stopped at all). `fab release-spot` cancels the requests: from then on every
StopInstances call for those nodes fails with UnsupportedOperation. A stand-in EC2 endpoint below
answers exactly that (moto does not model the refusal); CloudWatch is the moto server."""

import json
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs

import boto3
import pytest
from conftest import mark_ready, moto_instances, tool_env

IDLE_S = 12.0  # IDLE_MINUTES=0.2


def heartbeat_values(instance: str, since: float) -> list[float]:
    """Minimum and Maximum of the Busy heartbeat published from `since` on (moto keeps each point)."""
    points = boto3.client("cloudwatch").get_metric_statistics(
        Namespace="GpuCluster/Autostop",
        MetricName="Busy",
        Statistics=["Maximum", "Minimum"],
        Dimensions=[{"Name": "InstanceId", "Value": instance}],
        Period=60,
        StartTime=since,
        EndTime=time.time() + 120,
    )["Datapoints"]
    return [p["Minimum"] for p in points] + [p["Maximum"] for p in points]


def start_watchdog(data, cluster: str, instance: str, aws_env: dict, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "cluster_node.daemons.autostop.watchdog", "--data", str(data), "--interval", "0.2"]
        + ["--pts", str(data / "no-terminals"), "--refresh", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=tool_env(
            **{
                "CLUSTER_NAME": cluster,
                "IDLE_MINUTES": str(IDLE_S / 60),
                "INSTANCE_ID": instance,
                "NODE_RANK": "0",
                **aws_env,
                **env,
            }
        ),
    )


def wait_for(condition, timeout: float) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_restarted_watchdog_resumes_its_idle_clock_and_reports_idle(aws_env, tmp_path):
    """The entrypoint restarts a watchdog that died (and Docker a container that died): the second
    one goes on from the first one's idle time, without a "watchdog starting" busy beat."""
    ids = moto_instances(2, "resume-clock")
    mark_ready(tmp_path, ids)
    beat = tmp_path / ".cluster" / "heartbeat" / "node0.json"
    first = start_watchdog(tmp_path, "resume-clock", ids[0], aws_env)
    try:
        wait_for(beat.exists, 60)
        time.sleep(IDLE_S - 5)  # idle for 7 of the 12 minutes' worth of seconds
        assert first.poll() is None, first.communicate()[0]
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    restarted = time.time()
    second = start_watchdog(tmp_path, "resume-clock", ids[1], aws_env)
    output, _ = second.communicate(timeout=60)
    took = time.time() - restarted
    assert second.returncode == 0, output
    # ~5 s of the clock were left (plus the interpreter's start); starting over takes 12 s and more.
    assert took < IDLE_S - 2, f"the restarted watchdog took {took:.1f} s: it started its idle clock over"
    assert heartbeat_values(ids[1], restarted) and max(heartbeat_values(ids[1], restarted)) == 0.0
    states = {
        i["State"]["Name"]
        for r in boto3.client("ec2").describe_instances(InstanceIds=ids)["Reservations"]
        for i in r["Instances"]
    }
    assert states <= {"stopping", "stopped"}


class RefusingEc2(BaseHTTPRequestHandler):
    """EC2's query API for two running Spot nodes whose requests were cancelled: DescribeInstances
    lists them, StopInstances fails as EC2 documents (UnsupportedOperation)."""

    stops: list[float] = []

    def do_POST(self):
        action = parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())["Action"][0]
        if action == "DescribeInstances":
            items = "".join(
                f"<item><instanceId>{i}</instanceId><instanceState><code>16</code><name>running</name>"
                "</instanceState></item>"
                for i in ("i-0spot00000000000a", "i-0spot00000000000b")
            )
            body = (
                '<DescribeInstancesResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"><requestId>r</requestId>'
                f"<reservationSet><item><reservationId>r-1</reservationId><instancesSet>{items}</instancesSet>"
                "</item></reservationSet></DescribeInstancesResponse>"
            )
            self._answer(200, body)
        else:
            RefusingEc2.stops.append(time.time())
            message = (
                "You can't stop the Spot Instance 'i-0spot00000000000a' because the associated Spot Instance "
                "request is cancelled. You can only terminate the Spot Instance."
            )
            self._answer(
                400,
                f"<Response><Errors><Error><Code>UnsupportedOperation</Code><Message>{message}</Message></Error>"
                "</Errors><RequestID>r</RequestID></Response>",
            )

    def _answer(self, status: int, body: str) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/xml")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_a_stop_that_ec2_refuses_is_retried_with_backoff_the_clock_kept_and_the_heartbeat_idle(aws_env, tmp_path):
    RefusingEc2.stops = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), RefusingEc2)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    dog = start_watchdog(tmp_path, "released", "i-0spot00000000000a", aws_env, AWS_ENDPOINT_URL_EC2=endpoint)
    try:
        wait_for(lambda: len(RefusingEc2.stops) >= 1 or dog.poll() is not None, 60)
        first_failure = time.time()
        time.sleep(IDLE_S)
        alive = dog.poll() is None
    finally:
        dog.terminate()
        output = dog.communicate()[0]
        server.shutdown()
    assert alive, f"the watchdog died on a refused stop: {output[-2000:]}"
    calls = RefusingEc2.stops  # one StopInstances per node a round (issue 28 §7): a round's calls come together
    stops = [t for k, t in enumerate(calls) if k == 0 or t - calls[k - 1] > 0.05]
    gaps = [b - a for a, b in zip(stops, stops[1:])]
    assert len(stops) >= 3 and gaps[-1] > 1.5 * gaps[0], (stops, output)  # retried, further apart each time
    log = (tmp_path / ".cluster" / "autostop.log").read_text()
    assert "UnsupportedOperation" in log and "retrying in" in log and "npx cdk destroy" in log, log
    # The idle clock was not reset by the failures: it still counts from before the first one.
    clock = json.loads((tmp_path / ".cluster" / "autostop" / "node0.json").read_text())
    assert clock["busy_at"] is not None and clock["busy_at"] < first_failure - 0.5 and clock["stop_failures"] >= 3
    values = heartbeat_values("i-0spot00000000000a", first_failure + 1)
    assert values and max(values) == 0.0  # idle heartbeats: the alarm's count goes on


@pytest.mark.slow
def test_a_watchdog_with_autostop_off_beats_busy_and_applies_idle_minutes_set_later(aws_env, tmp_path):
    """Issue 28: a cluster deployed with idle_minutes=0 had no watchdog (the container read 0 once, at
    its creation); `cdk deploy -c idle_minutes=N` then created the alarms over a heartbeat nobody
    published, missing data is breaching, and N + 30 min later every node stopped mid-training. Now the
    watchdog runs with 0 too, says busy (no alarm can fire), and reads the SSM parameter again (here
    every second; 5 min by default): N applies from when it is read."""
    ids = moto_instances(2, "switched-on")
    mark_ready(tmp_path, ids)
    ssm = boto3.client("ssm")
    name = "/gpu-cluster/switched-on/idle-minutes"
    ssm.put_parameter(Name=name, Value="0", Type="String", Overwrite=True)
    started = time.time()
    dog = start_watchdog(tmp_path, "switched-on", ids[0], aws_env, IDLE_MINUTES="0")
    try:
        time.sleep(4)
        assert dog.poll() is None, dog.communicate()[0]  # it used to exit at once: "autostop: off"
        off = heartbeat_values(ids[0], started)
        assert off and min(off) == 1.0, off  # idle, but busy beats: an alarm created now finds data
        switched = time.time()
        ssm.put_parameter(Name=name, Value=str(IDLE_S / 60), Type="String", Overwrite=True)
        output, _ = dog.communicate(timeout=60)
    finally:
        if dog.poll() is None:
            dog.kill()
    took = time.time() - switched
    assert dog.returncode == 0, output
    assert f"idle_minutes 0 -> {IDLE_S / 60:g}" in output
    assert took >= IDLE_S - 1, f"stopped {took:.1f} s after the switch: the idle clock began before it"
    assert min(heartbeat_values(ids[0], switched)) == 0.0  # once on, the beats say idle
    states = {
        i["State"]["Name"]
        for r in boto3.client("ec2").describe_instances(InstanceIds=ids)["Reservations"]
        for i in r["Instances"]
    }
    assert states <= {"stopping", "stopped"}


def test_the_entrypoint_starts_the_watchdog_with_idle_minutes_0_too():
    """The container gets IDLE_MINUTES from the bootstrap (its parameter, 0 included); the emulated
    cluster's nodes get none and run no watchdog. The entrypoint's own condition, evaluated by bash
    (the image's path test made true: /workspace is the image's)."""
    import re

    from conftest import REPO

    text = (REPO / "assets" / "docker" / "entrypoint.sh").read_text()
    (condition,) = re.findall(r"^if (\[\[.*cluster_node/daemons/autostop/watchdog\.py.*\]\]); then$", text, re.M)
    condition = condition.replace("-f /workspace/cluster_node/daemons/autostop/watchdog.py", "-n image")
    for value, starts in (("0", True), ("60", True), (None, False)):
        env = {"PATH": "/usr/bin:/bin", **({"IDLE_MINUTES": value} if value is not None else {})}
        code = subprocess.run(["bash", "-c", condition], env=env).returncode
        assert (code == 0) == starts, (value, condition)
