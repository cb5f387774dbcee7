"""bert-data-prep: raw text → presorted, length-stratified BERT pretraining shards."""
__version__ = "0.1.0"
