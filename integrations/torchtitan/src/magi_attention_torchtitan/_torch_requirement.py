"""The torch that torchtitan 0.3.0 needs, checked before any module of this package imports torchtitan.

torchtitan 0.3.0 declares no torch requirement but imports ``torch.distributed.fsdp.DataParallelMeshDims``, new in
torch 2.12, at module level; on an older torch its ImportError names neither torch nor the version to install.
"""

import torch
import torch.distributed.fsdp

if not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"):
    raise ImportError(
        f"magi-attention-torchtitan needs torch>=2.12 (this is torch {torch.__version__}): torchtitan 0.3.0 "
        "imports torch.distributed.fsdp.DataParallelMeshDims, which torch 2.11 and older lack. Install torch "
        "2.12 or newer."
    )
