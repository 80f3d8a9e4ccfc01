"""Check an ImageNet folder (the standard train/ and val/ class-folder layout), fetch it from S3 onto /data first
if asked (a cluster deployed with -c data_bucket=BUCKET may read that bucket), and optionally stage it onto local
disk (e.g. the node's NVMe), since EFS can be too slow to feed image training. Fetching and staging are resumable:
files already there with the same size are skipped."""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

from cluster_node.protocol.clusterdir import STAGED_MARKER, STAGING_MARKER

IMAGE_SUFFIXES = {".jpeg", ".jpg", ".png"}


class LayoutError(ValueError):
    pass


# How ImageNet gets onto /data: named where it is found missing.
ROUTE = (
    'fab data --dataset imagenet --extra "--from s3://BUCKET/PREFIX" on a cluster deployed with '
    "-c data_bucket=BUCKET (docs/tasks.md, ImageNet)"
)


def scan(root: Path) -> dict:
    """Classes and image counts per split; a one-line LayoutError for the usual mistakes."""
    if not root.is_dir():
        raise LayoutError(f"{root} is not a directory: copy ImageNet there first ({ROUTE})")
    result = {}
    for split in ("train", "val"):
        directory = root / split
        if not directory.is_dir():
            raise LayoutError(f"{root} has no {split}/ directory (expected {split}/CLASS/IMAGE.JPEG)")
        loose = [p for p in directory.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES]
        if loose:
            raise LayoutError(
                f"{directory} holds {len(loose)} images directly: sort them into one "
                "folder per class (the val ground-truth script does this)"
            )
        classes = sorted(p.name for p in directory.iterdir() if p.is_dir())
        counts = {c: sum(1 for f in (directory / c).iterdir() if f.suffix.lower() in IMAGE_SUFFIXES) for c in classes}
        empty = [c for c, n in counts.items() if n == 0]
        if not classes or empty:
            raise LayoutError(f"{directory}: {len(classes)} class folders, {len(empty)} without images")
        result[split] = {"classes": len(classes), "images": sum(counts.values()), "class_names": classes}
    if result["train"]["class_names"] != result["val"]["class_names"]:
        raise LayoutError(f"{root}: train/ and val/ have different class folders")
    return result


# The root file system as seen from here: `/`, and in the container (whose `/` is an overlay with a device of its
# own) a file the bootstrap binds in from the host's /etc, always on its root volume (node-bootstrap.sh; not
# Docker's /etc/hostname: its data root may be moved to the instance store).
ROOT_PATHS = ("/", "/etc/gpu-cluster/authorized_keys")


def root_volume_error(target: Path, roots: tuple[str, ...] = ROOT_PATHS) -> Optional[str]:
    """Why staging into `target` would fill the root file system, or None. On a node, a local disk is a mount
    of its own (the DLAMI's instance store at /opt/dlami/nvme, bound into the container); on an instance type
    without one, that path is a plain directory of the host's root EBS volume (bound in, or the overlay's)."""
    existing = next(p for p in (target.absolute(), *target.absolute().parents) if p.exists())
    if existing.stat().st_dev not in {os.stat(root).st_dev for root in roots if os.path.exists(root)}:
        return None
    return (
        f"--stage-to {target} is on the root file system (no disk is mounted there: an instance type without "
        "an instance store?); staging there would fill it: leave --stage-to out (training reads /data) "
        "or give a directory on a mounted local disk"
    )


# STAGED_MARKER, written last into a staged copy, says what was copied from where; a copy cut off (a full disk, a
# lost node) has none and keeps STAGING_MARKER, written first. `fab train --data` compares the nodes' markers: every
# rank must read the same files (each its own ImageFolder).


class StageError(OSError):
    """A staging that cannot finish, in one line (a full disk)."""


def stage(source: Path, target: Path, log=print, workers: int = 16) -> tuple[int, int]:
    """Copy source to target (atomic per file), skipping files already there with the same size; then the marker
    (STAGED_MARKER: files, bytes, source). Each directory's files are copied `workers` at a time: on EFS each file's
    open and read wait on the network ("If you can parallelize your application ... you can drive higher
    throughput levels", EFS User Guide). A full disk is a StageError naming what fits, with no marker."""
    copied = skipped = size = 0
    target.mkdir(parents=True, exist_ok=True)
    (target / STAGING_MARKER).touch()  # a copy under way (or cut off) is no finished one
    (target / STAGED_MARKER).unlink(missing_ok=True)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for directory, _, files in os.walk(source):
            relative = Path(directory).relative_to(source)
            pairs = [(Path(directory) / name, target / relative / name) for name in files]
            try:
                (target / relative).mkdir(parents=True, exist_ok=True)
                for was_copied, bytes_ in pool.map(_copy_one, pairs):
                    copied, skipped, size = copied + was_copied, skipped + (not was_copied), size + bytes_
                    if was_copied and copied % 10_000 == 0:
                        log(f"  staged {copied} files")
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
                raise StageError(_full(target, copied + skipped, size)) from None
    marker = {"files": copied + skipped, "bytes": size, "source": str(source)}
    _whole(target / STAGED_MARKER, -1, lambda tmp: Path(tmp).write_text(json.dumps(marker)))
    (target / STAGING_MARKER).unlink()
    return copied, skipped


def _full(target: Path, files: int, size: int) -> str:
    free = shutil.disk_usage(target).free
    return (
        f"{target} is full after {files} files ({size / 1e9:.1f} GB; {free / 1e9:.1f} GB left): this node's disk is "
        "smaller than the data set (g4dn.xlarge's instance store is 125 GB): train from /data (no --data), or stage "
        "onto a type with a larger instance store"
    )


def staged_marker(target: Path) -> Optional[dict]:
    """The marker of a finished staging into `target`, None without one (never staged there, or cut off)."""
    try:
        return json.loads((target / STAGED_MARKER).read_text())
    except (OSError, ValueError):
        return None


def _copy_one(pair: tuple[Path, Path]) -> tuple[bool, int]:
    """Copy one file unless it is there with the same size: (copied, its size)."""
    src, dst = pair
    size = src.stat().st_size
    return _whole(dst, size, lambda tmp: shutil.copyfile(src, tmp)), size


def _whole(dst: Path, size: int, write: Callable[[str], object]) -> bool:
    """dst written by write(PATH) unless it is there with `size` bytes, into a temporary file of its own beside
    it (two writers never share one), renamed when whole; True when written."""
    if dst.exists() and dst.stat().st_size == size:
        return False
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 is for the temporary name only
        os.replace(tmp, dst)
    except BaseException:
        os.unlink(tmp)
        raise
    return True


def fetch_s3(url: str, target: Path, s3: Any = None, workers: int = 16, log=print) -> tuple[int, int]:
    """Copy every object under s3://BUCKET/PREFIX/ into target, keeping the keys' paths below the prefix
    (atomic per file, `workers` at a time); (copied, already there). A one-line LayoutError when nothing is
    there or S3 refuses (the node role may read only the bucket named at deploy: -c data_bucket)."""
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError

    if not url.startswith("s3://") or not url[5:].split("/")[0]:
        raise LayoutError(f"--from {url}: expected s3://BUCKET/PREFIX")
    bucket, _, prefix = url[5:].partition("/")
    prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
    try:
        s3 = s3 or _s3_client(workers)
        log(f"listing {url} ...")
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        objects = [(o["Key"], o["Size"]) for p in pages for o in p.get("Contents", []) if not o["Key"].endswith("/")]
        if not objects:
            raise LayoutError(f"{url} holds no objects (expected {prefix}train/CLASS/IMAGE.JPEG and val/...)")
        log(f"fetching {len(objects)} objects from {url} into {target} ...")
        copied = 0
        below = [target / key[len(prefix) :] for key, _ in objects]
        with ThreadPoolExecutor(max_workers=workers) as pool:
            fetched = pool.map(_fetch_one, [s3] * len(objects), [bucket] * len(objects), objects, below)
            for done, was_copied in enumerate(fetched, 1):
                copied += was_copied
                if done % 10_000 == 0:
                    log(f"  {done} of {len(objects)} objects ({copied} downloaded)")
    except (BotoCoreError, ClientError, Boto3Error) as error:
        raise LayoutError(f"{url}: {error} (a cluster may read only its -c data_bucket)") from None
    except OSError as error:  # the target's disk: full, read-only, not ours
        raise LayoutError(f"fetching {url} into {target}: {error}") from None
    return copied, len(objects) - copied


def _s3_client(workers: int) -> Any:
    """One client for every thread (clients are thread-safe), with a connection for each: botocore keeps 10."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", config=Config(max_pool_connections=workers))


def _fetch_one(s3: Any, bucket: str, obj: tuple[str, int], dst: Path) -> bool:
    """Download one object unless it is there with the same size; True when downloaded. GetObject alone
    (download_file asks HeadObject first: one more round trip for each of ~1.3M files)."""

    def download(tmp: str) -> None:
        with open(tmp, "wb") as out:
            shutil.copyfileobj(s3.get_object(Bucket=bucket, Key=obj[0])["Body"], out)

    return _whole(dst, obj[1], download)
