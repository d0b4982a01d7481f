"""Commands beside training: the dry-run plan, bench (variants side by side), compare (runs side by side)."""
