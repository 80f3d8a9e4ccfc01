"""ImageNet onto /data from S3 (prepare.py imagenet --from s3://BUCKET/PREFIX, imagenet.fetch_s3) against the moto
server, and the node role's read of the bucket named at deploy (-c data_bucket) and no other, in the template."""

from __future__ import annotations

import uuid

import boto3
import pytest
from conftest import REPO
from iampolicy import Request, evaluate
from stack_templates import cluster_template

from train import imagenet, prepare

IMAGES = {f"{split}/n0{c}/img{i}.JPEG": bytes(100 + i) for split in ("train", "val") for c in (1, 2) for i in range(3)}


@pytest.fixture
def bucket(aws_env):
    name = f"imagenet-{uuid.uuid4().hex[:8]}"
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=name)
    for key, body in IMAGES.items():
        s3.put_object(Bucket=name, Key=f"datasets/imagenet/{key}", Body=body)
    s3.put_object(Bucket=name, Key="datasets/imagenet-old/train/n01/stale.JPEG", Body=b"x")  # a sibling prefix
    return name


def test_imagenet_is_fetched_from_its_prefix_resumably_then_checked(bucket, tmp_path, capsys):
    target = tmp_path / "imagenet"
    prepare.main(["imagenet", "--source", str(target), "--from", f"s3://{bucket}/datasets/imagenet"])
    out = capsys.readouterr().out
    assert f"fetched into {target}: 12 downloaded, 0 already there" in out
    assert "2 classes, 6 train and 6 val images" in out
    assert {str(p.relative_to(target)) for p in target.rglob("*") if p.is_file()} == set(IMAGES)
    (target / "train" / "n01" / "img0.JPEG").write_bytes(b"half")  # an interrupted download
    assert imagenet.fetch_s3(f"s3://{bucket}/datasets/imagenet/", target, log=lambda _: None) == (1, 11)
    assert (target / "train" / "n01" / "img0.JPEG").read_bytes() == IMAGES["train/n01/img0.JPEG"]


@pytest.mark.parametrize(
    "url, words",
    [
        ("s3://{bucket}/nothing-here", "holds no objects (expected nothing-here/train/CLASS/IMAGE.JPEG"),
        ("s3://no-such-bucket-{bucket}/imagenet", "NoSuchBucket"),
        ("https://{bucket}/imagenet", "expected s3://BUCKET/PREFIX"),
    ],
)
def test_a_bad_source_is_one_line_and_fetches_nothing(bucket, tmp_path, url, words):
    with pytest.raises(SystemExit) as refused:
        prepare.main(["imagenet", "--source", str(tmp_path / "in"), "--from", url.format(bucket=bucket)])
    assert str(refused.value).startswith("error: ") and words in str(refused.value)
    assert "\n" not in str(refused.value) and not (tmp_path / "in").exists()


def test_a_missing_folder_names_the_way_to_fetch_it(tmp_path):
    with pytest.raises(SystemExit) as refused:
        prepare.main(["imagenet", "--source", str(tmp_path / "imagenet")])
    assert 'is not a directory: copy ImageNet there first (fab data --dataset imagenet --extra "--from' in str(
        refused.value
    )


def _resolved(value):
    """A policy value with the template's partition written out (the evaluator reads plain ARNs)."""
    if isinstance(value, dict) and "Fn::Join" in value:
        separator, parts = value["Fn::Join"]
        return separator.join("aws" if part == {"Ref": "AWS::Partition"} else str(part) for part in parts)
    if isinstance(value, list):
        return [_resolved(v) for v in value]
    return value


def _node_role_statements(template) -> list[dict]:
    policies = template.find_resources("AWS::IAM::Policy")
    mine = [p for p in policies.values() if any("NodeRole" in r["Ref"] for r in p["Properties"]["Roles"])]
    return [
        {**s, "Resource": _resolved(s.get("Resource", "*"))}
        for p in mine
        for s in p["Properties"]["PolicyDocument"]["Statement"]
    ]


def test_the_nodes_may_read_the_data_bucket_and_no_other():
    """S3 authorizes ListObjectsV2 as s3:ListBucket on the bucket, GetObject on the object's ARN."""
    reads = [
        Request("s3:ListBucket", "arn:aws:s3:::my-imagenet"),
        Request("s3:GetObject", "arn:aws:s3:::my-imagenet/datasets/imagenet/train/n01/img0.JPEG"),
    ]
    others = [
        Request("s3:GetObject", "arn:aws:s3:::someone-elses/secret"),
        Request("s3:ListBucket", "arn:aws:s3:::my-imagenet-2"),
        Request("s3:PutObject", "arn:aws:s3:::my-imagenet/x"),
        Request("s3:DeleteObject", "arn:aws:s3:::my-imagenet/x"),
    ]
    granted = [{"Statement": _node_role_statements(cluster_template(data_bucket="my-imagenet"))}]
    assert all(evaluate(granted, request).allowed for request in reads)
    assert not any(evaluate(granted, request).allowed for request in others)
    default = [{"Statement": _node_role_statements(cluster_template())}]
    assert not any(evaluate(default, request).allowed for request in reads)


def test_the_root_volumes_files_the_refusal_compares_are_bound_from_the_hosts_etc():
    """Inside the container `/` is an overlay: --stage-to's refusal also compares a file the bootstrap binds in
    from the host's /etc (its root volume), so a plain host directory at /opt/dlami/nvme is refused there too."""
    script = (REPO / "assets" / "bootstrap" / "node-bootstrap.sh").read_text()
    for path in imagenet.ROOT_PATHS[1:]:
        assert path.startswith("/etc/") and f"-v {path}:{path}" in script, path
