"""Unit tests: the run spec and its mpirun command, interface detection, train request validation."""

import json
import shlex
import threading
import time
import types

import pytest

from cluster_node.protocol.spec import RunSpec
from clusterops import terminal
from clusterops.inventory import Inventory, InventoryError, Node, SshSettings, write_known_hosts
from clusterops.nodes import remote, view
from clusterops.run import checkup, dataprep, launch, lifecycle


def inventory(nodes=3, gpus=4, source="aws") -> Inventory:
    return Inventory(
        cluster="c",
        source=source,
        gpus_per_node=gpus,
        nodes=[
            Node(rank=r, name=f"node{r}", public_ip=f"198.51.100.{r + 1}", private_ip=f"10.42.0.{r + 5}")
            for r in range(nodes)
        ],
        ssh=SshSettings(user="root", port=4444, key_file="/k", known_hosts="/kh"),
    )


def test_the_spec_places_one_rank_per_gpu_slot_of_each_node_in_rank_order():
    spec = launch.train_spec(inventory(), launch.TrainRequest(), "ens5", "/workspace/train")
    assert spec.hosts == ("10.42.0.5", "10.42.0.6", "10.42.0.7") and spec.slots == 4
    assert spec.argv()[4:6] == ["-H", "10.42.0.5:4,10.42.0.6:4,10.42.0.7:4"]


def test_mpirun_line_for_the_whole_cluster():
    argv = launch.mpirun_argv(inventory(), launch.TrainRequest(recipe="transformer-base"), "ens5", "/workspace/train")
    line = shlex.join(argv)
    assert argv[:4] == ["mpirun", "--allow-run-as-root", "-np", "12"]
    assert "-H 10.42.0.5:4,10.42.0.6:4,10.42.0.7:4 -bind-to none -map-by slot" in line
    assert "--mca plm_rsh_args '-F /data/.cluster/ssh/config'" in line
    for export in ("MASTER_ADDR=10.42.0.5", "MASTER_PORT=29500", "NCCL_SOCKET_IFNAME=ens5", "GLOO_SOCKET_IFNAME=ens5"):
        assert f"-x {export}" in line
    assert "--mca oob_tcp_if_include ens5" in line
    assert "btl_tcp_if" not in line  # HPC-X's conf sets btl_tcp_if_exclude; both are "mutually exclusive"
    assert line.endswith(
        "-x PYTHONPATH=/workspace python -m train.train --recipe transformer-base --data "
        "/data/datasets/wmt16-en-de --run-dir /data/runs/transformer-base"
    )


def test_mpirun_line_with_options_and_a_subset_of_nodes():
    request = launch.TrainRequest(
        recipe="transformer-tiny",
        run="exp1",
        steps=100,
        batch_per_gpu=32,
        precision="bf16",
        grad_compression="powersgd",
        nodes=2,
        extra_args=("--label-smoothing", "0.2"),
    )
    argv = launch.mpirun_argv(inventory(), request, "eth0", "/code/train")
    assert argv[argv.index("-np") + 1] == "8"
    tail = argv[argv.index("PYTHONPATH=/code:/workspace") - 1 :]
    assert tail == [
        "-x",
        "PYTHONPATH=/code:/workspace",
        "python",
        "-m",
        "train.train",
        "--recipe",
        "transformer-tiny",
        "--data",
        "/data/datasets/numbers",
        "--run-dir",
        "/data/runs/exp1",
        "--max-steps",
        "100",
        "--batch-per-gpu",
        "32",
        "--precision",
        "bf16",
        "--grad-compression",
        "powersgd",
        "--label-smoothing",
        "0.2",
    ]
    spec = launch.train_spec(inventory(), request, "eth0", "/code")
    assert spec.pool == ("10.42.0.5", "10.42.0.6") and spec.limits.stall == 600


def test_values_pass_through_the_spec_as_argv_words_no_shell_between():
    request = launch.TrainRequest(extra_args=("--run-note", "it's; rm -rf /"))
    spec = launch.train_spec(inventory(), request, "eth0", "/code dir/train")
    assert spec.process_env == {"HWLOC_COMPONENTS": "-gl"} and spec.argv()[0] == "mpirun"
    again = RunSpec.from_json(json.loads(json.dumps(spec.to_json())))
    assert again == spec and again.argv()[-1] == "it's; rm -rf /"
    assert "PYTHONPATH=/code dir:/workspace python -m train.train" in " ".join(again.argv())


def test_mpirun_prefix_places_one_rank_per_gpu_slot_and_stops_before_the_program():
    inv = inventory()
    prefix = launch.mpirun_prefix(inv, inv.nodes, "ens5", 29600)
    assert prefix[:4] == ["mpirun", "--allow-run-as-root", "-np", "12"]
    assert prefix[prefix.index("-H") + 1] == "10.42.0.5:4,10.42.0.6:4,10.42.0.7:4" and "--hostfile" not in prefix
    assert prefix[-2:] == ["-x", "OMP_NUM_THREADS=4"] and "MASTER_PORT=29600" in prefix
    request = launch.TrainRequest(recipe="transformer-base", nodes=2)
    train = launch.mpirun_argv(inv, request, "ens5", "/workspace/train")
    prefix = launch.mpirun_prefix(inv, inv.nodes[:2], "ens5")
    assert train[: len(prefix)] == prefix
    assert train[len(prefix) :][:5] == ["-x", "PYTHONPATH=/workspace", inv.python, "-m", "train.train"]


def test_check_training_steps_are_a_valid_short_run_in_a_scratch_directory():
    from train.config import build_parser, config_from_args

    inv = inventory()
    prepare, train = checkup.check_argvs(inv, "/code/train")
    assert prepare[:6] == ["env", "PYTHONPATH=/code:/workspace", "python", "-m", "train.prepare", "numbers"]
    assert prepare[7] == "/data/runs/.check/numbers"
    assert train[:5] == ["-x", "PYTHONPATH=/code:/workspace", "python", "-m", "train.train"]
    config = config_from_args(build_parser("").parse_args(train[5:]))
    assert config.run_dir.startswith(checkup.check_dir(inv) + "/") and config.data == prepare[7]
    assert config.max_steps == checkup.CHECK_STEPS and config.eval_every == checkup.CHECK_STEPS


def test_versions_line_names_every_version_that_differs_and_where():
    same = [dict(node=f"node{i}", torch="2.13.0", cuda="13.0", nccl="2.27.7", driver="580.65.06") for i in range(3)]
    assert terminal.versions_line(same) == (
        True,
        "versions: torch 2.13.0, CUDA 13.0, NCCL 2.27.7, driver 580.65.06 on all 3 nodes",
    )
    differ = [dict(row) for row in same]
    differ[2].update(torch="2.6.0", driver="570.133.20")
    ok, line = terminal.versions_line(differ)
    assert not ok and "\n" not in line
    assert line == (
        "versions differ between nodes: torch 2.13.0 on node0,node1 vs 2.6.0 on node2; "
        "driver 580.65.06 on node0,node1 vs 570.133.20 on node2"
    )
    cpu = [dict(node="node0", torch="2.13.0+cpu", cuda=None, nccl=None, driver=None)] * 2
    assert (
        terminal.versions_line(cpu)[1] == "versions: torch 2.13.0+cpu, CUDA none, NCCL none, driver none on all 2 nodes"
    )


def test_a_failed_check_run_is_reported_by_its_error_line():
    output = (
        "[rank1]: Traceback (most recent call last):\n[rank1]: RuntimeError: No backend type associated "
        "with device type cpu\nPrimary job  terminated normally, but 1 process returned\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \ntrain.py FAILED\n"
    )
    assert lifecycle._failure_line(output) == "[rank1]: RuntimeError: No backend type associated with device type cpu"
    assert lifecycle._failure_line("starting\nerror: no prepared data set\nbye\n") == "error: no prepared data set"
    assert lifecycle._failure_line("") == "no output"


IP_ADDR = """1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever
2: ens5    inet 10.42.0.5/20 metric 100 brd 10.42.15.255 scope global dynamic ens5\\       valid_lft 3000sec
3: docker0    inet 172.17.0.1/16 brd 172.17.255.255 scope global docker0\\       valid_lft forever"""


def test_interface_is_the_one_holding_the_node_address():
    assert view.parse_interface(IP_ADDR, "10.42.0.5") == "ens5"
    assert view.parse_interface(IP_ADDR, "127.0.0.1") == "lo"
    with pytest.raises(remote.RemoteError, match="no interface holds 10.42.0.9"):
        view.parse_interface(IP_ADDR, "10.42.0.9")


@pytest.mark.parametrize(
    "fields, text",
    [
        ({"recipe": "gpt"}, "invalid --recipe"),
        ({"run": "../etc"}, "invalid --run"),
        ({"run": ""}, None),
        ({"steps": 0}, "invalid --steps"),
        ({"batch_per_gpu": -4}, "invalid --batch-per-gpu"),
        ({"precision": "fp64"}, "invalid --precision"),
        ({"grad_compression": "int8"}, "invalid --grad-compression"),
        ({"master_port": 80}, "invalid --master-port"),
        ({"master_port": 4444}, "invalid --master-port"),
        ({"stall_minutes": 0}, "invalid --stall-minutes"),
        ({"dataset": "a b"}, "invalid --dataset"),
    ],
)
def test_bad_train_requests_are_rejected(fields, text):
    request = launch.TrainRequest(**fields)
    if text is None:  # empty run name falls back to the recipe
        request.validate()
        assert request.run_name == "transformer-tiny"
        return
    with pytest.raises(launch.LaunchError, match=text):
        request.validate()


def test_selecting_more_nodes_than_exist_is_an_error():
    with pytest.raises(InventoryError, match="invalid --nodes 4: the cluster has 3"):
        inventory().select(4)


def test_inventory_round_trip_and_clear_errors(tmp_path):
    path = tmp_path / "inventory.json"
    inventory().save(path)
    assert Inventory.load(path) == inventory()
    with pytest.raises(InventoryError, match="fab local.up"):
        Inventory.load(tmp_path / "missing.json")
    path.write_text("{not json")
    with pytest.raises(InventoryError, match="unreadable inventory"):
        Inventory.load(path)


def test_known_hosts_pins_each_node_exactly(tmp_path):
    path = tmp_path / "known_hosts"
    write_known_hosts(path, ["10.0.0.1", "10.0.0.2"], "ssh-ed25519 AAAAkey comment\n", 4444)
    assert path.read_text() == "[10.0.0.1]:4444 ssh-ed25519 AAAAkey\n[10.0.0.2]:4444 ssh-ed25519 AAAAkey\n"


def test_then_stop_env_names_the_cluster_and_the_watchdog_next_to_the_program():
    stop = launch.then_stop(inventory(), launch.TrainRequest(then_stop=True), {"AWS_SECRET_ACCESS_KEY": "real"})
    assert stop is not None and stop.env == {"CLUSTER_NAME": "c", "PYTHONPATH": "/workspace"}
    assert stop.argv[1:] == ("-m", "cluster_node.daemons.autostop.watchdog", "--stop-now")
    assert not any(k.startswith("AWS_") for k in stop.env)  # real nodes use their instance role; nothing secret
    assert launch.then_stop(inventory(), launch.TrainRequest(), {}) is None


def test_an_emulated_cluster_reaches_an_emulator_endpoint_through_its_bridge():
    local = Inventory(
        cluster="l",
        source="local",
        gpus_per_node=1,
        nodes=inventory().nodes,
        ssh=inventory().ssh,
        extra={"controller_ip": "10.213.0.1"},
    )
    environ = {
        "AWS_ENDPOINT_URL": "http://localhost:5000",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    assert launch.emulator_env(local, environ)["AWS_ENDPOINT_URL"] == "http://10.213.0.1:5000"
    assert launch.emulator_env(local, {"AWS_SECRET_ACCESS_KEY": "real"}) == {}  # no emulator: nothing
    assert launch.emulator_env(inventory(), environ) == {}


@pytest.mark.parametrize(
    "task",
    [
        "status",
        "check",
        "data",
        "sync",
        "train",
        "logs",
        "stop",
        "tensorboard",
        "monitor",
        "fetch",
        "ssh",
        "start",
        "stop-cluster",
    ],
)
def test_every_cluster_task_without_an_inventory_says_what_to_run(task, tmp_path):
    import subprocess

    from conftest import REPO, tool_env

    result = subprocess.run(
        ["fab", task],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=tool_env(GPU_CLUSTER_INVENTORY=str(tmp_path / "inventory.json")),
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: no inventory at {tmp_path / 'inventory.json'}: run `fab local.up` (emulated cluster) or "
        "`npx cdk deploy` then `fab inventory` (AWS)"
    ]


def test_a_quiet_running_run_says_how_long_it_has_shown_no_progress():
    from clusterops import terminal

    running = {"state": "running", "time": "2026-01-01T00:00:00Z"}
    start = 1767225600.0  # 2026-01-01T00:00:00Z
    from runfiles import run_files

    progress = {"step": 40, "max_steps": 100, "time": start}
    quiet = run_files(status=running, progress=progress)
    assert "no progress for 10 min" in terminal.run_line("/data/runs/r", quiet, now=start + 600)
    assert "no progress" not in terminal.run_line("/data/runs/r", quiet, now=start + 30)
    never = run_files(status=running)
    assert "no step yet after 16 min" in terminal.run_line("/data/runs/r", never, now=start + 960)
    ended = run_files(status={"state": "finished"}, progress=progress)
    assert "no progress" not in terminal.run_line("/data/runs/r", ended, now=start + 6000)


def test_train_help_is_help_and_lists_every_recipe():
    import subprocess

    from conftest import REPO, tool_env

    out = subprocess.run(["fab", "--help", "train"], cwd=REPO, capture_output=True, text=True, env=tool_env()).stdout
    assert "-h, --then-stop" not in out and "--then-stop" in out
    for recipe in launch.RECIPES:
        assert recipe in out


def test_no_aws_variable_leaks_into_tests_that_did_not_ask_for_the_emulator():
    """The moto server's variables are set per test (fixture aws_env), never for the whole session."""
    import os

    assert "AWS_ENDPOINT_URL" not in os.environ and os.environ.get("AWS_ACCESS_KEY_ID") != "testing"


@pytest.mark.parametrize("instance_type, cards", [("g5.12xlarge", 1), ("g4dn.12xlarge", 1), ("p4d.24xlarge", 4)])
def test_an_efa_cluster_exports_what_nccls_ofi_plugin_needs(instance_type, cards):
    """libfabric's EFA provider calls abort() when FI_EFA_USE_DEVICE_RDMA=1 is set on a device without
    RDMA read (g4dn, g5: ofiwg/libfabric prov/efa/src/rdm/efa_rdm_util.c, efa_rdm_get_use_device_rdma);
    aws-ofi-nccl's doc/efa-env-var.md: with libfabric >= 1.18 and the plugin >= 1.7 set neither it nor
    FI_PROVIDER (the plugin selects the efa provider itself, platform-aws.cpp). So neither, on any type."""
    from dataclasses import replace

    plain = launch.mpirun_argv(inventory(), launch.TrainRequest(), "ens5", "/workspace/train")
    efa = launch.mpirun_argv(
        replace(inventory(), instance_type=instance_type, extra={"efa_cards": cards}),
        launch.TrainRequest(),
        "ens5",
        "/workspace/train",
    )
    for argv in (plain, efa):
        assert not [word for word in argv if word.startswith(("FI_EFA_USE_DEVICE_RDMA=", "FI_PROVIDER="))]
    assert "NCCL_SOCKET_IFNAME=ens5" in efa


def _efa_argv(instance_type="p4d.24xlarge", cards=4, **request) -> list[str]:
    from dataclasses import replace

    inv = replace(inventory(), instance_type=instance_type, extra={"efa_cards": cards})
    return launch.mpirun_argv(inv, launch.TrainRequest(**request), "ens5", "/workspace/train")


def test_an_efa_launch_selects_the_ofi_plugin_so_that_a_missing_one_is_an_error():
    """NCCL_NET_PLUGIN picks libnccl-net-${NCCL_NET_PLUGIN}.so (NCCL's environment-variable docs; the
    plugin ships libnccl-net-ofi.so since v1.15, aws/aws-ofi-nccl#808); NCCL_NET forces the named
    network instead of falling back to the internal IB/Socket ones, and the plugin answers to "OFI"
    when NCCL_NET says so (src/nccl_ofi_interface_nvidia.cpp, nvidia_plugin_name_fixup)."""
    efa = _efa_argv()
    assert f"NCCL_NET_PLUGIN={launch.EFA_PLUGIN}" in efa and "NCCL_NET=OFI" in efa
    plain = launch.mpirun_argv(inventory(), launch.TrainRequest(), "ens5", "/workspace/train")
    assert not [word for word in plain if word.startswith(("NCCL_NET=", "NCCL_NET_PLUGIN="))]
    # --allow-tcp: the user chose sockets, so nothing forces the plugin.
    assert not [w for w in _efa_argv(allow_tcp=True) if w.startswith(("NCCL_NET=", "NCCL_NET_PLUGIN="))]


@pytest.mark.parametrize("name", ["-dash", ".hidden", "x" * 65, "a b"])
def test_a_bad_run_name_is_refused_with_the_rule_it_breaks(name):
    """`--run -dash` was refused with "letters, digits, '.', '_' or '-'", a rule it satisfies (issue 23
    §8): the message states the whole rule, the first character's part included."""
    with pytest.raises(launch.LaunchError, match="a letter or digit first") as refused:
        launch.TrainRequest(recipe="transformer-tiny", run=name).validate()
    assert "\n" not in str(refused.value)


def test_recipes_datasets_precisions_and_compressions_are_the_training_packages_lists():
    """One list per concept, in train.catalog: fab's choices are the trainer's, and each recipe's default
    data directory is the one `fab data` prepares (ImageNet included)."""
    from train import catalog
    from train.config import build_parser, config_from_args

    assert (launch.RECIPES, dataprep.DATASETS) == (catalog.RECIPES, catalog.DATASETS)
    assert (launch.PRECISIONS, launch.COMPRESSIONS) == (catalog.PRECISIONS, catalog.COMPRESSIONS)
    for recipe in catalog.RECIPES:
        config = config_from_args(build_parser("").parse_args(["--recipe", recipe]))
        assert config.data == launch.data_path(inventory(), launch.default_dataset(recipe)), recipe
    assert catalog.dataset_dir("imagenet") == "/data/datasets/imagenet"


def test_a_recipe_and_a_data_set_that_do_not_match_are_one_line():
    """Issue 32 §2: resnet-small on ding passed the laptop's check ("started") and failed on every rank."""
    from train import catalog

    for recipe in catalog.RECIPES:  # each recipe's own data set matches it
        assert catalog.KNOWN_INPUTS[launch.default_dataset(recipe)] == catalog.recipe_input(recipe), recipe
    text, images = {"vocab_size": 8000, "src_lang": "en"}, {"classes": ["shirt"]}
    refused = catalog.input_mismatch("resnet-small", "ding", text, False)
    assert refused and refused.startswith("resnet-small trains on images; ding is text: use an image data set")
    refused = catalog.input_mismatch("transformer-tiny", "fashion-mnist", images, True)
    assert refused and refused.startswith("transformer-tiny trains on text; fashion-mnist is images")
    assert catalog.input_mismatch("resnet50", "imagenet", None, True) is None  # a staged folder, no meta.json
    assert catalog.input_mismatch("transformer-tiny", "numbers", text, False) is None


def test_a_missing_data_set_says_how_to_prepare_it_or_names_the_close_one():
    """Issue 32 §11: `--dataset dingg` suggested `fab data --dataset dingg`, itself refused."""
    from train import catalog

    assert catalog.missing_data("ding") == "run `fab data --dataset ding`"
    # ImageNet is not made by `fab data` (which only checked the folder, and said it was not one): fetched
    assert '`fab data --dataset imagenet --extra "--from s3://BUCKET/PREFIX"`' in catalog.missing_data("imagenet")
    assert catalog.missing_data("dingg").endswith(
        "wmt16-en-de, fashion-mnist or imagenet: did you mean --dataset ding?"
    )


def test_a_synced_root_comes_first_and_the_images_is_still_found():
    """After `fab sync` the ranks, the supervisor and fab's node commands import /data/code first, then
    the image's /workspace: a /data/code left by an older fab (train/ but no cluster_node/) still finds
    cluster_node instead of failing every launch (a fresh read of the deploy path)."""
    from clusterops.nodes import command as nodecmd

    inv = inventory()
    assert nodecmd.python_path(inv) == "/workspace"
    assert nodecmd.python_path(inv, "/data/code/train") == "/data/code:/workspace"
    assert nodecmd.node_command(inv, "probe", code_dir="/data/code/train").startswith(
        "PYTHONPATH=/data/code:/workspace "
    )


class _SlowNodes:
    """A connection pool whose nodes each take 0.3 s to run prepare.py, printing two lines (node2's fails)."""

    def __init__(self):
        self.busy = self.most = 0
        self.lock = threading.Lock()

    def get(self, node):
        pool = self

        class Connection:
            host = node.name

            def run(self, command, hide=False, warn=False, in_stream=None, timeout=None, **streams):
                if hide:  # code_dir_on's probe: no synced copy
                    return types.SimpleNamespace(exited=0, stdout="", stderr="")
                with pool.lock:
                    pool.busy += 1
                    pool.most = max(pool.most, pool.busy)
                time.sleep(0.3)
                with pool.lock:
                    pool.busy -= 1
                for chunk in ("staged into /opt/d", f"lami/nvme\nimages: {node.rank}"):  # invoke: a flush a chunk
                    streams["out_stream"].write(chunk)
                    streams["out_stream"].flush()
                return types.SimpleNamespace(exited=2 if node.rank == 2 else 0)

        return Connection()

    def close(self):
        pass


def test_data_on_every_node_runs_on_all_nodes_at_once_and_names_where_it_failed():
    """fab data --all-nodes (imagenet --stage-to): every node bills while it stages, so they stage at once."""
    pool, said = _SlowNodes(), []
    with pytest.raises(remote.RemoteError) as failed:
        dataprep.prepare(inventory(), "imagenet", ["--stage-to", "/nvme"], True, said.append, connections=pool)
    assert pool.most == 3
    assert str(failed.value) == "prepare.py imagenet failed on node2 (exit 2)"
    assert said[0].startswith("data: preparing imagenet on node0, node1, node2 at once (")
    assert sorted(said[1:]) == sorted(
        f"node{r}: {line}" for r in range(3) for line in ("staged into /opt/dlami/nvme", f"images: {r}")
    )
    with pytest.raises(launch.LaunchError, match="^--from fetches onto the shared /data once: run `fab data` with"):
        dataprep.prepare(inventory(), "imagenet", ["--from", "s3://b/p"], True, said.append, connections=pool)
    # A fresh read: N nodes preparing one /data folder at once left 25,579 of 30,000 images, marked prepared.
    before = len(said)
    for dataset, extra in (("fashion-mnist", []), ("ding", []), ("imagenet", ["--source", "/data/datasets/imagenet"])):
        with pytest.raises(launch.LaunchError, match="^--all-nodes copies a data set onto each node's own disk"):
            dataprep.prepare(inventory(), dataset, extra, True, said.append, connections=pool)
    assert len(said) == before  # nothing ran, nothing said, for the refused ones
    assert dataprep.staged_to(["--stage-to", "/nvme/x"]) == dataprep.staged_to(["--stage-to=/nvme/x"]) == "/nvme/x"
    assert dataprep.staged_to(["--source", "/data/datasets/imagenet"]) is None
