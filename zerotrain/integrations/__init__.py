"""Native integrations with training frameworks (imported on demand: each needs its framework)."""
