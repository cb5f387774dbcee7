"""Downstream evaluation: `bert-finetune` (cli.py) fine-tunes a pretrained BERT on a
classification task (tasks.py) over several seeds (trainer.py) and scores it (metrics.py);
`--watch` (watch.py) does so for each checkpoint of a running pretraining run."""
