"""The image table (stacks/images.py): the one place the training image's versions live, and everyone
who needs them reads it: the Dockerfile's default, `-c image`'s default, the second test environment's
requirements and lock, `fab check`'s comparison; and the run of the trainer's tests on the image's torch."""

import ast
import re

import pytest
from conftest import REPO, trainer_tests

from stacks import images
from stacks.instance_types import INSTANCE_TYPES


def test_the_dockerfiles_default_base_is_the_tables_default_image():
    """The bootstrap passes --build-arg BASE_IMAGE (from -c image); the ARG's default is what a plain
    `docker build` of assets/ uses, and the two must not drift."""
    dockerfile = (REPO / "assets" / "docker" / "Dockerfile").read_text()
    assert re.findall(r"^ARG BASE_IMAGE=(\S+)$", dockerfile, re.M) == [images.DEFAULT_IMAGE]


def test_the_stacks_default_image_is_the_tables():
    from stacks.config import DEFAULT_IMAGE, ClusterConfig

    assert DEFAULT_IMAGE == images.DEFAULT_IMAGE and ClusterConfig().image == images.DEFAULT_IMAGE


def test_the_default_image_drives_every_gpu_an_instance_type_carries():
    """p3/p3dn carry V100s (compute capability 7.0, NVIDIA's CUDA GPUs table): an image whose release notes
    drop Volta (25.08 and later, per the issue) may not become the default while the types are accepted."""
    row = images.default()
    for name, kind in INSTANCE_TYPES.items():
        capability = images.GPU_COMPUTE_CAPABILITY[kind.gpu]
        assert row.supports(capability), f"{row.tag} does not drive {name}'s {kind.gpu} ({capability})"
    assert not images.Image(**{**row.__dict__, "min_compute_capability": 7.5}).supports(7.0)


def test_the_default_image_needs_no_pip_constraints_the_dockerfile_ignores():
    """NGC 25.03 and later pin every preinstalled package in /etc/pip/constraint.txt (NVIDIA's PyTorch
    release notes); the Dockerfile's `pip install` does not honour one, so the default may not have one."""
    dockerfile = (REPO / "assets" / "docker" / "Dockerfile").read_text()
    assert images.default().pip_constraints is False or "constraint.txt" in dockerfile


def _pins(path) -> dict[str, str]:
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==([^\s;\\]+)", path.read_text(), re.M))


def test_the_second_environment_pins_the_images_torch_and_numpy():
    """requirements-image.txt and its lock carry the default row's torch (the PyPI release of its API)
    and numpy; scripts/test_image_torch.sh builds the row's Python."""
    row = images.default()
    for name in ("requirements-image.txt", "requirements-image.lock"):
        pins = _pins(REPO / name)
        assert (pins["torch"], pins["numpy"]) == (row.torch_pypi, row.numpy), name
    script = (REPO / "scripts" / "test_image_torch.sh").read_text()
    assert "images.default()" in script and "requirements-image.lock" in script


TRAINER_MODULES = {"train", "torch", "test_training"}  # the training package, torch, the trainer test helper
# Test modules that import a trainer module without running the trainer's code on torch.
NOT_THE_TRAINERS = {
    "test_autostop": "the watchdog; uses prepare.py's busy marker only",
    "test_image": "reads the Dockerfile and the launch scripts",
    "test_launch": "builds mpirun lines; parses trainer flags only",
    "test_verify": "the short run's flags, parsed with train.config only",
    "test_restarts": "the supervisor's decisions on recorded facts",
    "test_spotwatch": "the watcher; its one trainer run is the STOP path test_training's [spot-notice] case covers",
    "test_lifecycle": "the laptop parses trainer flags with train.config only; the supervisor runs a stand-in",
    "test_imagenet_s3": "prepare.py's S3 fetch into a folder (boto3 and the moto server); no torch",
    # Run the trainer, but what they add under 2.6 is covered by listed modules, and the phase's time
    # is the suite's: the same 2-rank trainer (test_training) and image pipeline (test_imagepipe).
    "test_real_text": "real-text learning runs (~90 s): the trainer's 2-rank runs are test_training's",
    "test_fashion": "real-image learning runs (~40 s): the worker pipeline is test_imagepipe's",
}


def _imports(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_every_deselection_from_the_images_torch_names_a_test_of_a_listed_module_and_why():
    listed, deselected = trainer_tests()
    for node, why in deselected.items():
        path, _, name = node.partition("::")
        assert path in listed and why, f"{node}: a listed module's test, with why (# ...)"
        assert re.search(rf"^def {re.escape(name)}\(", (REPO / path).read_text(), re.M), f"{node}: no such test"


def test_make_tests_first_phase_leaves_out_exactly_what_the_images_torch_runs():
    """--except-image-torch: each trainer test runs once in make test (on the image's torch); the ones
    the image's phase deselects, and every other module's, stay in the first phase."""
    import conftest

    listed, not_on_image = trainer_tests()
    module, kept_node = next((n.split("::")[0], n) for n in not_on_image)
    names = [f"{module}::test_runs_there", kept_node, "tests/test_config.py::test_x", f"{sorted(listed)[0]}::test_y"]
    item = type("Item", (), {"get_closest_marker": lambda self, name: None})
    items = [type("Item", (item,), {"nodeid": name})() for name in names]
    deselected = []
    hook = type("Hook", (), {"pytest_deselected": lambda self, items: deselected.extend(items)})()
    config = type("Config", (), {"hook": hook, "getoption": lambda self, name: name == "except_image_torch"})()
    conftest.pytest_collection_modifyitems(config, items)
    assert [i.nodeid for i in items] == [kept_node, "tests/test_config.py::test_x"]
    assert sorted(i.nodeid for i in deselected) == sorted([names[0], names[3]])


def test_every_test_module_that_runs_the_trainer_runs_on_the_images_torch_too():
    listed, _ = trainer_tests()
    assert all((REPO / path).is_file() for path in listed), listed
    for path in sorted((REPO / "tests").glob("test_*.py")):
        text = path.read_text()
        if path.stem in NOT_THE_TRAINERS or re.search(r"^pytestmark = \[[^\]]*mark\.cluster", text, re.M):
            continue  # the emulated cluster runs the checkout's torch; it has its own phase
        if _imports(path) & TRAINER_MODULES:
            assert f"tests/{path.name}" in listed, f"{path.name} runs the trainer: list it in tests/trainer_tests.txt"


@pytest.mark.parametrize(
    "node, line",
    [
        (
            {"torch": "2.6.0a0+df5bbc09d1.nv24.12", "cuda": "12.6", "nccl": "2.23.4"},
            "versions as 24.12-py3 ships: torch 2.6.0a0+df5bbc09d1, CUDA 12.6.3, NCCL 2.23.4",
        ),
        (
            {"torch": "2.6.0a0+df5bbc09d1", "cuda": "12.6", "nccl": "2.21.5"},
            "versions differ from 24.12-py3's: NCCL 2.21.5 (image ships 2.23.4)",
        ),
        (
            {"torch": "2.13.0+cpu", "cuda": None, "nccl": None},
            "versions differ from 24.12-py3's: torch 2.13.0+cpu (image ships 2.6.0a0+df5bbc09d1), "
            "CUDA none (image ships 12.6.3)",
        ),
    ],
    ids=["as-shipped", "nccl-differs", "cpu-node"],
)
def test_a_nodes_versions_are_compared_with_its_images_row_in_one_line(node, line):
    assert images.compare(images.DEFAULT_IMAGE, node) == line


def test_an_image_without_a_row_says_so_instead_of_comparing():
    assert images.compare("nvcr.io/nvidia/pytorch:25.08-py3", {"torch": "2.8.0"}) == (
        "image nvcr.io/nvidia/pytorch:25.08-py3: no row in stacks/images.py, versions not compared"
    )


def test_fab_check_prints_how_the_nodes_versions_differ_from_their_images_row(capsys):
    """`fab check`'s output (the real printer): after the nodes-agree line, one line against the table's
    row for the cluster's image, naming what differs and on which nodes."""
    from clusterops.nodes import health
    from fabfile.cluster import _print_check

    gpu = [{"name": "Tesla T4", "driver": "570.133.20", "ecc_uncorrected": 0}]
    facts = {
        "node0": {"gpus": gpu, "torch": "2.6.0a0+df5bbc09d1.nv24.12", "cuda": "12.6", "nccl": "2.23.4"},
        "node1": {"gpus": gpu, "torch": "2.6.0a0+df5bbc09d1.nv24.12", "cuda": "12.6", "nccl": "2.21.5"},
    }
    verdicts = [health.NodeHealth(name) for name in facts]
    _print_check(verdicts, {"node0": "eth0", "node1": "eth0"}, facts, None, None, [], images.DEFAULT_IMAGE)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == (
        f"{images.DEFAULT_IMAGE}: node0: versions as 24.12-py3 ships: torch 2.6.0a0+df5bbc09d1, CUDA 12.6.3, "
        "NCCL 2.23.4; node1: versions differ from 24.12-py3's: NCCL 2.21.5 (image ships 2.23.4)"
    )
