"""Each node's own launch template: IMDSv2 within one hop, EFA interfaces, Spot market options; and its
pinned AMI.

One template per node, built here (not CDK's require_imdsv2 aspect), so every path (On-Demand, Spot,
EFA, EFA + Spot) carries the same metadata options:
  * HttpTokens required: IMDSv2 only;
  * HttpPutResponseHopLimit 1: an AMI registered with ImdsSupport v2.0 (the DLAMIs) launches with a hop
    limit of 2, which lets a container on a bridge network take the node role's credentials (EC2 User
    Guide, "Configure the Instance Metadata Service options"). Everything here that asks IMDS runs on
    the host or in the training container on the host's network (--net=host): one hop is enough.
AWS::EC2::Instance has no InterfaceType (EFA) and no market options: both exist only in launch templates.
"""

from __future__ import annotations

from typing import Optional

import jsii
from aws_cdk import aws_ec2 as ec2
from constructs import Construct

from .spot import make_spot

IMDS_TOKENS, IMDS_HOP_LIMIT = "required", 1


@jsii.implements(ec2.IMachineImage)
class PinnedImage:
    """The AMI id synth pinned (stacks/pins.py), as a literal ImageId: no SSM parameter resolved at
    deploy, so a DLAMI release replaces no node."""

    def __init__(self, ami_id: Optional[str]):
        if not ami_id:
            raise ValueError("no AMI pinned: build the config with stacks.pins.synth_config")
        self.ami_id = ami_id

    def get_image(self, scope: Construct) -> ec2.MachineImageConfig:
        return ec2.MachineImageConfig(
            image_id=self.ami_id, os_type=ec2.OperatingSystemType.LINUX, user_data=ec2.UserData.for_linux()
        )


def efa_interfaces(cards: int, subnet_id: str, group_id: str, public: Optional[bool]) -> list[dict]:
    """Launch-template network interfaces for `cards` EFA cards (AWS's layout for multi-card types:
    an ENA primary at card 0 device 0, EFA-only at card 0 device 1 and at device 0 of every other
    card; one card: a single EFA-with-ENA interface, which may keep a public IP)."""
    common = {"SubnetId": subnet_id, "Groups": [group_id], "DeleteOnTermination": True}
    if cards == 1:
        return [
            {
                **common,
                "NetworkCardIndex": 0,
                "DeviceIndex": 0,
                "InterfaceType": "efa",
                **({} if public is None else {"AssociatePublicIpAddress": public}),
            }
        ]
    return [
        {**common, "NetworkCardIndex": 0, "DeviceIndex": 0, "InterfaceType": "interface"},
        {**common, "NetworkCardIndex": 0, "DeviceIndex": 1, "InterfaceType": "efa-only"},
    ] + [
        {**common, "NetworkCardIndex": card, "DeviceIndex": 0, "InterfaceType": "efa-only"} for card in range(1, cards)
    ]


def node_interfaces(
    cards: int, subnet_id: str, group_id: str, public: Optional[bool], existing_subnet: bool
) -> list[dict]:
    """The launch template's network interfaces: EFA's layout; in a given subnet, whose own public-IP
    setting (MapPublicIpOnLaunch) the stack cannot know, one primary interface that asks for a public IP
    where the nodes need one (`public`: True); else none (the instance's subnet decides: this stack's public
    subnets map public IPs, its private one does not)."""
    if cards:
        return efa_interfaces(cards, subnet_id, group_id, public)
    if existing_subnet and public:
        common = {"SubnetId": subnet_id, "Groups": [group_id], "DeleteOnTermination": True}
        return [{**common, "NetworkCardIndex": 0, "DeviceIndex": 0, "AssociatePublicIpAddress": public}]
    return []


def _interfaces(
    cards: int, subnet: ec2.ISubnet, group: ec2.ISecurityGroup, public: Optional[bool], existing: bool
) -> list:
    return [
        ec2.CfnLaunchTemplate.NetworkInterfaceProperty(
            subnet_id=i["SubnetId"],
            groups=i["Groups"],
            delete_on_termination=i["DeleteOnTermination"],
            network_card_index=i["NetworkCardIndex"],
            device_index=i["DeviceIndex"],
            interface_type=i.get("InterfaceType"),
            associate_public_ip_address=i.get("AssociatePublicIpAddress"),
        )
        for i in node_interfaces(cards, subnet.subnet_id, group.security_group_id, public, existing)
    ]


def attach_launch_template(
    scope: Construct,
    rank: int,
    instance: ec2.Instance,
    *,
    efa_cards: int,
    subnet: ec2.ISubnet,
    security_group: ec2.ISecurityGroup,
    public: Optional[bool],
    existing_subnet: bool = False,
    spot: Optional[tuple[Optional[float], dict[str, str]]] = None,
) -> ec2.CfnLaunchTemplate:
    """The node's template (spot: max price and request tags), used at its latest version. Where it has
    network interfaces (node_interfaces) the subnet and group move from the instance into them."""
    interfaces = _interfaces(efa_cards, subnet, security_group, public, existing_subnet)
    template = ec2.CfnLaunchTemplate(
        scope,
        f"Node{rank}LaunchTemplate",
        launch_template_data=ec2.CfnLaunchTemplate.LaunchTemplateDataProperty(
            metadata_options=ec2.CfnLaunchTemplate.MetadataOptionsProperty(
                http_tokens=IMDS_TOKENS, http_put_response_hop_limit=IMDS_HOP_LIMIT
            ),
            network_interfaces=interfaces or None,
        ),
    )
    if spot is not None:
        make_spot(template, *spot)
    resource = instance.node.default_child
    assert isinstance(resource, ec2.CfnInstance)
    resource.launch_template = ec2.CfnInstance.LaunchTemplateSpecificationProperty(
        launch_template_id=template.ref, version=template.attr_latest_version_number
    )
    if interfaces:
        resource.add_property_deletion_override("SubnetId")
        resource.add_property_deletion_override("SecurityGroupIds")
    return template
