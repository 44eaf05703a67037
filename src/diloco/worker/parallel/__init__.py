"""Several processes acting as one worker: a torch.distributed group, FSDP2."""
