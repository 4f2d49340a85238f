"""The dry run: one rank of a large cluster runs the real training step on this CPU with a fake
process group and fake tensors, so what it measures (bytes by category, collectives) comes from the
code a real run executes, not from a formula. `disttrain dryrun` and `plan --verify` drive it."""
