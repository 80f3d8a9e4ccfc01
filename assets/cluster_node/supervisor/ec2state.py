"""The cluster's nodes that bill now, as EC2 reports them, for the budget meter (budget.py) on AWS.

AWS's contract (EC2 User Guide, "Amazon EC2 instance state changes",
https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/ec2-instance-lifecycle.html): instance usage bills in
`running` only; pending, stopping, stopped, shutting-down and terminated do not. The meter counts `pending`
too (it bills a moment later: the safe side of a budget). A Spot node EC2 stops for an interruption and
starts again when capacity returns (a persistent request) bills again from then: only EC2's state says so,
not the interruption notice. DescribeInstances has no resource-level permissions (the node role grants it
on "*"). The question runs on a daemon thread: an EC2 endpoint that hangs holds the supervisor's loop
GRACE_S at most. boto3 is imported only when asked."""

from __future__ import annotations

import threading
from typing import Callable, Optional

BILLING = ("pending", "running")
GRACE_S = 1.0  # how long a reading waits for EC2's answer; a later reading takes a late one


def client(region: str):
    """An EC2 client that gives up in seconds: one attempt, no retries (the next reading asks again)."""
    import boto3
    from botocore.config import Config

    config = Config(connect_timeout=2, read_timeout=3, retries={"total_max_attempts": 1, "mode": "standard"})
    return boto3.client("ec2", region_name=region, config=config)


def billing_ids(ids: tuple[str, ...], region: str, client=client) -> set[str]:
    """The instances among `ids` in a state that bills (an id EC2 no longer lists is terminated).
    RuntimeError with one line when EC2 cannot answer, for any reason."""
    try:
        ec2 = client(region)
        pages = ec2.get_paginator("describe_instances").paginate(Filters=[{"Name": "instance-id", "Values": list(ids)}])
        states = {i["InstanceId"]: i["State"]["Name"] for p in pages for r in p["Reservations"] for i in r["Instances"]}
    except Exception as error:  # the meter counts every node then; the run goes on
        raise RuntimeError((str(error).splitlines() or [""])[0] or type(error).__name__) from None
    return {i for i in ids if states.get(i) in BILLING}


class Ec2Billing:
    """How many of the cluster's instances bill, read from EC2 at every meter reading. Without an answer
    (EC2 unreachable, an API error) every instance counts: the safe side of a budget."""

    def __init__(self, ids: tuple[str, ...], region: str, launched: int, ask: Callable = billing_ids):
        self.ids, self.region, self.ask = ids, region, ask
        self.count = launched  # at the latest answer; at first, the nodes fab train found billing
        self.why = ""  # why the latest question got no answer ("" when it did)
        self._asking: Optional[threading.Thread] = None
        self._answer: Optional[tuple[int, str]] = None

    def update(self) -> int:
        """The nodes to bill for the interval that ends now: the most of the previous reading's and this
        one's (a node that goes or comes back mid-interval counts for all of it)."""
        before = self.count
        self._collect()
        if self._asking is None:
            self._asking = threading.Thread(target=self._question, name="ec2state", daemon=True)
            self._asking.start()
        self._asking.join(GRACE_S)
        self._collect()
        return max(before, self.count)

    def _question(self) -> None:
        try:
            self._answer = (len(self.ask(self.ids, self.region)), "")
        except Exception as error:  # billing_ids' RuntimeError, or a bug in a test's fake: never the loop's
            self._answer = (len(self.ids), f"EC2: {(str(error).splitlines() or [''])[0]}")

    def _collect(self) -> None:
        if self._asking is None or self._asking.is_alive() or self._answer is None:
            return
        self._asking = None
        (self.count, self.why), self._answer = self._answer, None
