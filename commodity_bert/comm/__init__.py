"""How the ranks communicate: one object per communication mode (`mode`: DeepSpeed's own
allreduce, bucket-wise clipping, 1-bit LAMB, 0/1 Adam, DiLoCo), the gradient norm measured
without extra traffic (`grad_norm`), the byte counter behind `bytes_sent` (`bytes_counter`), and
DeepSpeed's CPU shared-memory allreduce (`deepspeed_shm`). The compressed collectives that the
modes and the 1-bit optimizers send through are one layer down, in `commodity_bert/collectives/`.
A new mode is a class in `mode.py`'s registry; train.py names none."""
