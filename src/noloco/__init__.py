"""noloco: train language models across loosely connected machines with little communication.

NoLoCo, DiLoCo, Streaming DiLoCo and synchronous data parallel over torch.distributed.
How a run flows through the code, and the floor each module stands on (its docstring's last
line): docs/architecture.md.
"""

__version__ = "0.1.0"
