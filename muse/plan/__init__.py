"""`muse plan`: memory per GPU and projected speeds of a model on a GPU fleet (`gpus`,
`projection`); the per-GPU shards come from `muse.parallel_plan`."""
