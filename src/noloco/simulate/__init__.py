"""``noloco simulate``: many replicas of a training run in one process.

A simulated run is the distributed run of the same config (same seeds, same data shards,
same partners, same codecs) with its replicas as a batch dimension instead of processes:
:class:`~noloco.simulate.replicas.StackedReplicas` holds the weights and the inner optimizer's
state of all N replicas stacked and takes their inner steps as one batched computation; every
replica keeps its own method object (:mod:`noloco.methods`, unchanged), whose communicator is
an in-process :class:`~noloco.simulate.fabric.Fabric`. docs/simulate.md has what it serves,
what it refuses, and how it is proven equal to the distributed runs.

Floor 3 of docs/architecture.md: one worker's training, and the models of runs.
"""

from noloco.simulate.fabric import Fabric, SimulatedCommunicator
from noloco.simulate.replicas import StackedReplicas
from noloco.simulate.run import Simulation, check_simulable

__all__ = ["Fabric", "SimulatedCommunicator", "Simulation", "StackedReplicas",
           "check_simulable"]
