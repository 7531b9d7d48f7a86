"""rlstream producer: long-running vLLM rollout service (see producer/service.py)."""
