"""moe_comm: expert-parallel (MoE) dispatch and combine for PyTorch training.

`import moe_comm` needs neither a GPU nor a compiler; kernels (CUDA backend) compile at first use.
"""

from . import env, quant, sizing
from .buffer import Buffer
from .event import EventOverlap, RecvHook
from .handle import EPHandle

__version__ = "0.1.0"

__all__ = ["Buffer", "EPHandle", "EventOverlap", "RecvHook", "env", "quant", "sizing", "__version__"]
