"""bf16 weight updates against an fp32 reference, the optimizer isolated
(tests/integration/test_trainer_precision.py and tests/bench/trainer_scale.py).

One gradient sequence (the fp32 model's gradients at its starting weights, one
random batch per step) is fed to three optimizers that all start from the
checkpoint rounded to bf16, so every difference is the optimizer's precision:

    reference   torch AdamW on fp32 copies of the weights
    trainer     the trainer's own optimizer (consumer/train/optimizer.py) on the bf16 model:
                the update read from its fp32 master weights
    plain_bf16  torch AdamW on the bf16 parameters (the trainer before issue #14)

    rel_error = ||delta - delta_ref||_F / ||delta_ref||_F,  delta = weights after - before

Gradient clipping is off (grad_clip 0) so that clipping's own rounding is not
part of the figure.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch


def bf16_rounded_copy(src: Path, dst: Path) -> Path:
    """`src` (an HF directory) with every tensor rounded to bf16 and stored in fp32."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    sd = load_file(str(Path(src) / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16).float() for k, v in sd.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def reference_gradients(hf_dir: Path, steps: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """The fp32 model's gradients of -mean log p on `steps` random batches, at its start."""
    from rlstream.consumer.train.model import load_hf_checkpoint, per_token_logprobs

    model = load_hf_checkpoint(hf_dir)
    vocab = model.hf_dims.vocab_size
    gen, out = torch.Generator().manual_seed(seed), []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        tokens = torch.randint(3, vocab, (8, 24), generator=gen)
        (-per_token_logprobs(model, tokens).mean()).backward()
        out.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    return out


def rel_error(delta: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    num = sum(float((delta[k] - ref[k]).double().pow(2).sum()) for k in ref)
    den = sum(float(ref[k].double().pow(2).sum()) for k in ref)
    return (num / den) ** 0.5


def _adamw_deltas(start: dict[str, torch.Tensor], grads: list[dict], lr: float,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    params = {n: w.to(dtype).clone().requires_grad_() for n, w in start.items()}
    opt = torch.optim.AdamW(params.values(), lr=lr, eps=1e-8, weight_decay=0.0)
    for g in grads:
        for n, p in params.items():
            p.grad = g[n].to(dtype)
        opt.step()
    return {n: p.detach().float() - start[n] for n, p in params.items()}


def _trainer_deltas(hf_dir: Path, start: dict[str, torch.Tensor], grads: list[dict],
                    lr: float, distributed: bool) -> tuple[dict, bool]:
    """The trainer's optimizer on the bf16 model, fed `grads` through its fp32
    gradient buffers; (master-weight deltas, bf16 params == masters rounded)."""
    from rlstream.common.config import ConsumerSettings
    from rlstream.consumer.train.trainer import Trainer

    cfg = ConsumerSettings(dtype="bfloat16", optimizer={"lr": lr, "grad_clip": 0.0,
                                                        "distributed": distributed})
    trainer = Trainer.from_hf(hf_dir, cfg)
    named = dict(trainer.model.named_parameters())
    for g in grads:
        trainer.optimizer.zero_grad()
        for n, p in named.items():
            p.main_grad.copy_(g[n])
        trainer.optimizer.step()
    masters = trainer.optimizer.fp32_masters()
    deltas = {n: masters[p].view(p.shape).float() - start[n] for n, p in named.items()}
    rounded = all(torch.equal(p.detach(), masters[p].view(p.shape).to(p.dtype))
                  for p in named.values())
    return deltas, rounded


def update_rel_errors(hf_dir: Path, work: Path, steps: int = 10, lr: float = 1e-6,
                      distributed: bool = True) -> dict:
    """{"trainer", "plain_bf16": rel_error against the fp32 reference,
    "params_are_rounded_masters": bool, "unmoved_share_plain_bf16": share of
    weights the plain bf16 optimizer never moved where the reference did}."""
    from rlstream.consumer.train.model import load_hf_checkpoint

    rounded = bf16_rounded_copy(Path(hf_dir), Path(work) / "bf16-rounded")
    start = {n: p.detach().clone() for n, p in load_hf_checkpoint(rounded).named_parameters()}
    grads = reference_gradients(rounded, steps)
    ref = _adamw_deltas(start, grads, lr, torch.float32)
    plain = _adamw_deltas(start, grads, lr, torch.bfloat16)
    trainer, is_rounded = _trainer_deltas(rounded, start, grads, lr, distributed)
    moved = sum(int((ref[k] != 0).sum()) for k in ref)
    stuck = sum(int(((plain[k] == 0) & (ref[k] != 0)).sum()) for k in ref)
    return {"trainer": rel_error(trainer, ref), "plain_bf16": rel_error(plain, ref),
            "params_are_rounded_masters": is_rounded, "unmoved_share_plain_bf16": stuck / moved}
