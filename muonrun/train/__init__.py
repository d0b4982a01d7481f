"""The training worker: the trainer (wires the parts in data-flow order, then the loop) and its step parts."""
