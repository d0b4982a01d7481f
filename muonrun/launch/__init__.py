"""Starting the workers: torchrun's elastic agent or one in-process worker, SLURM values, worker reports."""
