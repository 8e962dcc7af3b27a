"""Grammar backends. Each module imports its third-party package at import time, so import them
only through `radixlm.constrained.create_backend` (the registry imports them lazily)."""
