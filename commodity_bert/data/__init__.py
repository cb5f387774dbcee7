"""The training data as train.py reads it: one prepared data set (`dataset`: directory, manifest,
digest, vocabulary), the shard format and its manifest (`shard_format`),
the vocabulary (`vocab`), BERT's masking (`masking`), and the rank's stream of length-stratified
batches (`loader`). `data_prep/` writes what this package reads."""
