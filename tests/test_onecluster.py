"""The benchmarks' one-cluster lock: a second holder is refused in one line, not queued."""

import pytest

from clusterops.local import lock as onecluster


def test_a_second_run_is_refused_while_the_first_holds_the_lock(tmp_path):
    lock = tmp_path / "cluster.lock"
    with onecluster.held(lock):
        with pytest.raises(onecluster.ClusterBusy, match="another emulated cluster run holds"):
            with onecluster.held(lock):
                pass
    with onecluster.held(lock):  # released on leaving the block
        pass
