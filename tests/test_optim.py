"""The optimizers: LAMB against a reference step, the config's choice of optimizer, the head
warm-up, and which LAMB runs where."""
import pytest
import torch

from commodity_bert.optim.build import build_optimizer
from commodity_bert.optim.lamb import Lamb
from commodity_bert.run_config import RunConfig


def _reference_lamb_step(params, grads, states, lr, beta1, beta2, eps, wd, step, max_coeff, min_coeff):
    """LAMB as in the paper (Algorithm 2) with Adam bias correction, one tensor at a time."""
    for p, g, s in zip(params, grads, states):
        s["m"] = beta1 * s["m"] + (1 - beta1) * g
        s["v"] = beta2 * s["v"] + (1 - beta2) * g * g
        m_hat = s["m"] / (1 - beta1 ** step)
        v_hat = s["v"] / (1 - beta2 ** step)
        update = m_hat / (v_hat.sqrt() + eps) + wd * p
        w_norm, u_norm = p.norm().item(), update.norm().item()
        ratio = min(max(w_norm / u_norm, min_coeff), max_coeff) if w_norm > 0 and u_norm > 0 else 1.0
        p -= lr * ratio * update


def test_lamb_matches_the_reference():
    torch.manual_seed(0)
    shapes = [(64, 32), (32,), (16, 16), (8,)]
    params = [torch.randn(s, dtype=torch.float64) for s in shapes]
    params[3].zero_()  # zero weights: trust ratio 1
    params[2] *= 100   # large weights: ratio clipped at max_coeff
    ours = [torch.nn.Parameter(p.clone()) for p in params]
    reference = [p.clone() for p in params]
    lr, betas, eps, wd = 0.01, (0.9, 0.999), 1e-6, 0.01
    opt = Lamb([{"params": ours[:3], "weight_decay": wd}, {"params": ours[3:], "weight_decay": 0.0}],
               lr=lr, betas=betas, eps=eps, max_coeff=10.0, min_coeff=0.01)
    states = [{"m": torch.zeros_like(p), "v": torch.zeros_like(p)} for p in params]
    for step in range(1, 8):
        grads = [torch.randn(s, dtype=torch.float64) for s in shapes]
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        opt.step()
        _reference_lamb_step(reference[:3], grads[:3], states[:3], lr, *betas, eps, wd, step, 10.0, 0.01)
        _reference_lamb_step(reference[3:], grads[3:], states[3:], lr, *betas, eps, 0.0, step, 10.0, 0.01)
    for p, r in zip(ours, reference):
        assert torch.allclose(p.detach(), r, rtol=1e-10, atol=1e-12)
    assert not torch.equal(ours[0].detach(), params[0])


def test_optimizer_choice_follows_the_config():
    model = torch.nn.Module()
    model.dense, model.LayerNorm = torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)  # HF BERT's names
    lamb = {"optimizer": {"type": "Lamb", "params": {"lr": 0.1, "weight_decay": 0.01}}, "train_batch_size": 8}
    opt, groups = build_optimizer(lamb, model)  # the project's LAMB, on every device
    assert isinstance(opt, Lamb)
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0] and len(groups[1]["params"]) == 3
    fused = {**lamb, "commodity_bert": {"lamb": {"implementation": "deepspeed"}}}
    opt, _ = build_optimizer(fused, model)  # DeepSpeed's FusedLamb, asked for
    assert opt is None
    # DeepSpeed gets the JSON as written, less the project's block, and less the optimizer it does not build
    assert RunConfig.parse(fused).for_deepspeed() == lamb
    assert RunConfig.parse(fused).for_deepspeed(without_optimizer=True) == {"train_batch_size": 8}
    adam = {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}
    assert build_optimizer(adam, model)[0] is None


def test_a_head_warmup_holds_the_encoder_for_its_steps_and_raises_the_heads_rate():
    """The encoder (every group but the heads') at `encoder_lr_scale` x the scheduler's rate for the
    first `steps` optimizer steps, the heads at `head_lr_scale` x; then both at the scheduler's own.
    At rate 0, AdamW's decoupled weight decay leaves the encoder's weights exactly as they were;
    so after a resume within the warm-up, whose loaded optimizer has group dicts of its own."""
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    from commodity_bert.optim.head_warmup import HEAD_GROUP, HeadWarmupScheduler
    model = torch.nn.Module()
    model.encoder, model.cls = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)  # HF BERT's head is "cls."
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.01}},
              "commodity_bert": {"head_warmup": {"steps": 3, "head_lr_scale": 5.0}}}
    _, groups = build_optimizer(config, model)
    assert [(len(g["params"]), bool(g.get(HEAD_GROUP))) for g in groups] == [(1, False), (1, False), (1, True), (1, True)]
    optimizer = torch.optim.AdamW(groups, lr=0.1, weight_decay=0.01)
    scheduler = HeadWarmupScheduler(WarmupDecayLR(optimizer, total_num_steps=10, warmup_max_lr=0.1,
                                                  warmup_num_steps=2), 3, 0.0, 5.0)
    twin = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # the same scheduler, unwrapped
    alone = WarmupDecayLR(twin, total_num_steps=10, warmup_max_lr=0.1, warmup_num_steps=2)
    encoder_before = model.encoder.weight.detach().clone()
    seen, own = [], []
    for _ in range(5):
        own.append(twin.param_groups[0]["lr"])
        alone.step()
        seen.append((optimizer.param_groups[0]["lr"], optimizer.param_groups[2]["lr"]))
        assert scheduler.get_last_lr() == [g["lr"] for g in optimizer.param_groups]  # what is logged: the rates in use
        assert scheduler.last_batch_iteration == len(seen) - 2  # the wrapped scheduler's own state passes through
        model.zero_grad()
        (model.cls(model.encoder(torch.ones(2, 4))) ** 2).sum().backward()
        optimizer.step()
        scheduler.step()
        if len(seen) == 1:  # a resume within the warm-up: loading the checkpoint replaces the group dicts
            optimizer.load_state_dict(optimizer.state_dict())
        if len(seen) == 3:
            assert torch.equal(model.encoder.weight, encoder_before)  # 3 steps: not moved, not decayed
    assert not torch.equal(model.encoder.weight, encoder_before)
    assert own[3] > 0
    assert [e for e, _ in seen] == pytest.approx([0, 0, 0, *own[3:]])
    assert [h for _, h in seen] == pytest.approx([5 * r for r in own[:3]] + own[3:])


def test_lamb_implementation_is_checked_against_the_device():
    from commodity_bert.train.launch_checks import LaunchError, check_against_device, check_project_block
    lamb = {"optimizer": {"type": "Lamb", "params": {"lr": 0.1}}}

    def asking(implementation, **more):
        return {**lamb, **more, "commodity_bert": {"lamb": {"implementation": implementation}}}

    check_against_device(asking("project"), on_cuda=False)
    check_against_device(asking("deepspeed"), on_cuda=True)
    with pytest.raises(LaunchError, match="FusedLamb, which needs CUDA"):
        check_against_device(asking("deepspeed"), on_cuda=False)
    with pytest.raises(LaunchError, match="no bf16 kernel"):
        check_against_device(asking("deepspeed", bf16={"enabled": True}), on_cuda=True)
    with pytest.raises(LaunchError, match='"deepspeed".*or "project"'):
        check_project_block(asking("fused"))
    with pytest.raises(LaunchError, match="must be true or false"):
        check_project_block({"commodity_bert": {"activation_checkpointing": {"enabled": "yes"}}})
    with pytest.raises(LaunchError, match=r"attention.layout\" 'flash': give one of 'padded', 'jagged'"):
        check_project_block({"commodity_bert": {"attention": {"layout": "flash"}}})
    check_project_block({"commodity_bert": {"attention": {"layout": "jagged"}}})
