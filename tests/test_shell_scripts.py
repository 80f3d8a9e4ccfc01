"""shellcheck on every shell script the project ships."""
import subprocess

from conftest import REPO


def test_shellcheck_every_script():
    scripts = subprocess.run(["git", "ls-files", "*.sh"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split()
    assert len(scripts) >= 6
    result = subprocess.run(["shellcheck", "-x", *scripts], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
