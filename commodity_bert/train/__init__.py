"""What train.py's loop needs besides the model and the modes: the checks before the first step
(`launch_checks`), checkpoints that survive preemption (`checkpoint`), the loop's bookkeeping
(`bookkeeping`: windows, decisions, clocks), the metrics sinks (`metrics`), the plateau
warning (`plateau`) and a host memory that stays bounded (`host_memory`)."""
