"""A synchronous weight update (vLLM's `nccl` engine) that folds what it receives.

vLLM's NCCL engine receives each tensor into device memory and hands it to the
model's `load_weights`; nothing checks the bytes. Here
the worker runs the same update (start, update, finish: vLLM's own calls) with
`load_weights` wrapped so every (name, tensor) is folded into a device digest
(common/weights/digest.py) just before the model loads it. The producer's
reloader compares that digest with the one the trainer folded while sending,
and serves the version only when they are equal (producer/weights/reload.py).

Runs inside vLLM's worker (the worker extension's `rlstream_update_weights_folded`),
where `worker.weight_transfer_engine.model` is the model being loaded.
"""
from __future__ import annotations

from typing import Any

from rlstream.common.weights.digest import Fold
from rlstream.common.weights.watchdog import Watchdog, abort_nccl, nccl_async_error


def update_weights_folded(worker, update_info: dict[str, Any], timeout_s: float) -> str:
    """vLLM's start/update/finish on `worker`, folding every received tensor; the digest.
    A transfer without a tensor for `timeout_s` (a dead trainer) is aborted: the
    communicator is destroyed (ncclCommAbort), the blocked receive fails, this raises."""
    engine = worker.weight_transfer_engine
    model = engine.model
    fold = Fold()
    load = model.load_weights

    def abort():  # the link is dead now: the producer registers a new one (trainer_link.py)
        abort_nccl(getattr(engine, "model_update_group", None))

    def errored() -> int:  # the trainer's connection lost (it aborted, or died): no need to wait for the bound
        return nccl_async_error(getattr(engine, "model_update_group", None))

    with Watchdog(timeout_s, abort, what="nccl weight update", errored=errored) as dog:
        def folding_load(weights):
            def folded():
                for name, tensor in weights:
                    dog.beat()
                    fold.add(name, tensor)  # enqueued on the stream the load copies on: no extra sync
                    yield name, tensor
            return load(folded())

        model.load_weights = folding_load  # an instance attribute: removed below, the class's comes back
        try:
            worker.start_weight_update()
            worker.update_weights(update_info)  # vLLM clears its session flag if this raises
            worker.finish_weight_update()
        finally:
            del model.load_weights
    return fold.hexdigest()
