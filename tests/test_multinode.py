"""Two nodes on one machine, for real: two network namespaces joined by a rate-limited veth
pair (tests/netns.py), one `zerotrain run` (torchrun's agent) in each, rendezvous and
collectives over the veth link. The namespaces exist only while a test runs. Needs root and
iproute2; skipped otherwise.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launched import output_or_kill
from netns import ROOT, available, two_namespaces

pytestmark = pytest.mark.skipif(
    not available(), reason="needs root and iproute2 (ip, tc) to make network namespaces"
)


@pytest.fixture
def two_nodes():
    with two_namespaces("200mbit") as nodes:  # a slow link: 200 Mbit/s each way
        yield nodes


def _finish(process: subprocess.Popen, timeout: float = 240) -> str:
    output = output_or_kill(process, timeout, "zerotrain run")
    assert process.returncode == 0, output
    return output


def _summary(output: str) -> dict[str, str]:
    return dict(
        re.findall(r"^  (first loss|final loss|validation loss|world size)\s+(.+)$", output, re.M)
    )


TRAIN = ["examples/train_gpt.py", "--model", "tiny", "--steps", "12", "--print-every", "4"]


@pytest.mark.slow  # 49 s: the demo on 2 emulated nodes (docs/launching.md says so)
def test_two_nodes_train_as_one_node_with_the_same_ranks(two_nodes):
    """2 nodes x 2 ranks over the rate-limited veth train exactly as 1 node x 4 ranks: the same
    losses, bit for bit, on the node-local ranks of both nodes."""
    first = two_nodes[0]
    rendezvous = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", first.address]
    rendezvous += ["--master-port", "29611"]
    nodes = [
        node.run(*rendezvous, "--node-rank", str(i), *TRAIN) for i, node in enumerate(two_nodes)
    ]
    outputs = [_finish(p) for p in nodes]
    one_node = subprocess.run(
        [sys.executable, "-m", "zerotrain.cli", "run", "--nproc-per-node", "4", *TRAIN],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert one_node.returncode == 0, one_node.stderr[-3000:]
    assert "initialized gloo with 4 ranks" in outputs[0], outputs[0]
    got, want = _summary(outputs[0]), _summary(one_node.stdout)
    assert got["world size"] == "4" and set(got) == set(want), outputs[0]
    assert got == want, (got, want)
    progress = re.findall(r"^\[zerotrain\] step \d+ \| loss [\d.]+", outputs[0], re.M)
    assert progress == re.findall(r"^\[zerotrain\] step \d+ \| loss [\d.]+", one_node.stdout, re.M)
    assert "summary" not in outputs[1]  # rank 0 (node 0) prints; node 1's ranks are 2 and 3


@pytest.mark.slow
def test_losing_a_node_restarts_the_survivor_from_the_newest_checkpoint(two_nodes, tmp_path):
    """Elastic: `--nnodes 1:2 --max-restarts 2` on both nodes; node 1 is killed mid-training.
    torchrun restarts node 0's rank at world size 1, and the demo resumes from its newest
    complete checkpoint (saved at world size 2) with no manual step."""
    first = two_nodes[0]
    elastic = ["--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "2"]
    elastic += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{first.address}:29612"]
    elastic += ["--rdzv-id", "zt-elastic"]
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "10"]
    train = ["examples/train_gpt.py", "--model", "tiny", "--steps", "400", "--print-every", "10"]
    # which agent hosts the rendezvous store, and the address each advertises: torchrun would
    # take them from the machine's hostname, which the namespaces share
    survivor = first.run(*elastic, *first.advertised(host=True), *train, *ckpt)
    victim = two_nodes[1].run(*elastic, *two_nodes[1].advertised(host=False), *train, *ckpt)
    deadline = time.monotonic() + 180
    while _latest_step(tmp_path / "ckpt") < 20:  # two checkpoints at world size 2
        assert time.monotonic() < deadline, "no checkpoint at step 20"
        assert survivor.poll() is None and victim.poll() is None, _output(victim)
        time.sleep(0.2)
    two_nodes[1].kill_everything()  # the node is lost: its agent and its rank
    victim.communicate()
    output = _finish(survivor, timeout=240)
    # the same rank, started again by its agent at the new world size
    started = [int(n) for n in re.findall(r"initialized gloo with (\d+) ranks", output)]
    assert started == [2, 1], output
    resumed = re.search(r"resumed from \S+ at step (\d+)", output)
    assert resumed and int(resumed.group(1)) >= 20, output
    assert _summary(output)["world size"] == "1", output


def _latest_step(save_dir: Path) -> int:
    latest = save_dir / "latest"
    return int(latest.read_text().removeprefix("global_step")) if latest.exists() else -1


def _output(process: subprocess.Popen) -> str:
    return process.stdout.read() if process.poll() is not None and process.stdout else ""
