"""The model: the unpadded, sparse MLM loss against HF's padded dense one, activation
checkpointing, and the config's pretraining recipe (masking rate, dropout)."""
import copy

import numpy as np
import pytest
import torch
from conftest import batch_of

from commodity_bert.data import shard_format as fmt
from commodity_bert.data.dataset import ShardSet
from commodity_bert.data.loader import BatchMaker
from commodity_bert.data.vocab import Vocab
from commodity_bert.model.bert import PretrainingModel, build_config, build_model


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_unpadded_sparse_mlm_loss_equals_hf_padded_dense_loss(datasets, kind):
    # the 8 shortest and 8 longest samples in one batch: much of it is padding
    by_length = np.argsort(fmt.read_shard(datasets / kind / "shard_00000.hdf5")["lengths"], kind="stable")
    manifest, batch = batch_of(datasets / kind, [*by_length[:8], *by_length[-8:]])
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
    manifest, batch = batch_of(datasets / "dynamic", list(range(16)))
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
