"""The model: a Hugging Face BERT with the pretraining heads and the sizes by name (`bert`), and
the export a user loads with `from_pretrained` (`export`)."""
