"""Pure functions that build what `fab train` sends to the head node: the run spec (and its mpirun line)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Sequence
from urllib.parse import urlsplit, urlunsplit

from cluster_node.protocol import rundir
from cluster_node.protocol.contract import CONTAINER_SSH_PORT
from cluster_node.protocol.spec import Budget, Limits, RunSpec, ThenStop
from clusterops.inventory import Inventory, Node
from clusterops.nodes.command import package_root, python_path
from train.catalog import COMPRESSIONS, PRECISIONS, RECIPES, dataset_dir, default_dataset

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
NAME_RULE = "a letter or digit first, then letters, digits, '.', '_' or '-' (64 at most)"


# On EFA clusters NCCL must use the image's aws-ofi-nccl, or fail: NCCL_NET_PLUGIN=ofi loads
# libnccl-net-ofi.so (NCCL's docs; the plugin's name since v1.15), NCCL_NET=OFI forbids the fallback to
# NCCL's own Socket transport (the plugin answers to "OFI" when asked: nccl_ofi_interface_nvidia.cpp).
# Neither FI_PROVIDER nor FI_EFA_USE_DEVICE_RDMA: with libfabric >= 1.18 and aws-ofi-nccl >= 1.7 the
# plugin picks the efa provider and libfabric turns device RDMA on where the hardware has RDMA read
# (aws-ofi-nccl doc/efa-env-var.md); FI_EFA_USE_DEVICE_RDMA=1 on a device without it (g4dn, g5) makes
# libfabric abort() every rank (prov/efa/src/rdm/efa_rdm_util.c).
EFA_PLUGIN = "ofi"
EFA_ENVIRONMENT = {"NCCL_NET_PLUGIN": EFA_PLUGIN, "NCCL_NET": "OFI"}


class LaunchError(ValueError):
    pass


@dataclass(frozen=True)
class TrainRequest:
    recipe: str = "transformer-tiny"
    run: Optional[str] = None
    steps: Optional[int] = None
    batch_per_gpu: Optional[int] = None
    precision: Optional[str] = None
    grad_compression: Optional[str] = None
    nodes: Optional[int] = None
    exclude: tuple[str, ...] = ()  # ranks or names of nodes to leave out
    dataset: Optional[str] = None
    data: Optional[str] = None  # the data set's path on the nodes: a resumed run's saved one (clusterops.run.resume)
    master_port: int = 29500
    # The supervisor's limits default to its own (cluster_node.protocol.spec.Limits), in the units fab train takes.
    stall_minutes: float = Limits.stall / 60
    start_minutes: float = Limits.start / 60
    then_stop: bool = False
    max_restarts: int = Limits.max_restarts
    min_nodes: Optional[int] = None  # None: Limits.min_nodes
    hang_seconds: float = Limits.hang_floor
    allow_tcp: bool = False  # on an EFA cluster: let NCCL fall back to sockets
    budget_usd: Optional[float] = None  # end the run gracefully when its spend reaches this
    budget_margin: float = 0.2  # refuse when fab plan predicts more than budget x (1 + margin)
    keep_nodes: bool = False  # with a budget: leave the nodes up when the run ends (no implied --then-stop)
    extra_args: Sequence[str] = field(default_factory=tuple)

    @property
    def run_name(self) -> str:
        return self.run or self.recipe

    def validate(self) -> None:
        if self.recipe not in RECIPES:
            raise LaunchError(f"invalid --recipe {self.recipe!r}: one of {', '.join(RECIPES)}")
        if not _RUN_NAME.match(self.run_name):
            raise LaunchError(f"invalid --run {self.run_name!r}: {NAME_RULE}")
        for name in ("steps", "batch_per_gpu"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise LaunchError(f"invalid --{name.replace('_', '-')} {value}: a positive whole number")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise LaunchError(f"invalid --precision {self.precision!r}: one of {', '.join(PRECISIONS)}")
        if self.grad_compression is not None and self.grad_compression not in COMPRESSIONS:
            raise LaunchError(f"invalid --grad-compression {self.grad_compression!r}: one of {', '.join(COMPRESSIONS)}")
        if not 1024 <= self.master_port <= 65535 or self.master_port == CONTAINER_SSH_PORT:
            raise LaunchError(f"invalid --master-port {self.master_port}: 1024-65535, not {CONTAINER_SSH_PORT}")
        if self.max_restarts < 0:
            raise LaunchError(f"invalid --max-restarts {self.max_restarts}: 0 or a positive whole number")
        if self.min_nodes is not None and self.min_nodes < 1:
            raise LaunchError(f"invalid --min-nodes {self.min_nodes}: a positive whole number")
        for name in ("stall_minutes", "start_minutes", "hang_seconds"):
            if getattr(self, name) <= 0:
                raise LaunchError(f"invalid --{name.replace('_', '-')} {getattr(self, name)}: a positive number")
        if self.budget_usd is not None and self.budget_usd <= 0:
            raise LaunchError(f"invalid --budget-usd {self.budget_usd:g}: a positive number of dollars")
        if self.budget_margin < 0:
            raise LaunchError(f"invalid --budget-margin {self.budget_margin:g}: 0 or more (0.2 = 20%)")
        if self.dataset is not None and not _RUN_NAME.match(self.dataset):
            raise LaunchError(f"invalid --dataset {self.dataset!r}: {NAME_RULE}")
        if self.data is not None and (not _DATA_PATH.match(self.data) or ".." in self.data.split("/")):
            raise LaunchError(
                f"invalid --data {self.data!r}: an absolute path on the nodes, e.g. /opt/dlami/nvme/imagenet"
            )


def check_nodes(inventory: Inventory, request: TrainRequest, nodes: Optional[Sequence[Node]] = None) -> list[Node]:
    """The nodes the run starts on (selected here unless given); --min-nodes must not exceed them."""
    nodes = list(inventory.select(request.nodes, request.exclude) if nodes is None else nodes)
    if request.min_nodes is not None and request.min_nodes > len(nodes):
        raise LaunchError(f"invalid --min-nodes {request.min_nodes}: the run starts on {len(nodes)} node(s)")
    return nodes


@dataclass(frozen=True)
class LaunchPlan:
    """A launch decided once on the laptop and passed down: the (validated) request, the nodes it
    starts on, the head node's interface, the program's directory on the nodes and, from `fab train`,
    the quick health verdicts the nodes passed."""

    request: TrainRequest
    nodes: tuple[Node, ...]
    interface: str
    code_dir: str
    verdicts: tuple = ()
    budget: Optional[Budget] = None  # --budget-usd, priced


# An absolute path of plain name characters: it travels in the run spec and shell commands on every node.
_DATA_PATH = re.compile(r"^(/[A-Za-z0-9._-]+)+/?$")


def data_path(inventory: Inventory, dataset: str) -> str:
    return dataset_dir(dataset, inventory.data_dir)


def run_dir(inventory: Inventory, run_name: str) -> str:
    return f"{inventory.data_dir}/{rundir.RUNS}/{run_name}"


def active_file(inventory: Inventory) -> str:
    return f"{inventory.data_dir}/{rundir.RUNS}/{rundir.ACTIVE}"


def _mpirun_parts(
    inventory: Inventory, nodes: Sequence[Node], interface: str, master_port: int, allow_tcp: bool
) -> tuple[tuple[str, ...], dict[str, str]]:
    """mpirun's options and the ranks' exports: the interface for OpenMPI, NCCL and gloo, the
    rendezvous on the first node; on an EFA cluster the OFI plugin, required unless `allow_tcp`."""
    # fmt: off
    options = (
        "-bind-to", "none", "-map-by", "slot",
        "--mca", "plm_rsh_args", f"-F {inventory.cluster_ssh_config}",
        # The daemons' own traffic; no btl_tcp_if_include: the ranks never call MPI_Init (no BTL opens),
        # and beside HPC-X's btl_tcp_if_exclude (its openmpi-mca-params.conf) it is a "mutually-exclusive
        # MCA variables" help frame in any process that does.
        "--mca", "oob_tcp_if_include", interface,
        # Daemons notice a lost mpirun in ~25 s (default 480 s) and end their ranks, even when
        # a partition means no one can reach them to clean up.
        "--mca", "oob_tcp_keepalive_time", "10", "--mca", "oob_tcp_keepalive_intvl", "5",
        "--mca", "oob_tcp_keepalive_probes", "3",
    )
    # fmt: on
    exports = {
        "MASTER_ADDR": nodes[0].private_ip,
        "MASTER_PORT": str(master_port),
        # NCCL's bootstrap and socket transport; with EFA, data goes through the OFI plugin.
        # NCCL_SOCKET_NTHREADS / NCCL_NSOCKS_PERTHREAD stay unset: NCCL detects the AWS ENA (PCI vendor
        # 0x1d0f) and uses 2 threads x 8 sockets there, the values its docs give for AWS.
        "NCCL_SOCKET_IFNAME": interface,
        "GLOO_SOCKET_IFNAME": interface,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1" if inventory.source == "local" else "4",
    }
    if inventory.extra.get("efa_cards") and not allow_tcp:
        exports.update(EFA_ENVIRONMENT)
    return options, exports


def rank_program(inventory: Inventory, code_dir: str, module: str) -> list[str]:
    """mpirun's program part for `python -m train.MODULE`: `-x` (Open MPI mpirun(1)) hands the ranks the
    package root on PYTHONPATH, as the image's ENV does, so a `fab sync` copy is the one they import."""
    return ["-x", f"PYTHONPATH={python_path(inventory, code_dir)}", inventory.python, "-m", f"train.{module}"]


def node_program(inventory: Inventory, code_dir: str, module: str) -> list[str]:
    """`python -m train.MODULE` run over SSH on one node, with the package root on PYTHONPATH."""
    return ["env", f"PYTHONPATH={python_path(inventory, code_dir)}", inventory.python, "-m", f"train.{module}"]


def run_spec(
    inventory: Inventory,
    nodes: Sequence[Node],
    interface: str,
    program: Sequence[str] = (),
    master_port: int = TrainRequest.master_port,
    allow_tcp: bool = False,
    **more,
) -> RunSpec:
    """One rank per GPU slot of `nodes`, `program` on each; `more`: RunSpec's other fields (fab train's
    run, limits, then-stop). Its argv() is the one mpirun line of fab train, fab check and every restart."""
    options, exports = _mpirun_parts(inventory, nodes, interface, master_port, allow_tcp)
    hosts = tuple(node.private_ip for node in nodes)
    values = dict(run="", attempt=1, supervisor_host=inventory.head.private_ip, pool=hosts)
    values.update(ssh_config=inventory.cluster_ssh_config, active_file=active_file(inventory))
    values.update(python=inventory.python, process_env=dict(LAUNCH_ENVIRONMENT))
    values.update(names={node.private_ip: node.name for node in inventory.nodes})
    return RunSpec(
        **{**values, **more},
        hosts=hosts,
        slots=inventory.gpus_per_node,
        env=exports,
        mpirun_options=options,
        program=tuple(program),
    )


def mpirun_prefix(
    inventory: Inventory,
    nodes: Sequence[Node],
    interface: str,
    master_port: int = TrainRequest.master_port,
    allow_tcp: bool = False,
) -> list[str]:
    """mpirun and its options, up to the program (fab check's all-reduce and training steps)."""
    return run_spec(inventory, nodes, interface, (), master_port, allow_tcp).argv()


def program_argv(inventory: Inventory, request: TrainRequest, code_dir: str) -> list[str]:
    """`-x PYTHONPATH=ROOT python -m train.train` and its arguments for `request`."""
    return [*rank_program(inventory, code_dir, "train"), *trainer_args(inventory, request)]


def request_data(inventory: Inventory, request: TrainRequest) -> str:
    """Where the run's data set is on the nodes: --data (a staged copy on each node's own disk; a resumed run's
    saved path), else the data set's folder on the shared /data."""
    if request.data:
        return request.data.rstrip("/")
    return data_path(inventory, request.dataset or default_dataset(request.recipe))


def on_each_node(inventory: Inventory, data: str) -> bool:
    """Whether `data` is each node's own copy (outside the shared /data): every node must hold it."""
    return not data.startswith(inventory.data_dir.rstrip("/") + "/")


def trainer_args(inventory: Inventory, request: TrainRequest) -> list[str]:
    """train.train's arguments for `request` (what clusterops.run.resume checks with the trainer's parser)."""
    argv = ["--recipe", request.recipe, "--data", request_data(inventory, request)]
    argv += ["--run-dir", run_dir(inventory, request.run_name)]
    options: tuple[tuple[str, object], ...] = (
        ("--max-steps", request.steps),
        ("--batch-per-gpu", request.batch_per_gpu),
        ("--precision", request.precision),
        ("--grad-compression", request.grad_compression),
    )
    for flag, given in options:
        if given is not None:
            argv += [flag, str(given)]
    return argv + list(request.extra_args)


def limits(request: TrainRequest) -> Limits:
    return Limits(
        stall=float(int(request.stall_minutes * 60)),
        start=float(int(request.start_minutes * 60)),
        # A poll every 5 s, or often enough to see a short hang window three times over.
        poll=float(min(5, max(1, int(request.hang_seconds // 3)))),
        hang_floor=float(int(request.hang_seconds)),
        max_restarts=request.max_restarts,
        min_nodes=request.min_nodes or Limits.min_nodes,
    )


def resume_command(request: TrainRequest) -> tuple[str, ...]:
    """The `fab train` that resumes this run (a Spot notice's final status prints it)."""
    command = ["fab", "train", "--recipe", request.recipe, "--run", request.run_name]
    for flag, given in (("--steps", request.steps), ("--dataset", request.dataset)):
        if given is not None:
            command += [flag, str(given)]
    if request.max_restarts:
        command += ["--max-restarts", str(request.max_restarts)]
    return tuple(command)


def train_spec(
    inventory: Inventory,
    request: TrainRequest,
    interface: str,
    code_dir: str,
    environ: Optional[dict] = None,
    nodes: Optional[Sequence[Node]] = None,  # a LaunchPlan's; else selected from the request
    budget: Optional[Budget] = None,
) -> RunSpec:
    """What `fab train` writes to RUN_DIR/spec.json: attempt 1 of the run."""
    nodes = inventory.select(request.nodes, request.exclude) if nodes is None else nodes
    return run_spec(
        inventory,
        nodes,
        interface,
        program_argv(inventory, request, code_dir),
        request.master_port,
        request.allow_tcp,
        run=run_dir(inventory, request.run_name),
        root=python_path(inventory, code_dir),
        resume=resume_command(request),
        limits=limits(request),
        then_stop=then_stop(inventory, request, environ or {}),
        budget=budget,
    )


def mpirun_argv(
    inventory: Inventory,
    request: TrainRequest,
    interface: str,
    code_dir: str,
    nodes: Optional[Sequence[Node]] = None,
) -> list[str]:
    return train_spec(inventory, request, interface, code_dir, nodes=nodes).argv()


EMULATOR_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


def emulator_env(inventory: Inventory, environ: dict) -> dict:
    """For an emulated cluster driven against an AWS emulator (AWS_ENDPOINT_URL set): the same
    endpoint, seen from inside the nodes (localhost there is the node itself). Empty otherwise:
    real nodes use their instance role, and no credential is ever written to /data."""
    endpoint = environ.get("AWS_ENDPOINT_URL")
    if inventory.source != "local" or not endpoint:
        return {}
    parts = urlsplit(endpoint)
    if parts.hostname in ("localhost", "127.0.0.1") and inventory.extra.get("controller_ip"):
        port = f":{parts.port}" if parts.port else ""
        endpoint = urlunsplit(parts._replace(netloc=f"{inventory.extra['controller_ip']}{port}"))
    return {k: (endpoint if k == "AWS_ENDPOINT_URL" else environ[k]) for k in EMULATOR_VARIABLES if k in environ}


def then_stop(inventory: Inventory, request: TrainRequest, environ: dict) -> Optional[ThenStop]:
    """--then-stop, implied by a budget unless --keep-nodes: the autostop watchdog's --stop-now, with the region
    and cluster it needs, carried in the spec whatever the supervisor's SSH session holds (its own instance id comes
    from the container's INSTANCE_ID, through sshd's SetEnv, else from IMDS: it stops its own node last)."""
    if not (request.then_stop or (request.budget_usd is not None and not request.keep_nodes)):
        return None
    env = {"CLUSTER_NAME": inventory.cluster, **({"AWS_REGION": inventory.region} if inventory.region else {})}
    env.update(emulator_env(inventory, environ), PYTHONPATH=package_root(inventory.code_dir))
    return ThenStop((inventory.python, "-m", "cluster_node.daemons.autostop.watchdog", "--stop-now"), env)


# Open MPI's hwloc probes X displays at start-up: display :N is TCP port 6000+N, so a TensorBoard on
# 6006 made `orte_init` block in XOpenDisplay. Its GL component is what probes; leave it out.
LAUNCH_ENVIRONMENT = {"HWLOC_COMPONENTS": "-gl"}
