"""Export RUN/hf_model: weights with `save_pretrained` (fp32, safetensors) and the tokenizer,
so that `AutoModelForMaskedLM.from_pretrained(RUN/hf_model)` and `pipeline("fill-mask")` work."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from torch import nn
from transformers import BertTokenizerFast


def export_hf_model(hf_model: nn.Module, vocab_path: Path, lowercase: bool, out_dir: Path) -> Path:
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    state = {k: v.detach().float().cpu() for k, v in hf_model.state_dict().items()}
    training_dtype = hf_model.config.dtype
    hf_model.save_pretrained(str(tmp), state_dict=state)
    hf_model.config.dtype = training_dtype  # save_pretrained set it from the live (bf16) parameters
    # The config must say what the weights are: fp32. Left as the training's bfloat16/float16,
    # transformers 5 (dtype "auto") loads them in that dtype, and a user's fine-tuning at lr 5e-5
    # then updates 16-bit weights that such small steps cannot move.
    config = json.loads((tmp / "config.json").read_text())
    (tmp / "config.json").write_text(json.dumps({**config, "dtype": "float32"}, indent=2, sort_keys=True) + "\n")
    # vocab=, not vocab_file=: with transformers 5 the latter silently builds a 5-token vocabulary
    tokenizer = BertTokenizerFast(vocab=str(vocab_path), do_lower_case=lowercase)
    tokenizer.save_pretrained(str(tmp))
    old = out_dir.with_name(out_dir.name + ".old")
    if out_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir
