"""Compressed collectives over torch.distributed (gloo and NCCL): the error-compensated 1-bit
allreduce and the low-bit average. Below the optimizers that send through them (optim/) and the
communication modes that choose them (comm/); they import nothing of the project."""
