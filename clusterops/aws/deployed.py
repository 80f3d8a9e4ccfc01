"""`fab inventory`'s use case: the inventory of a deployed stack (its outputs from the outputs file or from
CloudFormation, EC2's addresses, the SSH keys) with the node price it is billed at, saved for every other task."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

from clusterops import cost as costs
from clusterops.aws.session import aws_session, nodes_zone, pricing_client
from clusterops.inventory import (
    Inventory,
    InventoryError,
    from_outputs,
    stack_outputs_from_aws,
    stack_outputs_from_file,
)


def inventory(
    stack: Optional[str],
    outputs: Path,
    from_aws: bool,
    key_file: Optional[str],
    target: Path,
    say: Callable[[str], None] = print,
) -> tuple[Inventory, costs.Price]:
    """The stack's inventory, saved to `target` (its keys beside it), and its node price. `from_aws`, or no
    outputs file and a --stack: CloudFormation describes the stack."""
    if not from_aws and not outputs.exists() and stack:
        say(f"no {outputs}: describing stack {stack} instead")
        from_aws = True
    if from_aws:
        if not stack:
            raise InventoryError("--from-aws needs --stack NAME")
        session = aws_session()
        name, outs = stack, stack_outputs_from_aws(stack, session)
    else:
        name, outs = stack_outputs_from_file(outputs)
        if stack and stack != name:
            raise InventoryError(f"{outputs} holds stack {name}, not {stack}")
        session = aws_session(outs.get("Region"))
    inv = from_outputs(name, outs, session, target.parent / "keys", key_file=key_file)
    price, _ = costs.node_price(
        session.client("ec2"),
        pricing_client(session),
        inv.instance_type,
        inv.region or session.region_name or "us-east-1",
        inv.spot,
        nodes_zone(session, inv) if inv.spot else None,
    )
    inv = replace(inv, usd_per_hour=price.usd_per_hour, price_source=price.source)
    inv.save(target)
    return inv, price
