"""Process groups and collectives for tensor, pipeline, expert, data and prefill-context
parallelism, all carved out of one `torch.distributed` world.

- `config.py`: `ParallelConfig`, the sizes and the rank layout (no torch).
- `layout.py`: which global ranks form each group (pure functions).
- `group.py`: `GroupCoordinator`, one group and its collectives.
- `parallel_state.py`: `init_distributed` and the `get_*_group` accessors.
- `launch.py`: `spawn_workers`, a process per rank on one machine.
"""
