"""Starting and ending processes: self-launch through torch.distributed.run, torchrun's agent with a bounded
exit barrier, workers forked from the launcher, Ray Train's TorchTrainer as the launcher, and a quick process
exit."""
