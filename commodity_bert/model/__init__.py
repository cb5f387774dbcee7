"""The model: a Hugging Face BERT with the pretraining heads and the sizes by name (`bert`), and
the export a user loads with `from_pretrained` (`export`)."""

# Hugging Face BERT's pretraining heads (masked-LM transform and bias, NSP) are the parameters under
# this name; here rather than in bert.py so that the optimizer's grouping reads it without transformers
HEAD_PREFIX = "cls."
