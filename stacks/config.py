"""Cluster configuration: read once from CDK context, validated, passed down typed.

Every key is top-level so `cdk synth -c nodes=3` works. `-c` values arrive as strings;
`ClusterConfig.from_context` is the one place that coerces them.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Mapping, Optional, Sequence

from .images import DEFAULT_IMAGE
from .instance_types import AMI_PARAMETERS, INSTANCE_TYPES, InstanceType

MAX_NODES = 64
# The idle alarm evaluates 1-minute heartbeats over idle_minutes + a grace (the watchdog stops the
# cluster first); CloudWatch: period x evaluation periods may not exceed one day.
ALARM_GRACE_MINUTES = 30
MAX_IDLE_MINUTES = 24 * 60 - ALARM_GRACE_MINUTES


def alarm_minutes(idle_minutes: int) -> int:
    """How long a node's heartbeat may say idle, or nothing, before its alarm stops it."""
    return idle_minutes + ALARM_GRACE_MINUTES


def offerings_context_key(region: str, instance_type: str) -> str:
    """The cdk.context.json key under which `fab preflight` caches the AZs offering a type."""
    return f"instance-type-offerings:region={region}:instance-type={instance_type}"


def cluster_az_context_key(region: str, cluster_name: str) -> str:
    """The cdk.context.json key under which `fab preflight` pins a deployed cluster's AZ (where its subnet is:
    CloudFormation cannot move a subnet to another AZ in an update)."""
    return f"cluster-availability-zone:region={region}:cluster={cluster_name}"


def stack_name(given: Optional[str], cluster_name: str) -> str:
    """The stack's name: -c stack_name, else GpuCluster-CLUSTER_NAME."""
    return given or f"GpuCluster-{cluster_name}"


def ami_context_key(region: str, parameter: str) -> str:
    """The cdk.context.json key under which `fab preflight` pins the AMI id that `parameter` (a
    DLAMI's `.../latest/ami-id`) resolved to: synth reads it, so a new DLAMI release replaces no node
    until the user re-pins it on purpose (`fab preflight --refresh-ami`)."""
    return f"ami:region={region}:ssm-parameter={parameter}"


def choose_availability_zone(
    explicit: Optional[str], offered: Optional[Sequence[str]], deployed: Optional[str] = None
) -> Optional[str]:
    """An explicit AZ wins; else, the type's offers known, the deployed cluster's AZ (see unmovable_zone) or
    the first AZ (by name) that offers the type; else None (unknown)."""
    if explicit:
        return explicit
    if not offered:
        return None
    return deployed if deployed in offered else sorted(offered)[0]


def cached_offerings(get: Callable[[str], Any], region: str, instance_type: str) -> Optional[list[str]]:
    """The AZs `fab preflight` found offering the type (cdk.context.json, or `-c KEY=a,b`), or None."""
    offered = get(offerings_context_key(region, instance_type))
    if isinstance(offered, str):
        return [zone for zone in offered.split(",") if zone]
    return offered


def unmovable_zone(deployed: Optional[str], offered: Optional[Sequence[str]]) -> Optional[str]:
    """Why a type not offered where the deployed cluster's subnet is cannot be deployed to it, else None."""
    if not deployed or not offered or deployed in offered:
        return None
    return (
        f"not offered in {deployed}, where the deployed cluster's subnet is (offered in {', '.join(offered)}); "
        "an update cannot move a subnet to another AZ: `fab destroy`, then `fab preflight` and deploy"
    )


_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,30}$")
_IMAGE_RE = re.compile(r"^(?=.{1,255}$)[a-z0-9.\-/:]+:[A-Za-z0-9._-]{1,128}$")  # Docker's limits
_SSM_RE = re.compile(r"^/[A-Za-z0-9_./-]+$")
AMI_ID_RE = re.compile(r"^ami-([0-9a-f]{8}|[0-9a-f]{17})$")  # EC2's two id lengths
_VPC_RE = re.compile(r"^vpc-[0-9a-f]{8,17}$")
_SUBNET_RE = re.compile(r"^subnet-[0-9a-f]{8,17}$")
# S3 bucket naming rules (S3 User Guide, *General purpose bucket naming rules*): 3-63 characters, lowercase
# letters, digits, dots and hyphens, starting and ending with a letter or digit, no two dots in a row.
_BUCKET_RE = re.compile(r"^(?!.*\.\.)[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_AZ_RE = re.compile(r"^[a-z]{2}(-gov)?-[a-z]+-\d[a-z]$")
_KEY_RE = re.compile(r"^[A-Za-z0-9_.@ -]{1,255}$")
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


class ConfigError(ValueError):
    """A bad context value. The message is one line: key, value, what is accepted."""

    def __init__(self, key: str, value: Any, accepted: str):
        super().__init__(f"invalid config {key}={value!r}: {accepted}")
        self.key = key


def _as_int(key: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool):
        raise ConfigError(key, value, f"expected a whole number from {low} to {high}")
    try:
        number = int(str(value).strip())
    except ValueError:
        raise ConfigError(key, value, f"expected a whole number from {low} to {high}") from None
    if not low <= number <= high:
        raise ConfigError(key, value, f"expected a whole number from {low} to {high}")
    return number


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(key, value, "expected true or false")


def _as_str(key: str, value: Any, pattern: re.Pattern, accepted: str) -> str:
    text = str(value).strip()
    if not pattern.match(text):
        raise ConfigError(key, value, accepted)
    return text


ACCESS_MODES = ("ssh", "ssm")
EFA_MODES = ("auto", "on", "off")


def _as_choice(key: str, value: Any, choices: Sequence[str]) -> str:
    text = str(value).strip().lower()
    if text not in choices:
        raise ConfigError(key, value, f"expected one of {', '.join(choices)}")
    return text


def _optional(convert: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    def wrapper(key: str, value: Any) -> Any:
        if value is None or str(value).strip() in ("", "none", "null"):
            return None
        return convert(key, value)

    return wrapper


def _instance_type(key: str, value: Any) -> str:
    text = str(value).strip().lower()
    if text not in INSTANCE_TYPES:
        family = text.partition(".")[0]
        sizes = sorted(t for t in INSTANCE_TYPES if t.startswith(family + "."))
        accepted = (
            f"expected one of {', '.join(sizes)}"
            if sizes
            else f"expected a GPU instance type of a supported family "
            f"({', '.join(sorted({t.split('.')[0] for t in INSTANCE_TYPES}))}), e.g. g4dn.2xlarge"
        )
        raise ConfigError(key, value, accepted)
    return text


# EC2 refuses a Spot maximum price at or below USD 0.001 (SpotMarketOptions, MaxPrice).
MIN_SPOT_MAX_PRICE = 0.001
# Spot nodes are stopped when interrupted, which needs persistent requests (see stacks/spot.py).
SPOT_INTERRUPTION = "stop"
SPOT_REQUEST = "persistent"
# EC2 User Guide, placement group rules: "You can't launch a Spot Instance that is configured to stop or
# hibernate on interruption in a placement group."
SPOT_PLACEMENT_RULE = "EC2 launches no Spot instance that stops on interruption (as these do) in a placement group"


def price_text(usd: float) -> str:
    """0.45 -> "0.45" (a Spot MaxPrice is a string; no exponent, no trailing zeros)."""
    return f"{usd:.6f}".rstrip("0").rstrip(".")


def _spot_price(key: str, value: Any) -> float:
    accepted = f"expected a price in USD per node-hour above {MIN_SPOT_MAX_PRICE}, e.g. 0.45"
    if isinstance(value, bool):
        raise ConfigError(key, value, accepted)
    try:
        price = float(str(value).strip().lstrip("$"))
    except ValueError:
        raise ConfigError(key, value, accepted) from None
    if not MIN_SPOT_MAX_PRICE < price < 1000:  # also refuses nan and inf
        raise ConfigError(key, value, accepted)
    return price


def _cidr(key: str, value: Any) -> str:
    text = str(value).strip()
    try:
        network = ipaddress.ip_network(text, strict=True)
    except ValueError:
        raise ConfigError(
            key, value, "expected an IPv4 CIDR with host bits zero, e.g. 203.0.113.7/32 (your address)"
        ) from None
    if network.version != 4:
        raise ConfigError(key, value, "expected an IPv4 CIDR, e.g. 203.0.113.7/32")
    return str(network)


_PARSERS: dict[str, Callable[[str, Any], Any]] = {
    "cluster_name": lambda k, v: _as_str(
        k, v, _NAME_RE, "expected 1-31 lowercase letters, digits or '-', starting with a letter"
    ),
    "nodes": lambda k, v: _as_int(k, v, 1, MAX_NODES),
    "instance_type": _instance_type,
    "gpus_per_node": _optional(lambda k, v: _as_int(k, v, 1, 16)),
    "ssh_cidr": _optional(_cidr),
    "allow_world_ssh": _as_bool,
    "root_volume_gb": lambda k, v: _as_int(k, v, 100, 16384),
    "image": lambda k, v: _as_str(
        k,
        v,
        _IMAGE_RE,
        "expected a pinned image REPO:TAG (at most 255 characters), e.g. nvcr.io/nvidia/pytorch:24.12-py3",
    ),
    "ami_ssm_parameter": _optional(
        lambda k, v: _as_str(k, v, _SSM_RE, "expected an SSM parameter path starting with '/'")
    ),
    "ami_id": _optional(lambda k, v: _as_str(k, v, AMI_ID_RE, "expected an AMI id, e.g. ami-0123456789abcdef0")),
    "retain_data": _as_bool,
    "placement_group": _optional(_as_bool),
    "flow_logs": _as_bool,
    "access": lambda k, v: _as_choice(k, v, ACCESS_MODES),
    "efa": lambda k, v: _as_choice(k, v, EFA_MODES),
    "private_subnet": _as_bool,
    "vpc_id": _optional(lambda k, v: _as_str(k, v, _VPC_RE, "expected vpc-xxxxxxxx")),
    "subnet_id": _optional(lambda k, v: _as_str(k, v, _SUBNET_RE, "expected subnet-xxxxxxxx")),
    "availability_zone": _optional(
        lambda k, v: _as_str(k, v, _AZ_RE, "expected an availability zone name, e.g. us-east-1a")
    ),
    "key_name": _optional(lambda k, v: _as_str(k, v, _KEY_RE, "expected the name of an existing EC2 key pair")),
    "data_bucket": _optional(
        lambda k, v: _as_str(k, v, _BUCKET_RE, "expected an S3 bucket's name (no s3://, no prefix), e.g. my-imagenet")
    ),
    "idle_minutes": lambda k, v: _as_int(k, v, 0, MAX_IDLE_MINUTES),
    "spot": _as_bool,
    "spot_max_price": _optional(_spot_price),
}


@dataclass(frozen=True)
class ClusterConfig:
    cluster_name: str = "gpu-cluster"
    nodes: int = 2
    instance_type: str = "g4dn.2xlarge"
    gpus_per_node: Optional[int] = None
    ssh_cidr: Optional[str] = None
    allow_world_ssh: bool = False
    root_volume_gb: int = 200
    image: str = DEFAULT_IMAGE
    ami_ssm_parameter: Optional[str] = None  # None: the DLAMI that supports the family
    ami_id: Optional[str] = None  # the pinned AMI: -c ami_id, else what `fab preflight` cached (stacks/pins.py)
    retain_data: bool = False
    placement_group: Optional[bool] = None  # None: one cluster placement group, unless spot (in_placement_group)
    flow_logs: bool = True  # rejected flows to a KMS-encrypted log group (new VPC only)
    access: str = "ssh"  # ssh: from ssh_cidr; ssm: Session Manager only, no inbound rule at all
    private_subnet: bool = False  # access=ssm: nodes without public IPs (NAT gateway + VPC endpoints)
    efa: str = "auto"  # auto: on where the type has EFA and the network allows it
    vpc_id: Optional[str] = None
    subnet_id: Optional[str] = None
    availability_zone: Optional[str] = None
    key_name: Optional[str] = None
    data_bucket: Optional[str] = None  # an S3 bucket the nodes may read: fab data --extra "--from s3://BUCKET/..."
    idle_minutes: int = 60
    spot: bool = False  # Spot nodes: persistent requests, stopped (not terminated) when interrupted
    spot_max_price: Optional[float] = None  # USD per node-hour; None: pay the Spot price, capped at On-Demand

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_context(
        cls, context: Mapping[str, Any] | Callable[[str], Any], region: Optional[str] = None
    ) -> "ClusterConfig":
        """Coerce and validate raw context values (strings from `-c`, or JSON from cdk.json);
        `context` is a mapping or a lookup such as `app.node.try_get_context`. Without an explicit
        AZ, the subnet goes to an AZ that offers the type, as `fab preflight` cached it for
        `region` in cdk.context.json."""
        get = context if callable(context) else context.get
        values = {}
        for key in cls.keys():
            if get(key) is not None:
                values[key] = _PARSERS[key](key, get(key))
        config = cls(**values)
        config.validate()
        if region and not config.vpc_id:
            offered = cached_offerings(get, region, config.instance_type)
            deployed = get(cluster_az_context_key(region, config.cluster_name))  # fab preflight's pin
            zone = choose_availability_zone(config.availability_zone, offered, deployed)
            config = replace(config, availability_zone=zone)
        return config

    def validate(self) -> None:
        """Checks that span several keys; single values are checked by their parser."""
        self._validate_ami()
        if self.access == "ssm" and self.ssh_cidr:
            raise ConfigError("ssh_cidr", self.ssh_cidr, "access=ssm opens no inbound port: leave ssh_cidr unset")
        if self.private_subnet and self.access != "ssm":
            raise ConfigError(
                "private_subnet",
                self.private_subnet,
                "needs -c access=ssm: nodes without public IPs are reached through Session Manager",
            )
        self._validate_efa()
        gpus = self.type_info.gpus
        if self.gpus_per_node and self.gpus_per_node > gpus:  # NCCL: "Duplicate GPU detected"
            raise ConfigError(
                "gpus_per_node",
                self.gpus_per_node,
                f"{self.instance_type} has {gpus} GPU(s): one rank per GPU, at most {gpus}",
            )
        if self.private_subnet and self.vpc_id:
            raise ConfigError(
                "private_subnet",
                self.private_subnet,
                "applies to the VPC this stack creates; with vpc_id, pass a private subnet_id",
            )
        if (
            self.ssh_cidr is not None
            and ipaddress.ip_network(self.ssh_cidr).prefixlen == 0
            and not self.allow_world_ssh
        ):
            raise ConfigError(
                "ssh_cidr",
                self.ssh_cidr,
                "SSH open to the whole internet needs -c allow_world_ssh=true; "
                "prefer your own address, e.g. 203.0.113.7/32",
            )
        if self.spot_max_price is not None and not self.spot:
            raise ConfigError("spot_max_price", self.spot_max_price, "needs -c spot=true")
        if self.spot and self.placement_group:
            raise ConfigError("placement_group", True, f"{SPOT_PLACEMENT_RULE}: leave it unset with spot=true")
        existing = {"vpc_id": self.vpc_id, "subnet_id": self.subnet_id, "availability_zone": self.availability_zone}
        given = [key for key, value in existing.items() if value is not None]
        if (self.vpc_id or self.subnet_id) and len(given) < len(existing):
            missing = [key for key in existing if key not in given]
            raise ConfigError(
                given[0],
                existing[given[0]],
                f"an existing VPC needs vpc_id, subnet_id (a public subnet) and "
                f"availability_zone together; missing {', '.join(missing)}",
            )

    def _validate_ami(self) -> None:
        """A known DLAMI must support the family (the OSS-driver one cannot drive V100s)."""
        known = {path: flavour for flavour, path in AMI_PARAMETERS.items()}
        flavour = known.get(self.ami_ssm_parameter or "")
        if flavour and flavour != self.type_info.ami:
            raise ConfigError(
                "ami_ssm_parameter",
                self.ami_ssm_parameter,
                f"this Deep Learning AMI's driver does not support {self.type_info.family} "
                f"({self.type_info.gpu}); leave it unset to get "
                f"{self.type_info.ami_parameter}",
            )

    def _validate_efa(self) -> None:
        if self.efa != "on":
            return
        cards = self.type_info.efa
        if not cards:
            raise ConfigError(
                "efa",
                self.efa,
                f"{self.instance_type} has no EFA; use efa=off or a type with EFA (e.g. g5.12xlarge, p4d.24xlarge)",
            )
        if self.spot:
            raise ConfigError(
                "efa",
                self.efa,
                f"EFA needs the nodes in one cluster placement group, and {SPOT_PLACEMENT_RULE}: "
                "use On-Demand nodes (no spot=true) for EFA, or efa=off",
            )
        if not self.in_placement_group:
            raise ConfigError(
                "efa", self.efa, "EFA needs the nodes in one cluster placement group: drop placement_group=false"
            )
        if cards > 1 and not self.nodes_without_public_ips:
            raise ConfigError(
                "efa",
                self.efa,
                f"{self.instance_type} has {cards} EFA cards, so several network "
                "interfaces, and AWS gives such instances no public IP: add "
                "-c access=ssm -c private_subnet=true (a new cluster: a deployed one keeps its subnet layout)",
            )

    @property
    def spot_max_price_output(self) -> Optional[str]:
        """The stack's SpotMaxPrice output: its nodes' MaxPrice, "on-demand" without one; None for On-Demand
        nodes (fab preflight: a new maximum price is a new launch template version, so new nodes)."""
        if not self.spot:
            return None
        return "on-demand" if self.spot_max_price is None else price_text(self.spot_max_price)

    @property
    def in_placement_group(self) -> bool:
        """The nodes share one cluster placement group: asked for, or by default unless they are Spot nodes."""
        return self.placement_group if self.placement_group is not None else not self.spot

    @property
    def efa_cards(self) -> int:
        """EFA network cards the nodes get: auto turns EFA on where the type pairs it with GPUDirect RDMA
        (instance_types.py) and the network allows it (several cards mean several interfaces, which get no
        public IP)."""
        cards = self.type_info.efa
        if self.efa == "off" or not cards:
            return 0
        if self.efa == "auto" and (
            not self.type_info.gpudirect_rdma
            or not self.in_placement_group
            or (cards > 1 and not self.nodes_without_public_ips)
        ):
            return 0
        return cards

    @property
    def nodes_without_public_ips(self) -> bool:
        """Reached through Session Manager in a private subnet (this stack's, or a given one)."""
        return self.access == "ssm" and (self.private_subnet or self.vpc_id is not None)

    @property
    def public_ips(self) -> bool:
        """The nodes have public IPv4 addresses, and the stack's outputs read them (Fn::GetAtt PublicIp fails
        the stack for an instance that has none)."""
        return not self.nodes_without_public_ips

    @property
    def public_ip_request(self) -> Optional[bool]:
        """What a node's primary interface asks for: a public IP with access=ssh (fab reaches the node there,
        whatever the subnet's auto-assign); with access=ssm the subnet decides (a given public subnet keeps
        its way out to SSM, S3 and nvcr.io; a private one needs its NAT)."""
        return True if self.access == "ssh" else None

    @property
    def efa_note(self) -> Optional[str]:
        """Why auto left EFA off on a type that has it (a synth-time warning), else None."""
        if self.efa != "auto" or not self.type_info.efa or self.efa_cards:
            return None
        return f"EFA off: {self.instance_type} has {self.type_info.efa} EFA card(s), but " + (
            "no GPUDirect RDMA (only p4d/p4de/p5 have it); -c efa=on turns EFA on anyway"
            if not self.type_info.gpudirect_rdma
            else "Spot nodes have no placement group (EC2 refuses one for Spot instances that stop when interrupted)"
            if self.spot
            else "placement_group=false"
            if not self.in_placement_group
            else "several interfaces get no public IP; -c access=ssm -c private_subnet=true turns it on (a new cluster)"
        )

    @property
    def type_info(self) -> InstanceType:
        return INSTANCE_TYPES[self.instance_type]

    @property
    def ami_parameter(self) -> str:
        return self.ami_ssm_parameter or self.type_info.ami_parameter

    @property
    def gpus(self) -> int:
        return self.gpus_per_node or self.type_info.gpus

    def node_name(self, rank: int) -> str:
        return f"{self.cluster_name}-node{rank}"
