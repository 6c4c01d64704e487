"""The shipped proxy configurations parse: HAProxy's and nginx's by their own binaries (where
installed), Envoy's as YAML carrying the session-key hash."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
HEADER = "specdec-session-key"


def test_envoy_hashes_on_the_session_key() -> None:
    config = yaml.safe_load((DEPLOY / "envoy.yaml").read_text())
    route = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hashing = route["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["hash_policy"]
    assert hashing == [{"header": {"header_name": HEADER}}]
    assert config["static_resources"]["clusters"][0]["lb_policy"] == "RING_HASH"


@pytest.mark.parametrize(("binary", "args", "name"), [("haproxy", ["-c", "-f"], "haproxy.cfg"),
                                                        ("nginx", ["-t", "-c"], "nginx.conf")])
def test_proxy_config_is_valid(binary: str, args: list[str], name: str) -> None:
    found = shutil.which(binary) or shutil.which(binary, path="/usr/sbin")
    if found is None:
        pytest.skip(f"no {binary} here (.ci/run installs haproxy)")
    text = (DEPLOY / name).read_text()
    assert HEADER in text or HEADER.replace("-", "_") in text
    checked = subprocess.run([found, *args, str(DEPLOY / name)], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr
