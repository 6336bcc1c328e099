"""The losses of ``ppo_fast.torch`` on a CUDA device, against verl 0.9.1's own functions there.

    python bench/cuda_losses.py                      1024 x 4096 float32, 20 repeats
    python bench/cuda_losses.py --shape 4096x8192 --json out.json

Needs a CUDA device (it exits with a message where torch sees none). Every row is forward and
backward of one loss on the batch of ``ppo-fast bench`` (``ppo_fast.bench.batch.Batch``: rows of
T/2 .. T tokens, right-padded) moved to the device, timed with CUDA events (median of
``--repeats`` after 3 warm-ups, each call on a fresh leaf):

- ``ppo_fast.torch``: the loss's device path (torch formulas on the device, the closed-form
  gradient; a bool mask, so nothing is read back to the host);
- ``verl``: verl's function (the verbatim copy in ``ppo_fast._peers``) and autograd, eager,
  with an int64 ``response_mask`` as verl passes it;
- ``torch.compile``: ``torch.compile`` of verl's function, forward and backward;
- ``floor``: the compulsory bytes (each input read once, a bool mask at one byte, the gradient
  written once) at the device's copy bandwidth, measured in the same run as 2 x bytes / time of
  ``Tensor.copy_`` over 1 GiB (best of 10).

KL-Cov's rows include its token selection, as verl's function does (``ppo_fast.torch``'s runs on
the device: torch's top-k, one synchronisation for the count of valid tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--shape", default="1024x4096", help="B x T (default 1024x4096)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="write the rows here as JSON")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile's rows")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench/cuda_losses.py needs a CUDA device; torch sees none here", file=sys.stderr)
        return 2
    import ppo_fast.torch as pt
    from ppo_fast import _peers
    from ppo_fast.bench import adapters
    from ppo_fast.bench.batch import Batch, parse_shape

    device = torch.device("cuda")
    verl = _peers.copy("verl_0_9_1")
    batch = Batch(parse_shape(args.shape), np.float32)

    def on_device(array):
        return torch.from_numpy(np.ascontiguousarray(array)).to(device)

    logp, old, adv = (on_device(a) for a in (batch.logprobs, batch.old_logprobs, batch.advantages))
    values, old_values, returns = (
        on_device(a) for a in (batch.values, batch.old_values, batch.returns)
    )
    mask = on_device(batch.mask)
    response_mask = mask.long()
    tokens = batch.tokens

    def time_ms(call) -> float:
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def copy_bandwidth() -> float:
        n = 1 << 30
        source = torch.ones(n, dtype=torch.uint8, device=device)
        target = torch.empty_like(source)
        best = min(time_ms(lambda: target.copy_(source)) for _ in range(10))
        return 2 * n / (best / 1e3)

    def backward(leaf, loss_of):
        def run():
            x = leaf.detach().requires_grad_(True)
            loss = loss_of(x)
            loss.backward()
            return x.grad

        return run

    clip, dual, clamp = adapters.CLIP, adapters.DUAL_CLIP, adapters.LOG_RATIO_CLAMP
    config = verl.ActorConfig(
        clip_ratio=clip,
        clip_ratio_low=clip,
        clip_ratio_high=clip,
        clip_ratio_c=dual,
        tau_pos=adapters.SAPO_TAU_POS,
        tau_neg=adapters.SAPO_TAU_NEG,
    )
    family = {
        "reinforce": lambda x: pt.reinforce_loss(x, old, adv, mask=mask),
        "cispo": lambda x: pt.cispo_loss(
            x, old, adv, clip_low=clip, log_ratio_clamp=clamp, mask=mask
        ),
        "sapo": lambda x: pt.sapo_loss(
            x,
            old,
            adv,
            tau_pos=adapters.SAPO_TAU_POS,
            tau_neg=adapters.SAPO_TAU_NEG,
            log_ratio_clamp=20.0,
            mask=mask,
            agg="seq-mean-token-mean",
        ),
        "gspo": lambda x: pt.gspo_loss(
            x,
            old,
            adv,
            form="detached",
            clip_low=clip,
            log_ratio_max=10.0,
            mask=mask,
            agg="seq-mean-token-mean",
        ),
        "geo_mean": lambda x: pt.geo_mean_loss(
            x, old, adv, clip_low=clip, mask=mask, num_seqs=float(batch.shape[0])
        ),
        "dppo": lambda x: pt.dppo_loss(
            x,
            old,
            adv,
            divergence="kl",
            divergence_low=clip,
            ratio_cap=adapters.DPPO_CAP,
            log_ratio_clamp=20.0,
            mask=mask,
        ),
        "kl_cov": lambda x: pt.kl_cov_loss(
            x,
            old,
            adv,
            pt.kl_cov_selection(x.detach(), adv, ratio=adapters.KL_COV_RATIO, mask=mask),
            coef=adapters.KL_COV_COEF,
            mask=mask,
        ),
    }
    rows = []  # (loss, who, ms)
    bandwidth = copy_bandwidth()

    def add(loss, who, call):
        ms = time_ms(call)
        rows.append({"loss": loss, "who": who, "ms": ms})
        print(f"{loss:18} {who:16} {ms:9.3f} ms", flush=True)

    def verl_call(function, agg):
        return lambda x: function(old, x, adv, response_mask, agg, config)[0]

    peers = {
        "clipped_surrogate": (
            lambda x: (
                pt.clipped_surrogate(x, old, adv, clip_low=clip, dual_clip=dual, mask=mask).loss
            ),
            verl_call(verl.compute_policy_loss_vanilla, "token-mean"),
        ),
        **{
            name: (
                lambda x, f=f: f(x).loss,
                verl_call(getattr(verl, adapters.FAMILY_VERL[name]), adapters.FAMILY_AGG[name]),
            )
            for name, f in family.items()
        },
    }
    for name, (ours, theirs) in peers.items():
        floor_ms = (3 * 4 + 1 + 4) * tokens / bandwidth * 1e3  # logp, old, adv, mask; grad
        rows.append({"loss": name, "who": "floor", "ms": floor_ms})
        add(name, "ppo_fast.torch", backward(logp, ours))
        add(name, "verl", backward(logp, theirs))
        if not args.no_compile:
            compiled = torch.compile(theirs)
            add(name, "torch.compile", backward(logp, compiled))
    value_ours = backward(
        values,
        lambda v: pt.value_loss(v, old_values, returns, clip=adapters.VALUE_CLIP, mask=mask).loss,
    )
    value_verl = backward(
        values,
        lambda v: verl.compute_value_loss(
            v, returns, old_values, response_mask, adapters.VALUE_CLIP
        )[0],
    )
    rows.append({"loss": "value_loss", "who": "floor", "ms": 17 * tokens / bandwidth * 1e3})
    add("value_loss", "ppo_fast.torch", value_ours)
    add("value_loss", "verl", value_verl)
    if not args.no_compile:
        compiled_value = torch.compile(verl.compute_value_loss)
        add("value_loss", "torch.compile", backward(values, lambda v: compiled_value(
            v, returns, old_values, response_mask, adapters.VALUE_CLIP)[0]
        ))  # fmt: skip

    name = torch.cuda.get_device_name(device)
    print(f"\n{name}, {args.shape} float32, copy bandwidth {bandwidth / 1e9:.0f} GB/s, "
          f"torch {torch.__version__}; median of {args.repeats}\n")  # fmt: skip
    by_loss: dict[str, dict[str, float]] = {}
    for row in rows:
        by_loss.setdefault(row["loss"], {})[row["who"]] = row["ms"]
    print(
        "| loss | ppo_fast.torch | verl | torch.compile | floor | ppo_fast x floor "
        "| verl / ppo_fast | compile / ppo_fast |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for loss, times in by_loss.items():
        ours = times["ppo_fast.torch"]
        compiled_ms = times.get("torch.compile", float("nan"))
        print(
            f"| {loss} | {ours:.3f} ms | {times['verl']:.3f} ms | {compiled_ms:.3f} ms | "
            f"{times['floor']:.3f} ms | {ours / times['floor']:.2f}x | "
            f"{times['verl'] / ours:.2f}x | {compiled_ms / ours:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "shape": args.shape, "bandwidth": bandwidth,
                       "torch": torch.__version__, "rows": rows}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
