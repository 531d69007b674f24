"""Properties every function of rlkit.algos holds: no writes to inputs, dtypes, devices, bad arguments."""

import pytest
import torch
from algos_helpers import ragged_mask

from rlkit.algos import advantages, correction, kl, losses

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _inputs(dtype=torch.float32, device="cpu", float_mask=False):
    gen = torch.Generator().manual_seed(0)
    n, t = 6, 8
    mask = ragged_mask(n, t, gen)
    old = -torch.rand(n, t, generator=gen) * 2
    x = {
        "rewards": torch.randn(n, generator=gen),
        "token": torch.randn(n, t, generator=gen),
        "values": torch.randn(n, t, generator=gen),
        "logp": old + 0.3 * torch.randn(n, t, generator=gen),
        "old": old,
        "adv": torch.randn(n, t, generator=gen),
    }
    x = {k: v.to(device=device, dtype=dtype) for k, v in x.items()}
    x["mask"] = (mask.float() if float_mask else mask).to(device)
    return x


CALLS = {
    "grpo": lambda x: advantages.grpo(x["rewards"], 3),
    "dr_grpo": lambda x: advantages.grpo(x["rewards"], 2, norm_by_std=False),
    "rloo": lambda x: advantages.rloo(x["rewards"], 2),
    "zero_std_groups": lambda x: advantages.zero_std_groups(x["rewards"], 2),
    "reinforce_pp": lambda x: advantages.reinforce_pp(x["token"], x["mask"], gamma=0.9),
    "gae": lambda x: advantages.gae(x["token"], x["values"], x["mask"], gamma=0.9, lam=0.95),
    "kl_shaped_rewards": lambda x: advantages.kl_shaped_rewards(
        x["rewards"], x["token"], x["mask"], kl_coef=0.1
    ),
    "kl_estimate": lambda x: kl.kl_estimate(x["logp"], x["old"], "k3"),
    "ppo_clip": lambda x: losses.ppo_clip(x["logp"], x["old"], x["adv"], x["mask"], dual_clip=3.0),
    "gspo": lambda x: losses.gspo(x["logp"], x["old"], x["adv"], x["mask"], clip_low=0.2, clip_high=0.2),
    "cispo": lambda x: losses.cispo(x["logp"], x["old"], x["adv"], x["mask"], clip_low=0.2, clip_high=0.2),
    "aggregate": lambda x: losses.aggregate(x["token"], x["mask"], "seq-mean-token-mean"),
    "rollout_is": lambda x: correction.rollout_is(
        x["logp"], x["old"], x["mask"], level="geometric", mode="both"
    ),
    "mismatch_metrics": lambda x: correction.mismatch_metrics(x["logp"], x["old"], x["mask"]),
    "rollout_kl": lambda x: correction.rollout_kl(x["logp"], x["old"]),
}


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return list(out.values())
    return [t for o in out for t in _tensors(o)]


@pytest.mark.parametrize("name", CALLS)
@pytest.mark.parametrize("float_mask", [False, True])
def test_inputs_bitwise_unchanged_and_outputs_not_aliased(name, float_mask):
    x = _inputs(float_mask=float_mask)
    snapshot = {k: v.clone() for k, v in x.items()}
    outs = _tensors(CALLS[name](x))
    for k in x:
        assert torch.equal(x[k], snapshot[k]), f"{name} modified its input {k}"
    # Writing to an output must not reach an input either (no returned views of the arguments).
    for o in outs:
        o.detach().add_(1) if o.dtype != torch.bool else o.detach().logical_not_()
    for k in x:
        assert torch.equal(x[k], snapshot[k]), f"{name} returned an alias of its input {k}"


@pytest.mark.parametrize("name", CALLS)
def test_bool_and_float_masks_agree(name):
    a = _tensors(CALLS[name](_inputs()))
    b = _tensors(CALLS[name](_inputs(float_mask=True)))
    for u, v in zip(a, b):
        assert torch.equal(u, v), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("name", CALLS)
def test_dtypes_and_devices(name, dtype, device):
    out = _tensors(CALLS[name](_inputs(dtype=dtype, device=device)))
    reference = _tensors(CALLS[name](_inputs(dtype=torch.float64)))
    for o, r in zip(out, reference):
        assert o.device.type == device
        if o.dtype == torch.bool:
            continue
        # bf16 inputs are computed in float32; float64 stays float64.
        assert o.dtype == (torch.float64 if dtype == torch.float64 else torch.float32), (name, o.dtype)
        assert torch.isfinite(o).all()
        if dtype != torch.bfloat16:  # bf16 rounds the inputs themselves; only compare the wider ones
            torch.testing.assert_close(o.double().cpu(), r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_mask_zero_fallback_on_device(device):
    x = _inputs(device=device)
    x["mask"] = torch.zeros_like(x["mask"])
    for name in (
        "reinforce_pp",
        "gae",
        "ppo_clip",
        "gspo",
        "cispo",
        "aggregate",
        "rollout_is",
        "mismatch_metrics",
    ):
        for o in _tensors(CALLS[name](x)):
            assert (
                o.device.type == device
                and not o.any()
                and not (o.isnan().any() if o.is_floating_point() else False)
            ), name


@pytest.mark.parametrize(
    ("fn", "group_size", "match"),
    [
        (advantages.grpo, 4, r"group_size=4 does not divide N=6"),
        (advantages.rloo, 0, r"group_size=0 is not valid"),
        (advantages.zero_std_groups, 2.0, r"group_size=2\.0 is not valid"),
    ],
)
def test_bad_group_size(fn, group_size, match):
    with pytest.raises(ValueError, match=match):
        fn(torch.zeros(6), group_size)
