"""Schedule templates: per-family plans that say only what differs between model families."""
