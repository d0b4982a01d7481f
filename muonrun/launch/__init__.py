"""Starting the workers: torchrun's public API or one in-process worker (launcher), the workers' side
(worker), the launcher's signals, reports and restarts (supervise), the run folder's lock (lock), SLURM
values (slurm)."""
