"""DeepSpeed's process group for ZeRO training, without the op that training never calls.

On CPU, `deepspeed.init_distributed` first JIT-builds DeepSpeed's shared-memory all-reduce (a C++ extension: about
a minute of compiling on 2 cores, on every fresh machine) and opens shared-memory segments for it, although only
DeepSpeed's inference tensor parallelism (`inference_all_reduce`) calls it: ZeRO's collectives go through
torch.distributed. The op is marked unavailable first, so it is neither built nor loaded.
"""

from __future__ import annotations


def init_distributed(use_gpu: bool) -> None:
    """nccl on GPUs, gloo on CPU (DS_ACCELERATOR is set before deepspeed is first imported)."""
    import deepspeed

    if not use_gpu:
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # DeepSpeed's probe result, edited
    deepspeed.init_distributed(dist_backend="nccl" if use_gpu else "gloo")
