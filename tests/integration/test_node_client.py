"""A Node.js client (@grpc/grpc-js, the proto loaded at run time) drives one session through
the Decode and Verify calls: its tokens are the target's greedy continuation, as cloud_only
computes it in Python. Needs node and npm; the npm packages are installed into tests/node."""

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from edge.round.generate import cloud_only_generate
from tests.harness import gen_config, random_prompt, running_verifier

NODE_DIR = Path(__file__).resolve().parents[1] / "node"
SCRIPT = NODE_DIR / "decode_client.mjs"


@pytest.fixture(scope="module")
def node() -> str:
    """The node executable, with tests/node's packages installed (again when the lockfile is newer)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.fail("the Node.js client tests need node and npm on PATH (Node.js 20 or newer)")
    lock, installed = NODE_DIR / "package-lock.json", NODE_DIR / "node_modules" / ".package-lock.json"
    if not installed.exists() or (lock.exists() and lock.stat().st_mtime > installed.stat().st_mtime):
        command = [npm, "ci"] if lock.exists() else [npm, "install", "--no-audit", "--no-fund"]
        done = subprocess.run(command, cwd=NODE_DIR, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stderr[-2000:]}"
    return node


async def run_client(node: str, *args: str) -> tuple[int, str, str]:
    # An asyncio subprocess: the verifier it calls runs on this very event loop.
    proc = await asyncio.create_subprocess_exec(
        node, str(SCRIPT), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def test_node_client_decodes_and_verifies_one_session(target_model, node: str) -> None:
    prompt, n = random_prompt(11), 9

    async def run() -> None:
        async with running_verifier(target_model) as (client, verifier):
            reference = await cloud_only_generate(prompt, client, gen_config(max_new_tokens=n))
            address = client.replicas.addresses[0]
            rc, out, err = await run_client(node, address, json.dumps(prompt), str(n))
            assert rc == 0, err
            result = json.loads(out)
            assert result["session_opened"] is True
            assert result["tokens"] == reference.token_ids
            assert result["positions"] == list(range(len(prompt) + 1, len(prompt) + n + 1))
            assert len(verifier.sessions) == 0  # closed by the client

    asyncio.run(run())


def test_node_client_naming_a_session_and_opening_one_is_refused(target_model, node: str) -> None:
    async def run() -> None:
        async with running_verifier(target_model) as (client, _):
            rc, _, err = await run_client(node, client.replicas.addresses[0], json.dumps(random_prompt(12)), "9", "bad")
            assert rc == 1
            assert err.startswith("INVALID_ARGUMENT"), err

    asyncio.run(run())
