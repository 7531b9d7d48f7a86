"""What runs inside vLLM's workers (imported there by name: the `vllm.general_plugins` entry
point and `worker_extension_cls`, producer/weights/port.py): the `rlstream_gloo` engine and
the worker extension, the experts' staging, the CPU MoE repack and nccl's folded update."""
