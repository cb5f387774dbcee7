"""The optimizers the DeepSpeed config names and DeepSpeed does not build on every device
(`build` chooses): LAMB (`lamb`), 1-bit LAMB and 0/1 Adam (whose steps also decide what
travels; their communication modes are in `comm/`), and what mixed precision changes for them
(`precision`)."""
