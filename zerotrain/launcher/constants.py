"""``deepspeed.launcher.constants``: the names of the multi-node launchers DeepSpeed's
``--launcher`` chooses between. zerotrain starts no node over ssh, pdsh, MPI or SLURM: its
launcher refuses a multi-node fan-out naming the flag and ``zerotrain run`` on each node
(docs/launching.md); the names are here for code that compares against them."""

PDSH_LAUNCHER = "pdsh"
OPENMPI_LAUNCHER = "openmpi"
MPICH_LAUNCHER = "mpich"
IMPI_LAUNCHER = "impi"
SLURM_LAUNCHER = "slurm"
MVAPICH_LAUNCHER = "mvapich"
JSRUN_LAUNCHER = "jsrun"

__all__ = [
    "IMPI_LAUNCHER",
    "JSRUN_LAUNCHER",
    "MPICH_LAUNCHER",
    "MVAPICH_LAUNCHER",
    "OPENMPI_LAUNCHER",
    "PDSH_LAUNCHER",
    "SLURM_LAUNCHER",
]
