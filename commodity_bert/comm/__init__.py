"""How the ranks communicate: one object per communication mode (`mode`: DeepSpeed's own
allreduce, bucket-wise clipping, 1-bit LAMB, 0/1 Adam, DiLoCo), the compressed allreduce they
share (`onebit_allreduce`), the gradient norm measured without extra traffic (`grad_norm`), the
byte counter behind `bytes_sent` (`bytes_counter`), and DeepSpeed's CPU shared-memory allreduce
(`deepspeed_shm`). A new mode is a class in `mode.py`'s registry; train.py names none."""
