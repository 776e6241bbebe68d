"""Trial and training runners."""
