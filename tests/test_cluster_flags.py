"""The multi-process flags as one `Cluster`: given by hand, or read from the launcher's
environment with `--coordinator auto` (JAX's own cluster detection; here a Slurm step's
variables, as `srun` sets them)."""

from __future__ import annotations

import argparse
import os

import pytest

from scaletui.serve.multihost.cluster import Cluster
from scaletui.shape import ConfigError

LAUNCHERS = ("SLURM_", "OMPI_", "KUBERNETES_SERVICE_HOST", "JAX_COORDINATOR_PORT")
# what srun sets for task 1 of a 2-node step (one task a node)
SLURM_TASK_1 = {
    "SLURM_JOB_ID": "1234",
    "SLURM_STEP_NODELIST": "gpu[007-008]",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
}


def flags(coordinator=None, num_processes=None, process_id=None) -> argparse.Namespace:
    return argparse.Namespace(
        coordinator=coordinator, num_processes=num_processes, process_id=process_id,
        step_timeout=20.0, tp_over_hosts=False,
    )  # fmt: skip


@pytest.fixture
def no_launcher(monkeypatch):
    for name in list(os.environ):
        if name.startswith(LAUNCHERS):
            monkeypatch.delenv(name)
    return monkeypatch


def test_flags_by_hand_and_one_missing() -> None:
    assert Cluster.from_args(flags()) is None
    assert Cluster.from_args(flags("h:1", 1, 0)) is None  # one process: the ordinary server
    assert Cluster.from_args(flags("h:1234", 2, 1)) == Cluster("h:1234", 2, 1)
    with pytest.raises(ConfigError, match="needs --coordinator, --num-processes and --process"):
        Cluster.from_args(flags("h:1234", 2))


def test_auto_reads_a_slurm_step(no_launcher) -> None:
    for name, value in SLURM_TASK_1.items():
        no_launcher.setenv(name, value)
    # JAX's rule: the step's first node, a port from the job id (1234 % 4096 + 61440)
    assert Cluster.from_args(flags("auto")) == Cluster("gpu007:62674", 2, 1)
    no_launcher.setenv("JAX_COORDINATOR_PORT", "8476")  # the launcher's port, where it sets one
    assert Cluster.from_args(flags("auto")).coordinator == "gpu007:8476"
    assert Cluster.from_args(flags("auto", process_id=0)).leader  # a flag beside it wins
    no_launcher.setenv("SLURM_NTASKS", "1")
    assert Cluster.from_args(flags("auto")) is None  # one task: the ordinary server


def test_auto_without_a_launcher_says_what_to_give(no_launcher) -> None:
    with pytest.raises(ConfigError, match="no launcher found .*SlurmCluster") as err:
        Cluster.from_args(flags("auto"))
    assert "--coordinator HOST:PORT --num-processes N --process-id I" in str(err.value)
