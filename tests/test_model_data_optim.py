"""Unpadded, sparse MLM loss vs HF's padded dense loss, LAMB vs a reference, the stratified rank data."""
import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli

from commodity_bert.data import shard_format as fmt
from commodity_bert.data.dataset import ShardSet
from commodity_bert.data.loader import (
    ID_STRATUM,
    BatchMaker,
    TrainingBatches,
    ValidationBatches,
    load_arrays,
    round_schedule,
    spread_strata,
)
from commodity_bert.data.vocab import Vocab
from commodity_bert.model.bert import PretrainingModel, build_config, build_model
from commodity_bert.optim.build import build_optimizer
from commodity_bert.optim.lamb import Lamb
from commodity_bert.run_config import RunConfig


@pytest.fixture(scope="module")
def datasets(tmp_path_factory, sotu_small):
    root = tmp_path_factory.mktemp("data")
    common = ["--input", sotu_small, "--seq-len", 64, "--dupe-factor", 1, "--val-fraction", 0.05, "--workers", 2]
    run_cli("shards", *common, "--num-shards", 4, "--output", root / "static")
    run_cli("shards", *common, "--num-shards", 3, "--masking", "dynamic", "--no-nsp", "--output", root / "dynamic")
    return root


def _batch(data_dir, indices):
    manifest = fmt.load_manifest(data_dir)
    arrays = fmt.read_shard(data_dir / "shard_00000.hdf5")
    static = manifest["masking"] == "static"
    maker = BatchMaker(arrays, manifest, Vocab.load(data_dir / "vocab.txt"), seed=3, static=static)
    return manifest, maker(np.asarray(indices), (0, 0, 0))


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_unpadded_sparse_mlm_loss_equals_hf_padded_dense_loss(datasets, kind):
    # the 8 shortest and 8 longest samples in one batch: much of it is padding
    by_length = np.argsort(fmt.read_shard(datasets / kind / "shard_00000.hdf5")["lengths"], kind="stable")
    manifest, batch = _batch(datasets / kind, [*by_length[:8], *by_length[-8:]])
    assert batch["attention_mask"].float().mean() < 0.9
    torch.manual_seed(0)
    model = build_model(build_config("tiny", manifest["vocab"]["size"]), nsp=manifest["nsp"]).double().eval()
    stock_hf = type(model)._from_config(copy.deepcopy(model.config), attn_implementation="sdpa").double().eval()
    stock_hf.load_state_dict(model.state_dict())
    with torch.autocast("cpu", enabled=False):
        torch.set_default_dtype(torch.float64)
        try:
            sparse_loss, stats = PretrainingModel(model)(batch)
            sparse_loss.backward()
            padded_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            model.zero_grad()
            jagged_loss, _ = PretrainingModel(model, attention="jagged")(batch)  # SDPA on nested tensors
            jagged_loss.backward()
            jagged_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        finally:
            torch.set_default_dtype(torch.float32)
    assert torch.allclose(jagged_loss, sparse_loss, rtol=1e-10, atol=0)
    assert len(jagged_grads) == len(padded_grads) > 10
    assert all(torch.allclose(j, p, rtol=1e-8, atol=1e-12) for j, p in zip(jagged_grads, padded_grads))
    labels = torch.full_like(batch["input_ids"], -100).view(-1)
    labels[batch["masked_index"]] = batch["masked_labels"]
    kwargs = {"next_sentence_label": batch["next_sentence_labels"]} if manifest["nsp"] else {}
    dense = stock_hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     token_type_ids=batch["token_type_ids"], labels=labels.view(batch["input_ids"].shape), **kwargs)
    # the logits are cast to fp32 for the loss, hence not 1e-12
    assert torch.allclose(sparse_loss.double(), dense.loss, rtol=1e-6, atol=1e-7)
    assert stats["mlm_count"] == (labels != -100).sum()


def test_activation_checkpointing_gives_the_same_loss_and_gradients_and_keeps_less(datasets):
    """Dropout on (training mode): recomputing a layer must replay its masks. What autograd keeps
    for backward, counted through saved-tensor hooks, is the memory the switch exists to save."""
    from commodity_bert.model.bert import use_activation_checkpointing
    manifest, batch = _batch(datasets / "dynamic", list(range(16)))
    torch.manual_seed(0)
    plain = build_model(build_config("mini", manifest["vocab"]["size"]), nsp=manifest["nsp"])
    checkpointed = copy.deepcopy(plain)
    use_activation_checkpointing(checkpointed)
    results = []
    for hf in (plain, checkpointed):
        model = PretrainingModel(hf).train()
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        kept = {}  # storage -> bytes: each activation once, the weights (saved too, but held anyway) left out

        def pack(tensor, weights=weights, kept=kept):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in weights:
                kept[storage.data_ptr()] = storage.nbytes()
            return tensor

        torch.manual_seed(5)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss, _ = model(batch)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((loss.detach(), grads, sum(kept.values())))
    (loss, grads, kept), (loss_ckpt, grads_ckpt, kept_ckpt) = results
    assert torch.equal(loss, loss_ckpt)
    assert torch.allclose(grads, grads_ckpt, rtol=1e-5, atol=1e-7)
    print(f"activation memory kept for backward: {kept / 2**20:.1f} MiB, checkpointed {kept_ckpt / 2**20:.1f} MiB")
    assert kept_ckpt < kept / 3  # each layer keeps only its input, not its activations


def test_batches_are_trimmed_and_masked_like_the_shards(datasets):
    _, batch = _batch(datasets / "static", range(10))
    width = batch["input_ids"].shape[1]
    longest = int(batch["attention_mask"].sum(1).max())
    assert width % 8 == 0 and longest <= width < longest + 8
    # masked labels sit where the input shows [MASK] most of the time (80/10/10)
    mask_id = Vocab.load(datasets / "static" / "vocab.txt").id("[MASK]")
    shown = batch["input_ids"].view(-1)[batch["masked_index"]]
    assert 0.6 < (shown == mask_id).float().mean() < 0.95


def test_dynamic_masking_is_seeded_per_batch(datasets):
    data = datasets / "dynamic"
    manifest = fmt.load_manifest(data)
    arrays = fmt.read_shard(data / "shard_00000.hdf5")
    maker = BatchMaker(arrays, manifest, Vocab.load(data / "vocab.txt"), seed=3, static=False)
    rows = np.arange(64)
    a, b, c = maker(rows, (0, 0, 5)), maker(rows, (0, 0, 5)), maker(rows, (0, 0, 6))
    assert torch.equal(a["input_ids"], b["input_ids"]) and not torch.equal(a["input_ids"], c["input_ids"])
    # BERT's budget per row: 15% of its tokens (at least 1, at most max_predictions) among non-specials
    ids, lengths = arrays["input_ids"][rows], arrays["lengths"][rows].astype(int)
    budget = sum(min(maker.max_predictions, max(1, round(n * maker.mask_prob)),
                     int((~maker.is_special[ids[r, :n]]).sum())) for r, n in enumerate(lengths))
    assert a["masked_labels"].numel() == budget and lengths.sum() >= 300
    assert not np.isin(arrays["input_ids"], [maker.mask_id]).any()  # the shards stay unmasked


def test_pretraining_section_sets_the_masking_rate_and_the_dropout(datasets):
    from commodity_bert.model.bert import set_dropout
    from commodity_bert.train.launch_checks import LaunchError, check_project_block, pretraining_settings
    data = datasets / "dynamic"
    manifest = fmt.load_manifest(data)
    arrays = fmt.read_shard(data / "shard_00000.hdf5")
    vocab = Vocab.load(data / "vocab.txt")
    rows = np.arange(64)
    shards_rate = BatchMaker(arrays, manifest, vocab, seed=3, static=False)(rows, (0,))
    forty = BatchMaker(arrays, manifest, vocab, seed=3, static=False, mask_prob=0.4)
    assert forty.max_predictions == 26  # ceil(0.4 * 64): the cap follows the rate
    masked = forty(rows, (0,))["masked_labels"].numel()
    assert 2.2 < masked / shards_rate["masked_labels"].numel() < 2.9  # 0.4 / 0.15 = 2.67
    config = {"commodity_bert": {"pretraining": {"mask_prob": 0.4, "dropout": 0.0}}}
    check_project_block(config)
    assert pretraining_settings(config, ShardSet.open(data)) == {"mask_prob": 0.4, "dropout": 0.0}
    static = ShardSet.open(datasets / "static")
    with pytest.raises(LaunchError, match="needs dynamically masked shards.*--masking dynamic"):
        pretraining_settings(config, static)
    assert pretraining_settings({"commodity_bert": {"pretraining": {"dropout": 0.0}}}, static)
    for bad in ({"mask_prob": 0}, {"mask_prob": 1.0}, {"mask_prob": "fast"}, {"dropout": -0.1}, {"dropout": True}):
        with pytest.raises(LaunchError, match=r"pretraining\.\w+.*give a number in"):
            check_project_block({"commodity_bert": {"pretraining": bad}})
    # dropout off everywhere (attention too) while the config, which an export writes, keeps BERT's rate
    torch.manual_seed(0)
    model = build_model(build_config("tiny", manifest["vocab"]["size"]), nsp=False).train()
    ids = torch.from_numpy(arrays["input_ids"][:4, :32].astype(np.int64))
    assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
    set_dropout(model, 0.0)
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
    assert model.config.hidden_dropout_prob == model.config.attention_probs_dropout_prob == 0.1


def _epoch_plan(batches: TrainingBatches, epoch: int = 0) -> np.ndarray:
    return np.concatenate([r.plan for r in batches.stream.plans(epoch)])


@pytest.mark.parametrize("world, in_memory", [(1, 1), (2, 1), (3, 1), (3, 2), (2, 0)])
def test_every_micro_batch_has_the_same_strata_mix_on_every_rank(datasets, world, in_memory):
    """Streamed a few shards at a time (4 shards; 3 ranks read every W-th sample of every shard)."""
    data = datasets / "static"
    manifest = fmt.load_manifest(data)
    micro = 16
    seen, mixes = [], []
    shares = np.array(manifest["splits"]["train"]["strata_shares"])
    for rank in range(world):
        batches = TrainingBatches(ShardSet.open(data), rank, world, micro, seed=1, num_workers=0, shards_in_memory=in_memory)
        plan = _epoch_plan(batches)
        mixes.append(np.stack([np.bincount((row >> ID_STRATUM) & 15, minlength=len(shares)) for row in plan]))
        # a sample's identity: its token row, read back through the batches the rank trains
        stream, rows = iter(batches), set()
        for _ in range(len(plan)):
            batch = next(stream)
            for ids, n in zip(batch["input_ids"], batch["attention_mask"].sum(1)):
                rows.add(ids[:n].numpy().tobytes())
        assert batches.epoch == 0 and len(plan) * micro - len(rows) < 3  # no sample twice (a rare exact duplicate text aside)
        seen.append(rows)
    # the same number of batches and the same mix in batch r everywhere: no rank waits at a collective
    assert all(np.array_equal(m, mixes[0]) for m in mixes)
    assert (mixes[0].sum(axis=1) == micro).all()
    assert np.abs(mixes[0] - shares * micro).max() < 1 + 1e-9  # every batch within one sample of the shares
    for i in range(world):
        for j in range(i + 1, world):
            assert len(seen[i] & seen[j]) < 3  # disjoint samples
    # every sample trains in the epoch but fewer than a micro-batch per rank (plus shards' differences)
    total = sum(manifest["splits"]["train"]["strata_counts"])
    assert total - sum(len(r) for r in seen) < world * (micro + len(shares)) + 3


def test_a_stratum_too_small_for_one_sample_per_batch_still_trains_every_epoch():
    # the shares [.03, .03, .04, .90] at micro-batch 16 rounded to [1, 0, 1, 14] per batch
    counts = np.array([[30, 30, 40, 900], [31, 30, 40, 899]])
    schedule = round_schedule(counts, 16)
    per_stratum = np.bincount(schedule.ravel(), minlength=4)
    assert per_stratum.sum() == len(schedule) * 16 == 992
    assert (per_stratum >= counts.min(axis=0) - 16).all() and per_stratum[1] >= 29  # all but < one batch
    mix = np.stack([np.bincount(row, minlength=4) for row in schedule])
    assert np.abs(mix - np.array([.03, .03, .04, .90]) * 16).max() < 1.1
    assert np.array_equal(spread_strata(per_stratum, 16), schedule)


@pytest.mark.parametrize("in_memory", [1, 0])
def test_an_epoch_of_batches_trains_the_rare_length_stratum(datasets, in_memory):
    """This dataset's stratum 2 holds 0.3% of the samples: 0.09 of a micro-batch of 32, which
    rounding per batch made 0, so those samples never trained; streamed, a round's few are
    carried into the next until they fill their slots."""
    data = datasets / "static"
    manifest = fmt.load_manifest(data)
    rare = int(np.argmin([c if c else np.inf for c in manifest["splits"]["train"]["strata_counts"]]))
    assert 0 < manifest["splits"]["train"]["strata_shares"][rare] * 32 < 0.5
    batches = TrainingBatches(ShardSet.open(data), 0, 1, 32, seed=5, num_workers=0, shards_in_memory=in_memory)
    stream = iter(batches)
    lengths = []
    while batches.epoch == 0:
        batch = next(stream)
        lengths.extend(batch["attention_mask"].sum(1).tolist())
    strata = fmt.stratum_of(np.array(lengths), 64, manifest["num_strata"])
    total = manifest["splits"]["train"]["strata_counts"][rare]
    assert (strata == rare).sum() >= total - 1


@pytest.mark.parametrize("in_memory", [1, 2])
def test_training_batches_resume_at_their_position(datasets, in_memory):
    """Mid-round, at a round's first batch and in the next epoch; with and without a loader worker."""
    data = datasets / "dynamic"

    def batches_from(seed, micro_batch, workers):
        return TrainingBatches(ShardSet.open(data), 0, 1, micro_batch, seed=seed, num_workers=workers,
                               shards_in_memory=in_memory)
    # a seed and micro-batch whose round 0 carries samples into round 1, where two of the
    # positions below resume (whether it does depends on the shards' sizes)
    seed, micro_batch = next((seed, mb) for mb in (8, 7, 6, 5) for seed in range(5, 10)
                             if len(next(iter(batches_from(seed, mb, 0).stream.plans(0))).carried_out))
    first = batches_from(seed, micro_batch, 0)
    rounds = first.stream.rounds(0)
    assert len(rounds) > 1
    epoch_length = first.stream.batches_in_epoch(0)
    stream = iter(first)
    batches = [next(stream) for _ in range(epoch_length + 5)]
    for position, workers in [(4, 1), (rounds[1].first_batch, 0), (rounds[1].first_batch + 3, 1),
                              (epoch_length + 2, 0)]:
        again = batches_from(seed, micro_batch, workers)
        again.load_state_dict({"epoch": position // epoch_length, "batch": position % epoch_length})
        resumed = iter(again)
        for expected in batches[position:position + 3]:
            got = next(resumed)
            assert all(torch.equal(got[k], expected[k]) for k in expected)
    val = list(ValidationBatches(ShardSet.open(data), 0, 1, 8))
    assert val and all(b["masked_labels"].numel() for b in val)  # held-out split is pre-masked


def test_each_rank_holds_only_its_part_of_the_held_out_split(tmp_path, sotu_small):
    """The batches a whole-split load made, from a rank that keeps only its 1/world of the
    samples (read shard by shard): the split grows with the data set."""
    data = tmp_path / "val3"
    run_cli("shards", "--input", sotu_small, "--seq-len", 64, "--dupe-factor", 1, "--val-fraction", 0.2,
            "--num-val-shards", 3, "--num-shards", 2, "--workers", 2, "--output", data)
    manifest = fmt.load_manifest(data)
    digests = [entry["sha256"] for entry in manifest["splits"]["validation"]["shards"]]
    whole = load_arrays(fmt.shard_paths(data, manifest, "validation"), digests)
    order = np.argsort(whole["lengths"], kind="stable")
    maker = BatchMaker(whole, manifest, Vocab.load(data / "vocab.txt"), seed=0, static=True)
    assert len(manifest["splits"]["validation"]["shards"]) == 3 and len(order) > 100
    for world in (1, 3):
        held = 0
        for rank in range(world):
            val = ValidationBatches(ShardSet.open(data), rank, world, 8)
            mine = order[rank::world]
            expected = [maker(mine[i:i + 8], ()) for i in range(0, len(mine), 8)]
            got = list(val)
            assert len(val) == len(got) == len(expected)
            for g, e in zip(got, expected):
                assert g.keys() == e.keys() and all(torch.equal(g[k], e[k]) for k in e)
            assert all(len(a) == len(mine) for a in val.maker.arrays.values())  # its part, no more
            held += len(mine)
        assert held == len(order)


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


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[1] / "ds_configs").glob("*.json")),
                         ids=lambda p: p.name)
def test_shipped_configs_pass_the_launch_checks(path):
    from commodity_bert.train.launch_checks import check_deepspeed_config, load_deepspeed_config
    config = load_deepspeed_config(str(path))
    for world in (1, 2, 8, 16):
        total, micro, accumulation = check_deepspeed_config(config, world)
        assert total == micro * accumulation * world


def _tiled_dataset(source: Path, out: Path, num_shards: int, samples_per_shard: int) -> Path:
    """`num_shards` real shards of the source's samples repeated (same text, new files), with
    their manifest: a data set larger than the stream window without preparing more text."""
    manifest = fmt.load_manifest(source)
    arrays = {k: np.concatenate([fmt.read_shard(p)[k] for p in fmt.shard_paths(source, manifest)])
              for k in ("input_ids", "segment_ids", "next_sentence_labels", "lengths",
                        "masked_lm_positions", "masked_lm_ids")}
    seq_len, vocab_size = manifest["seq_len"], manifest["vocab"]["size"]
    records = np.zeros(len(arrays["lengths"]), dtype=fmt.record_dtype(seq_len, manifest["max_predictions"], vocab_size, True))
    records["tokens"], records["length"] = arrays["input_ids"], arrays["lengths"]
    records["segment_a"] = np.where(arrays["segment_ids"].any(1), arrays["segment_ids"].argmax(1), arrays["lengths"])
    records["random_next"] = arrays["next_sentence_labels"]
    records["masked_positions"], records["masked_ids"] = arrays["masked_lm_positions"], arrays["masked_lm_ids"]
    out.mkdir()
    infos = []
    for k in range(num_shards):
        rows = np.arange(k * samples_per_shard, (k + 1) * samples_per_shard) % len(records)
        infos.append(fmt.write_shard(out / fmt.shard_name(k), records[rows], seq_len=seq_len,
                                     num_strata=manifest["num_strata"], static_masking=True, vocab_size=vocab_size,
                                     split="train", vocab_sha256=manifest["vocab"]["sha256"]).to_json())
    train = manifest["splits"]["train"]
    train["shards"] = infos
    train["strata_counts"] = np.sum([i["strata_counts"] for i in infos], axis=0).tolist()
    train["samples"] = sum(train["strata_counts"])
    (out / fmt.MANIFEST_NAME).write_text(json.dumps(manifest))
    (out / fmt.VOCAB_NAME).write_bytes((source / fmt.VOCAB_NAME).read_bytes())
    return out


EPOCH_PEAK_RSS = """
import sys
from commodity_bert.data.dataset import ShardSet
from commodity_bert.data.loader import TrainingBatches
def peak_mb():
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024
data, in_memory = sys.argv[1], int(sys.argv[2])
open("/proc/self/clear_refs", "w").write("5")  # the peak from here on: torch's import peaks higher
start = peak_mb()
batches = TrainingBatches(ShardSet.open(data), 0, 1, 256, seed=1, num_workers=0, shards_in_memory=in_memory)
stream = iter(batches)
while batches.epoch == 0:
    next(stream)
print(peak_mb() - start)
"""


def test_a_ranks_memory_is_bounded_by_the_shards_it_streams_not_the_data_set(datasets, tmp_path):
    """An epoch over 4× the shards (same shard size) in a fresh process: the peak RSS grows by
    less than a quarter of the arrays added when streaming one shard at a time, and by most of
    them with every shard held (the measurement can tell the two apart)."""
    shard_mb = 4
    per_sample = sum(a.itemsize * (a.size // len(a)) for k, a in fmt.read_shard(
        datasets / "static" / "shard_00000.hdf5").items() if k != "input_mask")
    samples = shard_mb * 2**20 // per_sample
    small = _tiled_dataset(datasets / "static", tmp_path / "small", 4, samples)
    large = _tiled_dataset(datasets / "static", tmp_path / "large", 16, samples)

    def peak_mb(data, in_memory):
        out = subprocess.run([sys.executable, "-c", EPOCH_PEAK_RSS, str(data), str(in_memory)], check=True,
                             capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        return float(out.stdout.split()[-1])

    added_mb = 12 * shard_mb
    streamed = peak_mb(small, 1), peak_mb(large, 1)
    held = peak_mb(large, 0)
    print("peak MB above start, streamed small/large and held:", streamed, held)
    assert streamed[1] - streamed[0] < added_mb / 4, (streamed, held)
    assert held - streamed[0] > added_mb / 2, (streamed, held)
