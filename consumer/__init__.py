"""rlstream consumer: Megatron-core MoE trainer with MiniRL and Routing Replay."""
