"""noloco: train language models across loosely connected machines with little communication.

NoLoCo, DiLoCo, Streaming DiLoCo and synchronous data parallel over torch.distributed.
"""

__version__ = "0.1.0"
